"""Crash-safe file helpers: nothing half-written is ever visible under its final name."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from eaglelab.preemption import uninterruptible

_UMASK = os.umask(0o022)
os.umask(_UMASK)  # (reading the umask means setting it: put it back)


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


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive inter-process lock (flock): concurrent trials prepare a cache entry once."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
