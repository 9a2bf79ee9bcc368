"""Several sweep processes on one Optuna study, one of them killed mid-trial.

    python benchmarks/study_concurrency.py [--processes 4] [--trials-per-process 8] [--json PATH] [-- overrides]

Starts P processes of `python src/run.py -m +sweep=optuna_search` on one sqlite study whose budget is
P × T finished trials, kills the first process (SIGKILL, as a lost node) while a trial of it runs, lets the
others finish, and checks the study: exactly P × T COMPLETE trials, each with its own complete run directory
whose objective is the value the study holds; the killed trial FAIL and run again with the same parameters
(`failed_trial` attribute); nothing RUNNING or WAITING left.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICK = [
    "experiment=smoke",
    "train.epochs=1",
    "eval.suites.drift.enabled=false",
    "eval.suites.extrapolation.enabled=false",
    "train.num_threads=1",
    "data.num_prompts=16",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--trials-per-process", type=int, default=8)
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    import optuna

    budget = args.processes * args.trials_per_process
    with tempfile.TemporaryDirectory(prefix="eaglelab-study-") as tmp:
        db = f"sqlite:///{tmp}/study.db"
        env = {**os.environ, "EAGLELAB_CACHE_DIR": f"{tmp}/cache", "EAGLELAB_RESULTS_DIR": tmp}
        # Prepare the data once first, so the kill lands in a trial and not in the shared preparation.
        subprocess.run(
            [sys.executable, str(ROOT / "src" / "run.py"), *QUICK, *args.overrides, f"hydra.run.dir={tmp}/warmup"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            check=True,
        )
        cmd = lambda p: [
            sys.executable,
            str(ROOT / "src" / "run.py"),
            "-m",
            "+sweep=optuna_search",
            *QUICK,
            *args.overrides,
            f"hydra.sweeper.storage={db}",
            "hydra.sweeper.study_name=shared",
            f"hydra.sweeper.n_trials={budget}",
            "hydra.sweeper.heartbeat_interval=2",
            "hydra.sweeper.grace_period=10",
            f"hydra.sweep.dir={tmp}/p{p}",
        ]
        t0 = time.perf_counter()
        procs = [
            subprocess.Popen(cmd(p), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/p{p}.log", "w"))
            for p in range(args.processes)
        ]
        victim_dir = Path(f"{tmp}/p0")

        def victim_in_second_trial() -> bool:
            dirs = list(victim_dir.glob("trial*"))
            done = [d for d in dirs if (d / "metrics.json").exists()]
            return len(done) >= 1 and len(dirs) > len(done)

        while not victim_in_second_trial():
            if procs[0].poll() is not None:
                sys.exit("the first process ended before it could be killed")
            time.sleep(0.2)
        time.sleep(3)  # inside its second trial
        procs[0].send_signal(signal.SIGKILL)
        killed_in = [d.name for d in victim_dir.glob("trial*") if not (d / "metrics.json").exists()]
        rcs = [p.wait() for p in procs[1:]]
        wall = time.perf_counter() - t0
        study = optuna.load_study(study_name="shared", storage=db)
        trials = study.get_trials(deepcopy=False)
        by_state = {
            s: [t for t in trials if t.state.name == s] for s in ("COMPLETE", "FAIL", "RUNNING", "WAITING", "PRUNED")
        }
        runs = {p.parent.name: json.loads(p.read_text()) for p in Path(tmp).glob("p*/trial*/metrics.json")}
        values_match = all(
            abs(runs[f"trial{t.number:04d}"]["val/acceptance_length@k3"] - t.value) < 1e-12
            for t in by_state["COMPLETE"]
        )
        failed = by_state["FAIL"]
        redone = [t for t in by_state["COMPLETE"] if t.system_attrs.get("failed_trial") in {f.number for f in failed}]
        row = {
            "processes": args.processes,
            "budget": budget,
            "wall_s": wall,
            "survivor_exit_codes": rcs,
            "killed_trial_dirs": killed_in,
            **{k.lower(): len(v) for k, v in by_state.items()},
            "run_dirs_complete": len(runs),
            "distinct_complete_numbers": len({t.number for t in by_state["COMPLETE"]}),
            "values_match_run_dirs": values_match,
            "failed_numbers": [t.number for t in failed],
            "redone_as": [t.number for t in redone],
            "redone_same_params": all(
                t.params == next(f.params for f in failed if f.number == t.system_attrs["failed_trial"]) for t in redone
            ),
        }
    for k, v in row.items():
        print(f"{k:<28}{v}")
    ok = (
        row["complete"] == budget
        and row["fail"] == 1
        and row["running"] == row["waiting"] == 0
        and row["run_dirs_complete"] == budget
        and values_match
        and len(redone) == 1
        and row["redone_same_params"]
    )
    print("PASS" if ok else "FAIL")
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
