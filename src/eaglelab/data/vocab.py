"""The reduced draft vocabulary: the most frequent tokens the drafter is trained to predict.

Counted over loss-masked (assistant) tokens of the training split only; ties broken by token id so
the result is deterministic. Returned ascending, which is what vLLM's `d2t` offsets assume.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def draft_vocab(
    sequences: Iterable[torch.Tensor], prompt_lens: Iterable[int], vocab_size: int, draft_vocab_size: int
) -> tuple[torch.Tensor, float]:
    """-> (ascending target ids [V_draft], share of assistant tokens the draft vocab covers). `sequences` may be a
    generator: one sequence at a time is held, not a copy of the training set per rank."""
    counts = torch.zeros(vocab_size, dtype=torch.long, device="cpu")
    for ids, p in zip(sequences, prompt_lens):
        counts += torch.bincount(ids[p:].long(), minlength=vocab_size)
    total = int(counts.sum())
    # Frequency first, then low ids: unseen tokens fill the tail deterministically.
    key = -counts * vocab_size + torch.arange(vocab_size, device="cpu")
    ids = torch.sort(torch.argsort(key)[:draft_vocab_size]).values
    coverage = float(counts[ids].sum()) / max(total, 1)
    return ids, coverage
