"""submitit's job entry point, with Slurm's USR2 recorded from the interpreter's first instant.

submitit installs its USR2 handler (checkpoint, then requeue) only once it has imported itself and unpickled the
job: a second or more in which a USR2 (a time limit's warning, a preemption) meets Python's default action, kills
the task, and the trial is lost instead of requeued. conf/hydra/launcher/slurm.yaml's `python` runs this file, by
path (importing the `eaglelab` package first would open a gap of its own), in front of submitit's entry:

    python -u .../eaglelab/slurm_entry.py -u -m submitit.core._submit FOLDER

It records a USR2 in EAGLELAB_EARLY_SIGNAL and hands over to submitit in the same process; once submitit's handler
is in place, `eaglelab.core.preemption.install()` delivers it (and submitit checkpoints and requeues). What remains is
the interpreter's own start, before this file runs (tens of milliseconds).
"""

import os
import runpy
import signal
import sys

EARLY_SIGNAL_ENV = "EAGLELAB_EARLY_SIGNAL"


def _record(signum, frame) -> None:
    os.environ[EARLY_SIGNAL_ENV] = signal.Signals(signum).name
    os.write(2, b"eaglelab: SIGUSR2 before submitit's handler: delivered to it once it is installed\n")


if __name__ == "__main__":
    signal.signal(signal.SIGUSR2, _record)
    args = [a for a in sys.argv[1:3] if a != "-u"] + sys.argv[3:]  # (-u: this interpreter already runs with it)
    if len(args) < 2 or args[0] != "-m":
        sys.exit(f"usage: python -u {__file__} -u -m MODULE ARGS... (submitit's job command)")
    sys.argv = [args[1], *args[2:]]
    sys.path[0] = os.getcwd()  # as `python -m` has it (run as a file, it was this folder: eaglelab's own modules)
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
