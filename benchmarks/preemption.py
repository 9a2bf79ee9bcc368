"""Preemption: a training job killed at several points resumes to exactly the uninterrupted result.

    python benchmarks/preemption.py [--points data,mid_epoch1,epoch_end,mid_epoch3,evaluate] [--json PATH]
                                    [--chain] [-- extra overrides]

One uninterrupted reference run, then for each kill point a run in its own directory that is killed there
(SIGKILL: nothing gets to clean up, as when a node dies; `evaluate` uses SIGTERM, as Slurm does first) and
started again with the same command, which resumes from the run directory. Prints, per point, the step the
kill hit, whether the drafter weights are bitwise identical to the reference and whether every metric in
metrics.json is (timings excepted). tests/test_sweeps.py runs `chain`: one run killed at four points in turn,
each resume killed again, then run to its end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
# The smoke loop on the tiny target, 4 epochs of 5 steps with a checkpoint after every step.
BASE = ["experiment=smoke", "train.epochs=4", "train.checkpoint_every_n_steps=1", "eval.suites.drift.enabled=false"]
STEPS_PER_EPOCH = 5
POINTS = {  # name: (what must exist before the kill, the step the checkpoint must have reached, signal)
    "data": ("run.json", None, signal.SIGKILL),  # during data preparation / target load
    "mid_epoch1": ("lightning/last.ckpt", 2, signal.SIGKILL),
    "epoch_end": ("lightning/last.ckpt", STEPS_PER_EPOCH, signal.SIGKILL),  # around the first validation
    "mid_epoch3": ("lightning/last.ckpt", 2 * STEPS_PER_EPOCH + 3, signal.SIGKILL),
    "evaluate": ("drafter/config.json", None, signal.SIGTERM),  # trained and exported, evaluating
    "data_sigint": ("run.json", None, signal.SIGINT),  # Ctrl-C while the target loads / the data is prepared
    "train_sigterm": ("lightning/last.ckpt", STEPS_PER_EPOCH + 2, signal.SIGTERM),  # scheduler's TERM mid-epoch
}


# The points one run meets in this order: what `chain` kills it at by default (and tests/test_sweeps.py).
CHAIN = ["data_sigint", "train_sigterm", "mid_epoch3", "evaluate"]


def _cmd(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "src" / "run.py"), *BASE, *overrides, f"hydra.run.dir={run_dir}"]


def _env(cache_dir: Path) -> dict:
    return {**os.environ, "EAGLELAB_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1"}


def checkpoint_step(path: Path) -> int:
    try:
        return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])
    except Exception:  # being replaced right now: look again
        return -1


def run_to_end(run_dir: Path, cache_dir: Path, overrides: list[str], timeout: int = 900) -> None:
    proc = subprocess.run(
        _cmd(run_dir, overrides), cwd=ROOT, env=_env(cache_dir), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-3:]}")


def kill_at(point: str, run_dir: Path, cache_dir: Path, overrides: list[str], timeout: int = 900) -> int | None:
    """Start a run and kill it at `point`; returns the checkpoint step the kill hit (None before training)."""
    marker, step, sig = POINTS[point]
    proc = subprocess.Popen(
        _cmd(run_dir, overrides), cwd=ROOT, env=_env(cache_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{point}: the run ended (rc {proc.returncode}) before the kill point")
            if (run_dir / marker).exists() and (step is None or checkpoint_step(run_dir / marker) >= step):
                ckpt = run_dir / "lightning" / "last.ckpt"
                hit = checkpoint_step(ckpt) if ckpt.exists() else None
                proc.send_signal(sig)
                proc.wait(timeout=120)
                return hit
            time.sleep(0.05)
        raise RuntimeError(f"{point}: kill point not reached in {timeout} s")
    finally:
        if proc.poll() is None:
            proc.kill()


def compare(run_dir: Path, reference: Path) -> tuple[bool, bool, list[str]]:
    """(weights bitwise equal, metrics equal, differing metric names) — timings and memory figures (measured
    peak RSS; the estimate starts from the RSS at check time) are measurements, not results, and so is the work
    an attempt did (data/shards_prepared: shards made by this attempt; an earlier attempt made the others)."""
    a, b = load_file(run_dir / "drafter" / "model.safetensors"), load_file(reference / "drafter" / "model.safetensors")
    weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (run_dir, reference))
    measured = ("time/", "memory/", "data/shards_prepared")
    differ = sorted(k for k in set(ma) | set(mb) if not k.startswith(measured) and ma.get(k) != mb.get(k))
    return weights, not differ, differ


def _reference(workdir: Path, cache_dir: Path, overrides: list[str]) -> Path:
    """The uninterrupted run every killed one is compared with (kept in `workdir`, made once)."""
    reference = workdir / "reference"
    if not (reference / "metrics.json").exists():
        run_to_end(reference, cache_dir, overrides)
    return reference


def _record(run_dir: Path) -> dict:
    """run.json of the run's latest attempt ({} before it has one)."""
    info = run_dir / "run.json"
    return json.loads(info.read_text()) if info.exists() else {}


