"""Crash-safe file helpers: nothing half-written is ever visible under its final name."""

from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import functools
import io
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from eaglelab.core.errors import ConfigError, DiskFull
from eaglelab.core.preemption import uninterruptible

_UMASK = os.umask(0o022)
os.umask(_UMASK)  # (reading the umask means setting it: put it back)


def writable_folder(directory: Path, setting: str) -> None:
    """`directory` is (or is made) a folder this process can write to; otherwise one ConfigError line naming
    `setting`, the key that chooses it. Checked before any work: a cache or results path under a regular file used
    to end in a NotADirectoryError traceback at the first write."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"cannot write to {directory} ({e.strerror or type(e).__name__}); set {setting} to a writable folder"
        ) from None


def flock_folder(directory: Path, setting: str, needed_by: str) -> None:
    """`directory` is a writable folder where flock works (`needed_by` locks its files with it, with no fallback);
    otherwise one ConfigError line naming `setting`. Lustre without its `flock` mount option and many FUSE file
    systems answer ENOSYS or EOPNOTSUPP."""
    writable_folder(directory, setting)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".flock-check-") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
        except OSError as e:
            raise ConfigError(
                f"{directory} does not support flock ({errno.errorcode.get(e.errno, e.errno)}), which {needed_by} "
                f"needs; set {setting} to a node-local folder (the job's $TMPDIR, /tmp)"
            ) from None


@contextlib.contextmanager
def atomic_dir(final: Path):
    """Yield a temporary sibling folder; rename it to `final` only if the block succeeds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        # mkdtemp makes 0700: results and caches are for the team, as mkdir would (keeping a shared folder's setgid)
        os.chmod(tmp, (0o777 & ~_UMASK) | (os.stat(tmp).st_mode & stat.S_ISGID))
        yield tmp
        with uninterruptible(final.name):
            if final.exists():  # another process finished the same content first: keep theirs
                shutil.rmtree(tmp)
            else:
                os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w"):
    """A file whose content appears under `path` only once complete: written to a temporary file next to it
    (same filesystem, so the rename is atomic), its bytes fsynced, then renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600: results are for the team to read, as open() would
        with os.fdopen(fd, mode) as f:
            yield f
            with uninterruptible(path.name):  # the commit: a signal now waits until the file is in place
                f.flush()
                os.fsync(f.fileno())
                f.close()
                os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_file(path) as f:
        f.write(text)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_csv(path: Path, rows: list[dict]) -> None:
    """A tidy table (one dict per row; columns: every key, in first-seen order), written atomically."""
    if not rows:
        return
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


# Which lock a cache on this file system needs: a site fact (where the cache lives), not an experiment's, so an
# environment variable and not a config key. `auto` reads the mount (below); `flock` and `lease` force one.
LOCKS_ENV = "EAGLELAB_LOCKS"
# A lease not renewed for this long is taken over (its holder renews it every third of it). Every node sharing the
# cache must use the same value.
LEASE_SECONDS_ENV = "EAGLELAB_LEASE_SECONDS"


def _mount_of(path: Path, mountinfo: str | None = None) -> tuple[str, set[str]]:
    """The file-system type and mount options (per-mount and super-block) of the mount holding `path`."""
    best, found = "", ("", set())
    target = os.path.realpath(path)
    if mountinfo is None:
        with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
    for line in (mountinfo or "").splitlines():
        left, right = line.split(" - ", 1)
        point = left.split()[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            fstype, _, options = right.split()[:3]
            best, found = point, (fstype, set(left.split()[5].split(",")) | set(options.split(",")))
    return found


def node_local_flock(path: Path, mountinfo: str | None = None) -> str | None:
    """Why flock on `path` would not exclude other nodes, or None. flock is cluster-wide on local disks, NFS (by
    default), GPFS and Lustre mounted with `flock`; it is node-local (or absent) on Lustre with `localflock` or
    without `flock`, on NFS with `local_lock=flock|all`, and on BeeGFS unless its client enables global locks."""
    fstype, options = _mount_of(path, mountinfo)
    if fstype == "lustre" and "flock" not in options:
        return f"lustre mounted with {'localflock' if 'localflock' in options else 'no flock option'}"
    if fstype.startswith("nfs") and {"local_lock=flock", "local_lock=all"} & options:
        return "nfs mounted with local_lock"
    if fstype == "beegfs":
        return "beegfs (flock is node-local unless tuneUseGlobalFileLocks)"
    return None


def lock_kind(path: Path) -> str:
    kind = os.environ.get(LOCKS_ENV, "auto")
    if kind not in ("auto", "flock", "lease"):
        raise ConfigError(f"{LOCKS_ENV}={kind!r} is not a lock kind: set it to auto, flock or lease")
    return kind if kind != "auto" else ("lease" if _node_local_folder(str(Path(path).parent)) else "flock")


@functools.lru_cache(maxsize=64)  # a folder's mount does not change during a run: mountinfo is read once per folder
def _node_local_folder(folder: str) -> str | None:
    return node_local_flock(Path(folder))


@contextlib.contextmanager
def file_lock(path: Path, wait: bool = True, leases: dict | None = None):
    """An exclusive inter-process, inter-node lock: concurrent trials prepare a cache entry once. Yields True when
    held; with `wait=False` it does not wait for another holder and yields False instead (holding nothing).

    flock where it excludes every node; elsewhere (and wherever flock fails: ENOSYS, ENOLCK, EOPNOTSUPP) a lease
    file, filelock's `SoftFileLease`: created atomically (O_EXCL), holding owner host, pid and a token, renewed by
    a heartbeat thread; a waiter takes it over once its holder is a dead process on the same host, or after
    the lease's duration without a renewal from another host. A lease measures that duration from when it first
    saw the holder's claim: a caller polling many locks passes one `leases` dict across its attempts (one lease
    per path), so a dead node's claims expire together rather than one after another."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if lock_kind(path) == "flock":
        f = open(path, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            yield False
            return
        except OSError as e:
            f.close()
            if e.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
                raise
        else:
            try:
                yield True
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
            return
    from filelock import SoftFileLease, Timeout

    make = lambda: SoftFileLease(path.with_name(path.name + ".lease"), lease_duration=float(  # noqa: E731
        os.environ.get(LEASE_SECONDS_ENV, "30")))  # fmt: skip
    if leases is None:
        lease = make()
    else:
        if str(path) not in leases:
            leases[str(path)] = make()
        lease = leases[str(path)]
    try:
        lease.acquire(timeout=-1 if wait else 0)
    except Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lease.release()


# --- a full disk ---------------------------------------------------------------------------------------------
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# What a full disk reads like where no errno survives: pyarrow's message, torch's zip writer on a path.
NO_SPACE_MESSAGES = ("No space left on device", "file write failed", "unexpected pos")


def as_disk_full(error: BaseException, *folders: str | Path) -> DiskFull | None:
    """`error` as one DiskFull line when a full disk (or quota) caused it anywhere in its chain of causes; the
    folder named is the failing file's when the error says, else whichever of `folders` has the least room."""
    chain = list(_chain(error))
    full = [e for e in chain if isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS]
    # Writers that drop the errno say so in words; but not when the chain shows another cause (an interrupt
    # raised inside torch.save's write callback also ends as `unexpected pos`; an I/O error is not a full disk).
    other = [e for e in chain if isinstance(e, (KeyboardInterrupt, SystemExit)) or (isinstance(e, OSError) and e.errno)]
    if not full and not other:
        full = [
            e for e in chain if isinstance(e, (OSError, RuntimeError)) and any(m in str(e) for m in NO_SPACE_MESSAGES)
        ]
    if not full:
        return None
    filename = getattr(full[0], "filename", None)
    candidates = [Path(filename).parent] if filename else [Path(f).expanduser() for f in folders]
    where, free = min(((folder, free_bytes(folder)) for folder in candidates), key=lambda x: x[1])
    return DiskFull(
        f"no space left on device (writing under {where}: {size_text(free)} free); free space there and run the "
        "same command again: the run resumes"
    )


def _chain(error: BaseException):
    """`error` and everything in its chain of causes and contexts, each once."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]


def free_bytes(folder: Path) -> int:
    """Free bytes on the filesystem that holds `folder` (or would: its nearest existing ancestor)."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def size_text(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"
