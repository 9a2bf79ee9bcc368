"""The simulated evaluator's counting, against hand-worked chains."""

import torch

from eaglelab.acceptance import leading_matches, simulate


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


def test_simulate_caps_at_k_and_at_the_end_of_the_continuation():
    matches = torch.ones(6, 4, dtype=torch.bool)  # a perfect drafter
    c = simulate(matches, prompt_len=1, seq_len=6, k=2)
    # s=0: a=2 -> s=3; s=3: a=min(2, 5-4)=1 -> s=5 = last -> stop.
    assert (c.drafts, c.accepted) == (2, 3)
    c1 = simulate(matches, prompt_len=1, seq_len=6, k=4)
    assert (c1.drafts, c1.accepted) == (1, 4)  # 1 + 4 = 5 tokens after x_0... then stop
