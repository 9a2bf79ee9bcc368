"""The research loop: prompts -> regenerate -> capture -> cache -> train -> export -> evaluate -> results.

`run(cfg)` is what `python src/run.py` calls and what the tests call. It writes one run directory
(layout in docs/results_layout.md; its identity and attempts: eaglelab.rundir); `metrics.json` is written
last, so its presence means complete. `execute` is the method, stage by stage.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eaglelab import preemption
from eaglelab.acceptance import DepthAccuracy, tail_tokens
from eaglelab.batches import OnlineStates
from eaglelab.config import RunConfig, max_k
from eaglelab.data.prepare import CaptureSettings, PrepareStats, prepare_features
from eaglelab.data.prompts import hold_out_for_validation, load_source, mix_sources
from eaglelab.data.self_chat import self_chat_prompts
from eaglelab.drafter import Eagle3Config, Eagle3Drafter
from eaglelab.errors import ConfigError, EaglelabError
from eaglelab.evaluate import (
    Serving,
    acceptance_rows,
    evaluate_simulated,
    held_out_in_vllm,
    per_prompt_rows,
    vllm_wanted,
)
from eaglelab.export import TargetShape, load_checkpoint, save_drafter
from eaglelab.io import atomic_write_text, writable_folder, write_csv
from eaglelab.limits import as_disk_full, check_limits, measured_peaks
from eaglelab.plots import plot_acceptance, plot_speedup
from eaglelab.ranks import broadcast, gather, is_primary, same_on_every_rank, trial_ranks
from eaglelab.ranks import current as current_ranks
from eaglelab.rundir import RunRecord, adopt_trained_settings, begin_attempt, end_attempt
from eaglelab.suites import SuiteInputs, check_suites, evaluate_suites, prepare_suites
from eaglelab.targets import Target, TargetWeights, load_target, target_device
from eaglelab.vllm_engine import require_vllm, vllm_available

log = logging.getLogger("eaglelab")


class StageTimer:
    """Wall seconds per stage (`time/<stage>_s` in metrics.json); the stage a signal arrives in is named."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str):
        preemption.enter_stage(stage)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0


@dataclass
class PreparedData:
    """The data stage's output: captured training and held-out sequences, and the suites' prompt sets."""

    train: object | None = None  # datasets.Dataset with an is_val column; None when only evaluating
    held_out: object | None = None  # None in a DDP helper process (process 0 evaluates)
    suites: SuiteInputs = field(default_factory=SuiteInputs)
    metrics: dict[str, float] = field(default_factory=dict)


