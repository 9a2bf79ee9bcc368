"""A trial's evaluation in a Slurm job of its own (`eval.job.enabled=true`).

A trial that trains for hours on N GPUs and then starts its vLLM engines one after another (a 70B or MoE target's
at tensor-parallel 8) holds its training allocation through the evaluation, under one time limit for both. With
`eval.job.enabled=true` the trial trains and exports, then submits itself again (the same run directory and
configuration) as a Slurm job with the evaluation's own partition, time limit and memory (`eval.job`). Rank 0
records that job in run.json (status `trained`, `evaluation_job`) and the training job ends.

The evaluation job is the run's next attempt, as a requeued job is: it finds the training finished
(lightning/last.ckpt) and the data prepared, evaluates, and writes metrics.json into the trial's own directory,
where the sweep summary, W&B and analysis/ read it. What the training attempt measured (the data it prepared, its
training time and memory) is kept in `trained.json` and merged into metrics.json. Submitted through submitit, as
the Slurm launcher's trials are: a preempted or timed-out evaluation job is requeued and resumes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from eaglelab.core import preemption
from eaglelab.core.config import RunConfig, on_cuda
from eaglelab.core.errors import ConfigError, EaglelabError, first_line
from eaglelab.core.io import atomic_write_json
from eaglelab.core.ranks import is_primary
from eaglelab.core.resolvers import gpus_per_node, slurm_python
from eaglelab.results.summary import run_summary

log = logging.getLogger("eaglelab")

TRAINED = "trained.json"  # what the training attempt measured, for the evaluation's metrics.json
# What an evaluation attempt measures again (trivially: nothing prepared, training found finished); the training
# attempt's values stand.
TRAINING_KEYS = ("data/", "train/", "val/", "memory/target_loaded", "memory/rank", "time/convert_s", "time/prompts_s",
                 "time/prepare_s", "time/regenerate_s", "time/capture_s", "time/train_s", "time/export_s",
                 "time/training_job_s", "memory/training_job_")  # fmt: skip
FOLDER = "evaluation_job"  # <run_dir>/evaluation_job/<job id>_0_log.out: its log


def slurm_partitions(setting: str, without_slurm: str) -> list[str]:
    """The cluster's partitions; one line naming the fix where Slurm's commands are missing or do not answer."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        raise ConfigError(
            f"{setting} needs Slurm's client commands (sinfo, sbatch) on PATH; on a machine without Slurm "
            f"{without_slurm} (slurm/README.md starts a throw-away cluster for testing)"
        )
    proc = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "?"
        raise ConfigError(f"Slurm does not answer (sinfo: {why}); check SLURM_CONF or the controller")
    return [p.rstrip("*") for p in proc.stdout.split()]


def check(cfg: RunConfig) -> None:
    """Before any work: a trial that will hand its evaluation over can submit it."""
    if not cfg.eval.job.enabled or cfg.stage != "all":
        return
    if cfg.checkpoint:
        raise ConfigError(
            "eval.job.enabled=true hands a trained trial's evaluation to a job, and checkpoint=... is an evaluation "
            "already; submit it with `python src/run.py -m hydra/launcher=slurm checkpoint=...`"
        )
    partitions = slurm_partitions("eval.job.enabled=true", "evaluate in the trial (eval.job.enabled=false)")
    if cfg.eval.job.partition and cfg.eval.job.partition not in partitions:
        raise ConfigError(
            f"Slurm partition {cfg.eval.job.partition!r} does not exist; set eval.job.partition to one of: "
            f"{', '.join(partitions) or '(none)'}"
        )
    # The job as it will be submitted, asked of Slurm now (an account, QoS or time limit it refuses), not after training
    p = slurm_parameters(cfg, Path("check"))
    asked = {"partition": p.get("partition"), "account": p.get("account"), "qos": p.get("qos"), "time": p["time"],
             "nodes": p["nodes"], "ntasks-per-node": p["ntasks_per_node"], "cpus-per-task": p["cpus_per_task"],
             "mem": p["mem"], "gpus-per-node": p.get("gpus_per_node")}  # fmt: skip
    flags = [f"--{k}={v}" for k, v in asked.items() if v is not None]
    proc = subprocess.run(["sbatch", "--test-only", *flags, "--wrap", "true"], capture_output=True, text=True)
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        raise ConfigError(f"Slurm would refuse the evaluation job (sbatch --test-only: {why}); fix eval.job.*")


def hand_off(cfg: RunConfig, run_dir: Path, metrics: dict, evaluate: Callable[[RunConfig], Path]) -> dict:
    """Rank 0, once the drafter is exported: keep what training measured and submit the evaluation job.
    -> run.json's `evaluation_job` (the Slurm job id and its log)."""
    import submitit

    run_dir = run_dir.resolve()
    trained = {k: v for k, v in metrics.items() if k.startswith(TRAINING_KEYS)}
    peaks = ("memory/peak_rss_gb", "memory/peak_gpu_gb")  # (the evaluation job's own keep these names)
    trained.update({k.replace("memory/", "memory/training_job_"): v for k, v in metrics.items() if k in peaks})
    atomic_write_json(run_dir / TRAINED, trained)
    job_cfg = evaluation_config(cfg, run_dir)
    # the Slurm launcher's job command (eaglelab/slurm_entry.py: a USR2 kept from the job's first instant)
    executor = submitit.SlurmExecutor(folder=run_dir / FOLDER / "%j", max_num_timeout=20, python=slurm_python())
    executor.update_parameters(**slurm_parameters(cfg, run_dir))
    evaluation = EvaluationJob(job_cfg, evaluate, scratch_from_env=cfg.paths.scratch_dir == _default_scratch())
    try:
        # Without this job's Slurm and rendezvous variables (the evaluation job's ranks meet on its own nodes), with
        # the cluster's configuration file where one is named
        conf = os.environ.get("SLURM_CONF")
        with submitit.helpers.clean_env():
            os.environ.update({"SLURM_CONF": conf} if conf else {})
            job = executor.submit(evaluation)
    except Exception as e:
        raise EaglelabError(
            f"Slurm refused the evaluation job ({first_line(e)}); fix eval.job.* and run the same command again: "
            "the trained drafter is kept and not trained again"
        ) from None
    log.info("evaluation handed to Slurm job %s (log: %s); metrics.json appears when it ends", job.job_id,
             job.paths.stdout)  # fmt: skip
    return {"job_id": str(job.job_id), "log": str(job.paths.stdout)}


