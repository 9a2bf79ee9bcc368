"""Wall time of the default `python src/run.py`, split by stage, cold and warm cache.

    python benchmarks/default_run.py [--runs cold,warm] [--keep DIR] [--json PATH] [-- extra overrides]

cold: a fresh cache directory (the GGUF conversion, regeneration and capture all run); warm: the same
cache again (only training and evaluation run). Reads each run's `metrics.json` (`time/*_s`).
`--keep DIR` keeps the run directories (and the cache) there instead of a temporary folder.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["convert", "regenerate", "capture", "train", "export", "evaluate", "evaluate_vllm", "total"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="cold,warm")
    ap.add_argument("--json")
    ap.add_argument("--keep", help="keep runs and cache in this folder")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="eaglelab-bench-") as scratch:
        tmp = args.keep or scratch
        for kind in args.runs.split(","):
            proc = subprocess.run([sys.executable, str(ROOT / "src" / "run.py"), f"paths.cache_dir={tmp}/cache",
                                   f"paths.results_dir={tmp}/results", *args.overrides],
                                  cwd=ROOT, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.exit(f"{kind} run failed: {proc.stderr.strip().splitlines()[-1:]}")
            run_dir = Path(proc.stdout.strip().splitlines()[-1].removeprefix("run_dir: "))
            metrics = json.loads((run_dir / "metrics.json").read_text())
            rows[kind] = {s: metrics.get(f"time/{s}_s", 0.0) for s in STAGES}
            rows[kind]["tau@k3"] = metrics.get("acceptance_length@k3")
            print(f"{kind}: {rows[kind]['total']:.0f} s", file=sys.stderr, flush=True)
    print(f"{'stage':<15}" + "".join(f"{k:>10}" for k in rows))
    for s in STAGES:
        print(f"{s:<15}" + "".join(f"{rows[k][s]:>9.0f}s" for k in rows))
    print(f"{'tau@k3':<15}" + "".join(f"{rows[k]['tau@k3']:>10.3f}" for k in rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
