"""Per-run figure from the run's own result tables (downstream of results: reads, never recomputes)."""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Okabe-Ito: distinguishable under the common colour-vision deficiencies.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]


def plot_acceptance(run_dir: Path, title: str) -> Path:
    """acceptance.png: τ vs draft depth k, and per-position acceptance for a few k."""
    run_dir = Path(run_dir)
    with open(run_dir / "acceptance.csv") as f:
        by_k = list(csv.DictReader(f))
    with open(run_dir / "per_position.csv") as f:
        by_pos = list(csv.DictReader(f))
    ks = [int(r["k"]) for r in by_k]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), constrained_layout=True)
    ax1.plot(ks, [float(r["acceptance_length"]) for r in by_k], "o-", color=PALETTE[0])
    ax1.set(xlabel="draft tokens per round k", ylabel="acceptance length τ (tokens / target step)",
            title="τ vs k", xticks=ks)
    ax1.set_ylim(bottom=1.0)  # τ >= 1 always: an axis from 1 shows the gain honestly
    ax1.grid(alpha=0.3)
    shown = sorted({ks[0], ks[len(ks) // 2 - 1] if len(ks) > 1 else ks[0], ks[-1]})
    for c, k in zip(PALETTE, shown):
        rows = [r for r in by_pos if int(r["k"]) == k]
        ax2.plot([int(r["position"]) for r in rows], [float(r["acceptance_rate"]) for r in rows], "o-",
                 color=c, label=f"k={k}")
    ax2.set(xlabel="draft position i", ylabel="share of rounds accepting draft i", ylim=(0, 1),
            title="per-position acceptance", xticks=list(range(1, ks[-1] + 1)))
    ax2.grid(alpha=0.3)
    ax2.legend(frameon=False)
    evaluator = by_k[0]["evaluator"] if by_k else "?"
    suite = by_k[0]["suite"] if by_k else "?"
    fig.suptitle(f"{title} — {suite}, {evaluator} evaluator", fontsize=10)
    out = run_dir / "acceptance.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
