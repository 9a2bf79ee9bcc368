"""The research loop: prompts -> regenerate -> capture -> cache -> train -> export -> evaluate -> results.

`run(cfg)` is what `python src/run.py` calls and what the tests call. It writes one run directory
(layout in docs/results_layout.md); `metrics.json` is written last, so its presence means complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import OmegaConf

import eaglelab
from eaglelab.config import RunConfig, max_k
from eaglelab.data.prepare import PrepareStats, prepare_features
from eaglelab.data.prompts import humaneval_prompts, load_source, mix_sources
from eaglelab.data.vocab import draft_vocab
from eaglelab.drafter import Eagle3Config
from eaglelab.errors import ConfigError, EaglelabError
from eaglelab.evaluate import acceptance_rows, evaluate_in_vllm, evaluate_simulated
from eaglelab.export import TargetShape, load_checkpoint, save_drafter
from eaglelab.io import atomic_write_json, atomic_write_text, write_csv
from eaglelab.plots import plot_acceptance, plot_speedup
from eaglelab.suites import evaluate_suites, prepare_suites
from eaglelab.targets import load_target
from eaglelab.vllm_engine import INSTALL_HINT, require_vllm, vllm_available

log = logging.getLogger("eaglelab")


class StageTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0


def build_model_config(cfg: RunConfig, target) -> Eagle3Config:
    """The drafter's shape follows the target (vLLM shares the target's embeddings, so H matches)."""
    tc = target.model.config
    aux = list(cfg.drafter.aux_layer_ids or target.default_aux_layer_ids())
    heads = tc.num_attention_heads
    rope_theta = getattr(tc, "rope_theta", None) or (getattr(tc, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0)
    try:
        return Eagle3Config(
            hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size, num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", heads) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            vocab_size=tc.vocab_size, draft_vocab_size=min(cfg.drafter.draft_vocab_size, tc.vocab_size),
            target_hidden_size=tc.hidden_size, aux_layer_ids=tuple(aux), num_layers=cfg.drafter.num_layers,
            rms_norm_eps=tc.rms_norm_eps, rope_theta=float(rope_theta),
            max_position_embeddings=target.max_context, fc_norm=cfg.drafter.fc_norm,
            norm_before_fc=cfg.drafter.norm_before_fc, norm_output=cfg.drafter.norm_output,
            norm_before_residual=cfg.drafter.norm_before_residual,
            attention_window=cfg.drafter.attention_window,
            attention_sink_tokens=cfg.drafter.attention_sink_tokens, target_num_layers=tc.num_hidden_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def target_tensors(target) -> dict[str, torch.Tensor]:
    """The only target weights training needs: embeddings, lm_head and final norm (so the rest of the
    target can be freed before training)."""
    return {"embed": target.model.get_input_embeddings().weight.detach(),
            "lm_head": target.model.get_output_embeddings().weight.detach(),
            "norm": target.model.model.norm.weight.detach()}


def _init_from_target(module, shared: dict[str, torch.Tensor], draft_ids: torch.Tensor,
                      init_lm_head: bool) -> torch.Tensor:
    """Share the target's embeddings (frozen); optionally start lm_head/norm at the target's.
    Returns the target's lm_head rows of the draft vocab (the KL teacher)."""
    d = module.drafter
    d.set_vocab(draft_ids)
    d.embed_tokens.weight.data.copy_(shared["embed"].float())
    head = shared["lm_head"].float()[draft_ids].clone()
    if init_lm_head:
        d.lm_head.weight.data.copy_(head)
        d.norm.weight.data.copy_(shared["norm"].float())
    return head


def _loggers(cfg: RunConfig, run_dir: Path):
    from lightning.pytorch.loggers import CSVLogger

    if cfg.logger.kind == "none":
        return False
    loggers = [CSVLogger(save_dir=str(run_dir), name="logs", version="")]
    if cfg.logger.kind == "wandb" and is_primary():  # only process 0 logs to W&B
        from eaglelab.tracking import training_logger

        loggers.append(training_logger(cfg, run_dir))
    return loggers


