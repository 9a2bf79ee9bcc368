"""Peak memory of one training step against the context length: the fused attention against the explicit softmax.

    python benchmarks/attention_memory.py [--lengths 2048,4096,8192] [--batch 2] [--ttt 3]
                                          [--modes explicit,fused,checkpointed] [--precision fp32] [--json PATH]

One training step as Lightning runs it (`DrafterModule.ttt` + backward) on the SmolLM2-135M drafter shape (hidden
576, 9 heads / 3 KV heads of 64, intermediate 1536, vocab 49152, draft vocab 8192, one layer), B sequences whose
every position drafts (prompt length 1). Each (length, mode) runs in a fresh process; its figure is the peak RSS
during the step less the RSS before it (model, optimizer-free). Modes:

  explicit      the softmax written out in query blocks (`Attention._attend_explicit`, what eaglelab trained with
                before the fused kernel, and what drift's probes still read): B·h·T probabilities per query kept
  fused         `scaled_dot_product_attention` with the own drafts merged through the sink key (the default)
  checkpointed  fused, with train.activation_checkpointing (each decoder layer recomputed in the backward pass)

Beside each fused figure: the estimate eaglelab's memory check makes for the same step (`plan.costs.ttt_kept_bytes` +
`unroll_alive_bytes`), and the largest logit gap between the fused and the explicit forward (no gradients).
"""

import argparse
import json
import resource
import subprocess
import sys
import time

SHAPE = dict(hidden=576, heads=9, kv=3, inter=1536, vocab=49152, draft=8192)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def one(length: int, mode: str, batch: int, ttt: int, precision: str) -> dict:
    import torch

    from eaglelab.core.config import TrainConfig
    from eaglelab.models.drafter import Eagle3Config
    from eaglelab.plan.costs import ttt_kept_bytes, unroll_alive_bytes
    from eaglelab.train.batches import Batch
    from eaglelab.train.ttt_module import DrafterModule

    torch.manual_seed(0)
    s = SHAPE
    cfg = Eagle3Config(
        hidden_size=s["hidden"], intermediate_size=s["inter"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"], head_dim=s["hidden"] // s["heads"], vocab_size=s["vocab"],
        draft_vocab_size=s["draft"], target_hidden_size=s["hidden"], aux_layer_ids=(2, 15, 27),
        max_position_embeddings=max(8192, length),
    )  # fmt: skip
    module = DrafterModule(cfg, TrainConfig(ttt_steps=ttt))
    module.drafter.set_vocab(torch.randperm(s["vocab"])[: s["draft"]].sort().values)
    module.drafter.activation_checkpointing = mode == "checkpointed"
    probe = (lambda *a: None) if mode == "explicit" else None  # a probe routes attention to the explicit softmax
    for layer in module.drafter.layers:
        layer.self_attn.probe = probe
    B, T = batch, length
    ids = torch.randint(0, s["vocab"], (B, T))
    data = Batch(
        input_ids=ids, target_next=torch.roll(ids, -1, 1), aux=torch.randn(B, T, 3 * s["hidden"]),
        prompt_len=torch.ones(B, dtype=torch.long), seq_len=torch.full((B,), T), index=torch.arange(B),
    )  # fmt: skip
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    before = rss_bytes()
    t0 = time.perf_counter()
    with autocast:
        loss = module.ttt(data, ttt)[0]
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    row = {"length": T, "mode": mode, "peak_gb": peak / 1e9, "step_s": seconds, "batch": B, "ttt_steps": ttt}
    if mode != "explicit":
        lowp, stream = (2, 4) if precision == "bf16" else (4, 4)
        rows = B * (T - 1)
        row["estimate_gb"] = (
            ttt_kept_bytes(B, T, ttt, T - 1, cfg, lowp, stream, checkpointing=mode == "checkpointed")
            + unroll_alive_bytes(B, T, ttt, rows, cfg, lowp, stream)
        ) / 1e9
        with torch.no_grad(), autocast:  # the same forward both ways: the largest logit gap
            module.drafter.zero_grad(set_to_none=True)
            fused = module.drafter.unroll(data.aux, ids, ttt)
            for layer in module.drafter.layers:
                layer.self_attn.probe = lambda *a: None
            explicit = module.drafter.unroll(data.aux, ids, ttt)
            head = module.drafter.lm_head
            row["max_logit_gap"] = max(
                float((head(a.normed[:, i : i + 512]) - head(b.normed[:, i : i + 512])).abs().max())
                for a, b in zip(fused, explicit)
                for i in range(0, T, 512)
            )
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--modes", default="explicit,fused,checkpointed")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        length, mode = args.one.split(":")
        print(json.dumps(one(int(length), mode, args.batch, args.ttt, args.precision)))
        return
    rows = []
    for length in map(int, args.lengths.split(",")):
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, "--one", f"{length}:{mode}", "--batch", str(args.batch),
                   "--ttt", str(args.ttt), "--precision", args.precision]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:  # e.g. killed for memory: a figure of its own, not a crash of the table
                tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
                rows.append({"length": length, "mode": mode, "failed": tail[:200]})
            else:
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"  T={length} {mode}: {rows[-1].get('peak_gb', rows[-1].get('failed'))}", file=sys.stderr)
    print(f"\none training step, B={args.batch}, ttt_steps={args.ttt}, {args.precision}, SmolLM2 drafter shape")
    print(f"{'T':>6} {'mode':<13} {'peak GB':>8} {'step s':>7} {'estimate GB':>12} {'max logit gap':>14}")
    for r in rows:
        if "failed" in r:
            print(f"{r['length']:>6} {r['mode']:<13} failed: {r['failed']}")
            continue
        est = f"{r['estimate_gb']:.2f}" if "estimate_gb" in r else ""
        gap = f"{r['max_logit_gap']:.2e}" if "max_logit_gap" in r else ""
        print(f"{r['length']:>6} {r['mode']:<13} {r['peak_gb']:>8.2f} {r['step_s']:>7.1f} {est:>12} {gap:>14}")
    for length in sorted({r["length"] for r in rows}):
        by = {r["mode"]: r for r in rows if r["length"] == length and "peak_gb" in r}
        if "explicit" in by and "fused" in by:
            print(f"T={length}: explicit / fused peak = {by['explicit']['peak_gb'] / by['fused']['peak_gb']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