def run(cfg: RunConfig) -> Path:
    """Run the whole loop; returns the run directory. Raises EaglelabError on bad input.

    A run directory is a trial's identity: started again with the same config (a requeued job, a relaunched
    sweep) a finished run is returned as it is, an interrupted one resumes from its last checkpoint."""
    run_dir = Path(cfg.run_dir or Path(cfg.paths.results_dir) / "runs" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    if cfg.checkpoint:
        adopt_trained_settings(cfg)
    with trial_ranks(cfg, run_dir):  # one process, or this one's rank among the trial's (eaglelab.ranks)
        same_on_every_rank(str(run_dir.resolve()), "the run directory", "give every process the same hydra.run.dir")
        if is_primary():
            return run_as_primary(cfg, run_dir)
        # Another rank trains its share; rank 0 keeps the records and writes the results, and decides whether
        # there is anything to do.
        if broadcast(None):
            execute(cfg, run_dir, RunRecord.start(cfg, {}))
        return run_dir


def run_as_primary(cfg: RunConfig, run_dir: Path) -> Path:
    record = begin_attempt(cfg, run_dir)
    if not broadcast(record is not None):  # complete already (the other ranks stop with it)
        return run_dir
    try:
        metrics = execute(cfg, run_dir, record)
        if cfg.logger.kind == "wandb":
            log_to_wandb(cfg, run_dir, metrics, record)
    except BaseException as e:
        # A full disk, wherever it surfaced (cache, checkpoint, results): one line naming where and what to do.
        disk_full = as_disk_full(e, run_dir, cfg.paths.cache_dir)
        try:
            end_attempt(run_dir, record, error=disk_full or e)
        except OSError:
            if disk_full is None:
                raise
            log.warning("could not record the failure in %s: the disk is still full", run_dir / "run.json")
        if cfg.logger.kind == "wandb":
            from eaglelab.tracking import finish_failed

            try:
                finish_failed()
            except Exception as w:  # never hide the run's own error behind W&B's
                log.warning("could not close the W&B run (%s)", w)
        if disk_full is not None:
            raise disk_full from e
        raise
    end_attempt(run_dir, record, metrics)
    return run_dir


def log_to_wandb(cfg: RunConfig, run_dir: Path, metrics: dict, record: RunRecord) -> None:
    """W&B is a view of the results, not the results: a failure to log is reported, the run still completes."""
    from eaglelab.tracking import log_results

    preemption.enter_stage("wandb")
    try:
        log_results(cfg, run_dir, metrics)
    except Exception as e:  # W&B is a view of the results: any failure to log is reported, never fatal
        log.warning("W&B logging failed (%s: %s); the run's results are complete in %s", type(e).__name__, e, run_dir)
        record.wandb_error = f"{type(e).__name__}: {e}"


def execute(cfg: RunConfig, run_dir: Path, record: RunRecord) -> dict:
    """The method, stage by stage; returns metrics.json's content ({} in a DDP helper process).
    `record` (run.json) gains the target, the evaluator and anything skipped."""
    timer, primary = StageTimer(), is_primary()
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    check_suites(cfg)  # bad settings fail before any work
    writable_folder(Path(os.path.expanduser(cfg.paths.cache_dir)), "paths.cache_dir (or EAGLELAB_CACHE_DIR)")
    use_vllm, backend = vllm_wanted(cfg), regen_backend(cfg)  # a required but missing vLLM fails now
    with timer("convert"):  # the target (SmolLM2's GGUF converted once, then cached), where training runs
        target = load_target(cfg.target, cfg.paths.cache_dir, device=target_device(cfg.train.accelerator))
    weights = target.weights(last_layers=cfg.drafter.num_layers if cfg.drafter.init_layers_from_target else 0)
    # 1. The drafter's config: built for this target, or the checkpoint's when only evaluating.
    drafter = load_to_evaluate(cfg, target, weights) if cfg.checkpoint else None
    model_cfg = drafter.cfg if drafter else build_model_config(cfg, target)
    with timer("prompts"):
        prompts = select_prompts(cfg, target)
    # Each rank builds its prompts from what its own node has (python_docstrings reads the installed modules):
    # ranks training on different data would still train, silently. One digest compared, one line if they differ.
    if current_ranks().world_size > 1:
        digest = hashlib.sha256()
        for prompt in prompts.training_set:  # prompt by prompt: no copy of the whole set as one string
            digest.update(json.dumps(prompt, sort_keys=True).encode())
        same_on_every_rank(
            digest.hexdigest()[:16],
            "the training prompts (a digest)",
            "give every node the same packages and data files, or data.sources that do not depend on the node",
        )
    # Sizes against this data, target and machine, before any work.
    training = drafter is None  # else only evaluating: no training data
    memory = check_limits(
        cfg,
        target,
        model_cfg,
        prompts.train if training else [],
        prompts.held_out,
        prompts.validation if training else [],
    )
    record.target, record.target_path = target.fingerprint, str(target.path)
    record.checkpoint = str(Path(cfg.checkpoint).resolve()) if cfg.checkpoint else None
    if primary:
        write_resolved_config(cfg, run_dir, model_cfg, target)
    if use_vllm and model_cfg.attention_window is not None:
        # vLLM's Eagle3 drafter has no sliding window with kept sink tokens: its τ would be another drafter's.
        log.warning(
            "drafter.attention_window=%s cannot be expressed in vLLM: simulated evaluator only",
            model_cfg.attention_window,
        )
        record.vllm_skipped = "drafter.attention_window is not expressible in vLLM's Eagle3 drafter"
        use_vllm = False
    # 2. Prompts -> regenerate -> capture -> cache (shared by every run of this target and data).
    with timer("prepare"):
        data = prepare_data(cfg, target, model_cfg, prompts, timer, backend, train=drafter is None, evaluate=primary)
    serving = Serving(target.path, target.max_context)
    # Online and hybrid features keep the frozen target for training; otherwise it is freed before training.
    online = (
        OnlineStates(target.model, model_cfg.aux_layer_ids, cfg.train.loss == "kl")
        if drafter is None and cfg.features.kind != "cached"
        else None
    )
    del target
    metrics: dict[str, float | int] = dict(data.metrics)
    metrics.update(memory.metrics())
    # 3. Train (training-time test).
    if drafter is None:
        from eaglelab.tracking import training_loggers
        from eaglelab.trainer import train_drafter

        with timer("train"):
            drafter, train_metrics = train_drafter(
                cfg,
                run_dir,
                model_cfg,
                weights,
                data.train,
                loggers=lambda: training_loggers(cfg, run_dir),
                online=online,
            )
        del online
        metrics.update(train_metrics)
        # Each rank's host memory up to here (training is where every rank holds its share): what a node's --mem
        # must hold is their sum.
        by_rank = gather(measured_peaks()["memory/peak_rss_gb"])
        metrics.update({f"memory/rank{r}_train_peak_rss_gb": gb for r, gb in enumerate(by_rank)})
    if not primary:
        return {}
    # The drafter's own cost (the target's shared embeddings are not counted): a second Optuna objective.
    metrics["drafter/params"] = sum(p.numel() for n, p in drafter.named_parameters() if not n.startswith("embed"))
    # 4. Export in vLLM's Eagle3 format.
    with timer("export"):
        save_drafter(drafter, run_dir / "drafter")
    # Evaluated in float32 whatever train.precision trained it in (a "-true" one: 16 bits), on the training device
    # (Lightning's teardown leaves the module on the CPU).
    embed = drafter.embed_tokens.weight.data  # stays in the target's dtype, as in training and in vLLM:
    drafter.embed_tokens.weight.data = embed.new_empty(0)  # set aside, so .float() makes no copy of it
    drafter = drafter.float().to(target_device(cfg.train.accelerator))
    # (A "-true" precision converted it with the module: 64-true's float64 rows would make every layer's input float64.)
    drafter.embed_tokens.weight.data = embed.to(drafter.d2t.device, weights.embed.dtype)
    # 5. Evaluate on the held-out prompts: simulated, then in vLLM.
    record.evaluator = "simulated+vllm" if use_vllm else "simulated"
    with timer("evaluate"):
        by_k, by_pos = evaluate_held_out(cfg, run_dir, drafter, data.held_out, metrics)
    parity: list[dict] = []  # simulated vs vLLM, every group vLLM measures (parity.csv)
    if use_vllm:
        with timer("evaluate_vllm"), drafter_kept(run_dir):
            by_k, parity = evaluate_held_out_in_vllm(
                cfg, run_dir, drafter, serving, data.held_out, by_k, by_pos, metrics
            )
    plot_acceptance(run_dir, f"{cfg.variant} (seed {cfg.train.seed})")
    # 6. Suites: extrapolation, drift, long context, templates.
    with timer("suites"), drafter_kept(run_dir):
        metrics.update(
            evaluate_suites(
                cfg, drafter, data.suites, data.held_out, by_k, run_dir, serving if use_vllm else None, parity
            )
        )
    timer.seconds["total"] = time.time() - record.started
    metrics.update({f"time/{k}_s": v for k, v in timer.seconds.items()})
    metrics.update(measured_peaks(memory.device))
    return metrics


@contextlib.contextmanager
def drafter_kept(run_dir: Path):
    """An evaluation that fails after the export: the error also says where the drafter is and how to
    evaluate it again."""
    try:
        yield
    except EaglelabError as e:
        raise EaglelabError(
            f"{e} — the drafter is kept in {run_dir / 'drafter'}; evaluate it again with "
            f"`python src/run.py checkpoint={run_dir}`"
        ) from None


def build_model_config(cfg: RunConfig, target: Target) -> Eagle3Config:
    """The drafter's design flags (cfg.drafter) on the target's shape, with its aux layers."""
    aux = cfg.drafter.aux_layer_ids if cfg.drafter.aux_layer_ids is not None else target.default_aux_layer_ids()
    try:
        return Eagle3Config.for_target(
            cfg.drafter,
            target.model.config,
            aux_layer_ids=aux,
            draft_vocab_size=cfg.drafter.draft_vocab_size,
            max_context=target.max_context,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def load_to_evaluate(cfg: RunConfig, target: Target, weights: TargetWeights) -> Eagle3Drafter:
    """Evaluation only: the drafter (and its shape) come from the checkpoint; a window may be set for inference."""
    drafter = load_checkpoint(
        Path(cfg.checkpoint),
        weights.embed.float(),
        TargetShape(target.hidden_size, target.vocab_size, target.num_layers),
    )
    if cfg.drafter.attention_window is not None:  # a window at inference only: the long-context knob
        drafter.cfg.attention_window = cfg.drafter.attention_window
        drafter.cfg.attention_sink_tokens = cfg.drafter.attention_sink_tokens
    return drafter


def write_resolved_config(cfg: RunConfig, run_dir: Path, model_cfg: Eagle3Config, target: Target) -> None:
    """config.yaml: the run's settings plus what the target decided (`resolved`)."""
    resolved = {
        "aux_layer_ids": list(model_cfg.aux_layer_ids),
        "draft_vocab_size": model_cfg.draft_vocab_size,
        "target_num_layers": target.num_layers,
        "max_k": max_k(cfg),
        "attention_window": model_cfg.attention_window,
        "attention_sink_tokens": model_cfg.attention_sink_tokens,
    }
    atomic_write_text(
        run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create({**asdict(cfg), "resolved": resolved}))
    )


@dataclass
class Prompts:
    train: list  # training prompts
    validation: list  # validation prompts (data.val_prompts of them), from the training sources, never trained on
    held_out: list  # held-out evaluation prompts, from another source

    @property
    def training_set(self) -> list:
        """What the training data is prepared from: training then validation prompts (the `is_val` column)."""
        return self.train + self.validation


def select_prompts(cfg: RunConfig, target: Target | None = None) -> Prompts:
    """Training prompts and held-out evaluation prompts, never overlapping. `target` writes the `self_chat` source's
    requests (cached, eaglelab.data.self_chat)."""
    eval_prompts = load_source(cfg.eval.prompts, cfg.data.skip_empty)
    eval_prompts = eval_prompts[: cfg.eval.num_prompts] if cfg.eval.num_prompts else eval_prompts
    self_chat = None
    if target is not None:

        def self_chat(count: int) -> list:
            return self_chat_prompts(
                target,
                count,
                cache_dir=cfg.paths.cache_dir,
                system_prompt=cfg.data.system_prompt,
                seed=cfg.data.seed,
                settings=cfg.data.self_chat,
            )

    train_prompts = mix_sources(
        cfg.data.sources,
        cfg.data.num_prompts + cfg.data.val_prompts,
        cfg.data.seed,
        cfg.data.skip_empty,
        with_response=cfg.data.responses == "original",
        self_chat=self_chat,
    )
    held_out = {json.dumps(p, sort_keys=True) for p in eval_prompts}
    question = lambda p: p[:-1] if p[-1]["role"] == "assistant" else p  # noqa: E731  (original responses)
    kept = [p for p in train_prompts if json.dumps(question(p), sort_keys=True) not in held_out]
    if len(kept) < len(train_prompts):
        log.warning("dropped %d training prompts that are also evaluation prompts", len(train_prompts) - len(kept))
    return Prompts(*hold_out_for_validation(kept, cfg.data.val_prompts), eval_prompts)


def prepare_data(
    cfg: RunConfig,
    target: Target,
    model_cfg: Eagle3Config,
    prompts: Prompts,
    timer: StageTimer,
    backend: str,
    train: bool = True,
    evaluate: bool = True,
) -> PreparedData:
    """The training and held-out prompts regenerated and captured. `evaluate=False` (a DDP helper process): the
    training data only."""
    capture = CaptureSettings(
        cache_dir=cfg.paths.cache_dir,
        aux_layer_ids=list(model_cfg.aux_layer_ids),
        system_prompt=cfg.data.system_prompt,
        max_length=cfg.data.max_length,
        batch_size=cfg.data.regen_batch_size,
        backend=backend,
        shard_size=cfg.data.shard_size,
    )
    out, train_stats = PreparedData(), PrepareStats()
    if train:
        out.train, train_stats = prepare_features(
            target,
            prompts.training_set,
            name="train",
            max_new_tokens=cfg.data.max_new_tokens,
            is_val=[False] * len(prompts.train) + [True] * len(prompts.validation),
            features=cfg.features.kind,
            with_final=cfg.train.loss == "kl",  # the KL teacher's state; CE needs none
            tail_tokens=tail_tokens(2 * cfg.train.ttt_steps),  # validation τ up to k = 2·ttt
            source="+".join(cfg.data.sources) + ("" if cfg.data.responses == "regenerate" else ":original"),
            share=(current_ranks().rank, current_ranks().world_size),  # each rank regenerates its share of shards
            **asdict(capture),
        )
    if not evaluate:
        return out
    out.held_out, eval_stats = prepare_features(
        target,
        prompts.held_out,
        name="eval",
        source=cfg.eval.prompts,
        max_new_tokens=cfg.eval.max_new_tokens,
        tail_tokens=tail_tokens(max_k(cfg)),
        **asdict(capture),
    )
    for stage in ("regenerate", "capture"):
        timer.seconds[stage] = train_stats.seconds.get(stage, 0.0) + eval_stats.seconds[stage]
    out.suites = prepare_suites(cfg, target, prompts.held_out, capture)
    timer.seconds["prepare_suites"] = out.suites.seconds
    out.metrics = {
        "data/skipped_too_long": train_stats.skipped_too_long + eval_stats.skipped_too_long,
        "data/eval_sequences": len(out.held_out),
    }
    if train:
        on_disk = out.train.disk_bytes()
        out.metrics.update(
            {
                "data/train_tokens": train_stats.tokens,
                "data/response_tokens": train_stats.response_tokens,
                # What this run's training data holds on disk now (hybrid's states arrive after its first epoch).
                "data/disk_bytes_per_token": (on_disk["tokens"] + on_disk["states"]) / max(train_stats.tokens, 1),
            }
        )
    return out


def regen_backend(cfg: RunConfig) -> str:
    backend = cfg.data.regen_backend
    if backend == "auto":
        return "vllm" if vllm_available() else "hf"
    if backend == "vllm":
        require_vllm()
    return backend


def evaluate_held_out(
    cfg: RunConfig, run_dir: Path, drafter: Eagle3Drafter, held_out, metrics: dict
) -> tuple[list[dict], list[dict]]:
    """Simulated τ and per-position acceptance for k = 1..max_k: acceptance.csv, per_position.csv, metrics.
    Written before vLLM runs: if the engine fails, the trained drafter and these tables stay."""
    depth, per_sequence = DepthAccuracy(max_k(cfg)), []
    totals = evaluate_simulated(
        drafter, held_out, max_k(cfg), batch_size=cfg.train.batch_size, depth=depth, per_sequence=per_sequence
    )
    per_prompt, per_prompt_depth = per_prompt_rows(per_sequence, held_out, cfg.eval.prompts)
    write_csv(run_dir / "per_prompt.csv", per_prompt)  # what paired comparisons resample (analysis/paired.py)
    write_csv(run_dir / "per_prompt_depth.csv", per_prompt_depth)
    by_k, by_pos = acceptance_rows(totals, evaluator="simulated", suite=cfg.eval.prompts)
    by_depth = [
        {"suite": cfg.eval.prompts, "depth": d + 1, "accuracy": depth.accuracy[d], "correct": c, "counted": n}
        for d, (c, n) in enumerate(zip(depth.correct, depth.counted))
    ]  # teacher-forced, on the held-out sequences (validation's val/acc@d is the same measure on its split)
    metrics.update({f"acc@d{r['depth']}": r["accuracy"] for r in by_depth if r["counted"]})
    write_csv(run_dir / "depth_accuracy.csv", by_depth)
    metrics.update({f"acceptance_length@k{row['k']}": row["acceptance_length"] for row in by_k})
    metrics.update({f"acceptance_rate@k{row['k']}@pos{row['position']}": row["acceptance_rate"] for row in by_pos})
    metrics.update(  # n-α where some round reached the position (else it is no measurement, and not in the JSON)
        {f"conditional_rate@k{r['k']}@pos{r['position']}": r["conditional_rate"] for r in by_pos if r["reached"]}
    )
    write_csv(run_dir / "acceptance.csv", by_k)
    write_csv(run_dir / "per_position.csv", by_pos)
    return by_k, by_pos


def evaluate_held_out_in_vllm(
    cfg: RunConfig,
    run_dir: Path,
    drafter: Eagle3Drafter,
    serving: Serving,
    held_out,
    by_k: list[dict],
    by_pos: list[dict],
    metrics: dict,
) -> tuple[list[dict], list[dict]]:
    """vLLM's τ per k and decode speedup, appended to the simulated tables; parity.csv, throughput.csv.
    -> (acceptance rows of both evaluators, parity rows)."""
    report = held_out_in_vllm(cfg, run_dir, drafter, serving, held_out)
    by_k = by_k + report.acceptance
    write_csv(run_dir / "acceptance.csv", by_k)
    write_csv(run_dir / "per_position.csv", by_pos + report.per_position)
    write_csv(run_dir / "parity.csv", report.parity)
    write_csv(run_dir / "throughput.csv", report.throughput)
    metrics.update(report.metrics)
    if report.throughput:
        plot_speedup(run_dir, f"{cfg.variant} (seed {cfg.train.seed})")
    return by_k, report.parity
