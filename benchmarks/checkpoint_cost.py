"""What a checkpoint costs the training loop: the time the step waits for it, synchronous against asynchronous.

    python benchmarks/checkpoint_cost.py [--configs smollm2-8k,8b-64] [--saves 3] [--device cpu|cuda] [--json PATH]

A drafter of the shape (train_throughput.py's CONFIGS) after one AdamW step, so the checkpoint holds what a real one
does: weights, both Adam moments, the step counters. Each save goes through the CheckpointIO eaglelab's trainer uses
(`AtomicCheckpointIO`, alone or inside Lightning's `AsyncCheckpointIO` as train.async_checkpoint=true makes it),
into a folder on this machine's disk. On CUDA (`--device cuda`, scripts/gpu_check.sh) the drafter and its optimizer
live on the GPU, so the asynchronous save's copy is a device copy and the write reads it back in the thread.
Figures per mode (median over --saves):

  blocked_s    how long the training loop is held by the save call (sync: the whole write; async: the state's copy)
  written_s    from the call until the file is complete on disk (async: the thread's write, waited for)
  steps_s      the time of the training steps run right after the call, while an async write goes on (the thread
               competes with the step for the cores), against the same steps with no write (`steps_alone_s`)
  ckpt_gb      the file's size

and `keep=best`'s host memory: before this change a float32 host copy of the drafter's weights (`best_copy_gb`,
computed); now none (the best weights go to a file of their own).
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from train_throughput import CONFIGS  # (run as a script, benchmarks/ is on the path)


def module_for(name: str, device: str = "cpu"):
    import torch
    from lightning.fabric.utilities.apply_func import move_data_to_device

    from eaglelab.core.config import TrainConfig
    from eaglelab.models.drafter import Eagle3Config
    from eaglelab.train.batches import Batch
    from eaglelab.train.ttt_module import DrafterModule

    c = CONFIGS[name]
    torch.manual_seed(0)
    L = c["layers"]
    cfg = Eagle3Config(
        hidden_size=c["hidden"], intermediate_size=c["inter"], num_attention_heads=c["heads"],
        num_key_value_heads=c["kv"], head_dim=c["hidden"] // c["heads"], vocab_size=c["vocab"],
        draft_vocab_size=c["draft"], target_hidden_size=c["hidden"],
        aux_layer_ids=(2, L // 2, L - 3) if L > 4 else (1, 2, 3),
    )  # fmt: skip
    module = DrafterModule(cfg, TrainConfig(ttt_steps=3, lr=1e-4))
    module.drafter.set_vocab(torch.randperm(c["vocab"])[: c["draft"]].sort().values)
    module.to(device)
    T = min(c["seq"], 256)
    ids = torch.randint(0, c["vocab"], (1, T))
    batch = Batch(
        input_ids=ids, target_next=torch.roll(ids, -1, 1), aux=torch.randn(1, T, 3 * c["hidden"]),
        prompt_len=torch.tensor([1]), seq_len=torch.tensor([T]), index=torch.tensor([0]),
    )  # fmt: skip
    batch = move_data_to_device(batch, device)  # (as Lightning moves a batch: a dataclass of tensors)
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)

    def step():
        loss = module.ttt(batch, 3)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device != "cpu":  # (the steps' time, not their launch)
            torch.cuda.synchronize()

    step()
    return module, opt, step


def measure(name: str, saves: int, steps_after: int, device: str = "cpu") -> dict:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from eaglelab.train.ttt_module import AtomicCheckpointIO

    module, opt, step = module_for(name, device)
    checkpoint = {"state_dict": module.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": 1}
    module.on_save_checkpoint(checkpoint)  # as the trainer saves it: the target's shared embeddings left out
    weights = sum(p.numel() for p in module.parameters() if p.requires_grad)
    row = {"config": name, "device": device, "trainable_params": weights, "best_copy_gb": 4 * weights / 1e9}
    t0 = time.perf_counter()
    for _ in range(steps_after):
        step()
    row["steps_alone_s"] = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as folder:  # this disk, as a run's lightning/ folder
        path = Path(folder) / "last.ckpt"
        for mode in ("sync", "async"):
            blocked, written, during = [], [], []
            for _ in range(saves):
                io = AsyncCheckpointIO(AtomicCheckpointIO()) if mode == "async" else AtomicCheckpointIO()
                t0 = time.perf_counter()
                io.save_checkpoint(checkpoint, path)
                blocked.append(time.perf_counter() - t0)
                io.teardown()  # (an async write: waited for)
                written.append(time.perf_counter() - t0)
                if mode == "async":  # the steps that run beside a write
                    io = AsyncCheckpointIO(AtomicCheckpointIO())
                    io.save_checkpoint(checkpoint, path)
                    t1 = time.perf_counter()
                    for _ in range(steps_after):
                        step()
                    during.append(time.perf_counter() - t1)
                    io.teardown()
            row[f"{mode}_blocked_s"], row[f"{mode}_written_s"] = statistics.median(blocked), statistics.median(written)
            if mode == "async":
                row["async_steps_s"] = statistics.median(during)
        row["ckpt_gb"] = path.stat().st_size / 1e9
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="smollm2-8k,8b-64")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--steps-after", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda but torch sees no CUDA device; run it on a GPU machine")
    rows = [measure(name, args.saves, args.steps_after, args.device) for name in args.configs.split(",")]
    print(f"\ncheckpoint cost on {args.device}, median of {args.saves} saves; {args.steps_after} training steps after "
          "each async save")  # fmt: skip
    print(f"{'config':<12} {'ckpt GB':>8} {'sync: blocks s':>15} {'async: blocks s':>16} {'async: written s':>17} "
          f"{'steps alone s':>14} {'steps beside write s':>21} {'keep=best copy before GB':>25}")  # fmt: skip
    for r in rows:
        print(f"{r['config']:<12} {r['ckpt_gb']:>8.2f} {r['sync_blocked_s']:>15.2f} {r['async_blocked_s']:>16.2f} "
              f"{r['async_written_s']:>17.2f} {r['steps_alone_s']:>14.2f} {r['async_steps_s']:>21.2f} "
              f"{r['best_copy_gb']:>25.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
