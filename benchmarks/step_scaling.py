"""One drafter training step against the context length: peak memory, step time, share of the device's peak
FLOP/s, the SDPA kernel of each draft step, and eaglelab's memory estimate beside the measurement.

    python -m benchmarks.step_scaling --device cuda                       # the 8B drafter at T 2k/8k/32k, TTT 3 and 7
    python -m benchmarks.step_scaling --device cpu --shape tiny --lengths 64,128 --ttt 2,3 --steps 1   # the tests'

Shapes: `llama8b` is the drafter of an 8B target (Llama-3.1-8B: hidden 4,096, 32 heads / 8 KV heads of 128,
intermediate 14,336, vocab 128,256; draft vocab 32,000, aux ids (2, 16, 29)); `tiny` the same at toy size. One
sequence per step whose every position drafts (prompt length 1: the most labelled positions a length can have),
with cached features (the trainer's float32 aux states; no target), as Lightning runs it: `DrafterModule.ttt` under
bf16 autocast (`train.precision=bf16-mixed`, float32 weights), backward, gradient clipping, AdamW. Each (T, TTT)
runs without and with `train.activation_checkpointing`, in one process (the model and optimizer are reused; the
depth and the checkpointing switch change no parameter).

Per row: the peak of the step (GPU: torch's max allocated; CPU: peak RSS, which never goes down, so only the first
row's is its own) and what the step added over what was held before it (the model, AdamW's moments); eaglelab's
activation model for that addition (`plan.costs.ttt_kept_bytes` + `unroll_alive_bytes`, the terms its memory check sizes
a step with, + the float32 gradients; without what the check adds on top: AdamW's update temporaries, autocast's
16-bit weight copies and the allocator slack); the mean step time over --steps; the step's FLOPs as torch's
FlopCounterMode counts them without checkpointing (the model's FLOPs: recomputation is not useful work; causal
attention counted as half the dense product, `attention_flops`; where no step without checkpointing was measured at
that size (it did not fit, or --checkpointing on), the checkpointed step's, recomputation included, marked "*") and
their rate against --peak-tflops (default: the H200's and H100's bf16 dense peak, 989 TFLOP/s) and against a 8192³
bf16 GEMM measured here; the SDPA kernel each draft step's attention used (`eaglelab.core.devices.SdpaKernels`). A row
that runs out of memory is a figure of its own ("OOM").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

SHAPES = {
    "llama8b": dict(hidden=4096, heads=32, kv=8, inter=14336, vocab=128256, draft=32000, aux=(2, 16, 29), layers=32),
    "tiny": dict(hidden=64, heads=4, kv=2, inter=128, vocab=512, draft=256, aux=(1, 2, 3), layers=4),
}
H200_BF16_DENSE_TFLOPS = 989.4  # NVIDIA's datasheet, SXM, without sparsity (the H100 SXM's is the same)


def gemm_tflops(device, n: int = 8192, repeats: int = 10) -> float:
    """The bf16 matmul rate this device reaches on a large square product (what a step could at best run at)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e12


