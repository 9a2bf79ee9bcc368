"""User-facing errors: each message is one line that names the fix. `src/run.py` prints it and exits 2."""


class EaglelabError(Exception):
    """Bad input or a state the user must fix (not a bug)."""


class ConfigError(EaglelabError):
    pass


class TargetError(EaglelabError):
    pass


class DataError(EaglelabError):
    pass


class TrainingError(EaglelabError):
    pass


class ResourceError(EaglelabError):
    """A run larger than the memory or disk it would get, refused before the work (`eaglelab.plan.costs`)."""


class DiskFull(ResourceError):
    """A disk (or quota) that filled up while the run wrote to it; the run resumes once there is room."""


def first_line(e: BaseException, limit: int = 160) -> str:
    """An exception's first message line (its type name when it has no message), for one-line errors."""
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:limit]
