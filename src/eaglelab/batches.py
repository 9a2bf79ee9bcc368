"""Batches of captured sequences, and simulated acceptance from one unrolled forward.

Plain torch, below training in the data flow: training, evaluation and the drift diagnostics all read
batches through here, so evaluating a drafter needs no Lightning. Every tensor made here takes its device
from the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from eaglelab.acceptance import AcceptanceCounts, simulate
from eaglelab.data.prepare import from_bits
from eaglelab.drafter import Eagle3Drafter


# --- data ------------------------------------------------------------------------------------
class FeatureDataset(Dataset):
    """Captured sequences held in memory as bf16 tensors (a few hundred MB for the default run)."""

    def __init__(self, features, indices: list[int], with_final: bool):
        rows = features.select(indices).with_format("numpy")
        self.items = []
        for r in rows:
            item = {
                "input_ids": torch.from_numpy(r["input_ids"].astype("int64")),
                "target_next": torch.from_numpy(r["target_next"].astype("int64")),
                "prompt_len": int(r["prompt_len"]),
                "aux": from_bits(r["aux"]),
            }
            if with_final:
                item["final"] = from_bits(r["final"])
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T]
    target_next: torch.Tensor  # [B, T]
    aux: torch.Tensor  # [B, T, n·H_t] float32
    final: torch.Tensor | None  # [B, T, H_t] target post-norm state (KL only)
    prompt_len: torch.Tensor  # [B]
    seq_len: torch.Tensor  # [B]

    @property
    def first(self) -> torch.Tensor:
        """[B] the first verified position an engine drafts from: the prompt's last token."""
        return self.prompt_len - 1

    def drafting(self, j: int) -> torch.Tensor:
        """[B, T] positions t that draft (t >= P-1) and whose j-th draft x_{t+j+1} is in the sequence."""
        pos = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        return (pos >= self.first[:, None]) & (pos + j + 1 < self.seq_len[:, None])


def collate(items: list[dict]) -> Batch:
    T = max(len(it["input_ids"]) for it in items)

    def pad(key, value=0):
        out = []
        for it in items:
            x = it[key]
            out.append(F.pad(x, (0, 0, 0, T - len(x)) if x.dim() == 2 else (0, T - len(x)), value=value))
        return torch.stack(out)

    return Batch(
        input_ids=pad("input_ids"),
        target_next=pad("target_next"),
        aux=pad("aux").float(),
        final=pad("final").float() if "final" in items[0] else None,
        prompt_len=torch.tensor([it["prompt_len"] for it in items]),
        seq_len=torch.tensor([len(it["input_ids"]) for it in items]),
    )


def shift(x: torch.Tensor, by: int, value=0) -> torch.Tensor:
    """x[:, t + by] at index t (padded with `value` past the end)."""
    T = x.shape[1]
    pad = (0, 0, 0, by) if x.dim() == 3 else (0, by)
    return F.pad(x, pad, value=value)[:, by : by + T]


# --- acceptance from one unrolled forward -----------------------------------------------------
@torch.no_grad()
def acceptance_counts(
    drafter: Eagle3Drafter, batch: Batch, max_k: int, outs: list | None = None
) -> dict[int, AcceptanceCounts]:
    """Simulated greedy-chain acceptance for every k <= max_k from one max_k-step unroll (`outs`, when
    the caller already ran it)."""
    outs = outs or drafter.unroll(batch.aux, batch.input_ids, max_k, first=batch.first)
    drafting = batch.drafting(0)  # verified positions t >= P-1 with x_{t+1} in the sequence
    drafts = torch.full(
        (*batch.input_ids.shape, max_k), -1, dtype=torch.long, device=batch.input_ids.device
    )  # [B, T, K]
    for j, out in enumerate(outs):
        drafts[..., j][drafting] = drafter.to_target_ids(drafter.lm_head(out.normed[drafting]).argmax(-1))
    truth = torch.stack([shift(batch.input_ids, j + 1, value=-2) for j in range(1, max_k + 1)], dim=-1)
    matches = drafts == truth  # draft j at s vs x_{s+j+1}
    totals = {k: AcceptanceCounts(k=k) for k in range(1, max_k + 1)}
    for b in range(batch.input_ids.shape[0]):
        n, p = int(batch.seq_len[b]), int(batch.prompt_len[b])
        for k in totals:
            totals[k].add(simulate(matches[b, :n], p, n, k))
    return totals
