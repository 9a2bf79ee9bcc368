"""Batches of captured sequences, and simulated acceptance from one unrolled forward.

Plain torch, below training in the data flow: training, evaluation and the drift diagnostics all read
batches through here, so evaluating a drafter needs no Lightning. Every tensor made here takes its device
from the batch.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from eaglelab.core.io import atomic_write_json, file_lock
from eaglelab.data.capture import capture_states
from eaglelab.data.store import (
    COMPLETE,
    Sequences,
    StateStore,
    StateWriter,
    entry_lock,
    is_complete,
    shard_lock,
    state_shards_meta,
)
from eaglelab.models.acceptance import AcceptanceCounts, DepthAccuracy, SequenceCounts, expected_rounds, simulate
from eaglelab.models.drafter import Eagle3Drafter

log = logging.getLogger(__name__)


# --- data ------------------------------------------------------------------------------------
class FeatureDataset(Dataset):
    """Sequences of a prepared set, read one at a time from the stores (never the whole split in memory).
    Items carry their states when the set has them and `with_states`; otherwise the target computes them
    in the training step (online features, `OnlineStates`)."""

    def __init__(
        self,
        sequences: Sequences,
        indices: list[int],
        with_final: bool,
        with_states: bool = True,
        with_tail: bool = False,
        stream=None,
    ):
        self.sequences, self.indices = sequences, list(indices)
        self.with_final, self.with_states, self.with_tail = with_final, with_states, with_tail
        # Streamed states (eaglelab.data.stream.StreamReader): items are asked for as (index, position in the stream)
        self.stream = stream

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        if self.stream is None:
            return self.sequences.item(
                self.indices[i], with_states=self.with_states, with_final=self.with_final, with_tail=self.with_tail
            )
        i, position = i
        item = self.sequences.item(self.indices[i], with_states=False, with_tail=self.with_tail)
        states = self.stream.read(position, item["seq_len"])
        item["aux"], item["target_next"] = states["aux"], states["target_next"]
        if self.with_final:
            item["final"] = states["final"]
        return item


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] the sequences, then (evaluation) their tails, then 0 padding
    prompt_len: torch.Tensor  # [B]
    seq_len: torch.Tensor  # [B] tokens of the sequence proper (states, labels and losses stop here)
    index: torch.Tensor  # [B] the sequences' rows in their store
    known_len: torch.Tensor | None = None  # [B] seq_len + the tail's length (None: no tail, seq_len)
    target_next: torch.Tensor | None = None  # [B, T] target's greedy next token (None until states are known)
    aux: torch.Tensor | None = None  # [B, T, n·H_t] captured target states, in the dtype they were stored in
    final: torch.Tensor | None = None  # [B, T, H_t] target post-norm state (KL only), likewise
    # [B, S, 2] earlier assistant turns (start, end) of multi-turn conversations, trained on like the response
    # [prompt_len, seq_len); (0, 0) pads. None: one turn each.
    spans: torch.Tensor | None = None

    def pin_memory(self) -> Batch:
        """The batch in page-locked host memory (DataLoader(pin_memory=True) calls this): its copy to a CUDA device can
        then run beside the step."""
        return Batch(**{k: v.pin_memory() if v is not None else None for k, v in vars(self).items()})

    @property
    def first(self) -> torch.Tensor:
        """[B] the first verified position drafts are made (and trained) from: the last token before the first
        assistant turn (the prompt's last token, with one turn)."""
        if self.spans is None:
            return self.prompt_len - 1
        starts = self.spans[..., 0].masked_fill(self.spans[..., 1] == 0, 1 << 30)  # [B, S] (padding: never first)
        return torch.minimum(self.prompt_len, starts.min(-1).values) - 1

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, T] 1 inside each sequence, 0 on the right padding."""
        pos = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        return (pos < self.seq_len[:, None]).long()

    def drafting(self, j: int) -> torch.Tensor:
        """[B, T] positions t that draft (t >= P-1) and whose j-th draft x_{t+j+1} is in the sequence; in a
        multi-turn conversation, also those drafting inside an earlier assistant turn [s, e): s-1 <= t, t+j+1 < e
        (as an engine serving that turn drafts; the user's next turn is never a draft's target)."""
        pos = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        mask = (pos >= self.prompt_len[:, None] - 1) & (pos + j + 1 < self.seq_len[:, None])
        if self.spans is not None:
            s, e = self.spans[..., :1], self.spans[..., 1:]  # [B, S, 1] each
            mask |= ((pos >= s - 1) & (pos + j + 1 < e) & (e > 0)).any(1)
        return mask


def collate(items: list[dict]) -> Batch:
    T = max(len(it["input_ids"]) for it in items)
    known_len = torch.tensor([len(it["input_ids"]) for it in items], device="cpu")  # the sequence and its tail, if any
    seq_len = torch.tensor([it.get("seq_len", len(it["input_ids"])) for it in items], device="cpu")

    def pad(key, value=0):
        if key not in items[0]:
            return None
        out = []
        for it in items:
            x = it[key]
            out.append(F.pad(x, (0, 0, 0, T - len(x)) if x.dim() == 2 else (0, T - len(x)), value=value))
        return torch.stack(out)

    aux, final = pad("aux"), pad("final")
    spans = None
    if any("spans" in it for it in items):  # [B, S, 2], (0, 0) padding
        S = max(len(it.get("spans", ())) for it in items)
        spans = torch.zeros(len(items), S, 2, dtype=torch.long)
        for b, it in enumerate(items):
            if "spans" in it:
                spans[b, : len(it["spans"])] = it["spans"]
    return Batch(
        input_ids=pad("input_ids"),
        prompt_len=torch.tensor([it["prompt_len"] for it in items], device="cpu"),
        seq_len=seq_len,
        index=torch.tensor([it["index"] for it in items], device="cpu"),
        known_len=known_len,
        target_next=pad("target_next", value=-1),
        aux=aux,  # in the stored dtype: the drafter reads it in its own, on its device (`Eagle3Drafter.fc_input`)
        final=final,
        spans=spans,
    )


class OnlineStates:
    """Online features: the frozen target inside the training step. It runs on the batch's device, in its own
    dtype (never under the trainer's autocast), without gradients, and fills in what a cache would have held:
    the aux states, the post-norm state (KL only) and the greedy labels. Aux-layer and fc_norm ablations then
    share one token cache instead of each capturing terabytes."""

    def __init__(self, model: torch.nn.Module, aux_layer_ids: list[int], with_final: bool):
        self.model, self.aux_layer_ids, self.with_final = model, list(aux_layer_ids), with_final

    @torch.no_grad()
    def __call__(self, batch: Batch) -> Batch:
        device = batch.input_ids.device
        if next(self.model.parameters()).device != device:
            self.model.to(device)  # each process's copy, where it trains (a no-op once placed)
        with torch.autocast(device.type, enabled=False):
            aux, final, nxt = capture_states(
                self.model, batch.input_ids, batch.attention_mask, self.aux_layer_ids, batch.first
            )
        return replace(
            batch,
            target_next=nxt,
            aux=aux.float(),
            final=final.float() if self.with_final else None,
        )


class HybridStates:
    """Hybrid features: the states the target computes online in the first epoch are written as they come, by
    every process into state shards of its own of `shard_sequences` each (a shard counts once its rows list is
    written: a kill loses at most the shard in flight on each process), and at the end of that epoch published
    as the set's state store, where the later epochs (and other trials with the same cache key: it is `cached`'s
    entry) read them. Sequences no closed shard holds (the shards in flight when an attempt was killed, a dropped
    last batch) are computed then, each process a share."""

    def __init__(self, sequences: Sequences, folder: Path, with_final: bool, run_id: str, shard_sequences: int):
        self.sequences, self.folder, self.with_final = sequences, Path(folder), with_final
        self.shard_sequences = shard_sequences
        self.partial = self.folder.parent / f".{self.folder.name}.partial-{run_id}"  # this run's processes
        self.writer: StateWriter | None = None
        self.seen: set[int] | None = None  # rows written by this run's processes (any attempt), read on first use

    @property
    def published(self) -> bool:
        return self.sequences.states is not None

    def record(self, batch: Batch) -> None:
        if self.published:
            return
        if self.seen is None:  # a resumed attempt: what earlier attempts' closed shards hold is not written twice
            self.seen = {i for _, rows in self._done() for i in rows}
        if self.writer is None:
            self.partial.mkdir(parents=True, exist_ok=True)
            self.writer = StateWriter(self.partial / f"{uuid.uuid4().hex}.arrow", self.with_final)
        self._write(self.writer, batch)
        if len(self.writer.rows) >= self.shard_sequences:
            self._close()

    def _close(self) -> None:
        rows = self.writer.close()  # its rows are written after it: a shard without them is not used
        atomic_write_json(self.partial / f"{self.writer.path.name}.rows.json", rows)
        self.writer = None

    def publish(self, online: OnlineStates, device: torch.device, strategy, batch_size: int) -> None:
        """Every process closes its shard, computes its share of what no closed shard holds, then rank 0 merges
        the shards' row lists into the entry (under the entry's lock)."""
        if self.published:
            return
        if self.writer is not None:
            self._close()
        strategy.barrier()
        missing = self._missing()
        if not is_complete(self.folder):  # (another trial published it first: nothing to compute)
            share = missing[strategy.global_rank :: strategy.world_size]
            self._compute(share, online, device, batch_size)
        if missing and strategy.global_rank == 0:
            log.info("hybrid: %d sequences no closed shard held, computed over %d processes", len(missing),
                     strategy.world_size)  # fmt: skip
        strategy.barrier()
        if strategy.global_rank == 0:
            self._publish(online, device, batch_size, recomputed=len(missing))
        strategy.barrier()
        self.sequences.states = StateStore(self.folder)

    def _compute(self, indices: list[int], online: OnlineStates, device: torch.device, batch_size: int) -> None:
        if not indices:
            return
        self.partial.mkdir(parents=True, exist_ok=True)
        data = FeatureDataset(self.sequences, indices, self.with_final, with_states=False)
        self.writer = StateWriter(self.partial / f"rest-{uuid.uuid4().hex}.arrow", self.with_final)
        for batch in DataLoader(data, batch_size=batch_size, collate_fn=collate):  # in the order a loader batches
            self._write(self.writer, online(move(batch, device)))
        self._close()

    def _publish(self, online: OnlineStates, device: torch.device, batch_size: int, recomputed: int) -> None:
        """Under the entry's lock, as a `cached` preparation completes it: a whole entry is never replaced. A
        capture of the same entry may be writing its `shard-NNNNN` files into the folder meanwhile (another trial,
        features=cached): this run's shards join them under their own names, complete.json lists only this run's,
        and that capture stops once it sees the entry complete; shards no live capture holds are removed."""
        with entry_lock(self.folder):
            if is_complete(self.folder):  # another trial published (or captured) it first: theirs stands
                shutil.rmtree(self.partial, ignore_errors=True)
                return
            # What no process's listing showed it (a shared file system's stale view): computed here, so the entry
            # holds every sequence.
            if late := self._missing():
                self._compute(late, online, device, batch_size)
            shards = self._done()
            self.folder.mkdir(parents=True, exist_ok=True)
            for name, _ in shards:
                os.replace(self.partial / name, self.folder / name)
            for leftover in self.folder.glob("shard-*.arrow"):  # a killed capture's, unless one is writing it
                with file_lock(shard_lock(self.folder, leftover.name), wait=False) as free:
                    if free:
                        leftover.unlink()
            sizes = {name: (self.folder / name).stat().st_size for name, _ in shards}
            meta = state_shards_meta(shards, self.with_final, recomputed=recomputed + len(late))
            atomic_write_json(self.folder / COMPLETE, {**meta, "shard_bytes": sizes})
            shutil.rmtree(self.partial, ignore_errors=True)

    def _write(self, writer: StateWriter, batch: Batch) -> None:
        self.seen = set() if self.seen is None else self.seen
        for b, i in enumerate(batch.index.tolist()):
            if i not in self.seen:  # validation repeats sequences; DDP processes may share a last batch
                n = int(batch.seq_len[b])
                final = batch.final[b, :n] if self.with_final else None
                writer.write(i, batch.aux[b, :n], batch.target_next[b, :n], final)
                self.seen.add(i)

    def _missing(self) -> list[int]:
        """The sequences (indices into `sequences`) that no closed shard of this run holds."""
        covered = {i for _, rows in self._done() for i in rows}
        return [i for i, row in enumerate(self.sequences.rows) if row not in covered]

    def _done(self) -> list[tuple[str, list[int]]]:
        """The closed shards of this run's processes and their rows, in a fixed order (every process reads one)."""
        done = sorted(p for p in self.partial.glob("*.arrow") if (self.partial / f"{p.name}.rows.json").is_file())
        return [(p.name, json.loads((self.partial / f"{p.name}.rows.json").read_text())) for p in done]


