"""Faults at random instants: runs of the smoke experiment killed at an instant drawn over the whole run's wall
time, each resumed with the same command; every resumed run's drafter weights and metrics must equal the
uninterrupted run's.

    python benchmarks/faults.py [--runs 46] [--seed 0] [--workdir DIR] [--json PATH] [--no-slurm] [--profiles P,..]

The plan (seeded) mixes
- `light`:  the smoke loop on a warm cache (4 epochs of 5 steps, a checkpoint after every step), killed by
            SIGKILL (a dead node: nothing runs after it), SIGTERM (a scheduler) or SIGINT (Ctrl-C);
- `cold`:   the same on an empty cache, so that instants land in regeneration and capture;
- `full`:   with vLLM's evaluation (k = 1, 3) and W&B (offline) logging, so that they land there too;
- `slurm`:  the light run (`slurm-full`: the full one) as a one-trial sweep through the real Slurm launcher
            (hydra/launcher=slurm), USR2 sent by `scancel --signal=USR2` (as Slurm signals a preemption):
            submitit requeues the job by itself;
- `write`:  light runs killed the moment a checkpoint's temporary file appears, i.e. inside a checkpoint write.
Each instant is uniform over the reference run's wall time (`write`: the first write after a uniform instant).
Printed per run: profile, signal, instant, the stage it landed in (the run's log; run.json's `signal` for the
signals the run acts on; a checkpoint write when its temporary file is left behind or the signal waited for
it), attempts, and the verdict; then the stage histogram and the total. Slurm needs root and the packages
scripts/setup.sh installs: a throw-away cluster is started (slurm/dev-cluster) unless SLURM_CONF is set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

from benchmarks.preemption import BASE, _env, compare

ROOT = Path(__file__).resolve().parents[1]

FULL = ["eval.vllm.enabled=true", "eval.vllm.ks=[1,3]", "eval.vllm.concurrencies=[]", "logger=wandb"]
SLURM = [
    "hydra/launcher=slurm",
    "hydra.launcher.gpus_per_node=null",
    "hydra.launcher.cpus_per_task=2",
    "hydra.launcher.mem_gb=4",
    "hydra.launcher.timeout_min=30",
]
# (profile, signal, share of --runs): 46 runs give 18 light, 6 cold, 6 full, 12 through Slurm, 4 in writes
MIX = [
    ("light", "SIGKILL", 8 / 46),
    ("light", "SIGTERM", 6 / 46),
    ("light", "SIGINT", 4 / 46),
    ("cold", "SIGKILL", 4 / 46),
    ("cold", "SIGTERM", 2 / 46),
    ("full", "SIGKILL", 3 / 46),
    ("full", "SIGTERM", 3 / 46),
    ("slurm", "SIGUSR2", 10 / 46),
    ("slurm-full", "SIGUSR2", 2 / 46),
    ("write", "SIGKILL", 2 / 46),
    ("write", "SIGTERM", 2 / 46),
]


def plan(runs: int, seed: int) -> list[tuple[str, str]]:
    counts = [max(1, round(f * runs)) for *_, f in MIX]
    while sum(counts) > runs:
        counts[counts.index(max(counts))] -= 1
    items = [(p, s) for (p, s, _), n in zip(MIX, counts) for _ in range(n)]
    random.Random(seed).shuffle(items)
    return items


def overrides(profile: str) -> list[str]:
    # One thread: bitwise-identical numerics whatever else runs on the machine (two processes with a thread per
    # core each slow each other down many times over).
    return [*BASE, "train.num_threads=1", *(FULL if profile.endswith("full") else [])]


def command(profile: str, run_dir: Path) -> list[str]:
    script = [sys.executable, str(ROOT / "src" / "run.py")]
    if profile.startswith("slurm"):
        return [*script, "-m", *overrides(profile), *SLURM, f"hydra.sweep.dir={run_dir}"]
    return [*script, *overrides(profile), f"hydra.run.dir={run_dir}"]


def trial_dir(profile: str, run_dir: Path) -> Path:
    """Where the run's files are: the sweep's one trial folder for Slurm."""
    if not profile.startswith("slurm"):
        return run_dir
    found = sorted(p.parent for p in run_dir.glob("*/run.json"))
    return found[0] if found else run_dir / "0"


def run_once(profile: str, run_dir: Path, cache: Path, timeout: int = 1200) -> float:
    """Run to the end; -> its wall time (through Slurm: from the job's start, where instants are counted from)."""
    proc = subprocess.Popen(command(profile, run_dir), cwd=ROOT, env=_env(cache), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    t0 = time.time()
    while profile.startswith("slurm") and proc.poll() is None and not slurm_job(run_dir):
        time.sleep(0.05)
    t0 = time.time() if profile.startswith("slurm") else t0
    _, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{profile} run failed ({proc.returncode}): {err.strip().splitlines()[-3:]}")
    return time.time() - t0


def stage_at(run: Path, when: float) -> str:
    """The last `stage:` the run logged before `when` (epoch seconds); `startup` before any."""
    stage = "startup"
    for log in run.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\]\[eaglelab\]\[INFO\] - stage: (\w+)", line)
            if m and datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() <= when:
                stage = m.group(2)
    return stage


def torn_checkpoint(run: Path) -> bool:
    return any((run / "lightning").glob(".last.ckpt.tmp-*"))


def slurm_job(sweep: Path) -> str | None:
    """The running job of this sweep (its submitit folder names it)."""
    jobs = {p.name for p in (sweep / ".submitit").glob("*") if p.is_dir()}
    out = subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i"], capture_output=True, text=True).stdout.split()
    return next((j for j in out if j in jobs or j.split("_")[0] in jobs), None)


def start_requeued_now(job: str, proc: subprocess.Popen, wait_s: float = 120) -> None:
    """Slurm holds a requeued job for ~2 minutes (BeginTime) before it may start again: waiting time, not what is
    measured here. Once the first instance is gone (its step cleaned up, the node idle again) make it eligible at
    once; starting it while the node still completes the old instance fails the job."""
    deadline, seen = time.time() + wait_s, None
    while time.time() < deadline and proc.poll() is None:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True, text=True).stdout
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True).stdout.split()
        if "BeginTime" in state and nodes and all(n == "idle" for n in nodes):
            seen = seen or time.time()
            if time.time() - seen >= 5:  # idle for a while: the old instance's epilog is over
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
                return
        else:
            seen = None
        time.sleep(0.5)


