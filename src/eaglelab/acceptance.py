"""Simulated acceptance of greedy chain drafting, exact for greedy decoding
(docs/conventions.md#measuring-acceptance).

On the target's own greedy continuation x, drafting from verified position s proposes x̂_{s+2..s+k+1};
a(s) = number of leading drafts equal to x. The teacher-forced TTT forward gives the j-th draft at
every s in one pass (a chain stops at its first miss, so later teacher forcing never matters).
Decoding then emits a(s)+1 tokens and continues from s + a(s) + 1, exactly as vLLM verifies, so the
counters below mean what vLLM's `spec_decode_*` counters mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AcceptanceCounts:
    k: int
    drafts: int = 0  # verification rounds that carried k draft tokens
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k

    def add(self, other: AcceptanceCounts) -> None:
        self.drafts += other.drafts
        self.accepted += other.accepted
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos)]

    @property
    def acceptance_length(self) -> float:
        """τ = 1 + accepted / drafts (tokens emitted per target forward)."""
        return 1.0 + self.accepted / max(self.drafts, 1)

    @property
    def per_position(self) -> list[float]:
        return [a / max(self.drafts, 1) for a in self.accepted_per_pos]


def leading_matches(matches: torch.Tensor) -> torch.Tensor:
    """matches: [T, K] bool (draft j at position s equals the continuation) -> a(s) for k=K: [T]."""
    return matches.long().cumprod(dim=-1).sum(dim=-1)


def simulate(matches: torch.Tensor, prompt_len: int, seq_len: int, k: int) -> AcceptanceCounts:
    """Greedy chain decoding of x_{prompt_len..seq_len-1} with k drafts a round.

    matches[s, j-1] says whether draft j from position s equals x_{s+j+1}. Prefill emits x_P; rounds
    start at s = P-1 and stop once the last token x_{seq_len-1} is emitted.
    """
    counts = AcceptanceCounts(k=k)
    a_all = leading_matches(matches[:, :k]).tolist()
    last = seq_len - 1
    s = prompt_len - 1
    while s + 1 < last:
        a = min(a_all[s], k, last - (s + 1))
        counts.drafts += 1
        counts.accepted += a
        for j in range(a):
            counts.accepted_per_pos[j] += 1
        s += a + 1
    return counts
