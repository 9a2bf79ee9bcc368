"""The on-disk stores of the data path: token shards and state shards, written as they are produced and read
back one sequence at a time (never a whole split in memory).

    <cache>/regen/<key>/shard-00000.arrow      tokens: input_ids, prompt_len, is_val, max_tokens, tail, spans
                                               (1 record batch)
    <cache>/regen/<key>/complete.json          written last: the entry is whole
    <cache>/features/<key>/shard-00000.arrow   states: aux, [final], target_next (one record batch per sequence)
    <cache>/features/<key>/complete.json       which sequences each shard holds, the state widths

Both are Arrow IPC *files* (random access). Token shards are a few bytes per token and are memory-mapped.
State shards are ~3.5 KB per token on SmolLM2 and ~25-33 KB on an 8B target, so a sequence's states are read
with one positioned read of its record batch (pread, no mmap): a process holds only the batch it trains on,
mapped pages never pile up in its RSS (or in a Slurm job's memory accounting), and the kernel's page cache,
shared by every rank on a node, keeps what is hot. Each shard file is written to a temporary name and renamed
into place, so a killed writer leaves whole shards (kept, never redone) and at most one missing.

bf16 states are stored as their uint16 bits (Arrow has no bf16; fp16 would overflow: SmolLM2's residual
stream reaches ~2e4 on sink tokens).
"""

from __future__ import annotations

import json
import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from eaglelab.core.io import atomic_file, atomic_write_json, file_lock
from eaglelab.core.preemption import uninterruptible

# max_tokens: the sequence's response budget (its request's `max_tokens` when vLLM serves it); tail: the target's
# greedy continuation past the sequence's end, which a verifier scores drafts past the end against; spans: the
# earlier assistant turns of a multi-turn conversation, trained on too ([start0, end0, start1, end1, ...], positions
# in input_ids; empty for one turn: the response [prompt_len, len) is always trained). Shards written before spans
# existed have no such column and read as empty.
TOKENS = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("prompt_len", pa.int32()),
        ("is_val", pa.bool_()),
        ("max_tokens", pa.int32()),
        ("tail", pa.list_(pa.int32())),
        ("spans", pa.list_(pa.int32())),
    ]
)
COMPLETE = "complete.json"


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.arrow"


def state_bytes(n_aux: int, hidden: int, with_final: bool) -> int:
    """A state shard's bytes per token (`states_schema`): the aux states' bf16 bits, the int32 label, and the final
    state's bf16 bits when kept."""
    return (n_aux + with_final) * hidden * 2 + 4


def states_schema(with_final: bool) -> pa.Schema:
    fields = [("aux", pa.list_(pa.uint16())), ("target_next", pa.list_(pa.int32()))]
    return pa.schema(fields + ([("final", pa.list_(pa.uint16()))] if with_final else []))


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    """A tensor's values in bf16, as uint16 bits (lossless for a bf16 target)."""
    return x.detach().to("cpu", torch.bfloat16).contiguous().view(torch.uint16).numpy()


def from_bits(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np.uint16)).view(torch.bfloat16)


def _list(values: np.ndarray, dtype) -> pa.ListArray:
    """One list value holding `values` (flattened), without a Python list round trip."""
    return pa.ListArray.from_arrays(pa.array([0, values.size], pa.int32()), pa.array(values.reshape(-1), dtype))


# --- writing ----------------------------------------------------------------------------------------
def write_token_shard(path: Path, rows: list[tuple]) -> None:
    """rows: (input_ids, prompt_len, is_val, max_tokens, tail[, spans]) per sequence, in the shard's order."""
    rows = [(*row, []) if len(row) == 5 else row for row in rows]
    columns = [pa.array(values, field.type) for values, field in zip(zip(*rows), TOKENS)]
    batch = pa.record_batch(columns, TOKENS)
    with uninterruptible("token shard"), atomic_file(path, "wb") as f, pa.ipc.new_file(f, TOKENS) as writer:
        writer.write_batch(batch)


