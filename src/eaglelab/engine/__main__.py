"""The engine process: `python -m eaglelab.engine JOB.json OUT.json` (started by eaglelab.engine.process.run_engine).

It reads the job, rebuilt as its typed kind (eaglelab.engine.jobs), runs the handler that kind names, and writes the
handler's result to OUT.json only when whole.
"""

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from eaglelab.engine.jobs import EngineJob


def main() -> None:
    ap = argparse.ArgumentParser(description="Run one eaglelab vLLM engine job (eaglelab.engine.jobs).")
    ap.add_argument("job")
    ap.add_argument("out")
    args = ap.parse_args()
    job = EngineJob.from_json(json.loads(Path(args.job).read_text()))
    module, _, function = job.handler.partition(":")
    result = getattr(importlib.import_module(module), function)(job)
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, args.out)  # the caller reads a result only when it is whole
    # Nothing is left to clean up: the interpreter's own teardown of vLLM and torch takes ~4 s per engine process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
