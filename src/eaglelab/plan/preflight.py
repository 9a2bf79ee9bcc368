"""Limits checked before any work: does a run of this size fit this data, this target and this machine?

A mistyped size used to surface late and badly: a `train.ttt_steps` far beyond any sequence ran until the kernel
killed the process (exit 137, no message). `check_limits` runs in `eaglelab.pipeline.execute` once the target's
config and tokenizer are read (its shape is known) and before regeneration or training starts, and refuses with one
line that names the setting to change:

1. `data.max_length` against the target's context window;
2. draft depths against the responses they draft on (`eaglelab.core.config.check_depths_and_lengths`, once more: an
   evaluated checkpoint brings its own `train.ttt_steps`);
3. the precisions against the device (`check_precision`);
4. the run's peak memory against what the device has free (`estimate_memory`).

The disk a cache entry needs is checked where the prompts' lengths are known (`eaglelab.data.shard_claims`); a disk
that fills up anyway becomes one `DiskFull` error (`as_disk_full`, called once, by `eaglelab.pipeline.run`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eaglelab.core.config import RunConfig, check_depths_and_lengths
from eaglelab.core.errors import ConfigError, ResourceError
from eaglelab.core.io import free_bytes
from eaglelab.data.targets import Target
from eaglelab.models.drafter import Eagle3Config
from eaglelab.plan.costs import GB, MemoryEstimate, data_plan, estimate_memory, precision_name, prompt_sets

log = logging.getLogger("eaglelab")


def check_limits(
    cfg: RunConfig,
    target: Target,
    drafter: Eagle3Config,
    train_prompts: list,
    held_out_prompts: list,
    validation_prompts: list = (),
) -> MemoryEstimate:
    """Every limit this run must respect, checked before any work; -> the memory estimate (for metrics.json).
    The prompts (not yet regenerated) bound the sequences' lengths; `train_prompts` and `validation_prompts` are
    empty when only evaluating."""
    check_fits_context(cfg, target)
    check_depths_and_lengths(cfg)
    check_precision(cfg, target.device)
    sets = prompt_sets(cfg, target, train_prompts, held_out_prompts, validation_prompts)
    estimate = estimate_memory(cfg, target, drafter, sets)
    log.info("memory estimate: %s", estimate)
    check_fits_memory(estimate)
    train = next((s for s in sets if s.name == "train"), None)  # (none: every prompt too long, refused later)
    if train_prompts and train is not None:
        for line in data_plan(cfg, drafter, train).lines(free_bytes(Path(cfg.paths.cache_dir).expanduser())):
            log.info("data plan: %s", line)
    return estimate


def check_fits_context(cfg: RunConfig, target: Target) -> None:
    if cfg.data.max_length > target.max_context:  # longer sequences would run past the target's positions
        raise ConfigError(
            f"data.max_length={cfg.data.max_length} exceeds the target's context window "
            f"({target.max_context} tokens); lower data.max_length"
        )


def check_precision(cfg: RunConfig, device: torch.device) -> None:
    """Precisions the device cannot run, refused instead of swapped or emulated behind the run's back."""
    precision = precision_name(cfg.train.precision)
    training = cfg.checkpoint is None
    on_cpu = device.type == "cpu" and cfg.train.accelerator != "tpu"  # (a TPU run keeps its target on the host)
    if on_cpu and training and precision == "16-mixed":
        # Lightning would train bf16-mixed instead (a warning in the log) and the run would be labelled 16-mixed.
        raise ConfigError(
            f"train.precision={cfg.train.precision}: float16 autocast does not exist on the CPU (Lightning would "
            "quietly train bf16-mixed instead); use train.precision=bf16-mixed or 32-true"
        )
    if device.type == "cuda" and not _cuda_has_bf16(device):
        name = torch.cuda.get_device_name(device)
        if training and precision.startswith("bf16"):
            raise ConfigError(
                f"train.precision={cfg.train.precision} needs bfloat16, which {device} ({name}) lacks; "
                "use train.precision=16-mixed or 32-true"
            )
        if cfg.target.dtype == "bfloat16":
            raise ConfigError(
                f"target.dtype=bfloat16 needs bfloat16, which {device} ({name}) lacks; use target.dtype=float16"
            )
    if device.type == "mps" and training and precision == "64-true":
        raise ConfigError("train.precision=64-true: MPS has no float64; use train.precision=32-true")


def _cuda_has_bf16(device: torch.device) -> bool:
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8  # Ampere and later; older GPUs only emulate it, several times slower


def check_fits_memory(estimate: MemoryEstimate) -> None:
    if estimate.free is None or not estimate.stages:
        return
    stage = estimate.stages[estimate.peak_stage]
    if stage.bytes <= estimate.free:
        return
    raise ResourceError(
        f"this run needs ~{estimate.peak / GB:.1f} GB at its peak ({estimate.peak_stage}: {stage.sized_by}), "
        f"{stage.bytes / GB:.1f} GB more than it holds now, but {estimate.device} has {estimate.free / GB:.1f} GB "
        f"free; lower {stage.fix}"
    )
