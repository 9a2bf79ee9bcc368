"""The resolvers conf/ uses (`${eaglelab.NAME:...}`), registered when `eaglelab` is imported: a run's variant label,
its directory's time stamp, and what a Slurm job asks for (its job command, GPUs and host memory per node)."""

from __future__ import annotations

import math

from eaglelab.models.variants import variant_of


def register_resolver() -> None:
    """The resolvers conf/ uses: `${eaglelab.variant:${drafter}}` (the schema's default `variant`) and
    `${eaglelab.launch_stamp:${train.accelerator}}` (a run directory's time, one for all ranks: eaglelab.core.ranks),
    `${eaglelab.slurm_python:}` (the Slurm launcher's job command: eaglelab/slurm_entry.py) and
    `${eaglelab.gpus_per_node:...}` (the GPUs a job asks for: its ranks' or its data engine's, whichever is more) and
    `${eaglelab.mem_gb:...}` (a node's host memory: its ranks', each 8B-sized).
    Registered when `eaglelab` is imported, so every process that resolves a config (a submitit or Slurm job too)
    has them."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # no configs to resolve (the drafter and training used as a library, a bare GPU box)
        return
    if not OmegaConf.has_resolver("eaglelab.variant"):
        OmegaConf.register_resolver("eaglelab.variant", variant_of)
    if not OmegaConf.has_resolver("eaglelab.launch_stamp"):
        OmegaConf.register_resolver("eaglelab.launch_stamp", _launch_stamp, use_cache=True)
    if not OmegaConf.has_resolver("eaglelab.slurm_python"):
        OmegaConf.register_resolver("eaglelab.slurm_python", slurm_python)
    if not OmegaConf.has_resolver("eaglelab.gpus_per_node"):
        OmegaConf.register_resolver("eaglelab.gpus_per_node", gpus_per_node)
    if not OmegaConf.has_resolver("eaglelab.mem_gb"):
        OmegaConf.register_resolver("eaglelab.mem_gb", slurm_mem_gb)


def gpus_per_node(devices: int, tensor_parallel: int, pipeline_parallel: int) -> int:
    """The GPUs a node of a trial or a `stage=prepare` job needs: one per rank (train.devices), and the data engine's
    tensor × pipeline size (vLLM spreads the target over them: a 70B or MoE target's prepare job on its 8 GPUs)."""
    return max(int(devices), int(tensor_parallel) * int(pipeline_parallel))


# What one rank of an 8B trial holds on the host besides its loader's read-ahead (train.prefetch_gb), computed, not
# measured (no GPU here; benchmarks/rank_memory.py): the drafter built in fp32 before it moves to its GPU (1.7 GB at
# Llama-3.1-8B shapes with a 32k draft vocabulary), the target's embedding read by name (1.0 GB), and a process with
# torch, CUDA's host side and the loader's workers (~3 GB); 1.3 GB to spare.
RANK_HOST_GB = 7
MIN_NODE_GB = 64


def slurm_mem_gb(devices: int, prefetch_gb: float, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> int:
    """A node's --mem (the Slurm launcher's `mem_gb`): every rank's host memory, 8B-sized (RANK_HOST_GB), plus its
    read-ahead (8 ranks at the default 2 GB: 72 GB), or, where the data engine spans more GPUs (a large target's
    `stage=prepare` job), as much for each of its workers; never under the 64 GB asked before, which also holds the
    vLLM engines a trial runs beside its ranks (their host side is unmeasured here)."""
    ranks = int(devices) * (RANK_HOST_GB + math.ceil(float(prefetch_gb)))
    return max(ranks, int(tensor_parallel) * int(pipeline_parallel) * RANK_HOST_GB, MIN_NODE_GB)


def slurm_python() -> str:
    """The Slurm launcher's `python`: this interpreter, through eaglelab/slurm_entry.py (USR2 from the first
    instant of the job)."""
    import shlex
    import sys
    from pathlib import Path

    return f"{shlex.quote(sys.executable)} -u {shlex.quote(str(Path(__file__).parents[1] / 'slurm_entry.py'))}"


def _launch_stamp(accelerator: str = "cpu") -> str:
    from eaglelab.core.ranks import launch_stamp  # torch only when a run directory is named

    return launch_stamp(accelerator)
