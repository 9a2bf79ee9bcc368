"""Held-out evaluation with the in-house simulated evaluator (greedy chain drafting, exact)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from eaglelab.acceptance import AcceptanceCounts
from eaglelab.drafter import Eagle3Drafter
from eaglelab.training import FeatureDataset, acceptance_counts, collate


@torch.no_grad()
def evaluate_simulated(drafter: Eagle3Drafter, features, max_k: int, batch_size: int = 4) -> dict[int, AcceptanceCounts]:
    """τ and per-position acceptance for every k = 1..max_k over all sequences of `features`."""
    drafter.eval()
    data = FeatureDataset(features, list(range(len(features))), with_final=False)
    totals = {k: AcceptanceCounts(k=k) for k in range(1, max_k + 1)}
    loader = DataLoader(data, batch_size=batch_size, collate_fn=collate)
    for batch in tqdm(loader, desc="evaluate (simulated)", leave=False):
        for k, counts in acceptance_counts(drafter, batch, max_k).items():
            totals[k].add(counts)
    return totals


def acceptance_rows(totals: dict[int, AcceptanceCounts], evaluator: str, suite: str) -> tuple[list, list]:
    """Tidy tables: one row per k, and one row per (k, draft position)."""
    by_k = [{"suite": suite, "evaluator": evaluator, "k": k, "acceptance_length": c.acceptance_length,
             "drafts": c.drafts, "accepted": c.accepted} for k, c in sorted(totals.items())]
    by_pos = [{"suite": suite, "evaluator": evaluator, "k": k, "position": i + 1, "acceptance_rate": r}
              for k, c in sorted(totals.items()) for i, r in enumerate(c.per_position)]
    return by_k, by_pos
