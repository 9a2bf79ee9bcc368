"""A vLLM regeneration engine started beside a target that already holds memory on the same device.

    python -m benchmarks.engine_beside_target --device cuda --hold-gb 16 --out engine.json   # gpu_check.sh's stage
    python -m benchmarks.engine_beside_target --device cpu --hold-gb 0.25 --out engine.json  # what the tests run

On one GPU, a training process holds its target (16 GB for Llama-3.1-8B in bf16) when data preparation starts a
vLLM engine. vLLM 0.32 asks for 0.92 of the device by default and refuses to start when less is free, so eaglelab
gives each engine a share of what is free on the process's own device (`eaglelab.core.devices.engine_placement`). This
runs that situation for real: the tiny target is loaded onto the device, `--hold-gb` more is held there beside it
(the rest of an 8B target, as one tensor), then the prompts are regenerated through eaglelab's own path
(`prepare_features`, backend vllm: the engine process starts while both are held), and again with the HF backend
in this process. Reported: what was held and free when the engine started, the share it got (and what vLLM's
default would have asked for), the regeneration's seconds (the engine's start included), and how many greedy
sequences the two backends agree on.
Exit 1 when the engine fails, or on the CPU (float32, where both backends are exact) when they disagree on any
sequence; on a GPU (bf16, two engines' kernels) the agreement is reported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

GIB = 1 << 30
VLLM_DEFAULT_UTILIZATION = 0.92  # vLLM 0.32's gpu_memory_utilization when none is given


def run(args) -> dict:
    import torch

    from eaglelab.core.config import TargetConfig, TinyTargetConfig
    from eaglelab.core.devices import engine_placement, local_cuda_device
    from eaglelab.data.cache_entry import CaptureSettings, SetRequest
    from eaglelab.data.prepare_set import prepare_features
    from eaglelab.data.prompts import mix_sources
    from eaglelab.data.targets import free_memory, load_target

    device = local_cuda_device() if args.device == "cuda" else torch.device("cpu")
    cache = Path(args.cache or tempfile.mkdtemp(prefix="engine-beside-"))
    data = Path(tempfile.mkdtemp(prefix="engine-beside-data-"))  # never a cached regeneration: the engine must start
    # float32 on the CPU, where the HF and vLLM greedy paths agree bit for bit; bf16 on a GPU, as a target is held.
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    target = load_target(TargetConfig(kind="tiny", dtype=dtype, tiny=TinyTargetConfig(tokenizer=args.tokenizer)),
                         cache, device)  # fmt: skip
    target.load()  # on the device, as a process that runs the HF target (online features, HF capture) holds it
    # The rest of the target's memory: a tensor of --hold-gb on the same device, alive until the end.
    hold = torch.ones(int(args.hold_gb * GIB), dtype=torch.uint8, device=device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
    else:
        free, total, held = free_memory(device), None, hold.numel()
    placement, engine_env = engine_placement()  # the same call run_engine makes for the engine below
    prompts = mix_sources(["stdlib_docstrings"], args.prompts, seed=2)
    ask = SetRequest("beside", args.max_new_tokens)
    how = lambda folder, backend: CaptureSettings(data / folder, [2, 4, 5], None, 512, args.prompts, backend)  # noqa: E731
    t0 = time.perf_counter()
    vl, _ = prepare_features(target, prompts, ask, how("vllm", "vllm"))
    engine_wall = time.perf_counter() - t0  # engine start included
    hf, _ = prepare_features(target, prompts, ask, how("hf", "hf"))
    assert hold.numel() == int(args.hold_gb * GIB)  # (held the whole time)
    hf_seqs = {tuple(r) for r in hf["input_ids"]}
    result = {
        "device": str(device),
        "held_gb": round(held / 1e9, 3),
        "free_gb_at_engine_start": None if free is None else round(free / 1e9, 3),
        "total_gb": None if total is None else round(total / 1e9, 3),
        "gpu_memory_utilization": placement.get("gpu_memory_utilization"),
        "engine_cuda_visible_devices": engine_env.get("CUDA_VISIBLE_DEVICES"),
        "vllm_default_asks_gb": None if total is None else round(VLLM_DEFAULT_UTILIZATION * total / 1e9, 3),
        "engine_wall_s": round(engine_wall, 2),  # vLLM's regeneration, its engine's start included
        "sequences": len(vl),
        "identical_to_hf": sum(tuple(r) in hf_seqs for r in vl["input_ids"]),
        # the capture pass after vLLM's regeneration: one aux state and one label per token of every sequence
        "captured_every_token": all(
            len(row["aux"]) == len(row["input_ids"]) == len(row["target_next"]) for row in map(vl.item, range(len(vl)))
        ),
    }
    del vl, hf  # (memory-mapped from `data`)
    shutil.rmtree(data)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--hold-gb", type=float, default=16.0, help="GiB held beside the tiny target (default 16)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--tokenizer", default=None, help="the tiny target's tokenizer folder (target.tiny.tokenizer)")
    parser.add_argument("--cache", default=None, help="the tiny target's cache (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from eaglelab.core.errors import EaglelabError

    try:
        result = run(args)
    except EaglelabError as e:
        raise SystemExit(f"error: {e}") from None
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    share = result["gpu_memory_utilization"]
    where = (f"{result['free_gb_at_engine_start']:.1f} of {result['total_gb']:.1f} GB free, engine share {share} "
             f"(vLLM's default asks {result['vllm_default_asks_gb']:.1f} GB)" if share is not None
             else "the CPU: no device share")  # fmt: skip
    print(
        f"engine beside {result['held_gb']:.2f} GB held on {result['device']}: {where}; regenerated "
        f"{result['sequences']} sequences in {result['engine_wall_s']:.1f} s (engine start included), "
        f"{result['identical_to_hf']}/{result['sequences']} identical to the HF backend's"
    )
    exact = result["device"] == "cpu"
    agree = result["identical_to_hf"] == result["sequences"] or not exact
    sys.exit(0 if agree and result["captured_every_token"] else 1)


if __name__ == "__main__":
    main()
