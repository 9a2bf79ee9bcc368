"""Training-time test (TTT) as a LightningModule.

Per batch the drafter unrolls `ttt_steps` draft steps exactly as it drafts at inference (see
`Eagle3Drafter.unroll`). Step j (1-based) at position t predicts x_{t+j+1}; its label is the target's
greedy token after position t+j. Only drafts an engine would make count: from verified positions
t >= P-1 (the prompt's last token onwards), so every label is an assistant token. The loss is
sum_j w_j * loss_j (w_j = step_decay**(j-1), or train.step_weights), with loss_j cross-entropy on that token or
a divergence between the target's distribution (restricted to the draft vocab) and the drafter's (`train.loss`:
forward or reverse KL, Jensen-Shannon, total variation, -log acceptance; eaglelab.train.loss).
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from torch.utils.data import DataLoader, Sampler

from eaglelab.core import preemption
from eaglelab.core.config import TrainConfig
from eaglelab.core.errors import TrainingError
from eaglelab.core.io import atomic_file
from eaglelab.core.preemption import uninterruptible
from eaglelab.models.acceptance import AcceptanceCounts
from eaglelab.models.drafter import ContextShard, Eagle3Config, Eagle3Drafter
from eaglelab.train.batches import Batch, HybridStates, OnlineStates, acceptance_counts, shift
from eaglelab.train.loss import draft_head_loss, keeps_teacher, teacher_log_probs

# Lightning suggests `sync_dist=True` for every epoch-level value a DDP run logs without it: the validation figures
# below are logged after their counts were summed over the ranks (on_validation_epoch_end), so the hint is wrong here.
warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\('val/")


class EpochBatches(Sampler):
    """Global batches of a seeded per-epoch permutation, of which this process takes its share; resumable.

    Epoch e's order is a seeded randperm(n) (seed and e mixed), cut into global batches of batch_size × world_size
    sequences; rank r takes items r, r+W, ... of each. So W processes with batch_size b step through exactly
    the batches one process with batch_size W·b does (DDP equivalence), and the order never depends on what ran
    before. The batches served in the current epoch are part of a checkpoint (see `ResumableLoader`), so a
    job resumed mid-epoch continues at the next batch instead of replaying or reshuffling the epoch.

    With a token budget (`tokens_per_batch`, and the sequences' `lengths`) a batch is cut by tokens, not by count:
    each window of GROUP_WINDOW sequences of the permutation is sorted by length and cut greedily into batches whose
    padded size, rows × the longest, stays within the budget on each process; the batches are then shuffled (seeded).
    Sequences of like length share a batch, so little of a step is padding, and a batch of short sequences holds many.
    """

    GROUP_WINDOW = 1024  # sequences sorted together: wide enough to find equal lengths, narrow enough to stay random

    def __init__(
        self,
        n: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        lengths: list[int] | None = None,
        tokens_per_batch: int | None = None,
    ):
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.lengths = torch.as_tensor(lengths, dtype=torch.long) if lengths is not None else None
        self.tokens_per_batch = tokens_per_batch
        if tokens_per_batch is not None and (self.lengths is None or len(self.lengths) != n):
            raise ValueError("a token budget needs every sequence's length")
        self.epoch, self.served = 0, 0
        self._resume: tuple[int, int] | None = None  # (epoch, batches already served) from a checkpoint
        self.sampler = self  # Lightning calls set_epoch on `loader.batch_sampler.sampler`

    @staticmethod
    def _world() -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _global_batches(self) -> list[torch.Tensor]:
        _, world = self._world()
        # seed·1000003 + epoch: seed s's second epoch is not seed s+1's first (replicates stay independent)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = (
            torch.randperm(self.n, generator=generator, device="cpu")
            if self.shuffle
            else torch.arange(self.n, device="cpu")
        )
        if self.tokens_per_batch is not None:
            return self._budget_batches(order, world, generator)
        size = self.batch_size * world
        # A last global batch with fewer sequences than processes would leave a process without data.
        return [b for b in order.split(size) if len(b) >= world]

    def _budget_batches(self, order: torch.Tensor, world: int, generator: torch.Generator) -> list[torch.Tensor]:
        """Length-grouped global batches of at most `tokens_per_batch` padded tokens per process (a sequence longer
        than the budget goes alone, one per process), in a seeded random order."""
        batches = []
        for window in order.split(self.GROUP_WINDOW):
            window = window[torch.argsort(self.lengths[window], descending=True, stable=True)]
            start = 0
            while start < len(window):
                longest = int(self.lengths[window[start]])  # the first of a batch is its longest (sorted)
                rows = max(1, self.tokens_per_batch // longest) * world
                batches.append(window[start : start + rows])
                start += rows
        batches = [b for b in batches if len(b) >= world]
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        return batches

    def set_epoch(self, epoch: int) -> None:  # called by Lightning before each training epoch
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self._global_batches())

    def __iter__(self):
        rank, world = self._world()
        start = self._resume[1] if self._resume and self._resume[0] == self.epoch else 0
        self._resume = None
        self.served = start  # counted as the step takes them (`batch_taken`): loader workers run ahead of it
        for i, batch in enumerate(self._global_batches()):
            if i >= start:
                yield self._share(i, batch, rank, world)

    def _share(self, i: int, batch: torch.Tensor, rank: int, world: int) -> list:
        """This process's items of global batch i: its sequences' indices (a stream's sampler adds their positions)."""
        return batch[rank::world].tolist()

    def batch_taken(self) -> None:
        """The training step took the next batch (DrafterModule.on_train_batch_start): a checkpoint written after it
        resumes at the one after."""
        self.served += 1


class ResumableLoader(DataLoader):
    """A DataLoader Lightning checkpoints (it has state_dict/load_state_dict): the sampler's position."""

    def __iter__(self):
        # Lightning makes a resumed run's iterator before it sets the sampler's epoch. Loader workers would start
        # reading batches at once, in the order of the wrong epoch: the real iterator is made at the first batch.
        return _AtFirstBatch(super().__iter__)

    def state_dict(self) -> dict:
        return {"epoch": self.batch_sampler.epoch, "served": self.batch_sampler.served}

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler._resume = (int(state["epoch"]), int(state["served"]))


class _AtFirstBatch:
    def __init__(self, make):
        self.make, self.iterator = make, None

    def __iter__(self):
        return self

    def __next__(self):
        if self.iterator is None:
            self.iterator = self.make()
        return next(self.iterator)


def per_process_mean(count: torch.Tensor) -> torch.Tensor:
    """A count averaged over DDP processes (the count itself in one process). Dividing each process's sum by
    it makes DDP's gradient average the gradient of the global mean, so W processes with batch b train exactly
    like one process with batch W·b although their sequences hold different numbers of tokens."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        count = count.detach().float().clone()
        dist.all_reduce(count)
        return count / dist.get_world_size()
    return count


class FlushLogsWithCheckpoints(L.Callback):
    """A checkpoint and the log rows before it reach the disk together, so a killed run loses neither
    (Lightning's CSV logger otherwise writes every 100 steps)."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        for logger in trainer.loggers:
            logger.save()


class OneSignalOwner(L.Callback):
    """Signals stay eaglelab.core.preemption's in training: Lightning installs its own SIGTERM handler when fit starts,
    and that one runs a DDP collective inside the handler (`preemption.reclaim`)."""

    def on_train_start(self, trainer, pl_module) -> None:
        preemption.reclaim()


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written whole or not at all. Lightning's own save stages the file in the system temp
    folder and `shutil.move`s it, which is a copy (not atomic) when that is another filesystem — node-local
    /tmp, results on NFS: a job killed mid-copy would leave a torn last.ckpt. Here the temporary file sits
    next to the checkpoint and is renamed over it. A signal arriving meanwhile is acted on after it
    (eaglelab.core.preemption): raised inside torch.save's write it would tear the file and turn into a RuntimeError."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        with uninterruptible("checkpoint"), atomic_file(Path(path), "wb") as f:
            torch.save(checkpoint, f)

    def load_checkpoint(self, path, map_location="cpu", weights_only=None) -> dict:
        # To the host first, as Lightning's own default does: its strategy passes no map_location, and torch.load
        # would put every rank's copy on the device it was saved from (cuda:0, beside rank 0's target); Lightning
        # then moves the state to each rank's own device. Memory-mapped (copy-on-write): the ranks of a node read
        # one copy's pages from the page cache instead of each holding the checkpoint in its own memory.
        with uninterruptible("checkpoint read"):  # torch.load reads through Python's file from C++ too
            return torch.load(path, map_location=map_location, weights_only=bool(weights_only), mmap=True)


class StopOnNonFinite(L.Callback):
    """A non-finite loss, gradient or weight stops training before the optimizer step or the checkpoint that would
    keep it (Lightning runs checkpoint callbacks last): lightning/last.ckpt always holds finite weights. Each check
    waits for the device once (a check per tensor made the host wait ~20 times a step): the
    loss and the gradients before every optimizer step, the weights only before a step's checkpoint is written,
    which is all the guarantee needs."""

    def __init__(self, checkpoint_every_n_steps: int):
        self.checkpoint_every_n_steps = checkpoint_every_n_steps
        self.loss: torch.Tensor | None = None

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.loss = loss.detach()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            grads = []  # fp16's loss scaler makes inf gradients on purpose and skips those steps itself
        loss = [self.loss] if self.loss is not None else []
        if not loss + grads:
            return
        finite = finite_each(loss + grads)
        if bool(finite.all()):  # the step's one wait for the device
            return
        if loss and not bool(finite[0]):
            raise TrainingError(
                f"non-finite loss at step {trainer.global_step}; lightning/last.ckpt keeps the last "
                "finite weights; lower train.lr or train.grad_clip"
            )
        raise TrainingError(
            f"non-finite gradient at step {trainer.global_step}; lightning/last.ckpt keeps the last finite weights; "
            "lower train.lr or train.grad_clip"
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.checkpoint_every_n_steps:  # no checkpoint after this step: nothing to guard
            return
        if not weights_finite(pl_module):
            raise TrainingError(
                f"non-finite weights after step {trainer.global_step}; lightning/last.ckpt keeps "
                "the last finite weights; lower train.lr"
            )

    def on_train_end(self, trainer, pl_module) -> None:
        """The last step's weights, which the final checkpoint (`trainer.train_drafter`) keeps, whatever the cadence."""
        if not weights_finite(pl_module):
            raise TrainingError(f"non-finite weights after step {trainer.global_step}; lower train.lr")


def finite_each(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[n] bool on the device: whether each tensor is finite throughout, stacked so that the host waits once, not once
    per tensor. (Element by element: a norm would call finite but huge weights non-finite.)"""
    return torch.stack([torch.isfinite(t.detach()).all() for t in tensors])


def weights_finite(module: torch.nn.Module) -> bool:
    weights = [p for p in module.parameters() if p.requires_grad]
    return not weights or bool(finite_each(weights).all())


class KeepBest(L.Callback):
    """train.keep=best: the drafter of the validation pass with the highest `monitor` (validation τ at k = ttt),
    not the last one. A small drafter on little data overfits (validation τ peaks, then slips while training
    accuracy climbs), so the last epoch is rarely the one to export.

    The best weights (the frozen shared embeddings left out) go to a file of their own, `folder/best-epoch{E}.pt`,
    written by process 0 atomically, instead of a float32 copy in host memory that every checkpoint also carried (about
    5 GB per checkpoint at an 8B drafter's shape). A checkpoint records the best pass's score, epoch and metrics; the
    file it names is kept until a later checkpoint names another, so a run resumed from whichever checkpoint is on
    disk finds its best weights."""

    def __init__(self, monitor: str, folder: Path):
        self.monitor, self.folder = monitor, Path(folder)
        self.score, self.epoch = float("-inf"), -1
        self.metrics: dict[str, float] = {}
        self._checkpointed_epoch = -1  # the best epoch the checkpoint now on disk names (its file stays)

    def path(self, epoch: int) -> Path:
        return self.folder / f"best-epoch{epoch}.pt"

    def on_validation_end(self, trainer, pl_module) -> None:
        score = trainer.callback_metrics.get(self.monitor)
        if trainer.sanity_checking or score is None or not float(score) > self.score:
            return
        self.score, self.epoch = float(score), trainer.current_epoch
        if trainer.is_global_zero:  # (torch.save copies one tensor at a time to the host, not the whole state)
            state = pl_module.drafter.state_dict()
            state = {k: v.detach() for k, v in state.items() if not k.startswith("embed_tokens")}
            with atomic_file(self.path(self.epoch), "wb") as f:
                torch.save(state, f)
        self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        """This checkpoint names the current best; the one it replaces named `_checkpointed_epoch`. Files of any other
        epoch are named by neither and go (process 0, which wrote them)."""
        if trainer.is_global_zero:
            keep = {self.path(self.epoch), self.path(self._checkpointed_epoch)}
            for stale in set(self.folder.glob("best-epoch*.pt")) - keep:
                stale.unlink(missing_ok=True)
        self._checkpointed_epoch = self.epoch

    def restore(self, pl_module) -> dict[str, float]:
        """The best pass's weights into `pl_module`; -> its validation metrics and epoch (empty: never validated)."""
        if self.epoch < 0:
            return {}
        state = torch.load(self.path(self.epoch), map_location="cpu", weights_only=True)
        pl_module.drafter.load_state_dict(state, strict=False)
        return {**self.metrics, "train/kept_epoch": float(self.epoch)}

    def clear(self) -> None:
        """Once the final checkpoint holds the kept weights themselves, their files are not needed."""
        for stale in self.folder.glob("best-epoch*.pt"):
            stale.unlink(missing_ok=True)

    def state_dict(self) -> dict:
        return {"score": self.score, "epoch": self.epoch, "metrics": self.metrics}

    def load_state_dict(self, state: dict) -> None:
        self.score, self.epoch, self.metrics = state["score"], state["epoch"], state["metrics"]
        self._checkpointed_epoch = self.epoch


def adamw(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """The optimizer: AdamW, never the default per-parameter loop, whose parameter-sized temporaries took 2.5 s of a
    4.5 s step at 8B shapes on a CPU (benchmarks/train_throughput.py --profile 8b-64:bf16). Fused (one kernel per
    parameter, on a CPU as on CUDA: 4.7x the loop on a 14336 × 4096 matrix), except under 16-mixed with gradient
    clipping: a fused optimizer unscales the GradScaler's gradients itself, after the clipping, which would then see
    them scaled; there the multi-tensor one (`foreach`: 1.6x the loop). (bf16-mixed has no scaler:
    `DrafterModule.configure_gradient_clipping`.)"""
    fused = not (str(cfg.precision) == "16-mixed" and cfg.grad_clip)
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **kind)


def clip_gradients(module: L.LightningModule, optimizer, clip_val, algorithm) -> None:
    """The gradient clipping of a module whose optimizer is `adamw`'s. Lightning's mixed-precision plugin refuses to
    clip for an optimizer that unscales its own gradients (fused AdamW), as it could not unscale a GradScaler's
    first; bf16-mixed has no scaler, so its gradients are clipped as the plugin's base class clips them."""
    plugin = module.trainer.precision_plugin
    if clip_val and isinstance(plugin, MixedPrecision) and plugin.scaler is None:
        Precision.clip_gradients(plugin, optimizer, clip_val, GradClipAlgorithmType(algorithm or "norm"))
    else:
        module.clip_gradients(optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)


# --- the module --------------------------------------------------------------------------------
class DrafterModule(L.LightningModule):
    def __init__(self, model_cfg: Eagle3Config, train_cfg: TrainConfig, target_head: torch.Tensor | None = None):
        super().__init__()
        self.save_hyperparameters({"model": model_cfg.to_dict(), "train": vars(train_cfg)})
        self.train_cfg = train_cfg
        self.drafter = Eagle3Drafter(model_cfg)
        if train_cfg.freeze_lm_head:  # the output space stays the target's: half the parameters, none of them learnt
            for p in (*self.drafter.lm_head.parameters(), *self.drafter.norm.parameters()):
                p.requires_grad_(False)
        self.drafter.activation_checkpointing = train_cfg.activation_checkpointing
        # Target lm_head rows of the draft vocab [V_draft, H_t], frozen: the distilled losses' teacher, None for CE. A
        # plain attribute, not a buffer: DDP would broadcast a buffer every step, and it is never saved.
        self.target_head = target_head
        self.val_k = (train_cfg.ttt_steps, 2 * train_cfg.ttt_steps)
        self._val_counts: dict[int, AcceptanceCounts] = {}
        self._val_acc: list[list[float]] = []

    online: OnlineStates | None = None  # online and hybrid features: the frozen target (not a submodule)
    hybrid: HybridStates | None = None  # hybrid features: the first epoch's states, cached for the later ones

    def on_after_batch_transfer(self, batch: Batch, dataloader_idx: int) -> Batch:
        """A batch without states (online features, or hybrid's first epoch): the target computes them here, on
        the training device, for training and validation alike."""
        if batch.aux is None:
            batch = self.online(batch)
            if self.hybrid is not None:
                self.hybrid.record(batch)
            # Lightning casts a batch to a "-true" precision before the transfer (the loops' convert_input), when
            # these states did not exist yet: the same cast here, or fc meets float32 states with 16-bit weights.
            if self._trainer is not None:
                batch = self.trainer.precision_plugin.convert_input(batch)
        return batch

    _epoch_started: float | None = None
    _batch_ended: float | None = None
    _input_wait = 0.0
    _positions: torch.Tensor | int = 0
    _computed = 0

    def on_train_epoch_start(self) -> None:
        self._epoch_started, self._batch_ended, self._input_wait = time.perf_counter(), None, 0.0
        self._positions = self._computed = 0  # sequence positions trained, and positions computed (padding too)

    trained_rows: dict[int, list[int]] | None = None  # per epoch, the rows trained on (set to {} to record them)

    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        if self.train_batches is not None:
            self.train_batches.batch_taken()
        if self.trained_rows is not None:
            self.trained_rows.setdefault(self.current_epoch, []).extend(batch.index.tolist())
        # From one step's end to the next one's start the loop waits for the next batch (read, collated, moved to
        # the device, and with online features the target's forward): the input pipeline's share of the epoch.
        if self._batch_ended is not None:
            self._input_wait += time.perf_counter() - self._batch_ended

    def on_train_batch_end(self, outputs, batch: Batch, batch_idx: int) -> None:
        self._batch_ended = time.perf_counter()

    def on_train_epoch_end(self) -> None:  # (Lightning 2 calls it after the epoch's validation)
        if self.hybrid is not None and not self.hybrid.published:
            self.hybrid.publish(self.online, self.device, self.trainer.strategy, self.train_cfg.batch_size)
        # Per-epoch wall time (logs/metrics.csv): what online features cost, and what hybrid's cache saves later.
        # Not for an epoch this attempt did not start (a resume may begin at its end); a resumed one logs its rest.
        if self._epoch_started is not None:
            self.log("time/epoch_s", time.perf_counter() - self._epoch_started, sync_dist=True)
            self.log("time/input_wait_s", self._input_wait, sync_dist=True)
            if self._computed and self._batch_ended is not None:  # what batching costs, and positions per second
                positions, training_s = float(self._positions), self._batch_ended - self._epoch_started  # (no val.)
                self.log("train/padding_share", 1.0 - positions / self._computed, sync_dist=True)
                self.log("time/positions_per_s", positions / training_s, sync_dist=True)  # per process
            self._epoch_started = None

    def teacher_head(self) -> torch.Tensor:
        """The teacher's head rows, moved once to the training device (not being a buffer, they do not move with
        the module)."""
        if self.target_head is None:
            raise TrainingError(
                f"train.loss={self.train_cfg.loss} needs the target's lm_head rows (DrafterModule's target_head)"
            )
        if self.target_head.device != self.device:
            self.target_head = self.target_head.to(self.device)
        return self.target_head

    def ttt(self, batch: Batch, steps: int, outs: list | None = None, shard: ContextShard | None = None):
        """-> (weighted loss, [loss_j], [correct_j], [count_j]) over draft steps j = 1..steps. `shard` (context
        parallelism): this rank's positions of every sequence (batch.aux holds theirs, the rest of the batch the
        whole sequences'); its terms are its positions' sums over the mean count per process, as DDP's are."""
        d = self.drafter
        outs = outs or d.unroll(batch.aux, batch.input_ids, steps, first=batch.first, shard=shard)
        target_to_draft = torch.cumsum(d.t2d.long(), 0) - 1  # target id -> draft index (if in vocab)
        B, T = batch.input_ids.shape
        lo, hi = (shard.start, shard.end) if shard is not None else (0, T)
        teacher = None  # distilled: the teacher's log-probabilities at every position [B·T, V_d], where small to keep
        if self.train_cfg.distills and keeps_teacher(B * T, d.lm_head.weight.shape[0]):
            teacher = teacher_log_probs(batch.final.flatten(0, 1), self.teacher_head())
        total, losses, correct, counted = 0.0, [], [], []
        for j, out in enumerate(outs, start=1):
            # Only drafts an engine makes: from t >= P-1, inside the sequence. Their indices once per step (the one
            # host sync of a step: a boolean mask would wait for the device at each of its uses, and backward).
            valid = batch.drafting(j)[:, lo:hi].nonzero(as_tuple=True)  # (b, t - lo): this rank's positions
            label = shift(batch.target_next, j)[:, lo:hi][valid]  # target's greedy token after t+j: [N]
            # Summed over the rows, through the head in chunks (eaglelab.train.loss: no [N, V_draft] logits kept)
            if self.train_cfg.loss == "ce":  # tokens outside the draft vocab cannot be learnt (index -1)
                index = target_to_draft[label].masked_fill(~d.t2d[label], -1)
                summed, draft = draft_head_loss(out.normed[valid], d.lm_head.weight, index=index)
                count = d.t2d[label].sum()
            else:  # distilled from the target's next-token distribution at t+j
                if teacher is not None:
                    rows = valid[0] * T + valid[1] + lo + j  # (its rows in the kept log-probabilities)
                    kl = dict(teacher=teacher, teacher_rows=rows)
                else:  # (from the target's post-norm state at t+j)
                    kl = dict(teacher_states=shift(batch.final, j)[:, lo:hi][valid], teacher_head=self.teacher_head())
                summed, draft = draft_head_loss(
                    out.normed[valid], d.lm_head.weight, divergence=self.train_cfg.loss, **kl
                )
                count = torch.tensor(float(len(label)), device=label.device)
            loss_j = summed / per_process_mean(count).clamp(min=1)
            hit = d.to_target_ids(draft) == label
            total = total + self.train_cfg.step_weight(j) * loss_j
            losses.append(loss_j.detach())
            correct.append(hit.sum())  # a device tensor: read when logged, not here
            counted.append(len(label))
        return total, losses, correct, counted

    def training_step(self, batch: Batch, batch_idx: int):
        loss, losses, correct, counted = self.ttt(batch, self.train_cfg.ttt_steps)  # (checked: StopOnNonFinite)
        self._positions = self._positions + batch.seq_len.sum()  # (a device tensor: read once an epoch)
        self._computed += batch.input_ids.numel()
        # Each process's terms are already divided by the mean count per process, so their mean over
        # processes (sync_dist) is the global figure; in one process sync_dist does nothing.
        bs = batch.input_ids.shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=bs, sync_dist=True)
        for j, (l_j, c, n) in enumerate(zip(losses, correct, counted), start=1):
            self.log(f"train/loss@d{j}", l_j, batch_size=bs, sync_dist=True)
            n_mean = per_process_mean(torch.tensor(float(n), device=loss.device))  # NCCL reduces GPU tensors only
            self.log(f"train/acc@d{j}", c / n_mean.clamp(min=1), batch_size=bs, sync_dist=True)
        return loss

    def on_validation_epoch_start(self):
        self._val_counts = {k: AcceptanceCounts(k=k) for k in self.val_k}
        self._val_acc = []

    def validation_step(self, batch: Batch, batch_idx: int):
        steps = max(self.val_k)
        outs = self.drafter.unroll(batch.aux, batch.input_ids, steps, first=batch.first)  # one unroll for both
        _, _, correct, counted = self.ttt(batch, steps, outs)
        self._val_acc.append([correct, counted])
        counts = acceptance_counts(self.drafter, batch, steps, outs)
        for k in self.val_k:
            self._val_counts[k].add(counts[k])

    val_sharded = False  # each rank validated its share of the sequences: the counts are summed over the ranks

    def on_validation_epoch_end(self):
        if not self._val_acc:
            return
        steps = max(self.val_k)
        # Integer counts, summed over the ranks' shares in one reduce: τ and the accuracies are one process's.
        sums = [int(sum(r[0][j] for r in self._val_acc)) for j in range(steps)]
        sums += [int(sum(r[1][j] for r in self._val_acc)) for j in range(steps)]
        sums += [n for c in self._val_counts.values() for n in (c.drafts, c.accepted)]
        total = torch.tensor(sums, dtype=torch.long, device=self.device)
        if self.val_sharded:
            total = self.trainer.strategy.reduce(total, reduce_op="sum")
        total = total.tolist()
        correct, counted, rounds = total[:steps], total[steps : 2 * steps], total[2 * steps :]
        for j in range(steps):
            self.log(f"val/acc@d{j + 1}", correct[j] / max(counted[j], 1))
        for i, k in enumerate(self._val_counts):
            drafts, accepted = rounds[2 * i], rounds[2 * i + 1]
            self.log(f"val/acceptance_length@k{k}", 1.0 + accepted / max(drafts, 1), prog_bar=True)

    # The shared embeddings are the target's, frozen: left out of checkpoints (half their size at SmolLM2
    # scale, and a checkpoint is written every `train.checkpoint_every_n_steps`), put back on load.
    final_metrics: dict | None = None  # set when training has finished: the final checkpoint carries them

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["state_dict"].pop("drafter.embed_tokens.weight", None)
        if self.final_metrics is not None:
            checkpoint["eaglelab_train_metrics"] = self.final_metrics

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["state_dict"].setdefault("drafter.embed_tokens.weight", self.drafter.embed_tokens.weight.detach())

    train_batches: EpochBatches | None = None  # set before fit: the training loader's batch sampler

    def _total_steps(self) -> int:
        """Optimizer steps of the whole run (the LR schedule's length), from the batch sampler. Lightning's
        `estimated_stepping_batches` would set the train loader up before a checkpoint's loader state is
        restored, and a resumed run would then start its epoch's data order again."""
        if self.train_batches is None:
            return int(self.trainer.estimated_stepping_batches)
        per_epoch = -(-len(self.train_batches) // self.trainer.accumulate_grad_batches)  # (a last partial one steps)
        steps = per_epoch * self.trainer.max_epochs
        return min(steps, self.trainer.max_steps) if self.trainer.max_steps > 0 else steps

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        cfg = self.train_cfg
        opt = adamw([p for p in self.drafter.parameters() if p.requires_grad], cfg)
        total = max(self._total_steps(), 1)
        warmup = min(cfg.warmup_steps, max(total // 10, 1))

        def schedule(step):  # linear warm-up, cosine decay to 10%
            if step < warmup:
                return (step + 1) / warmup
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