def measure(points: list[str], workdir: Path, cache_dir: Path, overrides: list[str]) -> list[dict]:
    reference = _reference(workdir, cache_dir, overrides)
    rows = []
    for point in points:
        run_dir = workdir / point
        hit = kill_at(point, run_dir, cache_dir, overrides)
        state = _record(run_dir).get("status")
        run_to_end(run_dir, cache_dir, overrides)  # the same command again: resumes
        attempts = _record(run_dir)["attempt"]
        weights, metrics, differ = compare(run_dir, reference)
        rows.append(
            {
                "point": point,
                "killed_at_step": hit,
                "status_after_kill": state,
                "attempts": attempts,
                "weights_identical": weights,
                "metrics_identical": metrics,
                "differing": differ[:5],
            }
        )
    return rows


def chain(points: list[str], workdir: Path, cache_dir: Path, overrides: list[str]) -> dict:
    """One run killed at each point in turn (in the order a run reaches them), resumed by the same command each
    time, then run to the end: each resume starts from what the previous one left. -> the kills (point, the step
    each hit, the status each left) and the final attempt count and comparison with the uninterrupted run."""
    reference = _reference(workdir, cache_dir, overrides)
    run_dir, kills = workdir / "chain", []
    for point in points:
        hit = kill_at(point, run_dir, cache_dir, overrides)
        kills.append({"point": point, "killed_at_step": hit, "status": _record(run_dir).get("status")})
    run_to_end(run_dir, cache_dir, overrides)
    weights, metrics, differ = compare(run_dir, reference)
    return {
        "kills": kills,
        "attempts": _record(run_dir)["attempt"],
        "weights_identical": weights,
        "metrics_identical": metrics,
        "differing": differ[:5],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", help=f"default: all of {','.join(POINTS)}; with --chain, {','.join(CHAIN)}")
    ap.add_argument("--workdir", help="keep runs here (default: a temporary folder)")
    ap.add_argument("--json")
    ap.add_argument("--chain", action="store_true", help="one run killed at every point in turn (what the test runs)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory(prefix="eaglelab-preempt-") as tmp:
        work = Path(args.workdir or tmp)
        if args.chain:
            result = chain((args.points or ",".join(CHAIN)).split(","), work, work / "cache", args.overrides)
        else:
            rows = measure((args.points or ",".join(POINTS)).split(","), work, work / "cache", args.overrides)
    if args.chain:
        for k in result["kills"]:
            print(f"{k['point']:<14} killed at step {str(k['killed_at_step']):>5}, left {k['status']}")
        same = result["weights_identical"] and result["metrics_identical"]
        print(
            f"after {result['attempts']} attempts: {'identical to' if same else 'DIFFERENT from'} the uninterrupted run"
        )
        sys.exit(0 if same else 1)
    print(f"{'point':<12}{'killed at step':>15}{'status':>13}{'attempts':>9}{'weights':>9}{'metrics':>9}")
    for r in rows:
        print(
            f"{r['point']:<12}{str(r['killed_at_step']):>15}{str(r['status_after_kill']):>13}{r['attempts']:>9}"
            f"{'same' if r['weights_identical'] else 'DIFF':>9}{'same' if r['metrics_identical'] else 'DIFF':>9}"
        )
    ok = sum(r["weights_identical"] and r["metrics_identical"] for r in rows)
    print(f"identical to the uninterrupted run: {ok}/{len(rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    sys.exit(0 if ok == len(rows) else 1)


if __name__ == "__main__":
    main()
