"""Checks a run directory's acceptance tables must pass whatever the target and the numbers: relations that hold
by the definition of greedy chain drafting, and metrics.json recomputed from the stored tables."""

import csv
from pathlib import Path

import pytest


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def check_acceptance_tables(run_dir: Path, metrics: dict) -> dict[int, float]:
    """metrics.json's τ@k is 1 + accepted/drafts of acceptance.csv; per_position.csv's rates never increase
    with the position (a chain accepts draft i+1 only in a round that accepted draft i) and add up to
    accepted/drafts (every accepted draft is at one position). Simulated evaluator; returns {k: τ}."""
    by_k = {int(r["k"]): r for r in read_csv(run_dir / "acceptance.csv") if r["evaluator"] == "simulated"}
    rates: dict[int, list[float]] = {}
    reached_at: dict[int, list[tuple[int, int]]] = {}
    for r in read_csv(run_dir / "per_position.csv"):
        if r["evaluator"] == "simulated":
            rates.setdefault(int(r["k"]), []).append((int(r["position"]), float(r["acceptance_rate"])))
            reached_at.setdefault(int(r["k"]), []).append((int(r["position"]), int(r["reached"])))
            # n-α(d) = accepted at d / rounds that reached d, which are the rounds that accepted at d - 1
            accepted, reached = int(r["accepted"]), int(r["reached"])
            key = f"conditional_rate@k{r['k']}@pos{r['position']}"
            if reached:
                assert float(r["conditional_rate"]) == pytest.approx(accepted / reached, rel=1e-9), r
                assert metrics[key] == pytest.approx(accepted / reached, rel=1e-9), key
            else:
                assert key not in metrics and r["conditional_rate"] == "nan", r
    assert by_k and set(rates) == set(by_k)
    taus = {}
    for k, row in by_k.items():
        drafts, accepted = int(row["drafts"]), int(row["accepted"])
        assert drafts > 0, k
        taus[k] = 1 + accepted / drafts
        assert metrics[f"acceptance_length@k{k}"] == pytest.approx(taus[k], rel=1e-9), k
        positions, per_pos = zip(*sorted(rates[k]))
        assert positions == tuple(range(1, k + 1)), k
        assert all(later <= earlier for earlier, later in zip(per_pos, per_pos[1:])), (k, per_pos)
        assert sum(per_pos) == pytest.approx(accepted / drafts, rel=1e-9), k
        reached = [n for _, n in sorted(reached_at[k])]
        assert reached[0] == drafts and all(b <= a for a, b in zip(reached, reached[1:])), (k, reached)
    return taus
