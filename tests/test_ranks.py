"""Rank facts from each launcher's environment, the refusals, and the validation shares (no processes started;
the launch paths themselves run in tests/test_launch.py)."""

import pytest

from eaglelab.core.config import TrainConfig
from eaglelab.core.errors import ConfigError
from eaglelab.core.ranks import Ranks, cluster_environment, facts, trial_ranks
from eaglelab.train.fit import validation_share

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID")
LAUNCH_VARIABLES += ("MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")
LAUNCH_VARIABLES += ("SLURM_NTASKS_PER_NODE", "SLURM_JOB_NAME", "SLURM_JOB_ID", "SLURM_NODELIST")

TORCHRUN = {"TORCHELASTIC_RUN_ID": "r", "RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "GROUP_RANK": "1"}
SLURM = {
    "SLURM_NTASKS": "16",
    "SLURM_NTASKS_PER_NODE": "8",
    "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
}
SLURM |= {"SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "5", "SLURM_NODELIST": "node[1-2]"}


@pytest.fixture
def launched(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return lambda **env: [monkeypatch.setenv(k, v) for k, v in env.items()]


@pytest.mark.parametrize(
    "env, devices, nodes, expected",
    [
        ({}, 1, 1, Ranks(0, 1, 0, 0)),
        (TORCHRUN, 8, 2, Ranks(11, 16, 3, 1)),
        (SLURM, 8, 2, Ranks(9, 16, 1, 1)),
        ({**SLURM, **TORCHRUN}, 8, 2, Ranks(11, 16, 3, 1)),  # torchrun inside an allocation: torchrun's ranks
        ({"NODE_RANK": "1", "LOCAL_RANK": "2"}, 8, 2, Ranks(10, 16, 2, 1)),  # one command per node
    ],
    ids=["one process", "torchrun", "slurm tasks", "torchrun in slurm", "per-node commands"],
)
def test_every_launcher_gives_the_ranks_lightning_gives(launched, env, devices, nodes, expected):
    launched(**env)
    environment = cluster_environment()
    assert facts(environment, devices, nodes) == expected
    if expected.world_size > 1 and "SLURM_NTASKS" in env:  # Slurm's requeueing has one owner, submitit
        assert type(environment).__name__ != "SLURMEnvironment" or environment.auto_requeue is False


def _cfg(**train):
    class Cfg:  # trial_ranks reads only the training settings before it starts anything
        pass

    cfg = Cfg()
    cfg.train = TrainConfig(**train)
    return cfg


@pytest.mark.parametrize(
    "env, train, message",
    [
        (TORCHRUN, {"devices": 8}, "the launcher started 16 processes but train.devices × train.num_nodes = 8 × 1"),
        ({}, {"devices": 2, "strategy": "ddp_spawn"}, "use train.strategy=ddp"),
        ({"NODE_RANK": "0"}, {"devices": 1, "num_nodes": 2}, "set MASTER_ADDR (node 0's address), MASTER_PORT"),
    ],
    ids=["world mismatch", "spawning strategy", "nodes without an address"],
)
def test_a_launch_that_cannot_work_is_refused_before_anything_starts(launched, tmp_path, env, train, message):
    launched(**env)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        with trial_ranks(_cfg(**train), tmp_path):
            pass


@pytest.mark.parametrize("count, world", [(48, 8), (3, 2), (10, 3)])
def test_each_validation_sequence_is_validated_once_over_the_ranks(count, world):
    shares = [validation_share(count, Ranks(rank, world)) for rank in range(world)]
    assert sorted(i for share in shares for i in share) == list(range(count))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1  # 1/W of the steps each


def _compare(rank: int, port: int, cases: list[list], out):
    import torch.distributed as dist

    from eaglelab.core.ranks import same_on_every_rank

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(cases[0]))
    try:
        for case, values in enumerate(cases):
            try:
                same_on_every_rank(values[rank], "the training prompts (a digest)", "give every node the same packages")
                out.put((case, rank, None))
            except Exception as e:
                out.put((case, rank, str(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes importing torch
def test_ranks_that_built_different_data_stop_with_one_line_on_every_rank():
    """Two gloo processes (spawned, as ranks are): what each rank holds is compared before any work; the same
    value passes, different values stop every rank with one line naming both."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agree, differ = ["abc", "abc"], ["abc", "abd"]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_compare, args=(r, port, [agree, differ], out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {(case, rank): message for case, rank, message in (out.get(timeout=120) for _ in range(4))}
    for p in procs:
        p.join(timeout=60)
    assert results[0, 0] is None and results[0, 1] is None
    expected = "the ranks of this trial disagree on the training prompts (a digest) (rank 0: abc, rank 1: abd)"
    assert expected in results[1, 0] and expected in results[1, 1], results


BLOCKED_RANK_0 = """
import signal, subprocess, sys, threading, time
from eaglelab.core import ranks

ranks.UNWIND_GRACE_S = 0.5
signal.signal(signal.SIGTERM, lambda *_: None)  # as rank 0 inside a collective: no handler ever runs
helper = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
with ranks.last_words(lambda why: open(sys.argv[1], "w").write(why)):
    ranks._observe([helper], threading.Event())
    time.sleep(60)
"""


def test_rank_0_blocked_past_the_grace_records_why_before_it_is_ended(tmp_path):
    """A rank ended badly and rank 0 never unwinds (blocked in a collective, or slow on a crowded machine): the
    observer ends it after the grace, and what the run registered as its last words (pipeline: the attempt recorded
    as failed in run.json) runs first, naming the rank."""
    import subprocess
    import sys
    import time

    said = tmp_path / "said"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", BLOCKED_RANK_0, str(said)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 1 and time.monotonic() - t0 < 50, proc.stderr[-2000:]
    assert said.read_text().endswith("ended with exit code 3"), said.read_text()
    assert "still blocked waiting for the ranks that ended" in proc.stderr
