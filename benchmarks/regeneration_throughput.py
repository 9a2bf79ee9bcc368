"""Regeneration throughput: vLLM vs eaglelab's HF generate on the same prompts (median of runs).

    python benchmarks/regeneration_throughput.py [--target smollm2|tiny] [--prompts 64] [--tokens 160] [--repeats 3]

Both sides generate greedily the same training prompts (chat-templated) with the same budget. HF is
eaglelab's KV-cache loop without capture (`generate`, batch `--batch`); vLLM runs in its own process
with continuous batching of all prompts (`generate_vllm`, one shard). vLLM's figure is reported with and without
its engine start (one start per regeneration in practice). Runs alternate HF/vLLM. `--json` writes
the figures.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from eaglelab.core.config import TargetConfig
from eaglelab.data.prompts import mix_sources
from eaglelab.data.regenerate import generate, generate_vllm
from eaglelab.data.targets import load_target
from eaglelab.data.templates import template_prompt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--cache-dir", default="~/.cache/eaglelab")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    target = load_target(TargetConfig(kind=args.target, dtype="bfloat16"), args.cache_dir)
    prompts = [
        template_prompt(target.tokenizer, m, None)
        for m in mix_sources(["stdlib_docstrings", "pydoc_topics"], args.prompts, seed=0)
    ]
    limit = 1024
    hf_tps, vllm_tps, vllm_total_tps, agree = [], [], [], []
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        hf = {g.index: g.response for g in generate(target, prompts, args.tokens, limit, args.batch)}
        hf_s = time.perf_counter() - t0
        hf_tokens = sum(len(r) for r in hf.values())
        hf_tps.append(hf_tokens / hf_s)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            by_shard, result_s = generate_vllm(target, {0: prompts}, args.tokens, limit, Path(tmp))
            out = [response for response, _ in by_shard[0]]
            total_s = time.perf_counter() - t0
        v_tokens = sum(len(r) for r in out)
        vllm_tps.append(v_tokens / result_s)
        vllm_total_tps.append(v_tokens / total_s)
        agree.append(sum(out[i] == hf[i] for i in range(len(prompts))) / len(prompts))
        print(
            f"run {rep + 1}: HF {hf_tokens} tok in {hf_s:.1f} s ({hf_tps[-1]:.0f} tok/s) | vLLM {v_tokens} tok, "
            f"{result_s:.1f} s generating, {total_s:.1f} s with start",
            flush=True,
        )
    med = statistics.median
    rows = {
        "prompts": len(prompts),
        "max_new_tokens": args.tokens,
        "hf_tokens_per_s": med(hf_tps),
        "vllm_tokens_per_s": med(vllm_tps),
        "vllm_tokens_per_s_with_start": med(vllm_total_tps),
        "ratio_vllm_over_hf": med(vllm_tps) / med(hf_tps),
        "ratio_with_start": med(vllm_total_tps) / med(hf_tps),
        "identical_responses_share": med(agree),
    }
    print(
        f"\nregeneration, {len(prompts)} prompts x {args.tokens} new tokens, target {args.target} bf16, "
        f"median of {args.repeats}:"
    )
    print(f"  HF generate (batch {args.batch})      {rows['hf_tokens_per_s']:8.1f} tok/s")
    print(
        f"  vLLM (continuous batching)     {rows['vllm_tokens_per_s']:8.1f} tok/s   x{rows['ratio_vllm_over_hf']:.2f}"
    )
    print(
        f"  vLLM incl. engine start        {rows['vllm_tokens_per_s_with_start']:8.1f} tok/s   "
        f"x{rows['ratio_with_start']:.2f}"
    )
    print(f"  identical responses            {rows['identical_responses_share']:.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
