"""Cache locks that hold where flock does not (issue 29 item 6): flock missing (ENOSYS, made so by an LD_PRELOADed
flock; tests/no_flock.c), or node-local (Lustre `localflock`, NFS `local_lock`, BeeGFS: read from the mount).
There the lock is a heartbeat lease file (filelock's SoftFileLease). What it must do: exclude every holder, and be
taken over when its holder died, at once on the same host, after the lease's duration from another host (a second
"host" is a process in a UTS namespace of its own: another hostname, the same file system)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

# Holds the lock for `hold` seconds; logs entering and leaving with a timestamp.
HOLD = """
import os, sys, time
from pathlib import Path
from eaglelab.core.io import file_lock
lock, log, hold = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
with file_lock(lock):
    with open(log, "a") as f: f.write(f"in {os.getpid()} {time.time()}\\n")
    time.sleep(hold)
    with open(log, "a") as f: f.write(f"out {os.getpid()} {time.time()}\\n")
"""


def holder(lock: Path, log: Path, hold: float, env: dict, prefix: list[str] = ()) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **env}
    return subprocess.Popen([*prefix, sys.executable, "-c", HOLD, str(lock), str(log), str(hold)], env=env)


def wait_for_line(log: Path, count: int, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not (log.exists() and len(log.read_text().splitlines()) >= count):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.05)


@pytest.mark.slow  # (processes holding the lock)
@pytest.mark.parametrize("kind", ["flock", "flock unavailable", "lease forced"])
def test_three_processes_hold_the_lock_one_at_a_time(kind, no_flock, tmp_path):
    env = {"flock": {}, "flock unavailable": no_flock, "lease forced": {"EAGLELAB_LOCKS": "lease"}}[kind]
    if kind == "flock unavailable":  # the shim really takes flock away
        probe = "import fcntl; fcntl.flock(open('/dev/null'), fcntl.LOCK_EX)"
        out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, text=True)
        assert out.returncode == 1 and "Function not implemented" in out.stderr
    lock, log = tmp_path / "locks" / "entry.lock", tmp_path / "log"
    procs = [holder(lock, log, 0.4, env) for _ in range(3)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    events = [line.split() for line in log.read_text().splitlines()]
    assert [e[0] for e in events] == ["in", "out"] * 3  # never two inside at once
    assert all(events[i][1] == events[i + 1][1] for i in range(0, 6, 2))
    assert not lock.with_name("entry.lock.lease").exists()  # a lease is released by removing it


@pytest.mark.slow
def test_a_dead_holders_lease_is_taken_over(no_flock, tmp_path):
    """SIGKILLed holder on this host: the next process takes the lease at once (its pid is gone), not after the
    lease's duration. On another host the pid cannot be checked: a waiter takes over only once the lease went
    unrenewed for its duration."""
    lock, log = tmp_path / "entry.lock", tmp_path / "log"
    env = {**no_flock, "EAGLELAB_LEASE_SECONDS": "600"}
    dead = holder(lock, log, 600, env)
    wait_for_line(log, 1)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    start = time.monotonic()
    assert holder(lock, log, 0, env).wait(timeout=60) == 0
    assert time.monotonic() - start < 30  # not the 600 s of its lease

    if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0:
        pytest.skip("no UTS namespace here (unshare --uts needs CAP_SYS_ADMIN) for a second host")
    log.unlink()
    env["EAGLELAB_LEASE_SECONDS"] = "4"
    elsewhere = ["unshare", "--uts", "sh", "-c", 'hostname other-node && exec "$0" "$@"']
    other = holder(lock, log, 600, env, prefix=elsewhere)
    wait_for_line(log, 1)
    other.send_signal(signal.SIGKILL)  # sh exec'd python: the holder itself
    other.wait()
    start = time.monotonic()
    assert holder(lock, log, 0, env).wait(timeout=60) == 0
    waited = time.monotonic() - start
    assert 3.5 < waited < 30, waited  # the lease's 4 s, then taken over


MOUNTINFO = """\
22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
40 22 0:50 / /lustre rw,relatime - lustre 10.0.0.1@tcp:/fs rw,{lustre}
41 22 0:51 / /nfs rw,relatime - nfs4 server:/export rw,vers=4.2,{nfs}
42 22 0:52 / /beegfs rw,relatime - beegfs beegfs_nodev rw,cfgFile=/etc/beegfs/beegfs-client.conf
"""


def test_node_local_flock_is_read_from_the_mount():
    from eaglelab.core.io import node_local_flock

    info = MOUNTINFO.format(lustre="flock", nfs="local_lock=none")
    assert node_local_flock(Path("/home/x"), info) is None
    assert node_local_flock(Path("/lustre/cache"), info) is None
    assert node_local_flock(Path("/nfs/cache"), info) is None
    assert "beegfs" in node_local_flock(Path("/beegfs/cache"), info)
    info = MOUNTINFO.format(lustre="localflock", nfs="local_lock=all")
    assert "localflock" in node_local_flock(Path("/lustre/cache"), info)
    assert "local_lock" in node_local_flock(Path("/nfs/cache"), info)


def test_an_unknown_lock_kind_is_one_line(monkeypatch, tmp_path):
    from eaglelab.core.errors import ConfigError
    from eaglelab.core.io import file_lock

    monkeypatch.setenv("EAGLELAB_LOCKS", "nfs")
    with pytest.raises(ConfigError, match="set it to auto, flock or lease"), file_lock(tmp_path / "x.lock"):
        pass


def test_the_shards_of_an_entry_are_made_once_by_whoever_holds_them(tmp_path):
    """`shards.take_shards`, as two ranks run it at once (threads: flock excludes open files, not processes) on
    an entry of 8 shards, one of which a third holder keeps locked and then drops unmade (it died): every shard is
    made exactly once, each rank begins with its own share, and the dropped one is made by a rank that waited."""
    import threading

    from eaglelab.core.io import file_lock
    from eaglelab.data.shard_claims import take_shards
    from eaglelab.data.store import shard_name

    folder = tmp_path / "regen" / "key"
    folder.mkdir(parents=True)
    made: list[tuple[int, int]] = []  # (rank, shard), in order
    done = lambda i: (folder / shard_name(i)).exists()  # noqa: E731

    def make(rank, todo):
        for i in todo:
            time.sleep(0.05)
            made.append((rank, i))
            (folder / shard_name(i)).write_text("x")
        return len(todo)

    dropped = tmp_path / "locks" / f"regen-key-{shard_name(5)}.lock"
    holding, release = threading.Event(), threading.Event()

    def third():
        with file_lock(dropped):
            holding.set()
            release.wait()

    threading.Thread(target=third).start()
    holding.wait()
    ranks = [threading.Thread(target=lambda r=r: take_shards([1] * 8, (r, 2), folder, lambda t: make(r, t)))
             for r in (0, 1)]  # fmt: skip
    for t in ranks:
        t.start()
    time.sleep(0.6)  # both ranks are through the free shards, one waits for shard 5
    assert not done(5)
    release.set()
    for t in ranks:
        t.join(timeout=30)
    assert sorted(i for _, i in made) == list(range(8))  # each once
    first = {r: next(i for rank, i in made if rank == r) for r in (0, 1)}
    assert first == {0: 0, 1: 1}  # each rank's own share first
    assert any(i == 5 for _, i in made[-2:])  # the dropped shard, made once its holder let go


def test_one_engine_job_takes_shards_up_to_a_token_budget(tmp_path):
    """However long the shards' sequences, one claim (one engine job, its token ids in memory twice) holds at most
    CLAIM_TOKENS tokens, or one shard when a single shard is larger."""
    from eaglelab.data.shard_claims import CLAIM_TOKENS, take_shards
    from eaglelab.data.store import shard_name

    folder = tmp_path / "regen" / "key"
    folder.mkdir(parents=True)
    jobs = []

    def make(todo):
        jobs.append(list(todo))
        for i in todo:
            (folder / shard_name(i)).write_text("x")
        return len(todo)

    sizes = [CLAIM_TOKENS // 3] * 5 + [2 * CLAIM_TOKENS] + [10] * 3
    assert take_shards(sizes, (0, 1), folder, make) == 9
    assert jobs == [[0, 1, 2], [3, 4], [5], [6, 7, 8]]
