"""Context parallelism of the TTT step (`ContextShard`, eaglelab.models.drafter): N ranks (gloo, one process each)
against one, on the same sequence, model and loss.

    python benchmarks/context_parallel.py [--length 4096] [--cp 2] [--ttt 3] [--layer llama|qwen3|mla]
                                          [--loss ce|kl|...] [--batch 1] [--json PATH]

One training step as Lightning runs it (`DrafterModule.ttt` + backward) on the SmolLM2-135M drafter shape (hidden
576, 9 heads / 3 KV heads of 64, intermediate 1536, vocab 49152, draft vocab 8192, one layer; the MLA layer with a
128-wide latent, 64 + 32-wide q/k heads and 64-wide values), fp32, B sequences of T tokens whose prompts are the
first T/8 (`--prompt`: so the first rank's early positions, or all of them, draft nothing at steps >= 2). The
reference is one process holding the whole sequence; the N ranks each hold T/N positions of the target's states and
run the same step, their terms summed over the ranks as DDP's gradient average would (each rank's loss is its
positions' sum over the mean count per process). Reported: the largest absolute difference of the loss and of
every gradient (each parameter's), each process's peak memory during the step (peak RSS less the RSS before it) and
step time, one thread per process.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(hidden=576, heads=9, kv=3, inter=1536, vocab=49152, draft=8192)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def setup(args):
    """The drafter (as a DrafterModule) and the batch, the same in every process (seeded)."""
    import torch

    from eaglelab.core.config import TrainConfig
    from eaglelab.models.drafter import Eagle3Config
    from eaglelab.train.batches import collate
    from eaglelab.train.ttt_module import DrafterModule

    torch.manual_seed(0)
    s = SHAPE
    mla = dict(kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64) if args.layer == "mla" else {}
    cfg = Eagle3Config(
        hidden_size=s["hidden"], intermediate_size=s["inter"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"], head_dim=s["hidden"] // s["heads"], vocab_size=s["vocab"],
        draft_vocab_size=s["draft"], target_hidden_size=s["hidden"], aux_layer_ids=(2, 15, 27),
        max_position_embeddings=max(8192, args.length), layer=args.layer, **mla,
    )  # fmt: skip
    train = TrainConfig(ttt_steps=args.ttt, loss=args.loss)
    head = torch.randn(s["draft"], s["hidden"]) * 0.05
    module = DrafterModule(cfg, train, target_head=head if train.distills else None)
    module.drafter.set_vocab(torch.randperm(s["vocab"])[: s["draft"]].sort().values)
    with torch.no_grad():  # weights of a trained scale, so that attention is not uniform
        for p in module.drafter.parameters():
            if p.requires_grad and p.dim() >= 2:
                p.normal_(0, 0.05)
    items = []
    for b in range(args.batch):
        ids = torch.randint(0, s["vocab"], (args.length + 1,))
        items.append({
            "input_ids": ids[:-1], "target_next": ids[1:], "prompt_len": args.prompt or args.length // 8, "index": b,
            "aux": torch.randn(args.length, 3 * s["hidden"]), "final": torch.randn(args.length, s["hidden"]),
        })  # fmt: skip
    return module, collate(items)


def step(module, batch, ttt: int, shard=None) -> tuple[float, dict, float, float]:
    """One step -> (loss, {name: gradient}, peak bytes during it, seconds)."""
    import dataclasses

    if shard is not None:  # this rank's positions of the target's states; the tokens and labels whole
        batch = dataclasses.replace(batch, aux=batch.aux[:, shard.start : shard.end].contiguous())
    before = rss_bytes()
    t0 = time.perf_counter()
    loss = module.ttt(batch, ttt, shard=shard)[0]
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    grads = {n: p.grad.detach().clone() for n, p in module.drafter.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, peak, seconds


def reference(args, out: Path) -> None:
    import torch

    torch.set_num_threads(1)
    module, batch = setup(args)
    loss, grads, peak, seconds = step(module, batch, args.ttt)
    torch.save({"loss": loss, "grads": grads, "peak": peak, "seconds": seconds}, out)


def rank(args, r: int, init: str, ref: Path) -> None:
    import torch
    import torch.distributed as dist

    from eaglelab.models.drafter import ContextShard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=r, world_size=args.cp)
    module, batch = setup(args)
    n = args.length // args.cp
    shard = ContextShard(start=r * n, end=(r + 1) * n, rank=r, size=args.cp)
    loss, grads, peak, seconds = step(module, batch, args.ttt, shard)
    # What DDP's average makes of the ranks' terms: their mean (each rank's loss is its sum over the mean count)
    total = torch.tensor([loss])
    dist.all_reduce(total)
    for g in grads.values():
        dist.all_reduce(g)
        g /= args.cp
    figures = torch.tensor([peak, seconds], dtype=torch.float64)
    every = [torch.zeros_like(figures) for _ in range(args.cp)]
    dist.all_gather(every, figures)
    if r == 0:
        want = torch.load(ref)
        row = {
            "length": args.length, "cp": args.cp, "ttt_steps": args.ttt, "layer": args.layer, "loss": args.loss,
            "batch": args.batch, "loss_value": want["loss"],
            "loss_abs_diff": abs(float(total) / args.cp - want["loss"]),
            "grad_max_abs_diff": max(float((grads[k] - want["grads"][k]).abs().max()) for k in want["grads"]),
            "grad_max_abs": max(float(g.abs().max()) for g in want["grads"].values()),
            "parameters_compared": len(want["grads"]), "missing": sorted(set(want["grads"]) - set(grads)),
            "peak_gb_cp1": want["peak"] / 1e9, "step_s_cp1": want["seconds"],
            "peak_gb_per_rank": [float(f[0]) / 1e9 for f in every], "step_s_per_rank": [float(f[1]) for f in every],
        }  # fmt: skip
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--layer", default="llama", choices=["llama", "qwen3", "mla"])
    ap.add_argument("--loss", default="kl")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=0, help="prompt tokens (0: a eighth of --length)")
    ap.add_argument("--json")
    ap.add_argument("--role", help=argparse.SUPPRESS)  # reference:PATH | rank:R:INIT:REF
    args = ap.parse_args(argv)
    if args.role:
        kind, *rest = args.role.split("|")
        reference(args, Path(rest[0])) if kind == "reference" else rank(args, int(rest[0]), rest[1], Path(rest[2]))
        return 0
    if args.length % args.cp:
        print(f"error: --length {args.length} must divide into --cp {args.cp} equal shares", file=sys.stderr)
        return 2
    base = [sys.executable, __file__, *(f"--{k}={v}" for k, v in vars(args).items() if k not in ("json", "role"))]
    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp) / "reference.pt"
        subprocess.run([*base, f"--role=reference|{ref}"], check=True)
        init = f"file://{tmp}/rendezvous"
        procs = [subprocess.Popen([*base, f"--role=rank|{r}|{init}|{ref}"], stdout=subprocess.PIPE, text=True)
                 for r in range(args.cp)]  # fmt: skip
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            print(f"error: a rank failed (exit codes {[p.returncode for p in procs]})", file=sys.stderr)
            return 1
    row = json.loads(outs[0].strip().splitlines()[-1])
    print(
        f"T={row['length']} {row['layer']} TTT {row['ttt_steps']} {row['loss']}: CP={row['cp']} against one rank: "
        f"loss |Δ| {row['loss_abs_diff']:.2e}, gradients max |Δ| {row['grad_max_abs_diff']:.2e} (largest "
        f"{row['grad_max_abs']:.2e}, {row['parameters_compared']} tensors); peak "
        f"{row['peak_gb_cp1']:.2f} GB on one rank, {' / '.join(f'{g:.2f}' for g in row['peak_gb_per_rank'])} GB per "
        f"rank; step {row['step_s_cp1']:.1f} s, {' / '.join(f'{s:.1f}' for s in row['step_s_per_rank'])} s per rank"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
