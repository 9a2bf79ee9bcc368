"""Host memory per rank: what each of a node's ranks holds, measured here, and what 8 ranks of an 8B run would hold.

    python -m benchmarks.rank_memory [--tokens 50000000] [--smoke] [--json PATH]

A node's ranks share its `--mem`. What one copy or the page cache can serve must not be held once per rank.
Measured, each in a fresh process (the private memory it holds afterwards, what it built still alive, less that
before: /proc/self/status RssAnon; a memory-mapped file's pages are the page cache's, one copy for every rank), on a
synthetic token store of `--tokens` tokens (int32, in 64 shards, written with eaglelab's own writer):

  token store, read in place   `TokenStore(folder)` and every sequence's length (eaglelab now: the shards are
                               memory-mapped; what is read sits in the page cache, shared by the ranks)
  token store, copied          the shards concatenated and combined into one table (eaglelab before)
  draft vocab, streamed        `draft_vocab` over a generator of sequences (eaglelab now)
  draft vocab, listed          `draft_vocab` over the list of every training sequence as int64 (eaglelab before)

`--smoke`: the smoke experiment through the CLI with 1 and 2 ranks (`train.devices`, DDP on gloo): each rank's
peak RSS up to the end of training (`memory/rank<r>_train_peak_rss_gb` in metrics.json), rank 0's for the run.

Then, computed (not measured: no 8B target here), what each rank of 8 on one node holds at Llama-3.1-8B shapes
(hidden 4096, draft vocabulary 32k, 10^8 training tokens), before and after; rank 0's own extra (the best
weights kept by train.keep=best) is counted once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1024**3
CASES = ("token store, read in place", "token store, copied", "draft vocab, streamed", "draft vocab, listed")

MEASURE = """
import json, sys
from pathlib import Path

def private():  # anonymous resident memory: what this process alone holds (the page cache's pages are shared)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

import numpy as np, pyarrow as pa, torch
from eaglelab.data.store import TokenStore, shard_name, COMPLETE
from eaglelab.data.vocab import draft_vocab
folder, case = Path(sys.argv[1]), sys.argv[2]
before = private()
if case == "token store, read in place":
    store = TokenStore(folder)
    total = int(store.lengths().sum())
elif case == "token store, copied":
    n = json.loads((folder / COMPLETE).read_text())["shards"]
    tables = [pa.ipc.open_file(pa.memory_map(str(folder / shard_name(i)))).read_all() for i in range(n)]
    table = pa.concat_tables(tables).combine_chunks()
    total = len(table.column("input_ids").chunk(0).values)
else:
    store = TokenStore(folder)
    ids = lambda i: torch.from_numpy(store.input_ids(i).astype(np.int64))
    if case == "draft vocab, listed":
        seqs = [ids(i) for i in range(len(store))]
    else:
        seqs = (ids(i) for i in range(len(store)))
    draft_vocab(seqs, (int(p) for p in store.prompt_len), 49152, 8192)
print(json.dumps({"case": case, "held_gb": (private() - before) / 2**30}))  # (what it built is still alive)
"""


def write_store(folder: Path, tokens: int, shards: int = 64, length: int = 2048) -> None:
    import numpy as np

    from eaglelab.data.store import mark_complete, shard_name, write_token_shard

    rng = np.random.default_rng(0)
    per_shard = max(1, tokens // (shards * length))
    for s in range(shards):
        rows = [(rng.integers(0, 49152, length).tolist(), 16, False, length, []) for _ in range(per_shard)]
        write_token_shard(folder / shard_name(s), rows)
    mark_complete(folder, {"name": "synthetic", "shards": shards})


def measured(folder: Path) -> list[dict]:
    env = {"PYTHONPATH": str(ROOT / "src")}
    rows = []
    for case in CASES:
        out = subprocess.run([sys.executable, "-c", MEASURE, str(folder), case], capture_output=True, text=True,
                             env={**os.environ, **env}, check=True)  # fmt: skip
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def smoke(work: Path) -> dict[int, dict]:
    out = {}
    for world in (1, 2):
        run_dir = work / f"smoke_w{world}"
        args = ["experiment=smoke", f"train.devices={world}", "train.strategy=ddp", "train.batch_size=2",
                "train.num_threads=1", f"hydra.run.dir={run_dir}", f"paths.cache_dir={work / 'cache'}"]  # fmt: skip
        subprocess.run([sys.executable, str(ROOT / "src" / "run.py"), *args], cwd=ROOT, check=True,
                       capture_output=True)  # fmt: skip
        metrics = json.loads((run_dir / "metrics.json").read_text())
        by_rank = [metrics.get(f"memory/rank{r}_train_peak_rss_gb") for r in range(world)]
        out[world] = {"run_peak_rss_gb": metrics["memory/peak_rss_gb"], "train_peak_rss_gb_by_rank": by_rank}
    return out


def projection(ranks: int = 8, tokens: float = 1e8) -> list[tuple[str, float, float]]:
    """(what, GB per rank before, GB per rank after) at Llama-3.1-8B shapes; the page cache's one copy is not
    counted per rank."""
    H, V, D, inter = 4096, 128256, 32000, 14336
    drafter = 3 * H * H + (2 * H * H + 2 * 2 * H * 1024 + H * H) + 3 * H * inter + D * H  # fc, attention, MLP, head
    fp32 = drafter * 4 / GB
    ckpt = 4 * fp32  # weights, AdamW's two moments, train.keep=best's copy
    return [
        ("token shards (int32)", tokens * 4 / GB, 0.0),
        ("draft vocabulary's sequences (int64)", tokens * 8 / GB, 0.0),
        ("train.keep=best's weights (fp32), ranks > 0", fp32, 0.0),
        ("a resumed checkpoint read to the host", ckpt, 0.0),
        ("the drafter built in fp32 before it moves (unchanged)", fp32, fp32),
        ("the target's embedding in its dtype (unchanged)", V * H * 2 / GB, V * H * 2 / GB),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=50_000_000)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_store(work / "tokens", a.tokens)
        rows = measured(work / "tokens")
        runs = smoke(work) if a.smoke else {}
    print(f"measured, {a.tokens / 1e6:.0f}M tokens ({a.tokens * 4 / GB:.2f} GB as int32):")
    for r in rows:
        print(f"  {r['case']:30s} {r['held_gb']:6.2f} GB held privately by the process")
    for world, r in runs.items():
        ranks = ", ".join(f"{gb:.2f}" for gb in r["train_peak_rss_gb_by_rank"] if gb is not None) or "-"
        print(f"  smoke, {world} rank(s): run peak {r['run_peak_rss_gb']:.2f} GB; per rank in training: {ranks} GB")
    table = projection()
    print("computed, per rank of 8 on one node (Llama-3.1-8B shapes, 10^8 training tokens):")
    print(f"  {'':55s} {'before':>8s} {'after':>8s}")
    for what, before, after in table:
        print(f"  {what:55s} {before:7.2f}G {after:7.2f}G")
    total_b, total_a = sum(b for _, b, _ in table), sum(x for _, _, x in table)
    print(f"  {'8 ranks in all':55s} {8 * total_b:7.1f}G {8 * total_a:7.1f}G")
    if a.json:
        a.json.write_text(json.dumps({"measured": rows, "smoke": runs, "projection": table}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
