"""Drafter training throughput: trained positions per second, peak RSS, FLOP/s vs the GEMM roofline; eaglelab beside
vLLM's `speculators` on the same shapes, data and machine, in the same run.

    python benchmarks/train_throughput.py [--configs peer,smollm2-8k,smollm2-32k] [--precision fp32,bf16]
                                          [--steps 20] [--repeats 5] [--json PATH]
    python benchmarks/train_throughput.py --trainers eaglelab,speculators --loss kl --configs smollm2-8k,8b-64
    python benchmarks/train_throughput.py --profile smollm2-8k:bf16   # operator table of one config
    python benchmarks/train_throughput.py --configs smollm2-8k --layer llama,qwen3,mla   # eaglelab's drafter layers

Each (trainer, config, precision) runs in a fresh process (clean peak RSS) on one synthetic sequence per step whose
every position drafts (prompt length 1); a trained position = one sequence position through all ttt_steps (3).
- eaglelab: its own training step (`DrafterModule.ttt` + backward + AdamW step, as Lightning calls it; the Trainer
  loop itself adds a few hundred µs a step).
- speculators (0.9.0, `scripts/setup.sh` installs it without its dependencies): its `Eagle3DraftModel` forward with
  the TTT loss, backward, AdamW, with EAGLE-3.1's flags. On a CPU it runs with two of its own settings, no patches:
  attention "sdpa" (a dense TTT mask: FlexAttention has no backward on a CPU) and its eager losses (the fused ones are
  Triton kernels). It never trains lm_head, so in a run beside it eaglelab's is frozen too (train.freeze_lm_head),
  and both run the same loss (`--loss`: ce on the target's greedy token, or kl against its distribution), with
  the same allocator setting (`eaglelab.core.devices.keep_freed_memory`, which eaglelab's trainer applies on a CPU).
FLOPs per step are counted by torch's FlopCounterMode (forward + backward, as executed), and the roofline is the best
of fp32 / bf16 GEMM FLOP/s measured in the same run.

Configs:
  peer          target hidden 128, 4 layers, 4 heads / 2 KV heads, intermediate 256, vocab 512,
                draft vocab 256, sequence 256, ttt_steps 3, AdamW, EAGLE-3.1 flags
  smollm2-8k    SmolLM2-135M shapes (hidden 576, 9 heads / 3 KV, intermediate 1536, vocab 49152),
                draft vocab 8192, sequence 1024, ttt_steps 3
  smollm2-32k   the same with draft vocab 32768
  8b-64         an 8B-shaped drafter (hidden 4096, 32 heads / 8 KV, intermediate 14336, vocab 128256, draft vocab
                32000, one layer), sequence 64 (on a CPU the weights' and the optimizer's memory traffic set its step)
  8b-512        the same at sequence 512
  8b-2048       the same at sequence 2,048
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
        # vocab 128256), one decoder layer, draft vocab 32000; sequence 64 (a 2-core CPU: ~5 s a step)
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

# The same at sequence 512: the matmuls, not the weights' and the optimizer's memory traffic, set the step; and at
# 2,048, the shortest length the GPU check's step benchmark measures (~25 s a step on a 2-core CPU)
CONFIGS["8b-512"] = {**CONFIGS["8b-64"], "seq": 512}
CONFIGS["8b-2048"] = {**CONFIGS["8b-64"], "seq": 2048}


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


def one(
    name: str, precision: str, steps: int, repeats: int, profile: bool = False, loss: str = "ce", frozen: bool = False,
    layer: str = "llama",
) -> dict:  # fmt: skip
    from types import SimpleNamespace

    import torch

    from eaglelab.core.config import TrainConfig
    from eaglelab.core.devices import keep_freed_memory
    from eaglelab.models.drafter import Eagle3Config, mla_shape
    from eaglelab.train.batches import Batch
    from eaglelab.train.ttt_module import DrafterModule, adamw

    c = CONFIGS[name]
    torch.manual_seed(0)
    keep_freed_memory()  # as eaglelab's trainer does on a CPU
    L = c["layers"]
    target = SimpleNamespace(hidden_size=c["hidden"], num_attention_heads=c["heads"])
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
        layer=layer,  # (mla: its latent shape sized from the target's head_dim, as on a target without one)
        **(mla_shape(target) if layer == "mla" else {}),
    )
    train_cfg = TrainConfig(  # (the precision Lightning would train in: it picks the optimizer, `adamw`)
        ttt_steps=3,
        lr=1e-4,
        loss=loss,
        freeze_lm_head=frozen,
        precision="bf16-mixed" if precision == "bf16" else "32-true",
    )
    teacher_head = torch.randn(c["draft"], c["hidden"]) * 0.02 if loss == "kl" else None  # the target's draft rows
    module = DrafterModule(cfg, train_cfg, target_head=teacher_head)
    module.drafter.set_vocab(torch.randperm(c["vocab"])[: c["draft"]].sort().values)
    T = c["seq"]
    ids = torch.randint(0, c["vocab"], (1, T))
    batch = Batch(
        input_ids=ids,
        target_next=torch.roll(ids, -1, 1),
        aux=torch.randn(1, T, 3 * c["hidden"]),
        final=torch.randn(1, T, c["hidden"]) if loss == "kl" else None,
        prompt_len=torch.tensor([1]),
        seq_len=torch.tensor([T]),
        index=torch.tensor([0]),
    )
    opt = adamw([p for p in module.parameters() if p.requires_grad], train_cfg)  # (configure_optimizers')
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def step():
        with autocast:
            loss = module.ttt(batch, train_cfg.ttt_steps)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return measured(step, name, precision, T, steps, repeats, profile)


def speculators_one(name: str, precision: str, steps: int, repeats: int, loss: str = "ce") -> dict:
    """The same step in vLLM's speculators: its Eagle3DraftModel (EAGLE-3.1's fc_norm and norm_output) on the same
    shapes and synthetic data, forward with the TTT loss over every position, backward, AdamW."""
    import torch

    try:
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.losses import resolve_loss_config
        from speculators.models.eagle3 import Eagle3SpeculatorConfig
        from speculators.models.eagle3.core import Eagle3DraftModel
        from speculators.proposals.greedy import GreedyTokenProposalConfig
    except ImportError as e:
        sys.exit(f"error: speculators is not installed ({e}): run `make setup`, which installs speculators==0.9.0")
    from transformers import LlamaConfig

    from eaglelab.core.devices import keep_freed_memory

    c = CONFIGS[name]
    torch.manual_seed(0)
    keep_freed_memory()  # the same allocator setting as eaglelab's step (+17 % for speculators at SmolLM2 shapes)
    layer = LlamaConfig(
        hidden_size=c["hidden"], intermediate_size=c["inter"], num_attention_heads=c["heads"],
        num_key_value_heads=c["kv"], head_dim=c["hidden"] // c["heads"], vocab_size=c["vocab"], num_hidden_layers=1,
        max_position_embeddings=max(8192, c["seq"]), rms_norm_eps=1e-5,
    )  # fmt: skip
    layer._attn_implementation = "sdpa"  # (its default, FlexAttention, has no backward on a CPU)
    L = c["layers"]
    model = Eagle3DraftModel(
        Eagle3SpeculatorConfig(
            transformer_layer_config=layer,
            draft_vocab_size=c["draft"],
            norm_before_residual=False,
            fc_norm=True,
            norm_output=True,
            eagle_aux_hidden_state_layer_ids=[2, L // 2, L - 3] if L > 4 else [1, 2, 3],
            speculators_config=SpeculatorsConfig(
                algorithm="eagle3",
                proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                default_proposal_method="greedy",
                verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
            ),
        )
    )
    in_draft = torch.zeros(c["vocab"], dtype=torch.bool)
    in_draft[torch.randperm(c["vocab"])[: c["draft"]]] = True
    model.load_vocab_mappings(in_draft, in_draft.nonzero()[:, 0] - torch.arange(c["draft"]))
    with torch.no_grad():  # the target's weights it would load (NaN until then)
        for weight in (model.embed_tokens.weight, model.lm_head.weight, model.verifier_lm_head.weight):
            weight.normal_(0, 0.02)
    T = c["seq"]
    ids = torch.randint(0, c["vocab"], (1, T))
    aux, final = torch.randn(1, T, 3 * c["hidden"]), torch.randn(1, T, c["hidden"])
    loss_config = resolve_loss_config({"ce": "ce", "kl": "kl_div"}[loss], "eager")  # (its fused losses: Triton)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    documents, every = torch.zeros(1, T, dtype=torch.long), torch.ones(1, T, dtype=torch.bool)

    def step():
        with autocast:
            _, total, _ = model(aux, ids, documents, loss_mask=every, verifier_last_hidden_states=final, ttt_steps=3,
                                loss_config=loss_config)  # fmt: skip
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()

    return measured(step, name, precision, T, steps, repeats, profile=False)


def measured(step, name: str, precision: str, T: int, steps: int, repeats: int, profile: bool) -> dict:
    """Positions per second of `step` (median of `repeats` timings of `steps` steps, after 3 warm-up steps), its
    FLOPs and the process's peak RSS."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    for _ in range(3):
        step()
    if profile:  # where a step's time goes, by operator (what motivates an optimisation)
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), file=sys.stderr)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12), file=sys.stderr)
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
    ap.add_argument("--trainers", default="eaglelab", help="eaglelab, speculators, or both (side by side)")
    ap.add_argument("--loss", default="ce", choices=["ce", "kl"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--gemm-size", type=int, default=2048, help="side of the square GEMM that sets the roofline")
    ap.add_argument("--layer", default="llama", help="eaglelab's drafter layers (drafter.layer): llama,qwen3,mla")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # TRAINER:CONFIG:PRECISION[:LAYER], in a fresh process
    ap.add_argument("--frozen-head", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", metavar="CONFIG:PREC", help="print a torch.profiler table for one config")
    args = ap.parse_args()
    trainers = args.trainers.split(",")
    if unknown := set(trainers) - {"eaglelab", "speculators"}:
        sys.exit(f"error: --trainers {','.join(sorted(unknown))}: use eaglelab, speculators or eaglelab,speculators")
    if args.profile:
        name, precision = args.profile.split(":")
        print(json.dumps(one(name, precision, args.steps, args.repeats, profile=True, loss=args.loss)))
        return
    if args.one:
        trainer, name, precision, layer = (args.one.split(":") + ["llama"])[:4]
        row = (
            speculators_one(name, precision, args.steps, args.repeats, args.loss)
            if trainer == "speculators"
            else one(name, precision, args.steps, args.repeats, loss=args.loss, frozen=args.frozen_head, layer=layer)
        )
        if layer != "llama":
            row["config"] = f"{row['config']}/{layer}"
        print(json.dumps({"trainer": trainer, **row}))
        return
    import torch

    precisions = args.precision.split(",")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    gemm = dict(n=args.gemm_size, repeats=max(1, min(5, args.repeats)))
    roof = {p: gemm_flops(dtypes[p], **gemm) for p in precisions}  # again after the runs
    # speculators never trains lm_head: beside it, eaglelab's is frozen too (the same work per step)
    frozen = ["--frozen-head"] if "speculators" in trainers else []
    rows = []
    for name in args.configs.split(","):
        steps = args.steps if name == "peer" else max(args.steps // 10, 2)
        for precision, layer in ((p, la) for p in precisions for la in args.layer.split(",")):
            for trainer in trainers if layer == "llama" else ["eaglelab"]:  # (speculators: its Llama layer)
                out = subprocess.run(
                    [sys.executable, __file__, "--one", f"{trainer}:{name}:{precision}:{layer}", "--steps", str(steps),
                     "--repeats", str(args.repeats), "--loss", args.loss, *frozen],
                    capture_output=True, text=True,
                )  # fmt: skip
                if out.returncode != 0:
                    sys.exit(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"{trainer} failed")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"  {trainer} {name} {precision}: {rows[-1]['positions_per_s']:.0f} positions/s", file=sys.stderr)
    # The roofline is the better of the measurements before and after (a conservative denominator).
    roof = {p: max(roof[p], gemm_flops(dtypes[p], **gemm)) for p in precisions}
    best_roof = max(roof.values())
    print(
        f"\nGEMM roofline ({args.gemm_size}^3, {rows[0]['threads']} threads): "
        + ", ".join(f"{p} {roof[p] / 1e9:.1f} GFLOP/s" for p in precisions)
        + f"; loss {args.loss}"
        + (", lm_head frozen (speculators never trains it)" if frozen else "")
    )
    print(
        f"{'trainer':<13}{'config':<20}{'prec':<6}{'positions/s':>12}{'vs speculators':>16}{'GFLOP/s':>9}"
        f"{'of roof':>9}{'of same-dtype':>15}{'peak RSS MB':>13}"
    )
    peer = {(r["config"], r["precision"]): r["positions_per_s"] for r in rows if r["trainer"] == "speculators"}
    for r in rows:
        same, key = roof[r["precision"]], (r["config"], r["precision"])
        ratio = f"{r['positions_per_s'] / peer[key]:.2f}x" if key in peer and r["trainer"] != "speculators" else ""
        print(
            f"{r['trainer']:<13}{r['config']:<20}{r['precision']:<6}{r['positions_per_s']:>12.0f}{ratio:>16}"
            f"{r['achieved_flops'] / 1e9:>9.1f}{r['achieved_flops'] / best_roof:>9.1%}"
            f"{r['achieved_flops'] / same:>15.1%}{r['peak_rss_mb']:>13.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"roofline_flops": roof, "loss": args.loss, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
