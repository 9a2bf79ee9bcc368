"""The simulated evaluator's counting: hand-worked chains, and the batched evaluator against an independent
engine that drafts chain by chain from a KV cache (tests/reference_drafter.py), padding and tails included."""

import random

import pytest
import torch
from test_drafter import random_drafter, small_config

from eaglelab.models.acceptance import AcceptanceCounts, leading_matches, simulate, tail_tokens
from eaglelab.models.drafter import export_state_dict
from eaglelab.train.batches import acceptance_counts, collate

from reference_drafter import ReferenceDrafter


def small_drafter():
    """A random one-layer drafter in float64 over a 50-token vocabulary (30 in the draft vocab)."""
    return random_drafter(small_config())


def test_leading_matches_stops_at_first_miss():
    m = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert leading_matches(m).tolist() == [2, 0, 4]


def test_simulate_walks_the_chain_like_a_verifier():
    # Prompt of 2 tokens (positions 0,1), 8 generated tokens (positions 2..9); k = 3.
    T = 10
    a = {1: 3, 5: 1, 7: 0, 8: 2}  # a(s) where the walk will land
    matches = torch.zeros(T, 3, dtype=torch.bool)
    for s, n in a.items():
        matches[s, :n] = True
    c = simulate(matches, prompt_len=2, seq_len=T, k=3)
    # s=1: a=3 -> s=5; s=5: a=1 -> s=7; s=7: a=0 -> s=8; s=8: last=9, s+1=9 -> stop.
    assert (c.drafts, c.accepted) == (3, 4)
    assert c.accepted_per_pos == [2, 1, 1]
    assert abs(c.acceptance_length - (1 + 4 / 3)) < 1e-12
    assert c.per_position == [2 / 3, 1 / 3, 1 / 3]
    # n-α: 3 rounds reached position 1 (2 accepted), 2 reached position 2 (1 accepted), 1 reached position 3 (1)
    assert c.reached == [3, 2, 1] and c.conditional == [2 / 3, 1 / 2, 1.0]


def test_drafts_past_the_end_count_as_the_engine_counts_them():
    """vLLM drafts k tokens in the last round too and counts every accepted one before it truncates the output
    at the stop id or the budget: a perfect drafter's last round accepts all k (its matches against the tail)."""
    matches = torch.ones(6, 4, dtype=torch.bool)  # a perfect drafter, the tail known
    c = simulate(matches, prompt_len=1, seq_len=6, k=2)
    # s=0: a=2 -> s=3; s=3: a=2 (x_5 in the sequence, x_6 in the tail) -> s=6 > last -> stop.
    assert (c.drafts, c.accepted, c.accepted_per_pos) == (2, 4, [2, 2])
    c4 = simulate(matches, prompt_len=1, seq_len=6, k=4)
    assert (c4.drafts, c4.accepted) == (1, 4)  # one round emits x_1..x_5: the whole response


@pytest.mark.parametrize("deepest_k, tail", [(1, 8), (3, 8), (8, 8), (9, 8), (10, 16), (17, 16), (18, 32)])
def test_tail_holds_every_token_the_last_round_can_draft(deepest_k, tail):
    assert tail_tokens(deepest_k) == tail and tail_tokens(deepest_k) >= deepest_k - 1


# --- the batched evaluator against an engine ---------------------------------------------------------
class Engine:
    """Greedy chain drafting as an engine does it, with the independent reference drafter: the context's KV cache
    filled one verified position at a time, then k drafts each fed the previous draft (never the truth)."""

    def __init__(self, drafter, aux: torch.Tensor, ids: list[int]):
        cfg = drafter.cfg.to_vllm_config()
        self.ref = ReferenceDrafter(export_state_dict(drafter), cfg, drafter.embed_tokens.weight)
        self.d2t = drafter.d2t
        self.aux, self.ids = aux.double(), ids

    def chain(self, s: int, k: int) -> list[int]:
        """The k draft tokens (target ids) from verified position s: x̂_{s+2..s+k+1}."""
        caches = [[] for _ in range(self.ref.c["num_hidden_layers"])]
        for t in range(s + 1):  # the verified context x_0..x_{s+1} and the target's states at 0..s
            logits, fed = self.ref.step(self.ids[t + 1], self.ref.fuse(self.aux[t]), t, caches)
        drafts = []
        for j in range(1, k + 1):
            token = int(logits.argmax())
            token += int(self.d2t[token])
            drafts.append(token)
            if j < k:
                logits, fed = self.ref.step(token, fed, s + j, caches)
        return drafts


