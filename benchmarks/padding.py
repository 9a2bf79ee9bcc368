"""The share of a training epoch's computed positions that is padding: batches of a fixed count against batches cut by
a token budget (train.tokens_per_batch, length-grouped), on the sampler the trainer uses (`training.EpochBatches`).

    python benchmarks/padding.py [--sequences 20000] [--json PATH]

Mixes of sequence lengths (tokens, prompt + response):
  default-like   uniform 102–487 (the span of `make run`'s training sequences)
  long-tailed    50 + 4000·u³ (u uniform): most sequences short, a tail to ~4k, as multi-turn chat data is
Padding share = 1 − (sequence positions) / (rows × longest, summed over batches); positions per batch and batches per
epoch beside it. Exact (no training): what a step computes is rows × longest. (A run logs its own data's share
per epoch: `train/padding_share` in logs/metrics.csv.)
"""

import argparse
import json
from pathlib import Path

import torch

from eaglelab.train.ttt_module import EpochBatches


def mixes(n: int, seed: int = 0) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "default-like": torch.randint(102, 488, (n,), generator=g).tolist(),
        "long-tailed": (50 + torch.rand(n, generator=g).pow(3) * 4000).long().tolist(),
    }


def measure(lengths: list[int], batch_size: int | None, budget: int | None) -> dict:
    sampler = EpochBatches(len(lengths), batch_size or 1, seed=0, lengths=lengths, tokens_per_batch=budget)
    batches = list(sampler)
    computed = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    positions = sum(lengths[i] for b in batches for i in b)
    return {
        "batching": f"tokens_per_batch={budget}" if budget else f"batch_size={batch_size}",
        "padding_share": 1 - positions / computed,
        "batches": len(batches),
        "positions_per_batch": positions / len(batches),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=20000)
    ap.add_argument("--json")
    args = ap.parse_args()
    data = mixes(args.sequences)
    rows = []
    for name, lengths in data.items():
        for batch_size, budget in [(2, None), (8, None), (None, 1024), (None, 4096), (None, 16384)]:
            rows.append({"mix": name, **measure(lengths, batch_size, budget)})
    print(f"{'mix':<14} {'batching':<24} {'padding':>8} {'batches':>8} {'positions/batch':>16}")
    for r in rows:
        print(f"{r['mix']:<14} {r['batching']:<24} {r['padding_share']:>8.1%} {r['batches']:>8} "
              f"{r['positions_per_batch']:>16.0f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
