"""Who this process is in a trial: one answer for every way a trial's processes are started.

A trial runs as W processes, its ranks: `train.devices` on each of `train.num_nodes` nodes (W = 1 by default).
They are started by one of
- eaglelab itself, when nobody else did (`train.devices > 1` under `python src/run.py`, a Hydra sweep with any
  launcher, a submitit job with one task): `trial_ranks` below starts the node's other ranks;
- torchrun (`torchrun --nproc-per-node=G src/run.py ...`), inside a Slurm allocation or not;
- Slurm, one task per device (`srun`, or the Slurm launcher's `tasks_per_node: ${train.devices}`);
- the user, one command per node with NODE_RANK, MASTER_ADDR and MASTER_PORT set (several nodes, no scheduler).

The facts come from the cluster environment Lightning itself picks, in its own order (TorchElastic first, since
torchrun may run inside a Slurm allocation; then Slurm, LSF, MPI; else Lightning's own), and that same
environment is handed to the Trainer, so eaglelab and Lightning agree on who rank 0 is. They are established
(the process group joined) when the trial starts, before anything is written. Rank 0 alone writes the run's
records and results; every rank prepares its data and trains its share.

Why eaglelab, not Lightning, starts the ranks nobody else started: Lightning's launcher re-runs `sys.argv` at
`fit`, which under a Hydra sweep is the whole sweep again, and in a submitit job is submitit's own command
(whose parser rejects Hydra's overrides). Here every rank runs the trial's own resolved config
(`python -m eaglelab.rank_main CONFIG`), whatever started the trial.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from eaglelab.core.errors import ConfigError, EaglelabError

log = logging.getLogger("eaglelab")
# Lightning's Slurm environment says "prepend your python command with `srun`" wherever srun is installed (a login
# node, the dev cluster): eaglelab starts and finds its ranks itself (above), so the hint is wrong here.
warnings.filterwarnings("ignore", message="The `srun` command is available")

# Lightning strategies that start their processes inside `fit` by multiprocessing: they would start a second set
# beside the ranks already running here.
SPAWNING_STRATEGIES = ("ddp_spawn", "ddp_fork", "ddp_notebook")


def cluster_environment():
    """The cluster environment Lightning would choose itself (`_AcceleratorConnector`'s order), Slurm's with
    auto-requeue off: submitit owns requeueing, and two owners would requeue twice."""
    from lightning.fabric.plugins.environments import (
        LightningEnvironment,
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    if TorchElasticEnvironment.detect():
        return TorchElasticEnvironment()
    if SLURMEnvironment.detect():
        return SLURMEnvironment(auto_requeue=False)
    for env in (LSFEnvironment, MPIEnvironment):
        if env.detect():
            return env()
    return LightningEnvironment()


@dataclass(frozen=True)
class Ranks:
    rank: int = 0  # global: node_rank × devices + local_rank
    world_size: int = 1
    local_rank: int = 0
    node_rank: int = 0

    @property
    def primary(self) -> bool:
        """Rank 0: the one writer of run.json, metrics.json, the drafter, the suites and W&B."""
        return self.rank == 0


_current = Ranks()  # this process's in its latest trial (one process until a trial says otherwise)
_helpers_failed: list[str] = []  # what the observer saw: "rank 1 (pid 123) ended with exit code 1"
_last_words: list = []  # what rank 0 records before the observer ends it (`last_words`)


@contextlib.contextmanager
def last_words(record):
    """While inside: should the observer have to end this process (rank 0 still blocked in a collective after the
    grace, e.g. on a crowded machine), `record(why)` runs first, so the attempt is recorded as failed instead of
    left "running"."""
    _last_words.append(record)
    try:
        yield
    finally:
        _last_words.remove(record)


def current() -> Ranks:
    return _current


def is_primary() -> bool:
    return _current.primary


def _launcher_knows_the_world(env) -> bool:
    """torchrun, Slurm, LSF, MPI: the launcher started every rank and says how many there are."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    return not isinstance(env, LightningEnvironment)


def _launcher_facts(env) -> Ranks:
    return Ranks(env.global_rank(), env.world_size(), env.local_rank(), env.node_rank())


def facts(env, devices: int, num_nodes: int) -> Ranks:
    if _launcher_knows_the_world(env):
        return _launcher_facts(env)
    # Lightning's own environment knows only the local and node ranks: the world is the config's (as Lightning does)
    return Ranks(env.node_rank() * devices + env.local_rank(), devices * num_nodes, env.local_rank(), env.node_rank())


def _object_device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def establish(env, ranks: Ranks, accelerator: str = "cpu") -> None:
    """Join the trial's process group (Lightning's DDP reuses it: `_init_dist_connection` returns early) and make
    these facts this process's: `is_primary()`, Lightning's rank-zero utilities."""
    global _current
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if not dist.is_initialized():
        # The backend Lightning's DDP would pick for the device (NCCL on CUDA), on the address Lightning would use.
        nccl = accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available()
        if nccl:
            torch.cuda.set_device(ranks.local_rank)
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        # Lightning's DDP timeout (30 min), which it would have passed: NCCL's own default is 10 min, shorter than
        # rank 0 may take to prepare the held-out set and the suites while the others wait in DDP's first collective.
        from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

        dist.init_process_group(
            "nccl" if nccl else "gloo", rank=ranks.rank, world_size=ranks.world_size, timeout=default_pg_timeout
        )
    _current = ranks
    rank_zero_only.rank = ranks.rank


def _several() -> bool:
    """A process group of more than one process is joined."""
    return dist.is_initialized() and dist.get_world_size() > 1


def broadcast(value, src: int = 0):
    """Rank `src`'s value on every rank (a picklable object); the value itself in one process."""
    if not _several():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src, device=_object_device(dist.get_backend()))
    return box[0]


