"""The train stage: Lightning set-up around `DrafterModule` (eaglelab.train.ttt_module) — data loaders, the Trainer,
loggers, rolling checkpoints and resuming after a preemption."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch

from eaglelab.core.config import RunConfig, TrainConfig, on_cuda
from eaglelab.core.devices import keep_freed_memory
from eaglelab.core.errors import EaglelabError
from eaglelab.core.io import atomic_write_json
from eaglelab.core.preemption import uninterruptible
from eaglelab.core.ranks import cluster_environment, is_primary
from eaglelab.core.ranks import current as current_ranks
from eaglelab.core.rundir import keep_previous_log, merge_logs
from eaglelab.data.store import Sequences
from eaglelab.data.targets import TargetWeights
from eaglelab.data.vocab import draft_vocab
from eaglelab.engine.jobs import StreamJob
from eaglelab.models.drafter import Eagle3Config, Eagle3Drafter
from eaglelab.train.batches import FeatureDataset, HybridStates, OnlineStates, collate
from eaglelab.train.stream_plan import PositionedBatches, PositionedValidation, StartMarker, StreamPlan, streamed_states
from eaglelab.train.ttt_module import (
    AtomicCheckpointIO,
    DrafterModule,
    EpochBatches,
    FlushLogsWithCheckpoints,
    KeepBest,
    OneSignalOwner,
    ResumableLoader,
    StopOnNonFinite,
)

log = logging.getLogger("eaglelab")
# Lightning 2.6 calls torch's deprecated pytree check on every fit (its own code, nothing a user can change).
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def train_drafter(
    cfg: RunConfig,
    run_dir: Path,
    model_cfg: Eagle3Config,
    target: TargetWeights,
    features: Sequences,
    loggers: Callable[[], list | bool] = lambda: False,
    online: OnlineStates | None = None,
    stream_engine: StreamJob | None = None,
) -> tuple[Eagle3Drafter, dict]:
    """The train stage: draft vocabulary from the training split, init from the target, TTT training with
    Lightning (resumed from lightning/last.ckpt after an interruption). -> (trained drafter, train metrics).
    `loggers()` makes Lightning's loggers, once it is known that training runs. `online`: the frozen target
    that computes the states of sequences stored without them (features=online, and hybrid's first epoch).
    `stream_engine`: the target and placement of the engine that streams the states (features=stream)."""

    # Seeded here, right before anything random, so the result never depends on what ran before
    # (e.g. whether the data came from the cache or was just generated).
    L.seed_everything(cfg.train.seed, workers=True, verbose=False)
    if not on_cuda(cfg.train.accelerator):  # a step's freed temporaries kept for the next (CUDA's allocator does it)
        keep_freed_memory()
    train_idx, val_idx = held_out_split(features)
    with_final = cfg.train.distills
    streamed = cfg.features.kind == "stream"  # (the states come from a stream: eaglelab.train.stream_plan)
    train_set = FeatureDataset(features, train_idx, with_final)
    val_set = FeatureDataset(features, val_idx, with_final, with_tail=True) if val_idx else None  # exact val τ
    module, coverage = drafter_module(cfg, run_dir, model_cfg, target, features, train_idx, online)
    train_options = loader_options(cfg.train, batch_bytes(features, cfg, model_cfg, train_idx))
    loader = training_loader(cfg, features, train_set, train_idx, train_options)
    module.train_batches = loader.batch_sampler
    ranks = current_ranks()
    val_share = shard_validation(module, ranks, len(val_idx))
    val_options = loader_options(cfg.train, batch_bytes(features, cfg, model_cfg, val_idx))
    if streamed:  # every sample each rank will read, in order: the stream's plan (eaglelab.train.stream_plan)
        plan = stream_plan(cfg, features, loader, train_idx, val_idx, [val_share(r) for r in range(ranks.world_size)])
        val_loader = positioned_validation(val_set, plan, ranks.rank, module, loader, val_options) if val_set else None
    else:
        val_loader = validation_loader(cfg, val_set, val_share(ranks.rank), val_options) if val_set else None
    ckpt = run_dir / "lightning" / "last.ckpt"
    state = readable_checkpoint(ckpt)  # every DDP process reads the same file: the same decision everywhere
    if state is not None and "eaglelab_train_metrics" in state:  # training had finished: its result stands
        return finished_earlier(module, state, ckpt)
    resume = resume_point(run_dir, ckpt, state)
    del state
    keep_best = best_keeper(cfg, run_dir)
    trainer = make_trainer(cfg, run_dir, loggers(), [keep_best] if keep_best else [])
    with contextlib.ExitStack() as stream:
        if streamed:
            width = len(model_cfg.aux_layer_ids) * model_cfg.target_hidden_size
            streaming = stream.enter_context(
                streamed_states(cfg, run_dir, features, plan, stream_engine, width, model_cfg.target_hidden_size,
                                with_final, stream_lookahead(train_options), resumed=resume is not None)
            )  # fmt: skip
            read_from_stream(streaming, loader, module, train_set, val_set)
        trainer.fit(module, loader, val_loader, ckpt_path=resume)
    if streamed:  # what the stream cost, and which rows each epoch trained on (each once: tests/test_stream.py)
        atomic_write_json(run_dir / "stream" / f"trained-rank{ranks.rank}.json", module.trained_rows)
    if trainer.interrupted:
        raise KeyboardInterrupt("training interrupted")
    metrics = trained_metrics(trainer, module, keep_best)
    metrics.update(streaming.metrics if streamed else {})
    metrics.update(training_extent(train_idx, val_idx, coverage, trainer))
    module.final_metrics = metrics
    save_finished(trainer, ckpt, keep_best, run_dir)
    release_target(module)
    return module.drafter, metrics


def held_out_split(features: Sequences) -> tuple[list[int], list[int]]:
    """The training and the validation sequences (is_val: the held-out validation prompts' own)."""
    is_val = features["is_val"]
    train_idx = [i for i, v in enumerate(is_val) if not v]
    val_idx = [i for i, v in enumerate(is_val) if v]
    if not train_idx:
        raise EaglelabError(
            "no training sequences left once the validation prompts are held out; raise data.num_prompts"
        )
    return train_idx, val_idx


def drafter_module(
    cfg: RunConfig,
    run_dir: Path,
    model_cfg: Eagle3Config,
    target: TargetWeights,
    features: Sequences,
    train_idx: list[int],
    online: OnlineStates | None,
) -> tuple[DrafterModule, float]:
    """The drafter ready to train: the training split's draft vocabulary, its start from the target, where its target
    states come from. -> (module, the share of the training tokens the draft vocabulary covers)."""
    draft_ids, coverage = draft_vocab(  # streamed: one sequence at a time, not an int64 copy of the set per rank
        (features.item(i, with_states=False)["input_ids"] for i in train_idx),
        (int(features.tokens.prompt_len[features.rows[i]]) for i in train_idx),  # (not item() a second time)
        model_cfg.vocab_size,
        model_cfg.draft_vocab_size,
        spans=(features.tokens.spans(features.rows[i]) for i in train_idx),  # (multi-turn: every assistant turn)
    )
    module = DrafterModule(model_cfg, cfg.train)
    head = init_from_target(
        module, target, draft_ids, cfg.drafter.init_lm_head_from_target, cfg.drafter.init_layers_from_target
    )
    module.target_head = head if cfg.train.distills else None  # only a distilled loss reads the teacher's head
    if features.states is None and online is None and cfg.features.kind != "stream":
        raise EaglelabError("these sequences have no cached states and no target was given to compute them")
    module.online = online
    if cfg.features.kind == "hybrid" and features.states is None:
        run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]  # the same in every process
        # (the states it publishes are the entry's: with the final state when the entry keeps it, whatever the loss)
        module.hybrid = HybridStates(features, features.states_dir, features.keeps_final, run_id, cfg.data.shard_size)
    return module, coverage


def training_loader(
    cfg: RunConfig, features: Sequences, train_set: FeatureDataset, train_idx: list[int], options: dict
) -> ResumableLoader:
    """The training batches, epoch by epoch (EpochBatches; PositionedBatches when the states are streamed): a
    loader Lightning checkpoints, so a resumed run goes on mid-epoch."""
    return ResumableLoader(
        train_set,
        collate_fn=collate,
        batch_sampler=(PositionedBatches if cfg.features.kind == "stream" else EpochBatches)(
            len(train_set),
            cfg.train.batch_size,
            cfg.train.seed if cfg.train.data_seed is None else cfg.train.data_seed,
            lengths=(  # (only a token budget reads them)
                features.tokens.lengths()[[features.rows[i] for i in train_idx]].tolist()
                if cfg.train.tokens_per_batch
                else None
            ),
            tokens_per_batch=cfg.train.tokens_per_batch,
        ),
        **options,
    )


def shard_validation(module: DrafterModule, ranks, count: int) -> Callable[[int], list[int] | range]:
    """-> rank r's validation sequences. Each rank validates its share (the counts are summed over the ranks before τ
    and the accuracies are taken: DrafterModule.on_validation_epoch_end). Fewer sequences than ranks: each all."""
    module.val_sharded = ranks.world_size > 1 and count >= ranks.world_size
    return lambda r: validation_share(count, replace(ranks, rank=r)) if module.val_sharded else range(count)


def validation_loader(cfg: RunConfig, val_set: FeatureDataset, share, options: dict) -> torch.utils.data.DataLoader:
    """This rank's share of the validation sequences, in batches of train.batch_size."""
    return torch.utils.data.DataLoader(
        torch.utils.data.Subset(val_set, share),
        batch_size=cfg.train.batch_size,
        collate_fn=collate,
        **options,
    )


def stream_plan(
    cfg: RunConfig, features: Sequences, loader: ResumableLoader, train_idx: list[int], val_idx: list[int], shares
) -> StreamPlan:
    """Every sample each rank will read, in order: the training batches, then each rank's validation share (`shares`,
    one per rank) in batches of train.batch_size. The training sampler reads its positions from it."""
    size, shares = cfg.train.batch_size, [list(s) for s in shares]
    val_batches = [[s[i : i + size] for i in range(0, len(s), size)] for s in shares]
    plan = StreamPlan(loader.batch_sampler, [features.rows[i] for i in train_idx], val_batches,
                      [features.rows[i] for i in val_idx], cfg.train.epochs, len(shares))  # fmt: skip
    loader.batch_sampler.plan, loader.batch_sampler.start_marker = plan, StartMarker()
    return plan


def positioned_validation(
    val_set: FeatureDataset, plan: StreamPlan, rank: int, module: DrafterModule, loader: ResumableLoader, options: dict
) -> torch.utils.data.DataLoader:
    """This rank's validation batches where the plan puts them in the current epoch's stream."""
    return torch.utils.data.DataLoader(
        val_set, batch_sampler=PositionedValidation(plan, rank, lambda: module.current_epoch,
                                                    loader.batch_sampler.start_marker),
        collate_fn=collate, **options,
    )  # fmt: skip


def finished_earlier(module: DrafterModule, state: dict, ckpt: Path) -> tuple[Eagle3Drafter, dict]:
    """The checkpoint of a training that had finished: its weights and metrics stand, nothing is trained again."""
    module.on_load_checkpoint(state)
    module.load_state_dict(state["state_dict"])
    log.info("training finished in an earlier attempt: weights from %s", ckpt)
    return module.drafter, state["eaglelab_train_metrics"]


def resume_point(run_dir: Path, ckpt: Path, state: dict | None) -> str | None:
    """The checkpoint an interrupted training resumes from (None: it starts), the interrupted attempt's log kept."""
    resume = str(ckpt) if state is not None else None
    if resume:
        log.info("resuming training from %s (step %d)", ckpt, state["global_step"])
        if is_primary():
            keep_previous_log(run_dir)
    return resume


def best_keeper(cfg: RunConfig, run_dir: Path) -> KeepBest | None:
    """train.keep=best: the weights of the validation pass with the best acceptance length at train.ttt_steps."""
    monitor = f"val/acceptance_length@k{cfg.train.ttt_steps}"
    return KeepBest(monitor, run_dir / "lightning") if cfg.train.keep == "best" else None


def stream_lookahead(train_options: dict) -> int:
    """How many batches ahead of the step the loader workers read (the stream captures that far ahead)."""
    return train_options.get("num_workers", 0) * train_options.get("prefetch_factor", 0) + 2


def read_from_stream(streaming, loader: ResumableLoader, module: DrafterModule, train_set, val_set) -> None:
    """Both datasets read their states from the stream; the sampler publishes where this attempt starts reading."""
    train_set.stream = streaming.reader
    if val_set:
        val_set.stream = streaming.reader
    marker = loader.batch_sampler.start_marker
    marker.store, marker.name = streaming.store, streaming.spec.name
    module.trained_rows = {}


def trained_metrics(trainer: L.Trainer, module: DrafterModule, keep_best: KeepBest | None) -> dict:
    """The last validation pass's and training's metrics; train.keep=best: the best pass's, its weights restored."""
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("val/", "train/"))}
    if keep_best is not None:  # the best validation pass's weights and metrics replace the last's
        metrics.update(keep_best.restore(module))
    return metrics


