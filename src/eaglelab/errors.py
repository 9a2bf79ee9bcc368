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
