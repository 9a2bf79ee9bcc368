"""Simulated acceptance of greedy chain drafting, counted as vLLM counts it
(docs/conventions.md#measuring-acceptance).

On the target's own greedy continuation x, drafting from verified position s proposes x̂_{s+2..s+k+1};
a(s) = number of leading drafts equal to x. The teacher-forced TTT forward gives the j-th draft at
every s in one pass (a chain stops at its first miss, so later teacher forcing never matters).
Decoding then emits a(s)+1 tokens and continues from s + a(s) + 1, exactly as vLLM verifies, so the
counters below mean what vLLM's `spec_decode_*` counters mean.

At the end of a sequence vLLM still drafts k tokens and counts the accepted ones before it truncates the
output at the stop id or the budget. So x continues past the sequence's last token with its *tail*: the
target's greedy tokens after it (the stop id fed like any token), stored with the sequence when it was
regenerated. A draft past the known tokens counts as a miss.
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
        """Unconditional: accepted at position d / rounds. Falls with d as much because chains end as because
        deep drafts are worse, so it hides what a depth-robust drafter changes."""
        return [a / max(self.drafts, 1) for a in self.accepted_per_pos]

    @property
    def reached(self) -> list[int]:
        """Rounds whose chain reached position d (every draft before d accepted): all rounds at d = 1."""
        return [self.drafts, *self.accepted_per_pos[:-1]]

    @property
    def conditional(self) -> list[float]:
        """n-α(d) = accepted at d / rounds that reached d: the acceptance rate of the d-th draft given its chain got
        there (EAGLE's own depth measure). NaN where no round reached d: not a measurement."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted_per_pos, self.reached)]


@dataclass
class DepthAccuracy:
    """Teacher-forced accuracy by draft depth: at every drafting position, whether the d-th draft (its chain fed
    the true tokens, as in training) equals the target's token. Needs no surviving chain, so every depth is
    measured on every position, where n-α at depth d only sees the rounds whose chain got there."""

    depth: int
    correct: list[int] = field(default_factory=list)
    counted: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.correct = self.correct or [0] * self.depth
        self.counted = self.counted or [0] * self.depth

    @property
    def accuracy(self) -> list[float]:
        return [c / n if n else float("nan") for c, n in zip(self.correct, self.counted)]


@dataclass
class SequenceCounts:
    """One sequence's acceptance at every k and teacher-forced accuracy at every depth: the unit a paired
    comparison resamples (the same prompts under two drafters, analysis/paired.py)."""

    index: int  # the sequence's row in its prepared set
    by_k: dict[int, AcceptanceCounts]
    depth: DepthAccuracy


def tail_tokens(deepest_k: int) -> int:
    """Tail length a prepared set needs for drafts up to `deepest_k`: the last round drafts from x_{n-3} at the
    latest (x_{n-1} is always the target's own), so its k drafts reach k - 1 tokens past the end. Rounded up to
    a power of two (at least 8) so that sweeps over the draft depth mostly share one cache entry."""
    need = max(deepest_k - 1, 1)
    return max(8, 1 << (need - 1).bit_length())


def tail_room(seq_len: int, tail_tokens: int, max_length: int) -> int:
    """Tail tokens a sequence of `seq_len` tokens gets: none past `max_length`, where the regenerating engine
    stops (an engine serving at a longer context verifies drafts there, which the simulator then counts as
    misses: docs/conventions.md#measuring-acceptance)."""
    return max(0, min(tail_tokens, max_length - seq_len))


def leading_matches(matches: torch.Tensor) -> torch.Tensor:
    """matches: [T, K] bool (draft j at position s equals the continuation) -> a(s) for k=K: [T]."""
    return matches.long().cumprod(dim=-1).sum(dim=-1)


def simulate(matches: torch.Tensor, prompt_len: int, seq_len: int, k: int) -> AcceptanceCounts:
    """Greedy chain decoding of x_{prompt_len..seq_len-1} with k drafts a round.

    matches[s, j-1] says whether draft j from position s equals x_{s+j+1}, the tail included past the
    sequence's end. Prefill emits x_P; rounds start at s = P-1 and stop once the last token x_{seq_len-1} is
    emitted. Every round counts its k drafts and all its accepted ones, also those the engine then cuts at
    the stop id or the budget.
    """
    counts = AcceptanceCounts(k=k)
    a_all = leading_matches(matches[:, :k]).tolist()
    last = seq_len - 1
    s = prompt_len - 1
    while s + 1 < last:
        a = a_all[s]
        counts.drafts += 1
        counts.accepted += a
        for j in range(a):
            counts.accepted_per_pos[j] += 1
        s += a + 1
    return counts


def expected_rounds(starts: torch.Tensor, alive: torch.Tensor) -> tuple[list[float], list[float]]:
    """`simulate` in expectation, for speculative sampling: the target keeps draft j of a round from s with some
    probability, and `alive[b, s, j-1]` is the chance the chain from s is still unbroken after j drafts (the running
    product of those probabilities). A decode does not start a round at every position: one from s that accepts
    exactly j drafts (probability alive_j − alive_{j+1}) is followed by one from s + j + 1. So π(s), the chance a
    round starts at s, is carried forward down each sequence from its first start (1 there; each run of `starts`
    [B, T], e.g. each assistant turn, is a decode of its own) and τ@k = 1 + Σ_s π(s)·Σ_{j<=k} alive_j(s) / Σ_s π(s).
    With every probability 0 or 1 this is `simulate`'s count; unweighted (π = 1 everywhere) it would be the mean
    over positions, which overstates τ wherever acceptance comes in runs (an accepted run is skipped over).
    -> ([Σ π] for k = 1..K, [Σ π·expected accepted] for k = 1..K)."""
    B, T, K = alive.shape
    fresh = starts & ~torch.nn.functional.pad(starts, (1, 0))[:, :T]  # [B, T] the first start of each run
    alive = alive.double()
    alive = torch.cat([alive.new_ones(B, T, 1), alive, alive.new_zeros(B, T, 1)], -1)  # [B, T, K+2], alive_0 = 1
    rounds, accepted = [], []
    for k in range(1, K + 1):
        exactly = alive[..., : k + 1] - torch.cat([alive[..., 1 : k + 1], alive.new_zeros(B, T, 1)], -1)  # [B, T, k+1]
        visit = fresh.double()
        visit = torch.nn.functional.pad(visit, (0, k + 1))  # [B, T+k+1] π, mass flowing past the end is dropped
        for s in range(T):
            w = visit[:, s] * starts[:, s]  # [B] a round starts here (elsewhere the decode has ended)
            visit[:, s + 1 : s + k + 2] += w[:, None] * exactly[:, s]  # next start s + j + 1, j = 0..k
            visit[:, s] = w
        pi = visit[:, :T]
        rounds.append(float(pi.sum()))
        accepted.append(float((pi * alive[..., 1 : k + 1].sum(-1)).sum()))
    return rounds, accepted