def training_extent(train_idx: list[int], val_idx: list[int], coverage: float, trainer: L.Trainer) -> dict:
    """What the drafter was trained on and for how long: the split, the draft vocabulary's coverage, the steps."""
    return {
        "data/train_sequences": len(train_idx),
        "data/val_sequences": len(val_idx),
        "data/draft_vocab_coverage": coverage,
        "train/steps": int(trainer.global_step),
    }


def save_finished(trainer: L.Trainer, ckpt: Path, keep_best: KeepBest | None, run_dir: Path) -> None:
    """The finished state and its metrics in the rolling checkpoint (a rerun returns them); the attempts' logs
    merged."""
    trainer.save_checkpoint(ckpt)  # the finished state with its metrics (every process joins; process 0 writes)
    trainer.strategy.checkpoint_io.teardown()  # (an asynchronous write: on disk before the run goes on)
    if keep_best is not None and is_primary():
        keep_best.clear()
    if is_primary() and any((run_dir / "logs").glob("metrics.attempt*.csv")):
        merge_logs(run_dir / "logs")


def release_target(module: DrafterModule) -> None:
    """The module and the trainer reference each other: drop the target from the module now, so the device memory
    it holds is free when an evaluation engine starts (eaglelab.core.devices.engine_placement collects the rest)."""
    module.online = module.hybrid = None


