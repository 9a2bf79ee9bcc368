"""Attention-drift diagnostics per draft depth, read from the drafter's own attention and states.

For every draft the engine would make (verified position t >= P-1, draft j = 1..K inside the
sequence) on held-out sequences, teacher-forced as in the simulated evaluator:

    hidden_rms      RMS (‖x‖₂/√d) of the state fed to step j: g_t = fc(...) for j = 1, the previous
                    step's feedback (o or norm(o), the `norm_output` flag) for j >= 2
    sink_share      attention on position 0 (the first token), averaged over heads and layers
    context_share   attention on verified context positions (<= t); the rest goes to the query's own
                    drafted positions (draft_share = 1 - context_share)
    recent_share    attention on the R most recent keys by position id (drafted ones included)
    entropy         attention entropy in nats
and, once per drafter, the fc input balance: each aux layer's share of the squared norm of what fc
reads (the claim is that without `fc_norm` the high layers dominate).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from eaglelab.evaluate.held_out import prompt_key
from eaglelab.models.drafter import Eagle3Drafter
from eaglelab.train.batches import Batch, FeatureDataset, collate, move

MEASURES = ("hidden_rms", "sink_share", "context_share", "draft_share", "recent_share", "entropy")


class _Accumulator:
    """Sums of per-query measures per sequence and depth, restricted to the drafts an engine would make: the means
    over all sequences and each sequence's own (what paired comparisons resample, prompt by prompt)."""

    def __init__(self, recent: int, rows: list[int], device: torch.device):
        self.recent = recent
        self.slot_of = {r: i for i, r in enumerate(rows)}  # a sequence's store row -> its slot in the sums
        zeros = lambda dtype: lambda: torch.zeros(len(rows), dtype=dtype, device=device)  # noqa: E731
        self.sums: dict[tuple[int, str], torch.Tensor] = defaultdict(zeros(torch.float64))  # (j, measure) -> [N]
        self.counts: dict[tuple[int, str], torch.Tensor] = defaultdict(zeros(torch.long))
        self.batch: Batch | None = None
        self.slots: torch.Tensor | None = None  # [B] the batch's sequences' slots

    def start(self, batch: Batch) -> None:
        self.batch = batch
        slots = [self.slot_of[r] for r in batch.index.tolist()]  # (one copy to the host, not one per sequence)
        self.slots = torch.tensor(slots, device=batch.input_ids.device)

    def valid(self, query_t: torch.Tensor, j: int) -> torch.Tensor:
        """[B, tq] the queries at positions `query_t` [B, tq] that make a j-th draft an engine would (Batch.drafting:
        past the prompt, or inside an assistant turn of a multi-turn conversation)."""
        drafting = self.batch.drafting(j)  # [B, T]
        return drafting.gather(1, query_t.clamp(max=drafting.shape[1] - 1))

    def add(self, j: int, name: str, values: torch.Tensor, valid: torch.Tensor) -> None:
        """values: [B, tq] (or [B, heads, tq]: heads weigh equally, as layers do, each adding its own values)."""
        if values.dim() == 3:
            values = values.mean(1)
        kept = torch.where(valid, values.double(), 0.0).sum(1)  # [B] (padding's values may be anything)
        self.sums[(j, name)].index_add_(0, self.slots, kept)
        self.counts[(j, name)].index_add_(0, self.slots, valid.sum(1))

    def probe(self, probs: torch.Tensor, positions: torch.Tensor, query_t: torch.Tensor) -> None:
        """probs: [B, h, tq, T + j - 1] of one layer at draft step j."""
        j = int(positions[0, 0] - query_t[0, 0]) + 1  # step j sits at position id t + j - 1
        T = probs.shape[-1] - (j - 1)  # context keys; then the drafted keys at position ids t+1..t+j-1
        valid = self.valid(query_t, j)
        p = probs.float()
        ctx, own = p[..., :T], p[..., T:]
        recent_ctx = torch.arange(T, device=p.device) > (positions[..., None] - self.recent)  # [B, tq, T]
        own_recent = own[..., max(own.shape[-1] - self.recent, 0) :]  # drafted keys are the most recent ones
        self.add(j, "sink_share", ctx[..., 0], valid)
        self.add(j, "context_share", ctx.sum(-1), valid)
        self.add(j, "draft_share", own.sum(-1), valid)
        self.add(j, "recent_share", (ctx * recent_ctx[:, None]).sum(-1) + own_recent.sum(-1), valid)
        self.add(j, "entropy", -(p * torch.log(p.clamp_min(1e-30))).sum(-1), valid)

    def means(self) -> tuple[dict, dict]:
        """-> ({(j, measure): mean over every draft}, {(j, measure): [N] each sequence's mean}); NaN where no draft
        reached depth j (not a measurement)."""
        sums = {key: v.cpu() for key, v in self.sums.items()}
        counts = {key: v.cpu() for key, v in self.counts.items()}
        nan = float("nan")
        overall = {key: float(s.sum() / counts[key].sum()) if counts[key].sum() else nan for key, s in sums.items()}
        each = {key: torch.where(counts[key] > 0, s / counts[key].clamp_min(1), nan) for key, s in sums.items()}
        return overall, each


