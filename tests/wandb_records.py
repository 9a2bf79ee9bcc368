"""Read an offline W&B run file (RUN_DIR/wandb/offline-run-*/run-<id>.wandb) back, record by record.

wandb ships no Python reader any more (its Go core writes the file), so the tests read it here: W&B's
LevelDB-style log — a 7-byte file header (":W&B", magic, version), then 32 KiB blocks of chunks, each with a
7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) — holding protobuf `Record`s."""

import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768


def records(path: Path):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a record is complete
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(run_dir: Path) -> dict:
    """{"run": the run record, "history": [row dicts], "summary": {key: json}} of a run directory's W&B run."""
    files = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no offline W&B run file under {run_dir}/wandb"
    out = {"run": None, "history": [], "summary": {}}
    for path in files:  # a resumed run writes a second file with the same id
        for r in records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                out["run"] = r.run
            elif kind == "history":
                out["history"].append({_key(i): i.value_json for i in r.history.item})
            elif kind == "summary":
                out["summary"].update({_key(i): i.value_json for i in r.summary.update})
    return out