def loader_options(t: TrainConfig, batch_bytes: int = 0) -> dict:
    """The input pipeline (train.num_workers, null resolved): worker processes read and collate the next batches while
    the step computes, and on CUDA pin them, so the copy to the device is asynchronous. Each worker reads ahead as
    many batches of `batch_bytes` as train.prefetch_gb holds among them all, 1 to 4."""
    cuda = on_cuda(t.accelerator)
    workers = t.num_workers if t.num_workers is not None else (4 if cuda else 0)
    if not workers:
        return {"pin_memory": cuda}
    ahead = max(1, min(4, int(t.prefetch_gb * 1e9 // max(workers * batch_bytes, 1))))
    return {"pin_memory": cuda, "num_workers": workers, "prefetch_factor": ahead, "persistent_workers": True}


def batch_bytes(features, cfg: RunConfig, d: Eagle3Config, indices: list[int]) -> int:
    """A training batch's bytes in host memory, at most: its tokens (train.tokens_per_batch, or batch_size of the
    longest sequences) × what the loader holds per token: the int64 id and label, and, unless the states are computed
    online, the stored states (bf16: the aux layers', the final state for KL). A hybrid run's first epoch holds less,
    but its workers live on into the epochs that read the states."""
    train = cfg.train
    states = len(d.aux_layer_ids) + train.distills
    per_token = 8 + 8 + (0 if cfg.features.kind == "online" else states * d.target_hidden_size * 2)
    if train.tokens_per_batch:
        return train.tokens_per_batch * per_token
    lengths = features.tokens.lengths()
    return train.batch_size * int(max((lengths[features.rows[i]] for i in indices), default=0)) * per_token


def validation_share(count: int, ranks) -> list[int]:
    """Rank r's validation sequences: every W-th from r (no padding, so no sequence is counted twice)."""
    return list(range(ranks.rank, count, ranks.world_size))


def readable_checkpoint(ckpt: Path) -> dict | None:
    """The checkpoint to resume from, if there is one that loads. An unreadable one (truncated by a dying
    node) is not trusted: training starts again, and the next checkpoint replaces the file."""
    if not ckpt.exists():
        return None
    try:
        with uninterruptible("checkpoint read"):  # an interrupt inside torch.load would read as a torn file
            return torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)  # (pages, not a copy)
    except Exception as e:  # any unreadable checkpoint means: start training again
        log.warning("%s cannot be read (%s): training starts again", ckpt, type(e).__name__)
        return None


def init_from_target(
    module, target: TargetWeights, draft_ids: torch.Tensor, init_lm_head: bool, init_layers: bool = False
) -> torch.Tensor:
    """Share the target's embeddings (frozen); optionally start lm_head/norm and the decoder layers at the
    target's. Returns the target's lm_head rows of the draft vocab (the KL teacher)."""
    d = module.drafter
    d.set_vocab(draft_ids)
    # The target's own embedding rows in the target's dtype, as vLLM shares them (a float32 copy of an 8B target's
    # would hold 2.1 GB more per process); frozen, so no optimizer state either.
    d.embed_tokens.weight.data = target.embed.detach().to(d.embed_tokens.weight.device, copy=True)
    head = target.lm_head.float()[draft_ids].clone()
    if init_lm_head:
        d.lm_head.weight.data.copy_(head)
        d.norm.weight.data.copy_(target.norm.float())
    if init_layers:
        init_layers_from_target(d, target.layers)
    return head


def init_layers_from_target(drafter: Eagle3Drafter, layers: list[dict[str, torch.Tensor]]) -> None:
    """Drafter layer i starts at the target's layer L - n + i (n drafter layers): the drafter's output feeds the
    target's final norm and lm_head, so its layer starts as the one that feeds them in the target. The first
    layer reads [embed ; hidden] (2H): both halves start at the target's q/k/v, so at step 0 it attends as the
    target's layer would to the sum of the token and the fused state; hidden_norm starts at input_layernorm."""
    if len(layers) != len(drafter.layers):
        raise EaglelabError(
            f"drafter.init_layers_from_target needs the target's last {len(drafter.layers)} layers, got {len(layers)}"
        )
    for layer, source in zip(drafter.layers, layers):
        own = layer.state_dict()
        # each drafter weight's name in the target's layer (copy_ casts: no float copy of the whole layer)
        names = {n: "input_layernorm.weight" if n == "hidden_norm.weight" else n for n in own}
        # A Qwen3 layer (drafter.layer) on a target without per-head q/k norms: those start at ones
        names = {n: s for n, s in names.items() if s in source or s.split(".")[-2] not in ("q_norm", "k_norm")}
        if missing := sorted(set(names.values()) - source.keys()):
            raise EaglelabError(
                f"drafter.init_layers_from_target: the target's layer has no {', '.join(missing)} (the drafter's "
                f"drafter.layer={drafter.cfg.layer} is not the target's kind of layer); set "
                "drafter.init_layers_from_target=false"
            )
        for name, tensor in own.items():
            if name not in names:
                continue
            weight = source[names[name]]
            # (the projections that read the layer's input: Llama's q/k/v, the latent attention's q and kv latents)
            inputs = ("q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj_with_mqa")
            if layer.first and name in {f"self_attn.{p}.weight" for p in inputs}:
                weight = torch.cat([weight, weight], dim=1)  # [out, 2H]: embedding half, hidden half
            tensor.copy_(weight)


def deterministic(t: TrainConfig) -> bool:
    """train.deterministic, null resolved: deterministic algorithms on a CPU, not on CUDA (config.TrainConfig)."""
    return t.deterministic if t.deterministic is not None else not on_cuda(t.accelerator)


def make_trainer(cfg: RunConfig, run_dir: Path, loggers: list | bool, extra_callbacks: list | None = None):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    t = cfg.train
    # The environment eaglelab.core.ranks read the trial's ranks from, so Lightning's ranks are the same.
    checkpoint_io = AsyncCheckpointIO(AtomicCheckpointIO()) if t.async_checkpoint else AtomicCheckpointIO()
    plugins = [checkpoint_io, cluster_environment()]
    for stale in (run_dir / "lightning").glob(".*.tmp-*"):  # a killed save's temporary file: never the checkpoint
        stale.unlink(missing_ok=True)
    return L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        strategy=t.strategy,
        precision=t.precision,
        num_nodes=t.num_nodes,
        plugins=plugins,
        max_epochs=t.epochs,
        max_steps=t.max_steps,
        gradient_clip_val=t.grad_clip or None,
        accumulate_grad_batches=t.accumulate_grad_batches,
        logger=loggers,
        log_every_n_steps=5,
        deterministic=deterministic(t),
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # EpochBatches shards the batches itself (and resumes mid-epoch)
        # One rolling checkpoint: the resume point after a preemption (written atomically: AtomicCheckpointIO).
        callbacks=[
            ModelCheckpoint(
                dirpath=str(run_dir / "lightning"),
                filename="last",
                save_top_k=1,
                every_n_train_steps=t.checkpoint_every_n_steps,
                enable_version_counter=False,
            ),
            FlushLogsWithCheckpoints(),
            StopOnNonFinite(t.checkpoint_every_n_steps),
            OneSignalOwner(),
            *(extra_callbacks or []),
        ],
        enable_model_summary=False,
        default_root_dir=str(run_dir),
    )
