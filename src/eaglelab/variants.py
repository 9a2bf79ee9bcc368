"""The drafter variants the paper compares, defined once: name -> the design flags that make it.

`+ablation=NAME` (NAME with `_` for `.`: `eagle3_1`) sets these flags (eaglelab.config registers one Hydra
config per entry), a run's `variant` label is looked up here from its flags, and analysis/ hides exactly
these flags from its setup labels because the variant name already says them. Add a variant: one line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

# The flags a variant fixes. Other drafter settings (norm_before_residual, num_layers, ...) are shown
# next to the variant's name wherever they differ between runs.
VARIANT_FLAGS = ("fc_norm", "norm_before_fc", "norm_output")

VARIANTS: dict[str, dict[str, bool]] = {
    "eagle3.1": dict(fc_norm=True, norm_before_fc=False, norm_output=True),  # both EAGLE-3.1 changes (default)
    "no_fc_norm": dict(fc_norm=False, norm_before_fc=False, norm_output=True),
    "no_norm_output": dict(fc_norm=True, norm_before_fc=False, norm_output=False),
    "eagle3": dict(fc_norm=False, norm_before_fc=False, norm_output=False),  # both changes off
    "norm_before_fc": dict(fc_norm=False, norm_before_fc=True, norm_output=True),  # one norm over the concat
}
CUSTOM = "custom"  # flags that match no named variant


def ablation_name(variant: str) -> str:
    """The config name of a variant (`+ablation=eagle3_1`): Hydra config names hold no dots."""
    return variant.replace(".", "_")


def variant_of(drafter: Mapping | object) -> str:
    """The name of the variant whose flags `drafter` (a config node or object with the flags) has."""
    get = drafter.get if isinstance(drafter, Mapping) else lambda k: getattr(drafter, k)
    flags = {k: bool(get(k)) for k in VARIANT_FLAGS}
    return next((name for name, fixed in VARIANTS.items() if fixed == flags), CUSTOM)


def register_resolver() -> None:
    """The resolvers conf/ uses: `${eaglelab.variant:${drafter}}` (the schema's default `variant`) and
    `${eaglelab.launch_stamp:${train.accelerator}}` (a run directory's time, one for all ranks: eaglelab.ranks),
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

    return f"{shlex.quote(sys.executable)} -u {shlex.quote(str(Path(__file__).with_name('slurm_entry.py')))}"


def _launch_stamp(accelerator: str = "cpu") -> str:
    from eaglelab.ranks import launch_stamp  # torch only when a run directory is named

    return launch_stamp(accelerator)