def inject(profile: str, sig: str, instant: float, run_dir: Path, cache: Path, timeout: int = 1200) -> dict:
    """Start a run, send `sig` at `instant` seconds (from its start; Slurm: from the job's start), let the run
    end; -> what landed where."""
    proc = subprocess.Popen(command(profile, run_dir), cwd=ROOT, env=_env(cache), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    start, sent, job = time.time(), None, None
    deadline = start + timeout
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.002 if profile == "write" else 0.01)
        if profile.startswith("slurm") and job is None:
            job = slurm_job(run_dir)
            start = time.time() if job else start
        elif time.time() - start < instant or (profile == "write" and not torn_checkpoint(run_dir)):
            continue
        elif profile.startswith("slurm"):  # as Slurm signals a preemption; a job already ended is not signalled
            if subprocess.run(["scancel", "--signal=USR2", job], capture_output=True).returncode == 0:
                sent = time.time()
            break
        else:
            sent = time.time()
            proc.send_signal(getattr(signal, sig))
            break
    ran_s = time.time() - start  # (without a signal: the run's wall time)
    if profile.startswith("slurm"):  # the sweep goes on: the requeued job resumes and finishes
        if sent:
            start_requeued_now(job, proc)
        _, err = proc.communicate(timeout=timeout)
    else:
        _, err = proc.communicate(timeout=300)
    run = trial_dir(profile, run_dir)
    if sent and profile.startswith("slurm"):  # delivered only if the job was still running: submitit logs it
        logs = "".join(f.read_text(errors="replace") for f in run_dir.glob(".submitit/*/*.err"))
        # ("User defined signal 2": it killed the task before submitit had installed its handler)
        sent = sent if "Caught signal SIGUSR2" in logs or "User defined signal 2" in logs else None
    info = json.loads((run / "run.json").read_text()) if (run / "run.json").exists() else {}
    got = info.get("signal") or next((e["signal"] for e in info.get("earlier", []) if e.get("signal")), {})
    stage = got.get("stage") or (stage_at(run, sent) if sent else "ended first")
    if got.get("waited_for") == "checkpoint" or (sig == "SIGKILL" and torn_checkpoint(run)):
        stage = f"{stage}: checkpoint write"
    elif sent and not profile.startswith("slurm") and info.get("status") == "complete" and not got:
        # landed after the results were written, while the finished run was exiting
        stage = "exit (run complete)"
    return {
        "profile": profile,
        "signal": sig,
        "instant_s": round(instant if profile != "write" else (sent or start) - start, 2),
        "sent": sent is not None,
        "ran_s": round(ran_s, 2),
        "stage": stage,
        "waited_s": got.get("waited_s"),
        "exit": proc.returncode,
        "stderr_tail": err.strip().splitlines()[-1:] if err else [],
    }


