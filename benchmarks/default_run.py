"""Wall time of the default `python src/run.py`, split by stage, cold and warm cache.

    python benchmarks/default_run.py [--runs cold,cold,warm] [--keep DIR] [--json PATH] [-- extra overrides]

cold: a fresh cache directory each time (the GGUF conversion, regeneration and capture all run); warm:
the last cold run's cache again (only training and evaluation run). Reads each run's `metrics.json`
(`time/*_s`) and prints every run and the median per kind.
`--keep DIR` keeps the run directories (and the cache) there instead of a temporary folder.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = [
    "convert",
    "regenerate",
    "capture",
    "prepare_suites",
    "train",
    "export",
    "evaluate",
    "evaluate_vllm",
    "suites",
    "total",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="cold,cold,warm")
    ap.add_argument("--json")
    ap.add_argument("--keep", help="keep runs and cache in this folder")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    runs = []  # (column name, stage seconds)
    with tempfile.TemporaryDirectory(prefix="eaglelab-bench-") as scratch:
        tmp = args.keep or scratch
        cache = None
        for i, kind in enumerate(args.runs.split(",")):
            if kind == "cold" or cache is None:
                cache = f"{tmp}/cache-{i}"  # fresh: nothing converted, regenerated or captured yet
            proc = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "src" / "run.py"),
                    f"paths.cache_dir={cache}",
                    f"paths.results_dir={tmp}/results",
                    *args.overrides,
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                sys.exit(f"{kind} run failed: {proc.stderr.strip().splitlines()[-1:]}")
            run_dir = Path(proc.stdout.strip().splitlines()[-1].removeprefix("run_dir: "))
            metrics = json.loads((run_dir / "metrics.json").read_text())
            row = {s: metrics.get(f"time/{s}_s", 0.0) for s in STAGES}
            row["tau@k3"] = metrics.get("acceptance_length@k3")
            runs.append((f"{kind}#{sum(k.startswith(kind) for k, _ in runs) + 1}", row))
            print(f"{kind}: {row['total']:.0f} s", file=sys.stderr, flush=True)
    kinds = list(dict.fromkeys(name.split("#")[0] for name, _ in runs))
    medians = [
        (
            f"{k} median",
            {s: statistics.median(r[s] for n, r in runs if n.startswith(k + "#")) for s in [*STAGES, "tau@k3"]},
        )
        for k in kinds
    ]
    columns = runs + medians
    print(f"{'stage':<15}" + "".join(f"{name:>13}" for name, _ in columns))
    for s in STAGES:
        print(f"{s:<15}" + "".join(f"{row[s]:>12.0f}s" for _, row in columns))
    print(f"{'tau@k3':<15}" + "".join(f"{row['tau@k3']:>13.3f}" for _, row in columns))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(columns), indent=2))


if __name__ == "__main__":
    main()