class StateWriter:
    """Streams one record batch per sequence into one shard file (renamed into place on `close`)."""

    def __init__(self, path: Path, with_final: bool):
        self.schema, self.path = states_schema(with_final), Path(path)
        self._file = atomic_file(path, "wb")
        self._writer = pa.ipc.new_file(self._file.__enter__(), self.schema)
        self.rows: list[int] = []

    def write(self, row: int, aux: torch.Tensor, target_next: torch.Tensor, final: torch.Tensor | None = None):
        """aux [T, n·H], target_next [T], final [T, H] of sequence `row` (any device, any float dtype)."""
        arrays = [_list(bf16_bits(aux), pa.uint16()), _list(target_next.detach().cpu().int().numpy(), pa.int32())]
        if "final" in self.schema.names:
            arrays.append(_list(bf16_bits(final), pa.uint16()))
        with uninterruptible("state shard"):  # pyarrow writes through Python's file: never interrupted mid-batch
            self._writer.write_batch(pa.record_batch(arrays, self.schema))
        self.rows.append(int(row))

    def close(self) -> list[int]:
        with uninterruptible("state shard"):
            self._writer.close()
            self._file.__exit__(None, None, None)
        return self.rows

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:
            self._file.__exit__(RuntimeError, RuntimeError("aborted"), None)

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is None:
            self.close()
        else:
            self.abort()


def is_complete(folder: Path) -> bool:
    return (Path(folder) / COMPLETE).is_file()


def shards_done(folder: Path) -> set[int]:
    """Indices of the shard files already whole in `folder` (a killed writer's temporary files excluded)."""
    return {int(p.stem.split("-")[1]) for p in Path(folder).glob("shard-*.arrow")}


def shard_lengths(path: Path) -> np.ndarray:
    """The sequences' lengths in tokens of one token shard (its input_ids offsets, read in place)."""
    offsets, _ = _list_arrays(pa.ipc.open_file(pa.memory_map(str(path))).read_all().column("input_ids"))
    return np.diff(offsets)


def mark_complete(folder: Path, meta: dict) -> None:
    """The entry is whole: complete.json, with every shard's size as written, so a copy that is not can be told."""
    shards = sorted(Path(folder).glob("*.arrow"))  # token or state shards; a hybrid run's are named by rank
    atomic_write_json(Path(folder) / COMPLETE, {**meta, "shard_bytes": {p.name: p.stat().st_size for p in shards}})


def damaged(folder: Path) -> str | None:
    """What is wrong with a complete entry's shards (missing, or not the size they were written at: truncated,
    half-copied), in a few words; None when they are whole, or when the entry predates recorded sizes."""
    recorded = json.loads((Path(folder) / COMPLETE).read_text()).get("shard_bytes", {})
    for name, size in recorded.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} holds {path.stat().st_size} bytes, {size} were written"
    return None


def entry_lock(folder: Path):
    """The lock every writer of a cache entry (`<cache>/<kind>/<key>`) holds: `<cache>/locks/<kind>-<key>.lock`."""
    return file_lock(shard_lock(folder))


def shard_lock(folder: Path, shard_file: str | None = None) -> Path:
    """The lock file of a cache entry, or of one of its shards (held by that shard's maker):
    `<cache>/locks/<kind>-<key>[-<shard file>].lock`."""
    folder = Path(folder)
    name = f"{folder.parent.name}-{folder.name}" + (f"-{shard_file}" if shard_file else "")
    return folder.parent.parent / "locks" / f"{name}.lock"


# --- reading ----------------------------------------------------------------------------------------
@lru_cache(maxsize=64)  # open readers (footer parsed once); bounded: thousands of shards at 10^8 tokens
def _state_reader(path: str) -> pa.ipc.RecordBatchFileReader:
    return pa.ipc.open_file(pa.OSFile(path))