def attention_flops() -> dict:
    """FlopCounterMode's formulas for the fused attention kernels, where torch's own cannot count the drafter's calls:
    grouped KV heads (torch's asserts that q, k and v have the same heads) and the CPU's flash kernel (which it does
    not count at all). Every drafter call is causal (no sliding window here): half the dense T x T product is work
    the kernels do, the masked half they skip, so half is counted."""
    import torch
    from torch.utils import flop_counter as fc

    def heads(q, kv):  # k/v shapes [B, kv, T, d] -> [B, h, T, d]: each query head reads a whole K and V
        return (kv[0], q[1], *kv[2:])

    def forward(q, k, v, *args, out_shape=None, **kwargs):
        return fc.sdpa_flop_count(q, heads(q, k), heads(q, v)) // 2

    def backward(grad, q, k, v, *args, out_shape=None, **kwargs):
        return fc.sdpa_backward_flop_count(grad, q, heads(q, k), heads(q, v)) // 2

    aten = torch.ops.aten
    names = ("flash_attention", "efficient_attention", "cudnn_attention", "flash_attention_for_cpu")
    ops = {}
    for name in names:
        for suffix, formula in (("", forward), ("_backward", backward)):
            op = getattr(aten, f"_scaled_dot_product_{name}{suffix}", None)
            if op is not None:
                ops[op] = formula
    return ops


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(shape: str, device, max_length: int):
    """-> (DrafterModule of `shape` on `device`, its config, the AdamW over its trainable parameters)."""
    import torch

    from eaglelab.core.config import TrainConfig
    from eaglelab.models.drafter import Eagle3Config
    from eaglelab.train.ttt_module import DrafterModule

    s = SHAPES[shape]
    cfg = Eagle3Config(
        hidden_size=s["hidden"], intermediate_size=s["inter"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"], head_dim=s["hidden"] // s["heads"], vocab_size=s["vocab"],
        draft_vocab_size=s["draft"], target_hidden_size=s["hidden"], aux_layer_ids=s["aux"],
        target_num_layers=s["layers"], rope_theta=500000.0, max_position_embeddings=max_length,
    )  # fmt: skip
    torch.manual_seed(0)
    with device:
        module = DrafterModule(cfg, TrainConfig(precision="bf16-mixed")).to(device)
    module.drafter.set_vocab(torch.randperm(s["vocab"], device=device)[: s["draft"]].sort().values)
    params = [p for p in module.parameters() if p.requires_grad]
    return module, cfg, params, torch.optim.AdamW(params, lr=1e-4)


def batch_of(cfg, T: int, device):
    """One sequence of T random tokens, every position drafting, with float32 aux states (as `batches.collate`)."""
    import torch

    from eaglelab.train.batches import Batch

    ids = torch.randint(0, cfg.vocab_size, (1, T), device=device)
    return Batch(
        input_ids=ids, target_next=torch.roll(ids, -1, 1),
        aux=torch.randn(1, T, len(cfg.aux_layer_ids) * cfg.target_hidden_size, device=device),
        prompt_len=torch.ones(1, dtype=torch.long, device=device), seq_len=torch.full((1,), T, device=device),
        index=torch.zeros(1, dtype=torch.long, device=device),
    )  # fmt: skip


def estimate_added_bytes(cfg, T: int, ttt: int, checkpointing: bool, trainable: int) -> int:
    """What eaglelab's memory model says this step adds over what was held before it (no allocator slack)."""
    from eaglelab.plan.costs import ttt_kept_bytes, unroll_alive_bytes

    lowp, stream = 2, 4  # bf16-mixed: 16-bit matmul inputs and outputs, float32 residual stream
    kept = ttt_kept_bytes(1, T, ttt, T - 1, cfg, lowp, stream, checkpointing=checkpointing)
    return kept + unroll_alive_bytes(1, T, ttt, T - 1, cfg, lowp, stream) + 4 * trainable  # + float32 gradients


def measure(module, cfg, params, opt, T: int, ttt: int, checkpointing: bool, steps: int, device, count: bool) -> dict:
    """One row (module docstring); `count`: count the step's FLOPs (with checkpointing: recomputation included)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from eaglelab.core.devices import SdpaKernels
    from eaglelab.data.targets import proc_bytes
    from eaglelab.plan.costs import peak_rss

    cuda = device.type == "cuda"
    module.drafter.activation_checkpointing = checkpointing
    batch = batch_of(cfg, T, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    kernels = SdpaKernels()

    def step(record: bool = False) -> None:
        with autocast:
            if record:
                with kernels:  # the forward's calls only (checkpointing calls SDPA again in the backward pass)
                    loss = module.ttt(batch, ttt)[0]
            else:
                loss = module.ttt(batch, ttt)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()

    step(record=True)  # warm-up (AdamW's moments, cuBLAS's and SDPA's kernel choice), recording the kernels
    flops = None
    if count:
        with FlopCounterMode(display=False, custom_mapping=attention_flops()) as counter:
            step()
        flops = counter.get_total_flops()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    sync(device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
    else:
        held = proc_bytes("/proc/self/status", "VmRSS")
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    step_s = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated(device) if cuda else peak_rss()
    added = (peak - held) / 2**30 if cuda else None  # (peak RSS never goes down: no step's own addition on a CPU)
    layers = cfg.num_layers
    by_step = [kernels.log[i * layers : (i + 1) * layers] for i in range(ttt)]
    trainable = sum(p.numel() for p in params)
    return {
        "T": T, "ttt_steps": ttt, "activation_checkpointing": checkpointing,
        "peak_gib": peak / 2**30, "held_gib": held / 2**30, "added_gib": added,
        "estimate_added_gib": estimate_added_bytes(cfg, T, ttt, checkpointing, trainable) / 2**30,
        "step_s": step_s, "flops": flops, "flops_counted": "executed" if checkpointing else "model",
        "kernels": ["+".join(sorted(set(k))) for k in by_step],
    }  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--lengths", default="2048,8192,32768", help="sequence lengths T, comma-separated")
    ap.add_argument("--ttt", default="3,7", help="train.ttt_steps values, comma-separated")
    ap.add_argument("--checkpointing", default="off,on", help="train.activation_checkpointing: off, on or both")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per row (after one warm-up step)")
    ap.add_argument("--peak-tflops", type=float, help="the device's bf16 dense peak (CUDA default: the H200's)")
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="as eaglelab's Trainer runs (deterministic=True): torch.use_deterministic_algorithms, which SDPA's choice "
        "of kernel and cuBLAS follow",
    )
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="then the N costliest ops of one step")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"error: --device cuda, but torch {torch.__version__} sees no CUDA device; use --device cpu")
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        depths = [int(x) for x in args.ttt.split(",")]
        modes = sorted({{"off": False, "on": True}[x] for x in args.checkpointing.split(",")})  # off first: its FLOPs
    except (ValueError, KeyError):
        sys.exit("error: --lengths and --ttt take comma-separated integers, --checkpointing off, on or off,on")
    if args.steps < 1 or min(lengths) < 2 or min(depths) < 1:
        sys.exit("error: --steps must be >= 1, every length >= 2 and every --ttt >= 1")
    device = torch.device(args.device)
    if args.deterministic:  # what Lightning's Trainer(deterministic=True) sets (eaglelab.train.fit)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if args.peak_tflops is None and device.type == "cuda":
        args.peak_tflops = H200_BF16_DENSE_TFLOPS
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # (as Lightning's bf16-mixed users set it; fp32 matmuls only)
    module, cfg, params, opt = build(args.shape, device, max(lengths) + max(depths))
    gemm = gemm_tflops(device, n=8192 if device.type == "cuda" else 512)
    rows = []
    for T in lengths:
        for ttt in depths:
            flops = None  # the model FLOPs of this (T, TTT): counted on the row without checkpointing
            for ckpt in modes:
                label = f"T={T} ttt={ttt} checkpointing={'on' if ckpt else 'off'}"
                try:
                    row = measure(module, cfg, params, opt, T, ttt, ckpt, args.steps, device, count=flops is None)
                except torch.OutOfMemoryError as e:
                    row = {"T": T, "ttt_steps": ttt, "activation_checkpointing": ckpt, "failed": "OOM"}
                    print(f"  {label}: out of memory: {str(e).splitlines()[0][:160]}", file=sys.stderr)
                if "failed" in row:  # (out of the except block: its traceback no longer holds the step's tensors)
                    opt.zero_grad(set_to_none=True)
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                else:
                    if row["flops"] is None:  # (counted on the row without checkpointing)
                        row["flops"], row["flops_counted"] = flops, "model"
                    elif row["flops_counted"] == "model":
                        flops = row["flops"]
                    if row["flops"]:
                        row["tflops"] = row["flops"] / row["step_s"] / 1e12
                        row["of_peak"] = row["tflops"] / args.peak_tflops if args.peak_tflops else None
                        row["of_gemm"] = row["tflops"] / gemm
                    print(f"  {label}: {row['step_s']:.3f} s, {row['peak_gib']:.2f} GiB", file=sys.stderr)
                rows.append(row)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    mode = ", deterministic algorithms" if args.deterministic else ""
    print(f"\none training step, {args.shape} drafter, batch 1, bf16-mixed{mode}, on {name}")
    peak = f"{args.peak_tflops:.0f} TFLOP/s" if args.peak_tflops else "none given (--peak-tflops)"
    print(f"bf16 GEMM here: {gemm:.1f} TFLOP/s; bf16 dense peak taken: {peak}")
    print(
        f"{'T':>6} {'TTT':>3} {'ckpt':>4} {'peak GiB':>9} {'added':>7} {'model':>7} {'mod/meas':>8} {'step s':>7} "
        f"{'TFLOP/s':>8} {'of peak':>8} {'of GEMM':>8}  kernel by draft step"
    )
    for r in rows:
        ckpt = "on" if r["activation_checkpointing"] else "off"
        if "failed" in r:
            print(f"{r['T']:>6} {r['ttt_steps']:>3} {ckpt:>4}  {r['failed']}")
            continue
        of_peak = f"{r['of_peak']:>8.1%}" if r.get("of_peak") is not None else f"{'':>8}"
        mark = "*" if r.get("flops_counted") == "executed" else " "
        rate = f"{r['tflops']:>7.1f}{mark} {of_peak} {r['of_gemm']:>8.1%}" if "tflops" in r else f"{'':>8} " * 3
        added, est = r["added_gib"], r["estimate_added_gib"]
        measured = f"{added:>7.2f} {est:>7.2f} {est / added:>8.2f}" if added else f"{'':>7} {est:>7.2f} {'':>8}"
        print(
            f"{r['T']:>6} {r['ttt_steps']:>3} {ckpt:>4} {r['peak_gib']:>9.2f} {measured} {r['step_s']:>7.3f} "
            f"{rate}  {' '.join(r['kernels'])}"
        )
    if any(r.get("flops_counted") == "executed" for r in rows):
        print("* FLOPs executed with checkpointing (recomputation included): no step without it was measured there")
    if args.profile:  # where the first row's step spends its time, by kernel
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        module.drafter.activation_checkpointing = False
        batch = batch_of(cfg, lengths[0], device)
        with profile(activities=activities) as prof:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = module.ttt(batch, depths[0])[0]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
        key = "device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"\nprofile of one step at T={lengths[0]}, TTT {depths[0]}:")
        print(prof.key_averages().table(sort_by=key, row_limit=args.profile))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"device": name, "shape": args.shape, "gemm_tflops": gemm, "peak_tflops": args.peak_tflops}
        result["deterministic"] = args.deterministic
        args.out.write_text(json.dumps(result | {"torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
