"""Per-run figure from the run's own result tables (downstream of results: reads, never recomputes)."""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Okabe-Ito: distinguishable under the common colour-vision deficiencies.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]


def _read(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def plot_acceptance(run_dir: Path, title: str) -> Path:
    """acceptance.png: τ vs draft depth k (simulated on all held-out prompts; vLLM on its subset when
    measured), and the simulated per-position acceptance for a few k."""
    run_dir = Path(run_dir)
    by_k, by_pos = _read(run_dir / "acceptance.csv"), _read(run_dir / "per_position.csv")
    sim = [r for r in by_k if r["evaluator"] == "simulated"]
    ks = [int(r["k"]) for r in sim]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), constrained_layout=True)
    ax1.plot(ks, [float(r["acceptance_length"]) for r in sim], "o-", color=PALETTE[0],
             label="simulated (all held-out prompts)")
    if parity := (_read(run_dir / "parity.csv") if (run_dir / "parity.csv").exists() else []):
        n = parity[0]["prompts"]
        ax1.plot([int(r["k"]) for r in parity], [float(r["tau_vllm"]) for r in parity], "s", color=PALETTE[1],
                 label=f"vLLM ({n} prompts)", markerfacecolor="none", markersize=8)
        ax1.plot([int(r["k"]) for r in parity], [float(r["tau_simulated"]) for r in parity], "x", color=PALETTE[1],
                 label=f"simulated, same {n} prompts")
        ax1.legend(frameon=False, fontsize=8)
    ax1.set(xlabel="draft tokens per round k", ylabel="acceptance length τ (tokens / target step)",
            title="τ vs k", xticks=ks)
    ax1.set_ylim(bottom=1.0)  # τ >= 1 always: an axis from 1 shows the gain honestly
    ax1.grid(alpha=0.3)
    shown = sorted({ks[0], ks[len(ks) // 2 - 1] if len(ks) > 1 else ks[0], ks[-1]})
    for c, k in zip(PALETTE, shown):
        rows = [r for r in by_pos if int(r["k"]) == k and r["evaluator"] == "simulated"]
        ax2.plot([int(r["position"]) for r in rows], [float(r["acceptance_rate"]) for r in rows], "o-",
                 color=c, label=f"k={k}")
    ax2.set(xlabel="draft position i", ylabel="share of rounds accepting draft i", ylim=(0, 1),
            title="per-position acceptance (simulated)", xticks=list(range(1, ks[-1] + 1)))
    ax2.grid(alpha=0.3)
    ax2.legend(frameon=False)
    suite = by_k[0]["suite"] if by_k else "?"
    fig.suptitle(f"{title} — {suite}", fontsize=10)
    out = run_dir / "acceptance.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_speedup(run_dir: Path, title: str) -> Path:
    """speedup.png: vLLM output throughput with and without the drafter per concurrency, and the ratio."""
    run_dir = Path(run_dir)
    rows = _read(run_dir / "throughput.csv")
    conc = sorted({int(r["concurrency"]) for r in rows})
    methods = sorted({(r["method"], int(r["k"])) for r in rows}, key=lambda m: (m[0] != "none", m[1]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), constrained_layout=True)
    width = 0.8 / len(methods)
    for i, ((method, k), color) in enumerate(zip(methods, PALETTE)):
        sel = {int(r["concurrency"]): r for r in rows if r["method"] == method and int(r["k"]) == k}
        label = "no speculation" if method == "none" else f"EAGLE drafter, k={k}"
        xs = [j + i * width for j in range(len(conc))]
        ax1.bar(xs, [float(sel[c]["output_tokens_per_s"]) for c in conc], width, color=color, label=label)
        if method != "none":
            ax2.plot(conc, [float(sel[c]["speedup"]) for c in conc], "o-", color=color, label=label)
    ax1.set(xlabel="concurrent requests", ylabel="output throughput (tokens/s)", title="decode throughput",
            xticks=[j + 0.4 - width / 2 for j in range(len(conc))], xticklabels=[str(c) for c in conc])
    ax1.legend(frameon=False, fontsize=8)
    ax1.grid(alpha=0.3, axis="y")
    ax2.axhline(1.0, color="grey", lw=1, ls="--")
    ax2.set(xlabel="concurrent requests", ylabel="speedup vs no speculation (×)", title="speedup",
            xscale="log", xticks=conc, xticklabels=[str(c) for c in conc])
    ax2.legend(frameon=False, fontsize=8)
    ax2.grid(alpha=0.3)
    fig.suptitle(f"{title} — vLLM, greedy", fontsize=10)
    out = run_dir / "speedup.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