def barrier() -> None:
    """Every rank waits here for the others (a short wait: e.g. for rank 0's export); nothing in one process."""
    if _several():
        dist.barrier()


def gather(value, group=None) -> list:
    """Every rank's value (a picklable object), in rank order, on every rank; [value] in one process. `group`: one
    of `host_group`'s, for a wait longer than the training backend allows."""
    if not _several():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=group)
    return values


@contextlib.contextmanager
def host_group(timeout_s: float):
    """The trial's ranks in a process group of their own on gloo (host memory), whose collectives wait up to
    `timeout_s`: for a wait the training backend's would end (NCCL's watchdog: 30 minutes), e.g. rank 0 gathering
    evaluation rows that the other ranks measure for longer. Every rank enters it (creating a group is collective);
    None in one process."""
    if not _several():
        yield None
        return
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def same_on_every_rank(value, what: str, fix: str) -> None:
    """Stop every rank with one clear error when the ranks do not hold the same `value` (e.g. the run directory,
    the data's cache key): they would otherwise train on different data, or write to different places."""
    if not _several():
        return
    values = gather(value)
    if any(v != values[0] for v in values):
        shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise EaglelabError(f"the ranks of this trial disagree on {what} ({shown}); {fix}")


def launch_stamp(accelerator: str = "cpu") -> str:
    """The run directory's time stamp (`${eaglelab.launch_stamp:${train.accelerator}}` in conf/config.yaml).
    Processes that a launcher started together (torchrun, srun) each resolve their run directory themselves: they
    take rank 0's stamp, so a trial has one directory, not one per rank. (The group joined for it is the trial's, on
    the backend training will use.)"""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")
    env = cluster_environment()
    if _launcher_knows_the_world(env) and env.world_size() > 1:
        establish(env, _launcher_facts(env), accelerator)
        stamp = broadcast(stamp)
    return stamp