def move(batch: Batch, device: torch.device) -> Batch:
    return Batch(**{k: v.to(device) if v is not None else None for k, v in vars(batch).items()})


def shift(x: torch.Tensor, by: int, value=0) -> torch.Tensor:
    """x[:, t + by] at index t (padded with `value` past the end)."""
    T = x.shape[1]
    pad = (0, 0, 0, by) if x.dim() == 3 else (0, by)
    return F.pad(x, pad, value=value)[:, by : by + T]


# --- acceptance from one unrolled forward -----------------------------------------------------
@torch.no_grad()
def acceptance_counts(
    drafter: Eagle3Drafter,
    batch: Batch,
    max_k: int,
    outs: list | None = None,
    depth: DepthAccuracy | None = None,
    per_sequence: list[SequenceCounts] | None = None,
) -> dict[int, AcceptanceCounts]:
    """Simulated greedy-chain acceptance for every k <= max_k from one max_k-step unroll (`outs`, when
    the caller already ran it). Drafts past a sequence's end are scored against its tail (in input_ids up to
    known_len), as an engine scores them before it truncates; past the known tokens they are misses. `depth`,
    when given, accumulates the same drafts' teacher-forced accuracy at d = 1..max_k (inside the sequence);
    `per_sequence`, when given, receives each sequence's own counts of both."""
    outs = outs or drafter.unroll(batch.aux, batch.input_ids, max_k, first=batch.first)
    drafting = batch.drafting(0)  # verified positions t >= P-1 with x_{t+1} in the sequence
    drafts = torch.full(
        (*batch.input_ids.shape, max_k), -1, dtype=torch.long, device=batch.input_ids.device
    )  # [B, T, K]
    for j, out in enumerate(outs):
        drafts[..., j][drafting] = drafter.to_target_ids(drafter.lm_head(out.normed[drafting]).argmax(-1))
    known = batch.seq_len if batch.known_len is None else batch.known_len
    pos = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
    tokens = batch.input_ids.masked_fill(pos >= known[:, None], -2)  # no draft equals an unknown token
    truth = torch.stack([shift(tokens, j + 1, value=-2) for j in range(1, max_k + 1)], dim=-1)
    matches = drafts == truth  # draft j at s vs x_{s+j+1}
    if depth is not None or per_sequence is not None:  # (validation during training asks for neither)
        inside = torch.stack([batch.drafting(d) for d in range(1, max_k + 1)], dim=-1)  # [B, T, K] scored at d
        correct, counted = (matches & inside).sum(1).tolist(), inside.sum(1).tolist()  # [B][K] each, one sync
    if depth is not None:
        for d in range(max_k):
            depth.correct[d] += sum(row[d] for row in correct)
            depth.counted[d] += sum(row[d] for row in counted)
    totals = {k: AcceptanceCounts(k=k) for k in range(1, max_k + 1)}
    for b in range(batch.input_ids.shape[0]):
        n, p = int(batch.seq_len[b]), int(batch.prompt_len[b])
        own = {k: simulate(matches[b, :n], p, n, k) for k in totals}
        for k in totals:
            totals[k].add(own[k])
        if per_sequence is not None:
            per_sequence.append(SequenceCounts(int(batch.index[b]), own, DepthAccuracy(max_k, correct[b], counted[b])))
    return totals


