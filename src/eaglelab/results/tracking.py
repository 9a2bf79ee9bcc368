"""Weights & Biases: one W&B run per run directory, written from the run directory's own results.

Training metrics reach W&B through Lightning's WandbLogger (`training_logger`); once the run's result
files are written, `log_results` adds them (downstream of results: it reads the files, never recomputes):
    summary       every metrics.json number
    curves        rows with their own x-axis (W&B `define_metric`), so a dashboard can plot and average
                  them across seeds:  by_k/k           -> by_k/acceptance_length[_vllm], by_k/relative_to_ttt
                                      by_length/prompt_tokens -> by_length/acceptance_length
                                      by_depth/depth   -> by_depth/{n_alpha[_vllm], tf_accuracy, hidden_rms,
                                                          sink_share, context_share, ...}
    tables        every result CSV as a W&B table (tables/acceptance, tables/suites/templates, ...)
    images        every result figure (figures/acceptance, figures/suites/drift, ...)
Offline by default (no network needed; `wandb sync RUN_DIR/wandb/offline-run-*` uploads later). An online
run that cannot reach the server falls back to offline with a warning rather than losing the run's log.
The W&B id is kept in RUN_DIR/wandb/run_id: a resumed run continues its W&B run.
"""

from __future__ import annotations

import csv
import logging
import os
from dataclasses import asdict
from pathlib import Path

from eaglelab.core import preemption
from eaglelab.core.config import RunConfig
from eaglelab.core.errors import first_line
from eaglelab.core.io import atomic_write_text
from eaglelab.core.ranks import is_primary

log = logging.getLogger("eaglelab")

# Result tables and figures logged to W&B (paths relative to the run directory; absent ones are skipped).
TABLES = [
    "acceptance.csv",
    "per_position.csv",
    "depth_accuracy.csv",
    "parity.csv",
    "throughput.csv",
    "throughput_passes.csv",
    "sampling.csv",
    "suites/extrapolation.csv",
    "suites/long_context.csv",
    "suites/templates.csv",
    "suites/drift.csv",
    "suites/fc_balance.csv",
    "suites/long_context_throughput.csv",
]
FIGURES = [
    "acceptance.png",
    "speedup.png",
    "suites/extrapolation.png",
    "suites/long_context.png",
    "suites/templates.png",
    "suites/drift.png",
    "suites/long_context_speed.png",
]
DRIFT_MEASURES = ["hidden_rms", "sink_share", "context_share", "draft_share", "recent_share", "entropy"]
# Acceptance by draft depth d on the held-out prompts: n-α at the deepest k each evaluator ran, and teacher-forced
# accuracy (depth_accuracy.csv), the measures in which EAGLE-3.1 and EAGLE-3 separate where τ does not.
DEPTH_MEASURES = ["n_alpha", "n_alpha_vllm", "tf_accuracy"]


def tags(cfg: RunConfig) -> list[str]:
    """Variant, seed, trained depth, target and the suites that ran: what a W&B filter selects on."""
    suites = [
        name
        for name in ("extrapolation", "long_context", "templates", "drift")
        if getattr(cfg.eval.suites, name).enabled
    ]
    return [
        cfg.variant,
        f"seed{cfg.train.seed}",
        f"ttt{cfg.train.ttt_steps}",
        f"target:{cfg.target.kind}",
        *(f"suite:{s}" for s in suites),
        *(["evaluation-only"] if cfg.checkpoint else []),
    ]


def _init_kwargs(cfg: RunConfig, run_dir: Path) -> dict:
    id_file = run_dir / "wandb" / "run_id"
    if not id_file.exists():
        atomic_write_text(id_file, os.urandom(8).hex() + "\n")
    return dict(
        project=cfg.logger.project,
        entity=cfg.logger.entity,
        group=cfg.logger.group,
        job_type="evaluate" if cfg.checkpoint else "train",
        name=run_dir.name,
        tags=tags(cfg),
        id=id_file.read_text().strip(),
        resume="allow",
        dir=str(run_dir),
        config=asdict(cfg),
    )


def start_run(cfg: RunConfig, run_dir: Path):
    """The run's W&B run (the active one if this process started it already for this run directory)."""
    import wandb

    kwargs = _init_kwargs(cfg, run_dir)
    if wandb.run is not None:
        if wandb.run.id == kwargs["id"]:
            return wandb.run
        wandb.run.finish(exit_code=1)  # another trial's run, left open by a failure: not this run's to log into
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        return wandb.init(
            **kwargs, mode=cfg.logger.mode, settings=wandb.Settings(init_timeout=cfg.logger.init_timeout_s)
        )
    except Exception as e:  # no network, no login, server down: keep the log, upload later
        if cfg.logger.mode != "online":
            raise
        log.warning(
            "W&B online logging unavailable (%s: %s): logging offline instead; upload later with "
            "`wandb sync %s/offline-run-*`",
            type(e).__name__,
            first_line(e),
            run_dir / "wandb",
        )
        wandb.teardown()  # the failed online attempt still holds the run id in W&B's service process
        return wandb.init(**kwargs, mode="offline")


def training_logger(cfg: RunConfig, run_dir: Path):
    """Lightning's WandbLogger on this run's W&B run (so training curves and results share one run)."""
    from lightning.pytorch.loggers import WandbLogger

    run = start_run(cfg, run_dir)
    run.define_metric("trainer/global_step")
    for family in ("train/*", "val/*", "epoch"):  # training curves against the optimizer step
        run.define_metric(family, step_metric="trainer/global_step")
    return WandbLogger(experiment=run, save_dir=str(run_dir))


