"""A run directory is a trial's identity: what ran there, which attempt this is, and how it ended.

Started again with the same configuration (a requeued job, a relaunched sweep), a finished run is returned as
it is and an interrupted one resumes; a directory holding another configuration is refused. `run.json` records
each attempt (`RunRecord`); `metrics.json`, written last, alone marks a run complete. Layout:
docs/results_layout.md.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import platform
import shutil
import subprocess
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import eaglelab
from eaglelab.core import preemption
from eaglelab.core.config import RunConfig
from eaglelab.core.errors import EaglelabError
from eaglelab.core.io import atomic_write_json, write_csv

log = logging.getLogger("eaglelab")

# Settings that may change between attempts of one run: where results go, how they are logged, what a sweeper
# reads from them (a sweep relaunched elsewhere, W&B turned on), the variant's label (derived from the drafter
# flags, which are compared themselves; older runs stored it as typed), how long the vLLM engine may take (the
# timeout error's fix is to raise eval.vllm.timeout_s and run the same command again), and where the evaluation runs
# (eval.job: its own Slurm job is the run's next attempt, eaglelab.handoff).
NOT_IDENTITY = (
    "paths.", "logger.", "run_dir", "objective", "variant", "eval.vllm.timeout_s", "eval.job.", "plan.", "recipe.",
)  # fmt: skip


# Slurm job states of a job that will still run, or runs (squeue lists finished jobs for a while too)
QUEUED = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
          "RESIZING", "SIGNALING", "STAGE_OUT"}  # fmt: skip


@dataclass
class RunRecord:
    """run.json: one attempt of a run (None fields are left out of the file)."""

    status: str
    variant: str
    seed: int
    started: float
    attempt: int = 1
    eaglelab_version: str = eaglelab.__version__
    torch: str = torch.__version__
    host: str = platform.node()
    first_started: float | None = None  # a resumed run: when its first attempt started
    # A resumed run: how each earlier attempt ended (status, the signal and the stage it arrived in, error);
    # "running" means it was killed without a chance to say (SIGKILL, a dead node).
    earlier: list | None = None
    target: str | None = None  # the target's fingerprint
    target_path: str | None = None
    checkpoint: str | None = None  # evaluation only: the drafter evaluated
    evaluator: str | None = None  # simulated | simulated+vllm
    vllm_skipped: str | None = None  # why vLLM did not evaluate this drafter
    evaluation_job: dict | None = None  # the Slurm job evaluating it (job_id, log); later attempts keep it
    wandb_error: str | None = None
    signal: dict | None = None  # the signal that stopped this attempt: name, stage, the write it waited for
    error: str | None = None
    traceback: str | None = None
    finished: float | None = None

    @classmethod
    def start(cls, cfg: RunConfig, previous: dict) -> RunRecord:
        record = cls(
            status="running",
            variant=cfg.variant,
            seed=cfg.train.seed,
            started=time.time(),
            attempt=previous.get("attempt", 0) + 1,
        )
        if previous:
            record.first_started = previous.get("first_started", previous.get("started"))
            keys = ("attempt", "status", "signal", "error", "evaluation_job")
            ended = {k: previous[k] for k in keys if previous.get(k) is not None}
            record.earlier = previous.get("earlier", []) + [ended]
            record.evaluation_job = previous.get("evaluation_job")
        return record

    def write(self, run_dir: Path) -> None:
        atomic_write_json(run_dir / "run.json", {k: v for k, v in asdict(self).items() if v is not None})


def begin_attempt(cfg: RunConfig, run_dir: Path) -> RunRecord | None:
    """The record of a new attempt in `run_dir` (written), or None when the run there is complete."""
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = previous_attempt(cfg, run_dir)
    if previous.get("status") == "complete":
        log.info("%s is complete: not run again", run_dir)
        return None
    job = previous.get("evaluation_job")  # (a relaunched sweep while the job evaluating the run is queued or runs)
    if job and job["job_id"] != os.environ.get("SLURM_JOB_ID") and still_queued(job):
        log.info("%s is trained and its evaluation job %s is queued or running: not run again", run_dir, job["job_id"])
        return None
    record = RunRecord.start(cfg, previous)
    if previous:
        log.info("%s: resuming (attempt %d, after %s)", run_dir, record.attempt, previous.get("status"))
    record.write(run_dir)
    return record


def end_attempt(
    run_dir: Path, record: RunRecord, metrics: dict | None = None, error: BaseException | None = None
) -> None:
    """Complete (metrics.json written last: it marks completion), trained (its evaluation handed to a job of its own:
    no metrics.json yet), interrupted or failed."""
    record.finished = time.time()
    if error is None and metrics is None:
        record.status = "trained"
        record.write(run_dir)
        return
    if error is None:
        record.status = "complete"
        record.write(run_dir)
        atomic_write_json(run_dir / "metrics.json", metrics)
        return
    interrupted = isinstance(error, (KeyboardInterrupt, SystemExit))  # SystemExit: submitit's requeue
    record.status = "interrupted" if interrupted else "failed"
    record.signal = preemption.received()
    record.error = f"{type(error).__name__}: {error}"
    if not isinstance(error, (EaglelabError, KeyboardInterrupt, SystemExit)):
        record.traceback = traceback.format_exc()
    record.write(run_dir)


def previous_attempt(cfg: RunConfig, run_dir: Path) -> dict:
    """What an earlier start left in `run_dir` ({} if nothing): its run.json, status "complete" once
    metrics.json exists. A directory holding another configuration is refused."""
    from omegaconf import OmegaConf  # (Hydra's configs: not needed by training as a library)

    if not (run_dir / "run.json").exists():
        return {}
    if (run_dir / "config.yaml").exists():
        stored = _flat(OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")))
        now = _flat(OmegaConf.to_container(OmegaConf.create(asdict(cfg))))
        # A setting newer than the stored run counts as its default (the schema's).
        default = _flat(OmegaConf.to_container(OmegaConf.structured(RunConfig)))
        changed = sorted(k for k in now if not k.startswith(NOT_IDENTITY) and stored.get(k, default.get(k)) != now[k])
        if changed:
            raise EaglelabError(
                f"{run_dir} holds a run with another configuration (differs in {', '.join(changed)}); "
                "choose another run directory"
            )
    previous = json.loads((run_dir / "run.json").read_text())
    # metrics.json alone marks completion: a kill between the final run.json and metrics.json writes is unfinished
    previous["status"] = (
        "complete"
        if (run_dir / "metrics.json").exists()
        else ("interrupted" if previous.get("status") == "complete" else previous.get("status"))
    )
    return previous


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def adopt_trained_settings(cfg: RunConfig) -> None:
    """Evaluation of a run's drafter: take its variant, seed and ttt_steps from the run's config.yaml,
    so the suites measure extrapolation from the depth it was trained at and the results are labelled
    by what was trained (an exported folder elsewhere keeps the command line's values)."""
    from omegaconf import OmegaConf  # (Hydra's configs: not needed by training as a library)

    path = Path(cfg.checkpoint)
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / "config.yaml").is_file() and (candidate / "run.json").is_file():
            trained = OmegaConf.load(candidate / "config.yaml")
            cfg.variant = str(trained.get("variant", cfg.variant))
            cfg.train.ttt_steps = int(trained.train.ttt_steps)
            cfg.train.seed = int(trained.train.seed)
            cfg.data.system_prompt = trained.data.get("system_prompt")  # "native" = the template it was trained on
            log.info(
                "evaluating %s: variant %s, ttt_steps %d, seed %d (from its config.yaml)",
                candidate,
                cfg.variant,
                cfg.train.ttt_steps,
                cfg.train.seed,
            )
            return


