"""Strict-device mode: a tensor made without an explicit device inside eaglelab's own code is an error.

On a CPU box every tensor lands on the CPU whether or not its device was named, so a factory call that forgets
`device=` only fails on the first GPU it meets (a CPU index tensor against CUDA states). Under this mode, any
tensor factory (`torch.zeros`, `arange`, `tensor`, …) called from a file of the eaglelab package without a
`device` argument raises, naming the line; calls made by torch, Lightning or any other library are left alone, as
are the `*_like` factories and methods, which inherit their input's device, and a module's `__init__`, whose
parameters follow torch's default device (`with torch.device(...)`) as nn.Linear's do. Host tensors by design
(collation, the tiny target's construction, data preparation) say device="cpu".

    with strict_device():
        run(cfg)    # tests/test_training.py runs the smoke loop so
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

PACKAGE = Path(__file__).resolve().parents[1]  # eaglelab/ (this file is in eaglelab/core/)
FACTORIES = {
    torch.arange, torch.empty, torch.eye, torch.full, torch.linspace, torch.ones, torch.rand, torch.randint,
    torch.randn, torch.randperm, torch.tensor, torch.zeros, torch.as_tensor, torch.scalar_tensor,
}  # fmt: skip


class DeviceNotNamed(RuntimeError):
    pass


class _StrictDevice(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            caller = sys._getframe(1)
            path = Path(caller.f_code.co_filename).resolve()
            # A module's __init__ follows torch's default device, as nn.Linear's own parameters do.
            if (
                path.is_relative_to(PACKAGE)
                and path != Path(__file__).resolve()
                and caller.f_code.co_name != "__init__"
            ):
                raise DeviceNotNamed(
                    f"{path.relative_to(PACKAGE.parent)}:{caller.f_lineno}: torch.{func.__name__} without a device "
                    "(it would land on the CPU beside tensors on the GPU); pass device="
                )
        return func(*args, **kwargs)


@contextlib.contextmanager
def strict_device():
    with _StrictDevice():
        yield