def remove_entry(folder: Path) -> None:
    """A damaged entry removed to be prepared again. This process's open readers go with it: one kept by path
    would read the removed file's bytes, not the rebuilt shard's."""
    shutil.rmtree(folder)
    _state_reader.cache_clear()


class TokenStore:
    """The token shards of one regeneration: every sequence's ids, prompt length and split.

    The shards are read in place (memory-mapped, zero-copy): every rank of a node reads the same pages from the page
    cache instead of holding a copy of the whole set. Only the per-sequence columns (a few numbers each) are
    gathered."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / COMPLETE).read_text())  # also: stop_token_ids, tail_tokens
        files = [self.folder / shard_name(i) for i in range(self.meta["shards"])]
        tables = [pa.ipc.open_file(pa.memory_map(str(f))).read_all() for f in files]
        self._tables = tables or [pa.table({}, schema=TOKENS)]
        # Per shard: (offsets [n + 1], values) of input_ids and of tail, views into the mapped file.
        self._ids = [_list_arrays(t.column("input_ids")) for t in self._tables]
        self._tails = [_list_arrays(t.column("tail")) for t in self._tables]
        self._spans = [_list_arrays(t.column("spans")) if "spans" in t.column_names else None for t in self._tables]
        self._starts = np.cumsum([0] + [t.num_rows for t in self._tables])  # sequence i lives in shard k when
        self.prompt_len = self._gather("prompt_len")  # _starts[k] <= i < _starts[k + 1]
        self.max_tokens = self._gather("max_tokens")

    def _gather(self, name: str) -> np.ndarray:
        return np.concatenate([t.column(name).to_numpy() for t in self._tables])

    def _where(self, i: int) -> tuple[int, int]:
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return k, i - int(self._starts[k])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def input_ids(self, i: int) -> np.ndarray:
        k, j = self._where(i)
        offsets, values = self._ids[k]
        return values[offsets[j] : offsets[j + 1]]

    def tail(self, i: int) -> np.ndarray:
        k, j = self._where(i)
        offsets, values = self._tails[k]
        return values[offsets[j] : offsets[j + 1]]

    def spans(self, i: int) -> np.ndarray:
        """[S, 2] sequence i's earlier assistant turns (start, end), trained on besides [prompt_len, len)."""
        k, j = self._where(i)
        if self._spans[k] is None:
            return np.zeros((0, 2), np.int32)
        offsets, values = self._spans[k]
        return values[offsets[j] : offsets[j + 1]].reshape(-1, 2)

    def trained_from(self, i: int) -> int:
        """The first position of sequence i whose token is trained on: its first assistant turn's start."""
        spans = self.spans(i)
        return int(spans[0, 0]) if len(spans) else int(self.prompt_len[i])

    def trained_tokens(self, i: int) -> int:
        """Assistant tokens of sequence i: every turn's (the losses' positions)."""
        spans = self.spans(i)
        return len(self.input_ids(i)) - int(self.prompt_len[i]) + int((spans[:, 1] - spans[:, 0]).sum())

    def lengths(self) -> np.ndarray:
        return np.concatenate([np.diff(offsets) for offsets, _ in self._ids])

    def column(self, name: str) -> list:
        return [v for t in self._tables for v in t.column(name).to_pylist()]