def _trainer(cfg: RunConfig, run_dir: Path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from eaglelab.training import AtomicCheckpointIO, FlushLogsWithCheckpoints, StopOnNonFinite

    t = cfg.train
    # submitit owns requeueing (one owner): Lightning's own SLURM auto-requeue would requeue a second time.
    plugins = [AtomicCheckpointIO()] + ([SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else [])
    for stale in (run_dir / "lightning").glob(".*.tmp-*"):  # a killed save's temporary file: never the checkpoint
        stale.unlink(missing_ok=True)
    return L.Trainer(
        accelerator=t.accelerator, devices=t.devices, strategy=t.strategy, precision=t.precision,
        num_nodes=t.num_nodes, plugins=plugins,
        max_epochs=t.epochs, max_steps=t.max_steps, gradient_clip_val=t.grad_clip or None,
        logger=_loggers(cfg, run_dir), log_every_n_steps=5, deterministic=True, num_sanity_val_steps=0,
        use_distributed_sampler=False,  # EpochBatches shards the batches itself (and resumes mid-epoch)
        # One rolling checkpoint: the resume point after a preemption (written atomically: AtomicCheckpointIO).
        callbacks=[ModelCheckpoint(dirpath=str(run_dir / "lightning"), filename="last", save_top_k=1,
                                   every_n_train_steps=t.checkpoint_every_n_steps, enable_version_counter=False),
                   FlushLogsWithCheckpoints(), StopOnNonFinite()],
        enable_model_summary=False, default_root_dir=str(run_dir),
    )


def is_primary() -> bool:
    """Process 0 of a (possibly) distributed job: the only one that writes results. Other DDP processes
    (Lightning's children, or the tasks Slurm starts) prepare their data from the cache and train."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return rank_zero_only.rank == 0


def run(cfg: RunConfig) -> Path:
    """Run the whole loop; returns the run directory. Raises EaglelabError on bad input.

    A run directory is a trial's identity: started again with the same config (a requeued job, a relaunched
    sweep) a finished run is returned as it is, an interrupted one resumes from its last checkpoint."""
    run_dir = Path(cfg.run_dir or Path(cfg.paths.results_dir) / "runs" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    if cfg.checkpoint:
        adopt_trained_settings(cfg)
    if not is_primary():
        _run(cfg, run_dir, {"started": time.time()})
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = previous_attempt(cfg, run_dir)
    if previous.get("status") == "complete":
        log.info("%s is complete: not run again", run_dir)
        return run_dir
    started = time.time()
    info = {"status": "running", "variant": cfg.variant, "seed": cfg.train.seed,
            "eaglelab_version": eaglelab.__version__, "torch": torch.__version__,
            "host": platform.node(), "started": started, "attempt": previous.get("attempt", 0) + 1}
    if previous:
        info["first_started"] = previous.get("first_started", previous.get("started"))
        log.info("%s: resuming (attempt %d, after %s)", run_dir, info["attempt"], previous.get("status"))
    atomic_write_json(run_dir / "run.json", info)
    try:
        metrics = _run(cfg, run_dir, info)
        if cfg.logger.kind == "wandb":
            _log_to_wandb(cfg, run_dir, metrics, info)
    except BaseException as e:
        interrupted = isinstance(e, (KeyboardInterrupt, SystemExit))  # SystemExit: submitit's requeue
        info.update(status="interrupted" if interrupted else "failed",
                    error=f"{type(e).__name__}: {e}", finished=time.time())
        if not isinstance(e, (EaglelabError, KeyboardInterrupt, SystemExit)):
            info["traceback"] = traceback.format_exc()
        atomic_write_json(run_dir / "run.json", info)
        if cfg.logger.kind == "wandb":
            from eaglelab.tracking import finish_failed

            try:
                finish_failed()
            except Exception as w:  # noqa: BLE001  never hide the run's own error behind W&B's
                log.warning("could not close the W&B run (%s)", w)
        raise
    info.update(status="complete", finished=time.time())
    atomic_write_json(run_dir / "run.json", info)
    atomic_write_json(run_dir / "metrics.json", metrics)  # last: marks the run complete
    return run_dir


def _log_to_wandb(cfg: RunConfig, run_dir: Path, metrics: dict, info: dict) -> None:
    """W&B is a view of the results, not the results: a failure to log is reported, the run still completes."""
    from eaglelab.tracking import log_results

    try:
        log_results(cfg, run_dir, metrics)
    except Exception as e:  # noqa: BLE001
        log.warning("W&B logging failed (%s: %s); the run's results are complete in %s", type(e).__name__, e, run_dir)
        info["wandb_error"] = f"{type(e).__name__}: {e}"


def previous_attempt(cfg: RunConfig, run_dir: Path) -> dict:
    """What an earlier start left in `run_dir` ({} if nothing): its run.json, status "complete" once
    metrics.json exists. A directory holding another configuration is refused."""
    if not (run_dir / "run.json").exists():
        return {}
    if (run_dir / "config.yaml").exists():
        stored = _flat(OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")))
        now, default = (_flat(OmegaConf.to_container(OmegaConf.create(asdict(c)))) for c in (cfg, RunConfig()))
        # What was measured must match; where results go, how they are logged and what a sweeper reads from them
        # may change (a sweep relaunched elsewhere, W&B turned on). A setting newer than the stored run counts as
        # its default.
        changed = sorted(k for k in now if not k.startswith(("paths.", "logger.", "run_dir", "objective"))
                         and stored.get(k, default.get(k)) != now[k])
        if changed:
            raise EaglelabError(f"{run_dir} holds a run with another configuration (differs in {', '.join(changed)}); "
                                "choose another run directory")
    previous = json.loads((run_dir / "run.json").read_text())
    # metrics.json alone marks completion: a kill between the final run.json and metrics.json writes is unfinished
    previous["status"] = "complete" if (run_dir / "metrics.json").exists() else (
        "interrupted" if previous.get("status") == "complete" else previous.get("status"))
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
    path = Path(cfg.checkpoint)
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / "config.yaml").is_file() and (candidate / "run.json").is_file():
            trained = OmegaConf.load(candidate / "config.yaml")
            cfg.variant = str(trained.get("variant", cfg.variant))
            cfg.train.ttt_steps = int(trained.train.ttt_steps)
            cfg.train.seed = int(trained.train.seed)
            cfg.data.system_prompt = trained.data.get("system_prompt")  # "native" = the template it was trained on
            log.info("evaluating %s: variant %s, ttt_steps %d, seed %d (from its config.yaml)",
                     candidate, cfg.variant, cfg.train.ttt_steps, cfg.train.seed)
            return


def _run(cfg: RunConfig, run_dir: Path, info: dict) -> dict:
    timer = StageTimer()
    primary = is_primary()
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    use_vllm = vllm_wanted(cfg)  # before any expensive work: a required but missing vLLM fails now
    backend = regen_backend(cfg)
    with timer("convert"):
        target = load_target(cfg.target, cfg.paths.cache_dir)
    if cfg.data.max_length > target.max_context:  # longer sequences would run past the target's positions
        raise ConfigError(f"data.max_length={cfg.data.max_length} exceeds the target's context window "
                          f"({target.max_context} tokens); lower data.max_length")
    shared = target_tensors(target)
    loaded = None
    if cfg.checkpoint:  # evaluation only: the drafter (and its shape) come from the checkpoint
        loaded = load_checkpoint(Path(cfg.checkpoint), shared["embed"].float(),
                                 TargetShape(target.hidden_size, target.vocab_size, target.num_layers))
        if cfg.drafter.attention_window is not None:  # a window at inference only: the long-context knob
            loaded.cfg.attention_window = cfg.drafter.attention_window
            loaded.cfg.attention_sink_tokens = cfg.drafter.attention_sink_tokens
        model_cfg = loaded.cfg
        info["checkpoint"] = str(Path(cfg.checkpoint).resolve())
    else:
        model_cfg = build_model_config(cfg, target)
    info.update(target=target.fingerprint, target_path=str(target.path))
    resolved = OmegaConf.to_yaml(OmegaConf.create({**asdict(cfg), "resolved": {
        "aux_layer_ids": list(model_cfg.aux_layer_ids), "draft_vocab_size": model_cfg.draft_vocab_size,
        "target_num_layers": target.num_layers, "max_k": max_k(cfg),
        "attention_window": model_cfg.attention_window, "attention_sink_tokens": model_cfg.attention_sink_tokens}}))
    if primary:
        atomic_write_text(run_dir / "config.yaml", resolved)

    if use_vllm and model_cfg.attention_window is not None:
        # vLLM's Eagle3 drafter has no sliding window with kept sink tokens: its τ would be another drafter's.
        log.warning("drafter.attention_window=%s cannot be expressed in vLLM: simulated evaluator only",
                    model_cfg.attention_window)
        info["vllm_skipped"] = "drafter.attention_window is not expressible in vLLM's Eagle3 drafter"
        use_vllm = False
    train_feats, eval_feats, suite_inputs, data_metrics = prepare_data(cfg, target, model_cfg, timer, backend,
                                                                         train=loaded is None, evaluate=primary)
    serving = {"path": target.path, "max_model_len": target.max_context}
    del target  # the rest of the target is not needed past data preparation: free it before training
    metrics: dict[str, float | int] = dict(data_metrics)
    if loaded is None:
        with timer("train"):
            module, train_metrics = train_drafter(cfg, run_dir, model_cfg, shared, train_feats)
        drafter = module.drafter
        metrics.update(train_metrics)
    else:
        drafter = loaded
    if not primary:
        return {}  # a DDP helper process: its share of training is done; process 0 exports and evaluates
    # The drafter's own cost (the target's shared embeddings are not counted): a second Optuna objective.
    metrics["drafter/params"] = sum(p.numel() for n, p in drafter.named_parameters() if not n.startswith("embed"))
    with timer("export"):
        save_drafter(drafter, run_dir / "drafter")
    with timer("evaluate"):
        totals = evaluate_simulated(drafter, eval_feats, max_k(cfg), batch_size=cfg.train.batch_size)
    info["evaluator"] = "simulated+vllm" if use_vllm else "simulated"
    by_k, by_pos = acceptance_rows(totals, evaluator="simulated", suite=cfg.eval.prompts)
    for row in by_k:
        metrics[f"acceptance_length@k{row['k']}"] = row["acceptance_length"]
    for row in by_pos:
        metrics[f"acceptance_rate@k{row['k']}@pos{row['position']}"] = row["acceptance_rate"]
    # Written before vLLM runs: if the engine fails, the trained drafter and these tables stay.
    write_csv(run_dir / "acceptance.csv", by_k)
    write_csv(run_dir / "per_position.csv", by_pos)

    if use_vllm:
        with timer("evaluate_vllm"):
            report = _evaluate_in_vllm(cfg, run_dir, drafter, serving, eval_feats)
        by_k, by_pos = by_k + report.acceptance, by_pos + report.per_position
        write_csv(run_dir / "acceptance.csv", by_k)
        write_csv(run_dir / "per_position.csv", by_pos)
        write_csv(run_dir / "parity.csv", report.parity)
        write_csv(run_dir / "throughput.csv", report.throughput)
        metrics.update(report.metrics)
        if report.throughput:
            plot_speedup(run_dir, f"{cfg.variant} (seed {cfg.train.seed})")
    plot_acceptance(run_dir, f"{cfg.variant} (seed {cfg.train.seed})")
    with timer("suites"):
        try:
            metrics.update(evaluate_suites(cfg, drafter, suite_inputs, eval_feats, by_k, run_dir,
                                           serving if use_vllm else None))
        except EaglelabError as e:
            raise EaglelabError(f"{e} — the drafter is kept in {run_dir / 'drafter'}; evaluate it again with "
                                f"`python src/run.py checkpoint={run_dir}`") from None
    timer.seconds["total"] = time.time() - info["started"]
    metrics.update({f"time/{k}_s": v for k, v in timer.seconds.items()})
    return metrics


def vllm_wanted(cfg: RunConfig) -> bool:
    enabled = cfg.eval.vllm.enabled
    if enabled is False:
        return False
    if not vllm_available():
        if enabled:
            raise EaglelabError(INSTALL_HINT)
        log.warning("vLLM is not installed: evaluating with the simulated evaluator only (%s)", INSTALL_HINT)
        return False
    return True


def regen_backend(cfg: RunConfig) -> str:
    backend = cfg.data.regen_backend
    if backend == "auto":
        return "vllm" if vllm_available() else "hf"
    if backend == "vllm":
        require_vllm()
    return backend


def _evaluate_in_vllm(cfg: RunConfig, run_dir: Path, drafter, serving: dict, eval_feats):
    v, K = cfg.eval.vllm, max_k(cfg)
    try:
        return evaluate_in_vllm(
            drafter, run_dir / "drafter", serving["path"], eval_feats, ks=v.ks or list(range(1, K + 1)),
            throughput_ks=[cfg.train.ttt_steps] if v.throughput_ks is None else v.throughput_ks,
            concurrencies=v.concurrencies, num_prompts=v.num_prompts, throughput_prompts=v.throughput_prompts,
            max_new_tokens=cfg.eval.max_new_tokens, dtype=cfg.target.dtype, max_model_len=serving["max_model_len"],
            suite=cfg.eval.prompts, workdir=run_dir / "vllm", enforce_eager=v.enforce_eager, timeout=v.timeout_s)
    except EaglelabError as e:
        raise EaglelabError(f"{e} — the drafter is kept in {run_dir / 'drafter'}; evaluate it again with "
                            f"`python src/run.py checkpoint={run_dir}`") from None


def prepare_data(cfg: RunConfig, target, model_cfg: Eagle3Config, timer: StageTimer, backend: str = "hf",
                 train: bool = True, evaluate: bool = True):
    """Training prompts and held-out evaluation prompts (never overlapping), regenerated and captured.
    `evaluate=False` (a DDP helper process): the training data only."""
    eval_prompts = (humaneval_prompts() if cfg.eval.prompts == "humaneval"
                    else load_source(cfg.eval.prompts, cfg.data.skip_empty))
    eval_prompts = eval_prompts[: cfg.eval.num_prompts] if cfg.eval.num_prompts else eval_prompts
    train_prompts = mix_sources(cfg.data.sources, cfg.data.num_prompts, cfg.data.seed, cfg.data.skip_empty)
    held_out = {json.dumps(p, sort_keys=True) for p in eval_prompts}
    kept = [p for p in train_prompts if json.dumps(p, sort_keys=True) not in held_out]
    if len(kept) < len(train_prompts):
        log.warning("dropped %d training prompts that are also evaluation prompts", len(train_prompts) - len(kept))
    train_prompts = kept
    common = dict(cache_dir=cfg.paths.cache_dir, aux_layer_ids=list(model_cfg.aux_layer_ids),
                  system_prompt=cfg.data.system_prompt, max_length=cfg.data.max_length,
                  batch_size=cfg.data.regen_batch_size, backend=backend)
    train_feats, train_stats = None, PrepareStats()
    if train:
        train_feats, train_stats = prepare_features(target, train_prompts, name="train",
                                                    max_new_tokens=cfg.data.max_new_tokens,
                                                    val_fraction=cfg.data.val_fraction, **common)
    if not evaluate:
        return train_feats, None, None, {}
    eval_feats, eval_stats = prepare_features(target, eval_prompts, name="eval",
                                              max_new_tokens=cfg.eval.max_new_tokens, **common)
    for stage in ("regenerate", "capture"):
        timer.seconds[stage] = train_stats.seconds.get(stage, 0.0) + eval_stats.seconds[stage]
    suite_inputs = prepare_suites(cfg, target, eval_prompts, common)
    timer.seconds["prepare_suites"] = suite_inputs.seconds
    metrics = {"data/skipped_too_long": train_stats.skipped_too_long + eval_stats.skipped_too_long,
               "data/eval_sequences": len(eval_feats)}
    if train:
        metrics.update({"data/train_tokens": train_stats.tokens, "data/response_tokens": train_stats.response_tokens})
    return train_feats, eval_feats, suite_inputs, metrics


def train_drafter(cfg: RunConfig, run_dir: Path, model_cfg: Eagle3Config, shared: dict[str, torch.Tensor],
                  features):
    """Draft vocabulary from the training split, init from the target, TTT training with Lightning."""
    import lightning as L

    from eaglelab.training import DrafterModule, EpochBatches, FeatureDataset, ResumableLoader, collate

    # Seeded here, right before anything random, so the result never depends on what ran before
    # (e.g. whether the data came from the cache or was just generated).
    L.seed_everything(cfg.train.seed, workers=True, verbose=False)
    is_val = features["is_val"]
    train_idx = [i for i, v in enumerate(is_val) if not v]
    val_idx = [i for i, v in enumerate(is_val) if v]
    if not train_idx:
        raise EaglelabError("no training sequences left after the validation split; lower data.val_fraction "
                            "or raise data.num_prompts")
    with_final = cfg.train.loss == "kl"
    train_set = FeatureDataset(features, train_idx, with_final)
    val_set = FeatureDataset(features, val_idx, with_final) if val_idx else None
    draft_ids, coverage = draft_vocab([it["input_ids"] for it in train_set.items],
                                      [it["prompt_len"] for it in train_set.items],
                                      model_cfg.vocab_size, model_cfg.draft_vocab_size)
    module = DrafterModule(model_cfg, cfg.train)
    module.target_head = _init_from_target(module, shared, draft_ids, cfg.drafter.init_lm_head_from_target)
    loader = ResumableLoader(train_set, collate_fn=collate,
                             batch_sampler=EpochBatches(len(train_set), cfg.train.batch_size, cfg.train.seed))
    module.train_batches = loader.batch_sampler
    val_loader = (torch.utils.data.DataLoader(val_set, batch_size=cfg.train.batch_size, collate_fn=collate)
                  if val_set else None)
    ckpt = run_dir / "lightning" / "last.ckpt"
    state = readable_checkpoint(ckpt)  # every DDP process reads the same file: the same decision everywhere
    if state is not None and "eaglelab_train_metrics" in state:  # training had finished: its result stands
        module.on_load_checkpoint(state)
        module.load_state_dict(state["state_dict"])
        log.info("training finished in an earlier attempt: weights from %s", ckpt)
        return module, state["eaglelab_train_metrics"]
    resume = str(ckpt) if state is not None else None
    if resume:
        log.info("resuming training from %s (step %d)", ckpt, state["global_step"])
        if is_primary():
            keep_previous_log(run_dir)
    del state
    trainer = _trainer(cfg, run_dir)
    trainer.fit(module, loader, val_loader, ckpt_path=resume)
    if trainer.interrupted:
        raise KeyboardInterrupt("training interrupted")
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("val/", "train/"))}
    metrics.update({"data/train_sequences": len(train_idx), "data/val_sequences": len(val_idx),
                    "data/draft_vocab_coverage": coverage, "train/steps": int(trainer.global_step)})
    module.final_metrics = metrics
    trainer.save_checkpoint(ckpt)  # the finished state with its metrics (every process joins; process 0 writes)
    if is_primary() and any((run_dir / "logs").glob("metrics.attempt*.csv")):
        merge_logs(run_dir / "logs")
    return module, metrics


def readable_checkpoint(ckpt: Path) -> dict | None:
    """The checkpoint to resume from, if there is one that loads. An unreadable one (truncated by a dying
    node) is not trusted: training starts again, and the next checkpoint replaces the file."""
    if not ckpt.exists():
        return None
    try:
        return torch.load(ckpt, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 — any unreadable checkpoint means: start training again
        log.warning("%s cannot be read (%s): training starts again", ckpt, type(e).__name__)
        return None


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
    import csv

    def rows(path):
        with open(path, newline="") as f:
            return [r for r in csv.DictReader(f) if r.get("step")]

    attempts = sorted(logs.glob("metrics.attempt*.csv"), key=lambda p: int(p.stem.removeprefix("metrics.attempt")))
    tables = [rows(p) for p in attempts] + [rows(logs / "metrics.csv") if (logs / "metrics.csv").exists() else []]
    merged = []
    for i, table in enumerate(tables):
        later = [int(r["step"]) for t in tables[i + 1:] for r in t]
        resumed_at = min(later, default=None)
        merged += [r for r in table if resumed_at is None or int(r["step"]) < resumed_at]
    write_csv(logs / "metrics.csv", merged)