def training_loggers(cfg: RunConfig, run_dir: Path) -> list | bool:
    """Lightning's loggers for the train stage: the CSV log, and W&B (process 0 only) with `logger=wandb`."""
    from lightning.pytorch.loggers import CSVLogger

    if cfg.logger.kind == "none":
        return False
    loggers = [CSVLogger(save_dir=str(run_dir), name="logs", version="")]
    if cfg.logger.kind == "wandb" and is_primary():  # only process 0 logs to W&B
        loggers.append(training_logger(cfg, run_dir))
    return loggers


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _number(value: str):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def finish_failed() -> None:
    """A run that failed or was interrupted: close its W&B run (marked failed), so that the next trial of a sweep
    in this process starts its own."""
    import wandb

    if wandb.run is not None:
        wandb.run.finish(exit_code=1)


def finish_trained() -> None:
    """A trial whose evaluation was handed to a job of its own: its W&B run ends here, and the evaluation job resumes
    it (the same id, RUN_DIR/wandb/run_id) with the results."""
    import wandb

    if wandb.run is not None:
        wandb.run.finish()


def log_results_of(cfg: RunConfig, run_dir: Path, metrics: dict, record) -> None:
    """W&B is a view of the results, not the results: a failure to log is reported (and kept in `record`, run.json's
    `wandb_error`), the run still completes."""

    preemption.enter_stage("wandb")
    try:
        log_results(cfg, run_dir, metrics)
    except Exception as e:  # W&B is a view of the results: any failure to log is reported, never fatal
        log.warning("W&B logging failed (%s: %s); the run's results are complete in %s", type(e).__name__, e, run_dir)
        record.wandb_error = f"{type(e).__name__}: {e}"


def log_results(cfg: RunConfig, run_dir: Path, metrics: dict) -> None:
    """Add the run's results (its files in run_dir) to its W&B run, then finish the run."""
    run = start_run(cfg, run_dir)
    try:
        _log_results(run, cfg, run_dir, metrics)
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.finish()


def _by_depth(run_dir: Path) -> dict[int, dict]:
    """depth -> its row of by_depth/ curves: the drift measures, n-α (each evaluator's deepest k; depths no round
    reached are no measurement and left out) and teacher-forced accuracy."""
    out: dict[int, dict] = {}
    if (run_dir / "suites/drift.csv").exists():
        for r in _rows(run_dir / "suites/drift.csv"):
            out.setdefault(int(r["depth"]), {}).update({f"by_depth/{m}": float(r[m]) for m in DRIFT_MEASURES})
    rows = _rows(run_dir / "per_position.csv") if (run_dir / "per_position.csv").exists() else []
    for evaluator, name in (("simulated", "by_depth/n_alpha"), ("vllm", "by_depth/n_alpha_vllm")):
        mine = [r for r in rows if r["evaluator"] == evaluator and r.get("conditional_rate") not in (None, "")]
        deepest = max((int(r["k"]) for r in mine), default=0)
        for r in mine:
            if int(r["k"]) == deepest and int(r["reached"]) > 0:
                out.setdefault(int(r["position"]), {})[name] = float(r["conditional_rate"])
    if (run_dir / "depth_accuracy.csv").exists():
        for r in _rows(run_dir / "depth_accuracy.csv"):
            if int(r["counted"]) > 0:
                out.setdefault(int(r["depth"]), {})["by_depth/tf_accuracy"] = float(r["accuracy"])
    return out


def _log_results(run, cfg: RunConfig, run_dir: Path, metrics: dict) -> None:
    import wandb

    for x, ys in (
        ("by_k/k", ["acceptance_length", "acceptance_length_vllm", "relative_to_ttt"]),
        ("by_length/prompt_tokens", ["acceptance_length"]),
        ("by_depth/depth", DRIFT_MEASURES + DEPTH_MEASURES),
    ):
        run.define_metric(x, hidden=False)
        for y in ys:
            run.define_metric(f"{x.split('/')[0]}/{y}", step_metric=x)

    ttt = cfg.train.ttt_steps
    by_k: dict[int, dict] = {}
    for r in _rows(run_dir / "acceptance.csv"):
        key = "by_k/acceptance_length" + ("_vllm" if r["evaluator"] == "vllm" else "")
        by_k.setdefault(int(r["k"]), {})[key] = float(r["acceptance_length"])
    if (run_dir / "suites/extrapolation.csv").exists():
        for r in _rows(run_dir / "suites/extrapolation.csv"):
            if r["evaluator"] == "simulated":
                by_k[int(r["k"])]["by_k/relative_to_ttt"] = float(r["relative_to_ttt"])
    for k in sorted(by_k):
        run.log({"by_k/k": k, **by_k[k]})
    if (run_dir / "suites/long_context.csv").exists():  # the simulated evaluator at the trained depth
        for r in _rows(run_dir / "suites/long_context.csv"):
            if r["evaluator"] == "simulated" and int(r["k"]) == ttt:
                run.log(
                    {
                        "by_length/prompt_tokens": float(r["prompt_tokens"]),  # measured (clipped) length
                        "by_length/acceptance_length": float(r["acceptance_length"]),
                    }
                )
    for depth, row in sorted(_by_depth(run_dir).items()):
        run.log({"by_depth/depth": depth, **row})

    media = {}
    for name in TABLES:
        if (run_dir / name).exists():
            rows = _rows(run_dir / name)
            columns = list(rows[0]) if rows else []
            media[f"tables/{name.removesuffix('.csv')}"] = wandb.Table(
                columns=columns, data=[[_number(r[c]) for c in columns] for r in rows]
            )
    for name in FIGURES:
        if (run_dir / name).exists():
            media[f"figures/{name.removesuffix('.png')}"] = wandb.Image(str(run_dir / name))
    run.log(media)
    run.summary.update(metrics)
