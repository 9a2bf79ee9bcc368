"""Signals at any instant: recorded when they arrive, acted on where that is safe.

A cluster preempts whenever it likes (Slurm: USR2 before a time limit or a preemption, which submitit answers
by checkpointing and requeueing the job; TERM when it kills), and a user presses Ctrl-C. Acting on a signal
means unwinding the run: KeyboardInterrupt, or submitit's requeue, which exits. Raised inside a write, that
tears the write; raised inside native code that calls back into Python it is turned into another error: torch.save
calls Python's `write` from C++ and reports `RuntimeError: ... unexpected pos`, matplotlib's Agg renderer reports
`ValueError: Invalid bounding box` — a requeue became a crash and the trial was lost to its sweep.

So `install()` gives SIGINT, SIGTERM and SIGUSR2 one handler that records the signal and
- acts on it at once elsewhere: every other instant is a safe point, because every file appears under its final
  name only when whole (eaglelab.core.io) and every stage resumes from what is on disk;
- inside `uninterruptible(what)` (a checkpoint saved or loaded, a cache shard, a result file's commit, a figure
  drawn) only records it; it is acted on the moment the outermost such block ends.
Acting happens once; signals after that are recorded, not acted on again (the run is already unwinding).
What arrived, in which stage, and how long it waited for a write go to the log and to run.json (`signal`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass

log = logging.getLogger("eaglelab")

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)


@dataclass
class Received:
    """A signal as it arrived and as it was acted on (run.json's `signal`)."""

    name: str
    stage: str  # the pipeline stage it arrived in
    waited_for: str | None = None  # the uninterruptible block it arrived in (acted on after it)
    waited_s: float = 0.0  # from arrival to action


_stage = "startup"  # before the pipeline names its first stage (Hydra, the run directory)
_writes: list[str] = []  # the uninterruptible blocks in progress, outermost first
_pending: tuple[int, float, str] | None = None  # (signum, arrival, write) of a signal waiting for a write to end
_received: Received | None = None
_acted = False  # the run is unwinding
_previous: dict[int, object] = {}  # the handlers before install(): submitit's, in a submitit job


def install() -> None:
    """Record-then-act handlers for SIGINT, SIGTERM and SIGUSR2 (call once, in the main thread). In a submitit
    job the handlers submitit installed are kept and called when the signal is acted on."""
    global _pending, _received, _acted
    _pending, _received, _acted = None, None, False
    for signum in SIGNALS:
        current = signal.getsignal(signum)
        if current is not _handle:
            _previous[signum] = current
        signal.signal(signum, _handle)
    # A USR2 that reached the job before submitit's handler existed (eaglelab/slurm_entry.py kept it): delivered
    # now, so submitit checkpoints and requeues as for any other.
    early = os.environ.pop("EAGLELAB_EARLY_SIGNAL", None)
    if early is not None:
        log.warning("%s arrived before submitit's handler was installed: delivering it now", early)
        os.kill(os.getpid(), signal.Signals[early])


def reclaim() -> None:
    """This module's handlers back in place of whatever replaced them since `install()` (Lightning's, in fit):
    one owner of signals. Lightning's SIGTERM handler runs a collective (a broadcast from rank 0) inside the
    handler; under DDP, rank 0 interrupted while the other ranks wait in another collective then waits forever,
    until the scheduler's SIGKILL, and its attempt is never recorded. The handlers it replaced (`_previous`:
    submitit's) are kept. Nothing happens where `install()` was not called (training used as a library)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not _handle:
        return
    for signum in SIGNALS:
        signal.signal(signum, _handle)


def enter_stage(name: str) -> None:
    """The pipeline stage now running (what a signal's record names)."""
    global _stage
    _stage = name
    log.info("stage: %s", name)


def received() -> dict | None:
    """The signal this process acted on, as run.json records it (None if none)."""
    return asdict(_received) if _received else None


@contextlib.contextmanager
def uninterruptible(what: str):
    """A write, or native code calling back into Python, that no signal may interrupt: a signal arriving inside
    waits until the outermost such block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers run in the main thread only: another thread is never interrupted
        return
    _writes.append(what)
    try:
        yield
    finally:
        _writes.pop()
        if not _writes and _pending is not None:
            _act(*_pending)


def _handle(signum: int, frame) -> None:
    global _pending
    name = signal.Signals(signum).name
    if _acted:
        log.warning("%s received while already stopping: ignored", name)
    elif _writes:
        if _pending is None:
            _pending = (signum, time.monotonic(), _writes[0])
            log.warning("%s received during %s: acted on once it is done", name, _writes[0])
    else:
        _act(signum, time.monotonic(), None)


@contextlib.contextmanager
def _term_ignored():
    """SIGTERM ignored, by this process and the programs it starts meanwhile (an ignored signal is inherited
    across exec). submitit requeues by running `scontrol requeue` inside the job it requeues: Slurm's SIGTERM to
    every process of the job can reach scontrol before it returns, and submitit then takes the accepted requeue
    for a failure and writes it as the job's result. Slurm's SIGKILL still ends whatever outstays KillWait."""
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _act(signum: int, arrived: float, waited_for: str | None) -> None:
    global _pending, _received, _acted
    name = signal.Signals(signum).name
    _pending, _acted = None, True
    _received = Received(name, _stage, waited_for, round(time.monotonic() - arrived, 4))
    log.warning("%s received during %s: stopping (the same command resumes)", name, _stage)
    previous = _previous.get(signum)
    if "SUBMITIT_EXECUTOR" in os.environ and callable(previous):
        with _term_ignored():
            previous(signum, None)  # submitit: USR2 checkpoints, requeues the job and exits
        _acted, _received = False, None  # it returned (TERM is only logged; USR2 in a rank > 0): the run goes on
        return
    raise KeyboardInterrupt(f"{name} during {_stage}")