@contextlib.contextmanager
def _probing(drafter: Eagle3Drafter, probe):
    for layer in drafter.layers:
        layer.self_attn.probe = probe
    try:
        yield
    finally:
        for layer in drafter.layers:
            layer.self_attn.probe = None


@torch.no_grad()
def drift_diagnostics(
    drafter: Eagle3Drafter, features, depth: int, recent_tokens: int = 8, batch_size: int = 2
) -> tuple[list[dict], list[dict], list[dict]]:
    """-> (rows per depth j = 1..depth with MEASURES, rows per aux layer with its fc input share, rows per
    (sequence, depth) with the sequence's own means and drafts: `prompt` names it as the per-prompt tables do)."""
    drafter.eval()
    device = drafter.d2t.device  # the drafter's: the batches go there
    acc = _Accumulator(recent_tokens, list(features.rows), device)
    n_aux = len(drafter.cfg.aux_layer_ids)
    energy = torch.zeros(n_aux, dtype=torch.float64, device=device)
    data = FeatureDataset(features, list(range(len(features))), with_final=False)
    with _probing(drafter, acc.probe):
        for batch in tqdm(
            DataLoader(data, batch_size=batch_size, collate_fn=collate), desc="drift diagnostics", leave=False
        ):
            batch = move(batch, device)
            acc.start(batch)
            B, T = batch.input_ids.shape
            every = torch.arange(T, device=device).expand(B, T)
            fc_in = drafter.fc_input(batch.aux)  # [B, T, n_aux·H_t]
            mask = acc.valid(every, 1)
            energy += torch.stack([c[mask].double().pow(2).sum() for c in fc_in.chunk(n_aux, dim=-1)])
            outs = drafter.unroll(batch.aux, batch.input_ids, depth, first=batch.first)
            fed = [drafter.fc(fc_in)] + [o.hidden for o in outs[:-1]]  # state fed to step j = 1..depth
            for j, x in enumerate(fed, start=1):
                rms = x.float().pow(2).mean(-1).sqrt()  # [B, T]
                acc.add(j, "hidden_rms", rms, acc.valid(every, j))
    overall, each = acc.means()
    drafts = {j: acc.counts[(j, "hidden_rms")].cpu() for j in range(1, depth + 1)}
    per_depth = [
        {"depth": j, **{m: overall[(j, m)] for m in MEASURES}, "drafts": int(drafts[j].sum())}
        for j in range(1, depth + 1)
    ]
    keys = {r: prompt_key(ids[:p]) for r, ids, p in zip(features.rows, features["input_ids"], features["prompt_len"])}
    per_prompt = [
        {"prompt": keys[row], "depth": j, "drafts": int(drafts[j][i]), **{m: float(each[(j, m)][i]) for m in MEASURES}}
        for i, row in enumerate(features.rows)
        for j in range(1, depth + 1)
    ]
    share = (energy / energy.sum()).tolist() if energy.sum() > 0 else [float("nan")] * n_aux
    fc_balance = [{"aux_layer": layer, "input_share": s} for layer, s in zip(drafter.cfg.aux_layer_ids, share)]
    return per_depth, fc_balance, per_prompt


def drift_inputs(features, depth: int, recent_tokens: int) -> dict:
    """The sequences `drift_diagnostics` measured (their stores and rows) and how: enough for a reader to recompute
    every measure from the exported drafter alone (analysis/drift_check.py)."""
    return {
        "tokens": str(features.tokens.folder),
        "states": str(features.states.folder),
        "rows": [int(r) for r in features.rows],
        "depth": depth,
        "recent_tokens": recent_tokens,
    }