def start_slurm(work: Path) -> dict:
    root = Path(tempfile.mkdtemp(prefix="eaglelab-slurm-"))
    root.chmod(0o755)  # munged wants every folder above its socket world-searchable
    env = {**os.environ, "SLURM_TEST_ROOT": str(root), "SMOKE": "0"}
    subprocess.run(["bash", str(ROOT / "slurm/dev-cluster/start.sh")], env=env, check=True, capture_output=True)
    os.environ["SLURM_CONF"] = str(root / "slurm.conf")
    return env


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=46)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="keep everything here (default: a temporary folder)")
    ap.add_argument("--json")
    ap.add_argument("--no-slurm", action="store_true")
    ap.add_argument("--profiles", help="only these profiles, e.g. slurm,write (default: all)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: still stop the throw-away cluster
    items = plan(args.runs, args.seed)
    if args.no_slurm:
        items = [i for i in items if not i[0].startswith("slurm")]
    if args.profiles:
        items = [i for i in items if i[0] in args.profiles.split(",")]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="eaglelab-faults-"))
    warm = work / "cache"
    slurm = any(p.startswith("slurm") for p, _ in items)
    cluster = start_slurm(work) if slurm and "SLURM_CONF" not in os.environ else None
    rng = random.Random(args.seed + 1)
    saved = work / "references.json"  # reference wall times, for a rerun in the same --workdir
    references, walls, rows = {}, json.loads(saved.read_text()) if saved.exists() else {}, []
    try:
        for profile in sorted({p for p, _ in items}):
            ref = work / f"reference-{profile}"
            if not trial_dir(profile, ref).joinpath("metrics.json").exists():
                shutil.rmtree(ref, ignore_errors=True)
                cache = work / "cache-ref-cold" if profile == "cold" else warm
                walls[profile] = run_once(profile, ref, cache)
                saved.write_text(json.dumps(walls))
            references[profile] = trial_dir(profile, ref)
            print(f"reference {profile}: {walls.get(profile, float('nan')):.1f} s", flush=True)
        for n, (profile, sig) in enumerate(items):
            run_dir = work / f"{n:03d}-{profile}-{sig}"
            shutil.rmtree(run_dir, ignore_errors=True)
            cache = work / f"cache-{n:03d}" if profile == "cold" else warm
            # `write`: the first checkpoint write after the instant, so the instant falls before training ends
            span = walls.get(profile, 30.0) * (0.6 if profile == "write" else 1.0)
            for tries_left in (2, 1, 0):  # a run faster than its reference may end before the instant: draw again
                row = inject(profile, sig, rng.uniform(0, span), run_dir, cache)
                if row["sent"] or not tries_left:
                    break
                span = min(span, row["ran_s"])
                shutil.rmtree(run_dir, ignore_errors=True)
                shutil.rmtree(cache, ignore_errors=True) if profile == "cold" else None
            if not profile.startswith("slurm"):
                run_once(profile, run_dir, cache)  # the same command again: resumes
            run = trial_dir(profile, run_dir)
            if not row["sent"]:
                row["stage"] = "ended before the instant"
            if not (run / "metrics.json").exists():  # the trial was lost: counted, and the benchmark goes on
                row.update(attempts=None, weights_identical=False, metrics_identical=False, differing=["lost"])
                rows.append(row)
                print(f"{n:3d} {profile:<6}{sig:<8}{row['instant_s']:>8.2f} s  {row['stage']:<32}LOST "
                      f"(exit {row['exit']}: {row['stderr_tail']})", flush=True)  # fmt: skip
                continue
            row["attempts"] = json.loads((run / "run.json").read_text())["attempt"]
            weights, metrics, differ = compare(run, references[profile])
            row.update(weights_identical=weights, metrics_identical=metrics, differing=differ[:5])
            rows.append(row)
            verdict = "same" if weights and metrics else f"DIFF {differ[:3]}"
            print(
                f"{n:3d} {profile:<6}{sig:<8}{row['instant_s']:>8.2f} s  {row['stage']:<32}"
                f"attempts {row['attempts']}  {verdict}",
                flush=True,
            )
            if profile == "cold":
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        if cluster:
            subprocess.run(["bash", str(ROOT / "slurm/dev-cluster/stop.sh"), "--purge"], env=cluster,
                           capture_output=True)  # fmt: skip
            shutil.rmtree(cluster["SLURM_TEST_ROOT"], ignore_errors=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"references_s": walls, "runs": rows}, indent=2))
    print("\nwhere the instants landed:")
    for stage, count in sorted(Counter(r["stage"] for r in rows).items(), key=lambda kv: -kv[1]):
        print(f"  {stage:<34}{count}")
    by_slurm = sum(r["profile"].startswith("slurm") for r in rows)
    ok = sum(r["weights_identical"] and r["metrics_identical"] for r in rows)
    print(f"resumed to identical results: {ok}/{len(rows)} ({by_slurm} through Slurm)")
    sys.exit(0 if ok == len(rows) else 1)


if __name__ == "__main__":
    main()
