"""The reduced draft vocabulary: the most frequent tokens the drafter is trained to predict.

Counted over loss-masked (assistant) tokens of the training split only; ties broken by token id so
the result is deterministic. Returned ascending, which is what vLLM's `d2t` offsets assume.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

import torch


def draft_vocab(
    sequences: Iterable[torch.Tensor],
    prompt_lens: Iterable[int],
    vocab_size: int,
    draft_vocab_size: int,
    spans: Iterable | None = None,
) -> tuple[torch.Tensor, float]:
    """-> (ascending target ids [V_draft], share of assistant tokens the draft vocab covers). `sequences` may be a
    generator: one sequence at a time is held, not a copy of the training set per rank. `spans`: per sequence, its
    earlier assistant turns ([S, 2] (start, end), multi-turn conversations), counted besides ids[prompt_len:]."""
    counts = torch.zeros(vocab_size, dtype=torch.long, device="cpu")
    for ids, p, earlier in zip(sequences, prompt_lens, spans if spans is not None else repeat(())):
        for s, e in [*earlier, (p, len(ids))]:
            counts += torch.bincount(ids[int(s) : int(e)].long(), minlength=vocab_size)
    total = int(counts.sum())
    # Frequency first, then low ids: unseen tokens fill the tail deterministically.
    key = -counts * vocab_size + torch.arange(vocab_size, device="cpu")
    ids = torch.sort(torch.argsort(key)[:draft_vocab_size]).values
    coverage = float(counts[ids].sum()) / max(total, 1)
    return ids, coverage
