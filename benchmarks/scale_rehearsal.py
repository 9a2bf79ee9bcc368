"""Scale rehearsal: online-feature drafter training against an 8B-shaped target — does it fit, and how fast?

    python -m benchmarks.scale_rehearsal --device cuda [--shape llama8b] [--batch 4] [--seq-len 2048] [--steps 10]
    python -m benchmarks.scale_rehearsal --device cpu --shape tiny --steps 2 --out scale.json   # what the tests run

Users train drafters for 8B targets, whose aux hidden states (3 × 4096 per token, ~25 KB) are too large to
cache for a real data set, so the target computes them online, in every step (`features=online`). This measures
that loop on a target with random weights and the real shape (Llama-3.1-8B's by default; nothing is downloaded),
built in bf16 on the device. Per step, as Lightning runs it: a random token batch [B, T] goes to the frozen
target through the module's own hook (`DrafterModule.on_after_batch_transfer` -> `OnlineStates` ->
`capture_states`: aux states at vLLM's default ids, greedy labels), then the training step (`DrafterModule.ttt`
over ttt_steps, backward, gradient clipping, AdamW; bf16 autocast as `train.precision=bf16-mixed`).
Reported: trained positions per second (B·T / step time, target forward included), the target forward's share
of a step, and the peak memory (GPU: max allocated; CPU: peak RSS). Llama-3.1's rope scaling is left out: it
changes no cost.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from pathlib import Path

# The target's shape, then the draft vocabulary, batch and length a user of that target trains with
# (llama8b: Llama-3.1-8B, and the 32k draft vocabulary of EAGLE-3's published Llama-3.1-8B drafter).
SHAPES = {
    "llama8b": dict(hidden=4096, layers=32, heads=32, kv=8, inter=14336, vocab=128256, max_pos=131072)
    | dict(draft_vocab=32000, batch=4, seq_len=2048),
    "tiny": dict(hidden=128, layers=4, heads=4, kv=2, inter=256, vocab=2048, max_pos=4096)
    | dict(draft_vocab=512, batch=2, seq_len=64),
}


def build_target(s: dict, device):
    """A random-weight Llama of shape `s`, in bf16, allocated directly on `device` (an 8B never touches the CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        intermediate_size=s["inter"],
        vocab_size=s["vocab"],
        rope_theta=500000.0,  # Llama-3.1's
        max_position_embeddings=s["max_pos"],
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def estimate_bytes(s: dict, target, cfg, train_cfg, B: int, T: int, P: int, device) -> int:
    """eaglelab's estimate of this process's peak (`plan.costs.train_bytes`, as the memory check makes it before a run):
    the target's weights, which the check measures as held, plus the train stage with online features (on a CPU the
    caller adds the resident memory of the imports, which the check measures as held too)."""
    from dataclasses import replace

    from eaglelab.core.config import FeaturesConfig, RunConfig
    from eaglelab.plan.costs import ALLOCATOR_SLACK, PromptSet, TargetShape, train_bytes

    run = RunConfig(train=replace(train_cfg, batch_size=B), features=FeaturesConfig(kind="online"))
    shape = TargetShape(
        layers=s["layers"], hidden=s["hidden"], heads=s["heads"], kv_heads=s["kv"], head_dim=s["hidden"] // s["heads"],
        intermediate=s["inter"], vocab=s["vocab"], dtype_bytes=2, max_context=s["max_pos"],
    )  # fmt: skip
    data = PromptSet("train", B, P, T, T - P, f"sequences of {T} tokens")
    slack = ALLOCATOR_SLACK["cuda" if device.type == "cuda" else "cpu"]
    weights = sum(p.numel() * p.element_size() for p in target.parameters())
    return int(weights + train_bytes(run, shape, cfg, data, slack, device))


def rehearse(args) -> dict:
    import torch
    from tqdm import tqdm

    from eaglelab.core.config import TrainConfig
    from eaglelab.data.targets import TargetWeights, proc_bytes
    from eaglelab.models.drafter import DrafterFlags, Eagle3Config
    from eaglelab.train.batches import Batch, OnlineStates
    from eaglelab.train.fit import init_from_target
    from eaglelab.train.ttt_module import DrafterModule

    s = SHAPES[args.shape]
    B, T = args.batch, args.seq_len
    P = max(T // 4, 1)  # prompt length: drafts (and losses) start at P-1, as on chat data
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    imports = 0 if cuda else proc_bytes("/proc/self/status", "VmRSS") or 0  # (the estimate's base on a CPU)
    target = build_target(s, device)
    L = s["layers"]
    # vLLM's default aux ids, as Target.default_aux_layer_ids: the distinct ones of (2, L/2, L-3) in 1..L-1, sorted
    aux_ids = sorted({i for i in (2, L // 2, L - 3) if 1 <= i <= L - 1})
    train_cfg = TrainConfig(precision="bf16-mixed")  # (as an 8B target's users train, whatever the CPU running it)
    cfg = Eagle3Config.for_target(
        DrafterFlags(),
        target.config,
        aux_layer_ids=aux_ids,
        draft_vocab_size=s["draft_vocab"],
        max_context=s["max_pos"],
    )
    with device:  # the drafter's fp32 weights and the shared embeddings (2 GB at 8B) are made on the device too
        module = DrafterModule(cfg, train_cfg).to(device)  # .to: Lightning's own record of the device
    weights = TargetWeights(
        embed=target.get_input_embeddings().weight,
        lm_head=target.get_output_embeddings().weight,
        norm=target.model.norm.weight,
    )
    init_from_target(module, weights, torch.arange(cfg.draft_vocab_size, device=device), init_lm_head=True)
    module.online = OnlineStates(target, aux_ids, with_final=False)  # as train_drafter sets it for features=online
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=train_cfg.precision == "bf16-mixed")
    lengths = dict(prompt_len=torch.full((B,), P, device=device), seq_len=torch.full((B,), T, device=device))

    def step() -> tuple[float, float, float]:
        """-> (target forward s, whole step s, loss)."""
        sync()
        t0 = time.perf_counter()
        ids = torch.randint(0, s["vocab"], (B, T), device=device)
        # Lightning calls this hook on every batch it moved to the device: here the target fills in the states.
        batch = module.on_after_batch_transfer(Batch(input_ids=ids, index=torch.arange(B, device=device), **lengths), 0)
        sync()
        t1 = time.perf_counter()
        with autocast:
            loss = module.ttt(batch, train_cfg.ttt_steps)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, train_cfg.grad_clip)
        opt.step()
        sync()
        return t1 - t0, time.perf_counter() - t0, loss.item()

    times, warmup_s = [], 0.0
    bar = tqdm(range(args.warmup + args.steps), desc=f"{args.shape} B={B} T={T}", unit="step", file=sys.stderr)
    for i in bar:
        forward_s, step_s, loss = step()
        if i >= args.warmup:  # warm-up steps (allocator, kernel selection) are timed apart
            times.append((forward_s, step_s))
        else:
            warmup_s += step_s
        bar.set_postfix(loss=f"{loss:.3f}")
    step_s = sum(t for _, t in times) / len(times)
    estimate = imports + estimate_bytes(s, target, cfg, train_cfg, B, T, P, device)
    peak = (
        torch.cuda.max_memory_allocated(device) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "shape": args.shape,
        "target": {k: s[k] for k in ("hidden", "layers", "heads", "kv", "inter", "vocab")},
        "target_params": sum(p.numel() for p in target.parameters()),
        "drafter_trainable_params": sum(p.numel() for p in params),
        "aux_layer_ids": aux_ids,
        "draft_vocab_size": cfg.draft_vocab_size,
        "ttt_steps": train_cfg.ttt_steps,
        "batch": B,
        "seq_len": T,
        "prompt_len": P,
        "warmup_steps": args.warmup,
        "warmup_s": warmup_s,
        "steps": args.steps,
        "step_s": step_s,
        "tokens_per_s": B * T / step_s,  # trained positions per second, target forward included
        "target_forward_share": sum(f for f, _ in times) / sum(t for _, t in times),
        "peak_memory_gb": peak / 2**30,
        "peak_memory_kind": "cuda_max_allocated" if cuda else "cpu_peak_rss",
        # what the allocator held at most (GPU): what the estimate's slack is for, and what runs report (peak_gpu_gb)
        "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
        "estimate_gb": estimate / 2**30,  # (GiB, as peak_memory_gb)
        "device_memory_gb": torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else None,
        "final_loss": loss,
        "torch": torch.__version__,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--batch", type=int, help="sequences per step (default: the shape's)")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence (default: the shape's)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        sys.exit("error: --steps must be >= 1 and --warmup >= 0")
    import torch

    args.batch, args.seq_len = args.batch or SHAPES[args.shape]["batch"], args.seq_len or SHAPES[args.shape]["seq_len"]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"error: --device cuda, but torch {torch.__version__} sees no CUDA device; use --device cpu",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        result = rehearse(args)
    except torch.OutOfMemoryError as e:  # the answer to "does it fit" is no: say so, with what was asked
        first = str(e).splitlines()[0]
        print(
            f"error: out of memory at --shape {args.shape} --batch {args.batch} --seq-len {args.seq_len}: {first}",
            file=sys.stderr,
        )
        sys.exit(1)
    if not math.isfinite(result["final_loss"]):
        print(f"warning: non-finite loss {result['final_loss']}", file=sys.stderr)
    of_device = f" of {result['device_memory_gb']:.0f} GiB" if result["device_memory_gb"] else ""
    cuda = result["peak_reserved_gb"] is not None  # (the estimate's slack is for what the allocator reserves)
    measured, kind = (result["peak_reserved_gb"], "reserved") if cuda else (result["peak_memory_gb"], "RSS")
    rows = [
        ("device", result["device"]),
        ("target", f"{result['shape']} ({result['target_params'] / 1e6:,.1f} M params, bf16)"),
        ("drafter", f"{result['drafter_trainable_params'] / 1e6:,.1f} M trainable params (fp32, AdamW)"),
        ("draft vocab, ttt_steps", f"{result['draft_vocab_size']}, {result['ttt_steps']}"),
        ("aux layer ids", str(result["aux_layer_ids"])),
        ("batch × seq_len", f"{result['batch']} × {result['seq_len']} (prompt {result['prompt_len']})"),
        ("step", f"{result['step_s'] * 1e3:.1f} ms (mean of {result['steps']}; warm-up {result['warmup_s']:.1f} s)"),
        ("trained positions/s", f"{result['tokens_per_s']:,.0f}"),
        ("target forward share", f"{result['target_forward_share']:.1%}"),
        (f"peak memory ({result['peak_memory_kind']})", f"{result['peak_memory_gb']:.2f} GiB{of_device}"),
        *([("peak memory (cuda_max_reserved)", f"{result['peak_reserved_gb']:.2f} GiB")] if cuda else []),
        (
            "eaglelab's estimate",
            f"{result['estimate_gb']:.2f} GiB ({result['estimate_gb'] / measured:.2f}x the peak {kind})",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