def evaluation_config(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """The trial's own configuration, evaluated in place (not handed over again), its folders absolute (the job
    may start elsewhere)."""
    absolute = lambda p: str(Path(p).expanduser().resolve())  # noqa: E731
    paths = replace(cfg.paths, cache_dir=absolute(cfg.paths.cache_dir), results_dir=absolute(cfg.paths.results_dir))
    evaluation = replace(cfg.eval, job=replace(cfg.eval.job, enabled=False))
    return replace(cfg, eval=evaluation, paths=paths, run_dir=str(run_dir))


def slurm_parameters(cfg: RunConfig, run_dir: Path) -> dict:
    """sbatch's settings: eval.job's resources on the trial's tasks (every rank evaluates a share)."""
    job, t = cfg.eval.job, cfg.train
    gpus = job.gpus_per_node
    if gpus is None and on_cuda(t.accelerator):  # (as the launcher sizes a trial's: the ranks' or the engine's)
        gpus = gpus_per_node(t.devices, cfg.eval.vllm.tensor_parallel_size, 1)
    chosen = {"partition": job.partition, "account": job.account, "qos": job.qos, "gpus_per_node": gpus or None}
    return {
        "job_name": f"eval_{run_dir.name}",
        "time": job.timeout_min,
        "nodes": t.num_nodes,
        "ntasks_per_node": t.devices,
        "cpus_per_task": job.cpus_per_task,
        "mem": f"{job.mem_gb}GB",
        "setup": list(job.setup),
        "signal_delay_s": 120,  # USR2 this long before the time limit: submitit requeues, the next attempt resumes
        "srun_args": ["--kill-on-bad-exit=1"],
        **{k: v for k, v in chosen.items() if v is not None},
    }


def _default_scratch() -> str:
    return os.environ.get("TMPDIR", "/tmp")


class EvaluationJob:
    """What the evaluation job runs, in each of its tasks: the trial's run, resumed. submitit calls `checkpoint` on
    a time limit's or a preemption's USR2 and requeues the job with what it returns."""

    def __init__(self, cfg: RunConfig, evaluate: Callable[[RunConfig], Path], scratch_from_env: bool):
        # `evaluate`: the loop's own `run` (eaglelab.pipeline), handed in by the loop that submits this job, so that
        # this module need not import the loop that imports it (pickled by name: the job imports it on its node)
        self.cfg, self.evaluate, self.scratch_from_env = cfg, evaluate, scratch_from_env

    def __call__(self) -> str:
        cfg = self.cfg
        if self.scratch_from_env:  # the node-local scratch of this job's node, not the training job's
            cfg = replace(cfg, paths=replace(cfg.paths, scratch_dir=_default_scratch()))
        _log_to(Path(cfg.run_dir))
        preemption.install()
        _wait_for_the_hand_off(Path(cfg.run_dir))
        run_dir = self.evaluate(cfg)
        if is_primary():
            print("\n".join(run_summary(run_dir)), flush=True)
        return str(run_dir)

    def checkpoint(self):
        import submitit

        return submitit.helpers.DelayedSubmission(self)


def _wait_for_the_hand_off(run_dir: Path, timeout_s: float = 600.0) -> None:
    """Until the training job has recorded the hand-off (run.json names this job): the training job's last write
    comes after its submission, and must not land on this job's attempt."""
    me, deadline = os.environ.get("SLURM_JOB_ID"), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (json.loads((run_dir / "run.json").read_text()).get("evaluation_job") or {}).get("job_id") == me:
                return
        except (OSError, ValueError):
            pass  # (being replaced: atomic, read again)
        time.sleep(0.5)
    log.warning("run.json does not name this job after %.0f s (the training job died after submitting it?); "
                "evaluating anyway", timeout_s)  # fmt: skip


def _log_to(run_dir: Path) -> None:
    """eaglelab's lines to the job's log and to the run's run.log, as a Hydra run has them."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    fmt = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
    for handler in (logging.StreamHandler(), logging.FileHandler(run_dir / "run.log")):
        handler.setFormatter(logging.Formatter(fmt))
        root.addHandler(handler)


def with_training_metrics(run_dir: Path, metrics: dict) -> dict:
    """An evaluation job's metrics.json: what its training attempt measured stands for the data, training and its
    time (this attempt found them done), and the run's total time is both jobs'. Unchanged where the trial evaluated
    in its own job."""
    path = run_dir / TRAINED
    if not path.is_file():
        return metrics
    trained = json.loads(path.read_text())
    total = metrics.get("time/total_s", 0.0) + trained.get("time/training_job_s", 0.0)
    return {**metrics, **trained, "time/total_s": total}
