"""Hidden-state capture throughput vs a bare target forward on the same tokens (median of runs).

    python benchmarks/capture_throughput.py [--target smollm2|tiny] [--seqs 8] [--len 512] [--repeats 5]

Prints a small table; `--json PATH` also writes the figures. Both sides run the same padded batches
through the same model; capture adds the forward hooks, the concatenation of aux states, the argmax
and the bf16 -> uint16 conversion the cache stores.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from eaglelab.config import TargetConfig  # noqa: E402
from eaglelab.data.capture import capture_batch  # noqa: E402
from eaglelab.data.prepare import bf16_bits  # noqa: E402
from eaglelab.targets import load_target  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--cache-dir", default="~/.cache/eaglelab")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    target = load_target(TargetConfig(kind=args.target, dtype="bfloat16"), args.cache_dir)
    aux = target.default_aux_layer_ids()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(100, target.vocab_size, (args.len,), generator=g).tolist() for _ in range(args.seqs)]
    tokens = args.seqs * args.len

    def bare():
        with torch.no_grad():
            for i in range(0, len(seqs), args.batch):
                ids = torch.tensor(seqs[i: i + args.batch])
                target.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)

    def capture():
        for i in range(0, len(seqs), args.batch):
            for a, f, n in capture_batch(target, seqs[i: i + args.batch], aux):
                bf16_bits(a), bf16_bits(f), n.tolist()

    bare()  # warm-up
    times = {"bare_forward": [], "capture": []}
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
        for name, fn in (("bare_forward", bare), ("capture", capture)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: tokens / statistics.median(v) for k, v in times.items()}
    ratio = med["capture"] / med["bare_forward"]
    print(f"{'':14s} {'tok/s (median of ' + str(args.repeats) + ')':>24s}")
    for k, v in med.items():
        print(f"{k:14s} {v:24.0f}")
    print(f"capture / bare = {ratio:.3f}   ({args.target}, {args.seqs}x{args.len} tokens, batch {args.batch})")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens_per_s": med, "ratio": ratio, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