def engine_counts(engine: Engine, known: list[int], prompt_len: int, seq_len: int, k: int) -> AcceptanceCounts:
    """The verifier's walk: each round scores its k drafts against the known tokens (sequence, then tail)."""
    counts, s = AcceptanceCounts(k=k), prompt_len - 1
    while s + 1 < seq_len - 1:
        drafts = engine.chain(s, k)
        a = 0
        while a < k and s + a + 2 < len(known) and drafts[a] == known[s + a + 2]:
            a += 1
        counts.drafts += 1
        counts.accepted += a
        counts.accepted_per_pos = [c + (j < a) for j, c in enumerate(counts.accepted_per_pos)]
        s += a + 1
    return counts


def planted_sequence(engine_for, prompt: list[int], n: int, tail: int, k: int, rng: random.Random, vocab: int):
    """A sequence of n tokens (+ `tail`) in which the drafter's chains are right for a random number of drafts:
    x is grown round by round from the drafter's own chain, then a random token. A chain that reaches the end is
    right all the way, into the tail and past it (where the stored tail is cut short)."""
    ids = list(prompt)
    s = len(prompt) - 1
    ids.append(rng.randrange(vocab))  # x_P: what the prefill emits
    while len(ids) < n + tail:
        drafts = engine_for(ids + [0] * (k + 2)).chain(s, k)  # depends on x_{<= s+1} only
        m = k if s + k + 1 >= n - 1 else rng.randint(0, k)
        ids += drafts[:m] + [rng.randrange(vocab)]
        s += m + 1
    return ids[: n + tail]


def test_batched_acceptance_equals_an_engine_drafting_chain_by_chain():
    """acceptance_counts (one teacher-forced unroll, a padded batch of sequences of different lengths and tails)
    == an engine drafting every chain from its KV cache with its own drafts, at every k."""
    drafter = small_drafter()
    cfg = drafter.cfg
    K, rng = 4, random.Random(0)
    torch.manual_seed(3)
    items, known = [], []
    for b, (P, n, tail) in enumerate([(3, 22, 3), (5, 14, 0), (2, 18, 1)]):  # tails shorter than K-1: misses past
        aux = torch.randn(n + tail + K + 2, 3 * cfg.target_hidden_size, dtype=torch.float64)
        prompt = [rng.randrange(cfg.vocab_size) for _ in range(P)]
        ids = planted_sequence(lambda x: Engine(drafter, aux, x), prompt, n, tail, K, rng, cfg.vocab_size)
        known.append((Engine(drafter, aux, ids + [0] * (K + 2)), ids, P, n))
        items.append(
            {
                "input_ids": torch.tensor(ids),
                "prompt_len": P,
                "seq_len": n,
                "index": b,
                "aux": aux[:n],
                "target_next": torch.zeros(n, dtype=torch.long),
            }
        )
    batch = collate(items)
    batch.aux = batch.aux.double()
    assert batch.input_ids.shape[1] == 25 and batch.known_len.tolist() == [25, 14, 19]  # padded, with tails
    got = acceptance_counts(drafter, batch, K)
    for k in range(1, K + 1):
        expected = AcceptanceCounts(k=k)
        for engine, ids, P, n in known:
            expected.add(engine_counts(engine, ids, P, n, k))
        assert (got[k].drafts, got[k].accepted, got[k].accepted_per_pos) == (
            expected.drafts,
            expected.accepted,
            expected.accepted_per_pos,
        ), k
    assert got[K].accepted > got[K].drafts // 2 and got[K].accepted_per_pos[-1] > 0  # deep chains were planted


def test_a_draft_never_matches_padding():
    """A drafter that always drafts token 0, on sequences of token 0 without tails: every draft inside a sequence
    is right, every draft past its end wrong, also where the batch pads the shorter sequence with token 0."""
    drafter = small_drafter()
    cfg = drafter.cfg
    with torch.no_grad():
        drafter.lm_head.weight.zero_()  # every draft is draft id 0
    drafter.set_vocab(torch.arange(cfg.draft_vocab_size))  # draft id 0 is token 0
    items = [
        {"input_ids": torch.zeros(n, dtype=torch.long), "prompt_len": 3, "index": i, "aux": torch.randn(n, 3 * 48)}
        for i, n in enumerate([9, 14])
    ]
    batch = collate(items)
    batch.aux = batch.aux.double()
    counts = acceptance_counts(drafter, batch, 3)[3]
    # n=9: s=2 accepts x_4..x_6, s=6 accepts x_8 only (x_9, x_10 are past the end: padding); n=14: s=2, 6 accept
    # 3 each, s=10 accepts x_12, x_13 (x_14 is past the batch).
    assert (counts.drafts, counts.accepted, counts.accepted_per_pos) == (2 + 3, 4 + 8, [5, 4, 3])