@contextlib.contextmanager
def trial_ranks(cfg, run_dir):
    """The trial's ranks, established for the block: -> this process's `Ranks`. Where nobody else started the
    node's ranks, they are started here (each runs `cfg` in `run_dir`) and waited for at the end."""
    global _current
    t = cfg.train
    env = cluster_environment()
    ranks = facts(env, t.devices, t.num_nodes)
    if ranks.world_size != t.devices * t.num_nodes:
        raise ConfigError(
            f"the launcher started {ranks.world_size} processes but train.devices × train.num_nodes = "
            f"{t.devices} × {t.num_nodes}; set train.devices to the processes per node and train.num_nodes to the nodes"
        )
    if ranks.world_size == 1:
        _current = ranks
        yield ranks
        return
    if t.strategy in SPAWNING_STRATEGIES:
        raise ConfigError(
            f"train.strategy={t.strategy} starts its own processes inside training, beside the trial's ranks; "
            "use train.strategy=ddp"
        )
    starts_here = not _launcher_knows_the_world(env) and not env.creates_processes_externally
    if starts_here and t.num_nodes > 1 and not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        raise ConfigError(
            f"train.num_nodes={t.num_nodes} without Slurm or torchrun: set MASTER_ADDR (node 0's address), MASTER_PORT "
            "and NODE_RANK (0, 1, ...) on every node, or launch with torchrun or srun"
        )
    saved_env, helpers, config_file, done = dict(os.environ), [], None, threading.Event()
    try:
        if starts_here:
            # What Lightning's own launcher sets (LOCAL_RANK makes it leave the starting to us from now on)
            os.environ.update(
                MASTER_ADDR=env.main_address,
                MASTER_PORT=str(env.main_port),
                NODE_RANK=str(env.node_rank()),
                WORLD_SIZE=str(ranks.world_size),
                LOCAL_RANK="0",
            )
            config_file = _write_config(replace(cfg, run_dir=str(run_dir)))
            helpers = [_start_helper(config_file, local_rank) for local_rank in range(1, t.devices)]
            _observe(helpers, done)
        establish(env, ranks, t.accelerator)
        yield ranks
        for local_rank, helper in enumerate(helpers, start=1):
            if helper.wait() != 0:
                raise EaglelabError(
                    f"rank {ranks.node_rank * t.devices + local_rank} ended with exit code "
                    f"{helper.returncode}; its error is above in this log"
                )
    except BaseException:
        # Which rank went first (rank 0's collective may fail before the observer has looked), then the rest: a rank
        # left waiting in a collective for one that is gone would wait out its timeout.
        ended = _helpers_failed or _ended_badly(helpers)
        for helper in helpers:
            if helper.poll() is None:
                helper.kill()
        if ended:
            log.error("%s", "; ".join(ended))
        raise
    finally:
        done.set()
        if starts_here:  # this process may run another trial next (a sweep's basic launcher): leave nothing behind
            if dist.is_initialized():
                dist.destroy_process_group()
            os.environ.clear()
            os.environ.update(saved_env)
            _helpers_failed.clear()
        if config_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(config_file)


def _write_config(cfg) -> str:
    fd, path = tempfile.mkstemp(prefix="eaglelab-trial-", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        pickle.dump(cfg, f)
    return path


def child_pythonpath() -> str:
    """PYTHONPATH for a process of eaglelab's own (a rank, an engine): the same eaglelab as this process's, however
    it was found (an install, or src/ on the path of src/run.py), ahead of the caller's path."""
    here = str(Path(__file__).resolve().parents[2])  # src/ (this file is src/eaglelab/core/ranks.py)
    return os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))


def _start_helper(config_file: str, local_rank: int) -> subprocess.Popen:
    env = {**os.environ, "LOCAL_RANK": str(local_rank), "PYTHONPATH": child_pythonpath()}
    return subprocess.Popen([sys.executable, "-m", "eaglelab.rank_main", config_file], env=env)


# After telling rank 0 that a rank ended badly, how long it may take to unwind on its own (record the failure in
# run.json) before it is ended: a rank blocked inside a collective or the rendezvous never runs a signal handler.
UNWIND_GRACE_S = 20.0


def _ended_badly(helpers: list[subprocess.Popen]) -> list[str]:
    return [
        f"local rank {i} (pid {h.pid}) ended with exit code {h.poll()}"
        for i, h in enumerate(helpers, start=1)
        if h.poll() not in (None, 0)
    ]


def _quietly(fn, *args) -> None:
    with contextlib.suppress(Exception):
        fn(*args)


def _observe(helpers: list[subprocess.Popen], done: threading.Event) -> None:
    """A rank that dies leaves the others in their next collective for as long as its timeout (30 min): when one
    ends badly, the other helpers are ended (SIGKILL: one stuck in a collective never returns to a handler), rank 0
    gets SIGTERM (eaglelab.core.preemption: it unwinds and records the attempt), and if it is still blocked after the
    grace, it exits."""
    main = os.getpid()

    def watch():
        while not done.wait(1.0):
            if all(h.poll() == 0 for h in helpers):
                return
            bad = _ended_badly(helpers)
            if not bad:
                continue
            _helpers_failed.extend(bad)
            log.error("%s: ending this trial's other ranks", "; ".join(_helpers_failed))
            for h in helpers:
                if h.poll() is None:
                    h.kill()
            os.kill(main, signal.SIGTERM)
            if not done.wait(UNWIND_GRACE_S):
                log.error("rank 0 is still blocked waiting for the ranks that ended: exiting")
                why = "; ".join(_helpers_failed)
                for record in list(_last_words):  # in a thread of its own, given 5 s: exiting regardless
                    last = threading.Thread(target=_quietly, args=(record, why), daemon=True)
                    last.start()
                    last.join(5.0)
                logging.shutdown()
                os._exit(1)
            return

    threading.Thread(target=watch, daemon=True, name="eaglelab-rank-observer").start()