@torch.no_grad()
def expected_acceptance(
    drafter: Eagle3Drafter,
    batch: Batch,
    lm_head: torch.Tensor,
    max_k: int,
    temperature: float,
    draft_sampling: str = "greedy",
    outs: list | None = None,
) -> tuple[int, list[float]]:
    """Speculative sampling at `temperature`, simulated along the stored continuation. The target accepts the j-th
    draft of a round from s with probability α_j(s), p being the target's distribution for x_{s+j+1} (`lm_head`
    [V, H] over its post-norm final state at s+j) and q the drafter's step j (zero outside the draft vocabulary):
      greedy (vLLM's default draft_sample_method): the draft is argmax q, treated as one-hot: α = p(argmax q);
      probabilistic: the draft is sampled from q and kept with min(1, p/q): α = Σ_x min(p(x), q(x)).
    The chain from s is unbroken after d drafts with probability Π_{j<=d} α_j(s) (it stops at its first rejection),
    and the rounds a decode starts are weighted by the chance it starts one there (acceptance.expected_rounds).
    -> ([expected rounds], [expected accepted drafts]) for k = 1..max_k, summed over the batch: τ@k = 1 +
    accepted_k / rounds_k. Needs `batch.final` (states cached with it). `outs`: the max_k-step unroll, when the
    caller already ran it (it depends on neither the temperature nor the draft sampling)."""
    outs = outs or drafter.unroll(batch.aux, batch.input_ids, max_k, first=batch.first)
    drafting = batch.drafting(0)  # [B, T] verified positions that draft
    draft_to_target = drafter.to_target_ids(torch.arange(drafter.d2t.shape[0], device=drafting.device))  # [V_d]
    alive = torch.zeros(*drafting.shape, max_k, dtype=torch.float64, device=drafting.device)  # [B, T, K]
    survive = torch.ones(int(drafting.sum()), device=drafting.device)  # [N] chance the chain is still unbroken
    for j, out in enumerate(outs, start=1):
        scored = batch.drafting(j)[drafting]  # the j-th draft's token inside the sequence (else the chain ends)
        logits = drafter.lm_head(out.normed[drafting]).float()  # [N, V_d]
        p = F.softmax((shift(batch.final, j)[drafting].to(lm_head.dtype) @ lm_head.T).float() / temperature, -1)
        p = p[:, draft_to_target]  # [N, V_d]: the target's probability of each draft-vocabulary token
        if draft_sampling == "greedy":
            alpha = p.gather(-1, logits.argmax(-1, keepdim=True))[:, 0]
        else:
            alpha = torch.minimum(p, F.softmax(logits / temperature, dim=-1)).sum(-1)
        survive = survive * alpha * scored
        alive[..., j - 1][drafting] = survive.double()
    # Rounds start where x_{s+1} is not the sequence's last token (acceptance.simulate's loop).
    return expected_rounds(batch.drafting(1), alive)
