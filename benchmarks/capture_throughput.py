"""Hidden-state capture throughput vs a bare target forward on the same tokens (median of runs).

    python benchmarks/capture_throughput.py [--target smollm2|tiny] [--seqs 8] [--len 512] [--repeats 5]

Two comparisons, each side run on the same tokens through the same model, interleaved:
- separate capture pass (hooks, aux concatenation, argmax, bf16 -> uint16 as cached) vs a bare
  forward over the same padded batches;
- the fused path eaglelab uses by default: greedy generation that captures as it goes vs the same
  generation without capture (`--gen-prompts`, `--gen-tokens`).
Prints a small table; `--json PATH` also writes the figures.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eaglelab.core.config import TargetConfig
from eaglelab.data.capture import capture_batch
from eaglelab.data.prompts import humaneval_prompts
from eaglelab.data.regenerate import generate
from eaglelab.data.store import bf16_bits
from eaglelab.data.targets import load_target
from eaglelab.data.templates import template_prompt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--cache-dir", default="~/.cache/eaglelab")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument(
        "--prompt-share",
        type=float,
        default=0.5,
        help="share of each sequence that is prompt (capture computes labels only after it; "
        "the default run's data is ~0.5)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gen-prompts", type=int, default=8)
    ap.add_argument("--gen-tokens", type=int, default=48)
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
                ids = torch.tensor(seqs[i : i + args.batch])
                target.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)

    def capture():
        for i in range(0, len(seqs), args.batch):
            batch = seqs[i : i + args.batch]
            for a, f, n in capture_batch(target, batch, aux, [max(1, int(args.prompt_share * len(s))) for s in batch]):
                bf16_bits(a), bf16_bits(f), n.tolist()

    prompts = [template_prompt(target.tokenizer, m, None) for m in humaneval_prompts()[: args.gen_prompts]]
    generated = {}

    def gen(capture_layers):
        n = 0
        for g in generate(target, prompts, args.gen_tokens, 4096, len(prompts), capture_layers):
            generated.setdefault(g.index, g.response)
            assert generated[g.index] == g.response  # both sides produce the same tokens
            n += len(g.response)
        return n

    bare()  # warm-up
    fns = {
        "bare_forward": bare,
        "capture": capture,
        "generate": lambda: gen(None),
        "generate+capture": lambda: gen(aux),
    }
    times = {k: [] for k in fns}
    gen_tokens = gen(None)
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits all alike
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    work = {"bare_forward": tokens, "capture": tokens, "generate": gen_tokens, "generate+capture": gen_tokens}
    med = {k: work[k] / statistics.median(v) for k, v in times.items()}
    ratios = {
        "capture/bare_forward": med["capture"] / med["bare_forward"],
        "generate+capture/generate": med["generate+capture"] / med["generate"],
    }
    print(f"{'':18s} {'tok/s (median of ' + str(args.repeats) + ')':>24s}")
    for k, v in med.items():
        print(f"{k:18s} {v:24.0f}")
    for k, v in ratios.items():
        print(f"{k:28s} {v:.3f}")
    print(
        f"({args.target}; forward: {args.seqs}x{args.len} tokens, batch {args.batch}, prompt share "
        f"{args.prompt_share}; "
        f"generate: {len(prompts)} HumanEval prompts x {args.gen_tokens} new tokens)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens_per_s": med, "ratios": ratios, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