def keep_previous_log(run_dir: Path) -> None:
    """Lightning's CSV logger starts metrics.csv afresh: set the interrupted attempt's rows aside first
    (`merge_logs` joins them back once training ends)."""
    current = run_dir / "logs" / "metrics.csv"
    if current.exists():
        n = len(list(current.parent.glob("metrics.attempt*.csv"))) + 1
        current.rename(current.with_name(f"metrics.attempt{n}.csv"))


def merge_logs(logs: Path) -> None:
    """metrics.csv = each interrupted attempt's rows before the step the next attempt resumed from, then the
    last attempt's: every step once, none lost (the attempts' own files stay as they were)."""

    def rows(path):
        with open(path, newline="") as f:
            return [r for r in csv.DictReader(f) if r.get("step")]

    attempts = sorted(logs.glob("metrics.attempt*.csv"), key=lambda p: int(p.stem.removeprefix("metrics.attempt")))
    tables = [rows(p) for p in attempts] + [rows(logs / "metrics.csv") if (logs / "metrics.csv").exists() else []]
    merged = []
    for i, table in enumerate(tables):
        later = [int(r["step"]) for t in tables[i + 1 :] for r in t]
        resumed_at = min(later, default=None)
        merged += [r for r in table if resumed_at is None or int(r["step"]) < resumed_at]
    write_csv(logs / "metrics.csv", merged)


def still_queued(job: dict | None) -> bool:
    """Whether the evaluation job run.json names is pending or running (a relaunched sweep does not submit a second)."""
    if not job or shutil.which("squeue") is None:
        return False
    proc = subprocess.run(["squeue", "-h", "-j", job["job_id"], "-o", "%T"], capture_output=True, text=True)
    return proc.returncode == 0 and bool(set(proc.stdout.split()) & QUEUED)
