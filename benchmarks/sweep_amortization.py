"""Cost of an N-trial grid against one data preparation + N trainings.

    python benchmarks/sweep_amortization.py [--seeds 0,1,2,3] [--json PATH] [-- overrides]

Runs `python src/run.py -m train.seed=…` (N trials, Hydra's basic launcher, a fresh cache) and times it. The
baseline is what the grid cannot avoid: the data preparation once (the first trial's convert + regenerate +
capture + suite-data stages, cold) plus every trial's own work (train + export + evaluate + vLLM + suites).
The ratio's excess is what sharing costs: the later trials' cache reads and target loads, Hydra, start-up.
Default overrides: the smoke loop on the tiny target (pass e.g. `target=smollm2 data.num_prompts=48 …`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREP = ["convert", "regenerate", "capture", "prepare_suites"]
WORK = ["train", "export", "evaluate", "evaluate_vllm", "suites"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    overrides = args.overrides or ["experiment=smoke"]
    with tempfile.TemporaryDirectory(prefix="eaglelab-amortize-") as tmp:
        env = {**os.environ, "EAGLELAB_CACHE_DIR": f"{tmp}/cache", "EAGLELAB_RESULTS_DIR": f"{tmp}/results"}
        t0 = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "src" / "run.py"),
                "-m",
                *overrides,
                f"train.seed={args.seeds}",
                f"hydra.sweep.dir={tmp}/grid",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        grid_s = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"grid failed: {proc.stderr.strip().splitlines()[-3:]}")
        trials = sorted(Path(f"{tmp}/grid").glob("*/metrics.json"), key=lambda p: int(p.parent.name.split("_")[0]))
        metrics = [json.loads(p.read_text()) for p in trials]
    stage = lambda m, s: m.get(f"time/{s}_s", 0.0)
    prep_once = sum(stage(metrics[0], s) for s in PREP)
    prep_later = [sum(stage(m, s) for s in PREP) for m in metrics[1:]]
    work = [sum(stage(m, s) for s in WORK) for m in metrics]
    baseline = prep_once + sum(work)
    row = {
        "trials": len(metrics),
        "grid_s": grid_s,
        "prep_once_s": prep_once,
        "work_s": sum(work),
        "baseline_s": baseline,
        "ratio": grid_s / baseline,
        "later_trials_prep_s_median": sorted(prep_later)[len(prep_later) // 2] if prep_later else 0.0,
    }
    print(
        f"{'trials':>6}{'grid':>9}{'prep once':>11}{'N × work':>10}{'baseline':>10}{'ratio':>7}"
        f"{'later prep (median)':>21}"
    )
    print(
        f"{row['trials']:>6}{grid_s:>8.0f}s{prep_once:>10.0f}s{sum(work):>9.0f}s{baseline:>9.0f}s"
        f"{row['ratio']:>7.3f}{row['later_trials_prep_s_median']:>20.1f}s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