@pytest.mark.parametrize("draft_sampling", ["greedy", "probabilistic"])
def test_expected_acceptance_under_sampling_is_computed_down_each_chain(draft_sampling):
    """batches.expected_acceptance against a hand computation with the independent reference drafter: at every
    round start s (after the prompt, with a next token to verify) and depth j, the chance α the target keeps draft j
    (q: the reference's draft-j logits from s, teacher-forced; p: the target's head over its final state at s+j):
    p(argmax q) for greedy drafts (vLLM's default), Σ_x min(p, q) over the draft vocabulary for sampled ones; the
    chain's expected acceptances are the running products; past a sequence's end, nothing. Rounds are weighted by the
    chance a decode starts one there, here by the backward recursion E(s) = (1, Σ_j alive_j(s)) + Σ_j P(exactly j |
    s)·E(s + j + 1) from the first start (acceptance.expected_rounds carries the same chance forward)."""
    from eaglelab.train.batches import expected_acceptance

    drafter = small_drafter()
    cfg, K, temperature = drafter.cfg, 3, 0.7
    torch.manual_seed(5)
    head = torch.randn(cfg.vocab_size, cfg.target_hidden_size, dtype=torch.float64)
    items = []
    for b, (P, n) in enumerate([(3, 12), (4, 9)]):
        items.append(
            {
                "input_ids": torch.randint(cfg.vocab_size, (n,)),
                "prompt_len": P,
                "index": b,
                "aux": torch.randn(n, 3 * cfg.target_hidden_size, dtype=torch.float64),
                "final": torch.randn(n, cfg.target_hidden_size, dtype=torch.float64),
            }
        )
    batch = collate(items)
    batch.aux, batch.final = batch.aux.double(), batch.final.double()
    rounds, accepted = expected_acceptance(drafter, batch, head, K, temperature, draft_sampling)

    draft_ids = drafter.to_target_ids(torch.arange(cfg.draft_vocab_size))
    want_rounds, want = [0.0] * K, [0.0] * K
    for item in items:
        ids, aux, final, P = item["input_ids"], item["aux"], item["final"], item["prompt_len"]
        n = len(ids)
        logits = Engine(drafter, aux, ids.tolist()).ref.draft_logits(aux, ids, K)
        alive = {}  # (s, j) -> the chance the chain from s keeps its first j drafts
        for s in range(P - 1, n - 1):  # a round from s verifies x_{s+1} and drafts x_{s+2}..
            alive[s, 0] = 1.0
            for j in range(1, K + 1):
                alive[s, j] = 0.0
                if s + j + 1 >= n:  # draft j's token x_{s+j+1} is past the sequence
                    continue
                p = torch.softmax(final[s + j] @ head.T / temperature, -1)
                if draft_sampling == "greedy":
                    kept = float(p[int(draft_ids[int(logits[(s, j)].argmax())])])
                else:
                    q = torch.softmax(logits[(s, j)] / temperature, -1)
                    kept = float(torch.minimum(p[draft_ids], q).sum())
                alive[s, j] = alive[s, j - 1] * kept
        for k in range(1, K + 1):

            def expected(s):  # (rounds, accepted) from a round starting at s; none once x_{s+1} is the last token
                if s + 1 >= n - 1:
                    return 0.0, 0.0
                rounds, acc = 1.0, sum(alive[s, j] for j in range(1, k + 1))
                for j in range(k + 1):
                    exactly = alive[s, j] - (alive[s, j + 1] if j < k else 0.0)
                    r, a = expected(s + j + 1)
                    rounds, acc = rounds + exactly * r, acc + exactly * a
                return rounds, acc

            r, a = expected(P - 1)
            want_rounds[k - 1] += r
            want[k - 1] += a
    assert rounds == pytest.approx(want_rounds, rel=1e-5)
    assert accepted == pytest.approx(want, rel=1e-5)  # (the distributions are taken in float32)
    assert (
        0 < accepted[0] <= accepted[1] <= accepted[2] and rounds[2] <= rounds[1] <= rounds[0] <= 8 + 4
    )  # (at most a round at each start)


def test_expected_rounds_with_certain_outcomes_count_what_greedy_decoding_counts():
    """acceptance.expected_rounds with every probability 0 or 1 (a draft kept or not) is the greedy chain decode
    acceptance.simulate counts: the same rounds and accepted drafts at every k, over random match patterns."""
    from eaglelab.models.acceptance import expected_rounds, simulate

    torch.manual_seed(0)
    n, P, K = 40, 6, 4
    for _ in range(30):
        matches = torch.rand(n, K) < 0.7
        pos = torch.arange(n)[:, None] + torch.arange(1, K + 1) + 1  # draft j from s is x_{s+j+1}
        matches &= pos < n  # no tail: past the end, a miss
        starts = torch.zeros(1, n, dtype=torch.bool)
        starts[0, P - 1 : n - 2] = True  # rounds from P-1 while x_{s+1} is not the last token
        rounds, accepted = expected_rounds(starts, torch.cumprod(matches.double(), -1)[None])
        for k in range(1, K + 1):
            counts = simulate(matches, P, n, k)
            assert (rounds[k - 1], accepted[k - 1]) == (counts.drafts, counts.accepted), k