def _list_arrays(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A list column's (offsets, values) as numpy views (one chunk per shard file as written; more are combined)."""
    array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    if array.offset:  # (a sliced array: its offsets would not start at 0)
        array = pa.concat_arrays([array])
    return array.offsets.to_numpy(), array.values.to_numpy()


class StateStore:
    """The captured states of the sequences of one token store (rows in any shard order: see complete.json)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        meta = json.loads((self.folder / COMPLETE).read_text())
        self.with_final = bool(meta["with_final"])
        self.where: dict[int, tuple[str, int]] = {}  # sequence -> (shard file, record batch)
        for shard in meta["shards"]:
            path = str(self.folder / shard["file"])
            for j, row in enumerate(shard["rows"]):
                self.where.setdefault(int(row), (path, j))

    def __len__(self) -> int:
        return len(self.where)

    def read(self, i: int) -> dict[str, torch.Tensor]:
        """-> aux [T, n·H] bf16, target_next [T] int64, final [T, H] bf16 (when stored); T from target_next."""
        path, j = self.where[i]
        batch = _state_reader(path).get_batch(j)
        nxt = torch.from_numpy(batch.column("target_next").values.to_numpy().astype(np.int64))
        T = len(nxt)
        out = {"target_next": nxt, "aux": from_bits(batch.column("aux").values.to_numpy()).view(T, -1)}
        if self.with_final:
            out["final"] = from_bits(batch.column("final").values.to_numpy()).view(T, -1)
        return out


def state_shards_meta(files_rows: list[tuple[str, list[int]]], with_final: bool, **extra) -> dict:
    return {"shards": [{"file": f, "rows": rows} for f, rows in files_rows], "with_final": with_final, **extra}


class Sequences:
    """A prepared prompt set: its tokens, and its captured states once there are any (`states` is None for
    online features until a hybrid run caches them). `features["input_ids"]` etc. read a column; `select`
    gives a view of some of its sequences."""

    def __init__(
        self,
        tokens: TokenStore,
        states: StateStore | None = None,
        states_dir: Path | None = None,
        rows: list[int] | None = None,
        keeps_final: bool = False,
        tail_tokens: int | None = None,
    ):
        self.tokens, self.states = tokens, states
        self.states_dir = states_dir  # where this set's states are (or would be) cached
        self.keeps_final = keeps_final  # whether those states hold the target's final state (or will: hybrid)
        self.tail_tokens = tail_tokens  # tail tokens `item(with_tail=True)` gives (None: all that are stored)
        self.rows = list(range(len(tokens))) if rows is None else list(rows)  # this view's rows in the stores

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, column: str) -> list:
        if column == "input_ids":
            return [self.tokens.input_ids(r).tolist() for r in self.rows]
        values = self.tokens.column(column)
        return [values[r] for r in self.rows]

    def select(self, indices) -> Sequences:
        rows = [self.rows[i] for i in indices]
        return Sequences(self.tokens, self.states, self.states_dir, rows, self.keeps_final, self.tail_tokens)

    @property
    def stop_token_ids(self) -> list[int]:
        """The stop ids the target's responses were generated with (an engine serving them must use the same)."""
        return list(self.tokens.meta["stop_token_ids"])

    def item(self, i: int, with_states: bool = True, with_final: bool = False, with_tail: bool = False) -> dict:
        """Sequence i as tensors: input_ids, prompt_len, seq_len, index (its row in the stores), and (when stored
        and asked for) its states. `with_tail`: input_ids continue past seq_len with the sequence's tail."""
        r = self.rows[i]
        ids = self.tokens.input_ids(r)
        item = {
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "prompt_len": int(self.tokens.prompt_len[r]),
            "seq_len": len(ids),
            "index": r,
        }
        if len(spans := self.tokens.spans(r)):  # a multi-turn conversation's earlier assistant turns
            item["spans"] = torch.from_numpy(spans.astype(np.int64))
        if with_tail:
            tail = self.tokens.tail(r)[: self.tail_tokens]
            item["input_ids"] = torch.from_numpy(np.concatenate([ids, tail]).astype(np.int64))
        if with_states and self.states is not None:
            states = self.states.read(r)
            item["aux"], item["target_next"] = states["aux"], states["target_next"]
            if with_final:
                item["final"] = states["final"]
        return item

    def disk_bytes(self) -> dict[str, int]:
        """Bytes on disk of the token shards and of the state shards."""

        def size(folder):
            return sum(p.stat().st_size for p in Path(folder).iterdir()) if folder else 0

        return {"tokens": size(self.tokens.folder), "states": size(self.states.folder if self.states else None)}
