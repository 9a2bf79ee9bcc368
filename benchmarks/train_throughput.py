"""Drafter training throughput: trained positions per second, peak RSS, FLOP/s vs the GEMM roofline.

    python benchmarks/train_throughput.py [--configs peer,smollm2-8k,smollm2-32k] [--precision fp32,bf16]
                                          [--steps 20] [--repeats 5] [--json PATH]
    python benchmarks/train_throughput.py --profile smollm2-8k:bf16   # operator table of one config

Each (config, precision) runs in a fresh process (clean peak RSS): eaglelab's own training step
(`DrafterModule.ttt` + backward + AdamW step, as Lightning calls it; the Trainer loop itself adds a
few hundred µs a step) on one synthetic sequence per step whose every position drafts
(prompt length 1). A trained position = one sequence position through all ttt_steps.
FLOPs per step are counted by torch's FlopCounterMode (forward + backward, as executed), and the
roofline is the best of fp32 / bf16 GEMM FLOP/s measured in the same run.

Configs:
  peer          target hidden 128, 4 layers, 4 heads / 2 KV heads, intermediate 256, vocab 512,
                draft vocab 256, sequence 256, ttt_steps 3, AdamW, EAGLE-3.1 flags (the reference
                trainer, vLLM's `speculators`, runs it at ~4,750 positions/s median on this box, fp32)
  smollm2-8k    SmolLM2-135M shapes (hidden 576, 9 heads / 3 KV, intermediate 1536, vocab 49152),
                draft vocab 8192, sequence 1024, ttt_steps 3
  smollm2-32k   the same with draft vocab 32768
  8b-64         an 8B-shaped drafter (hidden 4096, 32 heads / 8 KV, intermediate 14336, vocab 128256, draft vocab
                32000, one layer), sequence 64
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "peer": {"hidden": 128, "layers": 4, "heads": 4, "kv": 2, "inter": 256, "vocab": 512, "draft": 256, "seq": 256},
    "smollm2-8k": {
        "hidden": 576,
        "layers": 30,
        "heads": 9,
        "kv": 3,
        "inter": 1536,
        "vocab": 49152,
        "draft": 8192,
        "seq": 1024,
    },
    "8b-64": {  # an 8B-shaped drafter (Llama-3.1-8B target: hidden 4096, 32 heads / 8 KV, intermediate 14336,
        # vocab 128256), one decoder layer, draft vocab 32000; sequence 64 (a 2-core CPU: ~15 s a step)
        "hidden": 4096,
        "layers": 32,
        "heads": 32,
        "kv": 8,
        "inter": 14336,
        "vocab": 128256,
        "draft": 32000,
        "seq": 64,
    },
    "smollm2-32k": {
        "hidden": 576,
        "layers": 30,
        "heads": 9,
        "kv": 3,
        "inter": 1536,
        "vocab": 49152,
        "draft": 32768,
        "seq": 1024,
    },
}


def gemm_flops(dtype, n: int = 2048, repeats: int = 5) -> float:
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        times.append((time.perf_counter() - t0) / 10)
    return 2 * n**3 / statistics.median(times)


def one(name: str, precision: str, steps: int, repeats: int, profile: bool = False) -> dict:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from eaglelab.batches import Batch
    from eaglelab.config import TrainConfig
    from eaglelab.drafter import Eagle3Config
    from eaglelab.training import DrafterModule

    c = CONFIGS[name]
    torch.manual_seed(0)
    L = c["layers"]
    cfg = Eagle3Config(
        hidden_size=c["hidden"],
        intermediate_size=c["inter"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["kv"],
        head_dim=c["hidden"] // c["heads"],
        vocab_size=c["vocab"],
        draft_vocab_size=c["draft"],
        target_hidden_size=c["hidden"],
        aux_layer_ids=(2, L // 2, L - 3) if L > 4 else (1, 2, 3),
        fc_norm=True,
        norm_output=True,
    )
    train_cfg = TrainConfig(ttt_steps=3, lr=1e-4)
    module = DrafterModule(cfg, train_cfg)
    module.drafter.set_vocab(torch.randperm(c["vocab"])[: c["draft"]].sort().values)
    T = c["seq"]
    ids = torch.randint(0, c["vocab"], (1, T))
    batch = Batch(
        input_ids=ids,
        target_next=torch.roll(ids, -1, 1),
        aux=torch.randn(1, T, 3 * c["hidden"]),
        final=None,
        prompt_len=torch.tensor([1]),
        seq_len=torch.tensor([T]),
        index=torch.tensor([0]),
    )
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def step():
        with autocast:
            loss = module.ttt(batch, train_cfg.ttt_steps)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    if profile:  # where a step's time goes, by operator (what motivates an optimisation)
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), file=sys.stderr)
    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        rates.append(steps * T / (time.perf_counter() - t0))
    pos_s = statistics.median(rates)
    return {
        "config": name,
        "precision": precision,
        "positions_per_s": pos_s,
        "positions_per_s_all": rates,
        "flops_per_step": flops,
        "achieved_flops": flops * pos_s / T,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="peer,smollm2-8k,smollm2-32k")
    ap.add_argument("--precision", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--gemm-size", type=int, default=2048, help="side of the square GEMM that sets the roofline")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--profile", metavar="CONFIG:PREC", help="print a torch.profiler table for one config")
    args = ap.parse_args()
    if args.one or args.profile:
        name, precision = (args.one or args.profile).split(":")
        print(json.dumps(one(name, precision, args.steps, args.repeats, profile=bool(args.profile))))
        return
    import torch

    precisions = args.precision.split(",")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    gemm = dict(n=args.gemm_size, repeats=max(1, min(5, args.repeats)))
    roof = {p: gemm_flops(dtypes[p], **gemm) for p in precisions}  # again after the runs
    rows = []
    for name in args.configs.split(","):
        steps = args.steps if name == "peer" else max(args.steps // 10, 2)
        for precision in precisions:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    f"{name}:{precision}",
                    "--steps",
                    str(steps),
                    "--repeats",
                    str(args.repeats),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  {name} {precision}: {rows[-1]['positions_per_s']:.0f} positions/s", file=sys.stderr)
    # The roofline is the better of the measurements before and after (a conservative denominator).
    roof = {p: max(roof[p], gemm_flops(dtypes[p], **gemm)) for p in precisions}
    best_roof = max(roof.values())
    print(
        f"\nGEMM roofline ({args.gemm_size}^3, {rows[0]['threads']} threads): "
        + ", ".join(f"{p} {roof[p] / 1e9:.1f} GFLOP/s" for p in precisions)
    )
    print(
        f"{'config':<13}{'prec':<6}{'positions/s':>12}{'vs 4750':>9}{'GFLOP/s':>9}{'of roof':>9}"
        f"{'of same-dtype':>15}{'peak RSS MB':>13}"
    )
    for r in rows:
        same = roof[r["precision"]]
        vs_ref = f"{r['positions_per_s'] / 4750:.2f}x" if r["config"] == "peer" else ""
        print(
            f"{r['config']:<13}{r['precision']:<6}{r['positions_per_s']:>12.0f}{vs_ref:>9}"
            f"{r['achieved_flops'] / 1e9:>9.1f}{r['achieved_flops'] / best_roof:>9.1%}"
            f"{r['achieved_flops'] / same:>15.1%}{r['peak_rss_mb']:>13.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"roofline_flops": roof, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
