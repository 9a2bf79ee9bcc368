"""Per-run figure from the run's own result tables (downstream of results: reads, never recomputes)."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from eaglelab.core.preemption import uninterruptible  # noqa: E402

# Okabe-Ito: distinguishable under the common colour-vision deficiencies.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]


def _read(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def plot_acceptance(run_dir: Path, title: str) -> Path:
    """acceptance.png: τ vs draft depth k (simulated on all held-out prompts; vLLM on its subset when
    measured), the simulated per-position acceptance for a few k, and n-α by depth at the deepest k."""
    run_dir = Path(run_dir)
    by_k, by_pos = _read(run_dir / "acceptance.csv"), _read(run_dir / "per_position.csv")
    sim = [r for r in by_k if r["evaluator"] == "simulated"]
    ks = [int(r["k"]) for r in sim]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 3.4), constrained_layout=True)
    ax1.plot(
        ks,
        [float(r["acceptance_length"]) for r in sim],
        "o-",
        color=PALETTE[0],
        label="simulated (all held-out prompts)",
    )
    parity = _read(run_dir / "parity.csv") if (run_dir / "parity.csv").exists() else []
    if parity := [r for r in parity if not r.get("group")]:  # the held-out set's rows (the suites' have a group)
        n = parity[0]["prompts"]
        ax1.plot(
            [int(r["k"]) for r in parity],
            [float(r["tau_vllm"]) for r in parity],
            "s",
            color=PALETTE[1],
            label=f"vLLM ({n} prompts)",
            markerfacecolor="none",
            markersize=8,
        )
        ax1.plot(
            [int(r["k"]) for r in parity],
            [float(r["tau_simulated"]) for r in parity],
            "x",
            color=PALETTE[1],
            label=f"simulated, same {n} prompts",
        )
        ax1.legend(frameon=False, fontsize=8)
    ax1.set(
        xlabel="draft tokens per round k",
        ylabel="acceptance length τ (tokens / target step)",
        title="τ vs k",
        xticks=ks,
    )
    ax1.set_ylim(bottom=1.0)  # τ >= 1 always: an axis from 1 shows the gain honestly
    ax1.grid(alpha=0.3)
    shown = sorted({ks[0], ks[len(ks) // 2 - 1] if len(ks) > 1 else ks[0], ks[-1]})
    for c, k in zip(PALETTE, shown):
        rows = [r for r in by_pos if int(r["k"]) == k and r["evaluator"] == "simulated"]
        ax2.plot(
            [int(r["position"]) for r in rows],
            [float(r["acceptance_rate"]) for r in rows],
            "o-",
            color=c,
            label=f"k={k}",
        )
    ax2.set(
        xlabel="draft position i",
        ylabel="share of rounds accepting draft i",
        ylim=(0, 1),
        title="per-position acceptance (simulated)",
        xticks=list(range(1, ks[-1] + 1)),
    )
    ax2.grid(alpha=0.3)
    ax2.legend(frameon=False)
    # n-α at the deepest k each evaluator measured: the rate at depth d among rounds whose chain reached d, which
    # per-position acceptance folds together with how often chains end before d.
    for c, evaluator, marker in ((PALETTE[0], "simulated", "o-"), (PALETTE[1], "vllm", "s--")):
        rows = [r for r in by_pos if r["evaluator"] == evaluator and r.get("conditional_rate") not in (None, "")]
        if not rows:
            continue
        deepest = max(int(r["k"]) for r in rows)
        rows = [r for r in rows if int(r["k"]) == deepest and int(r["reached"]) > 0]
        ax3.plot(
            [int(r["position"]) for r in rows],
            [float(r["conditional_rate"]) for r in rows],
            marker,
            color=c,
            label=f"{evaluator}, k={deepest}",
            markerfacecolor="none" if evaluator == "vllm" else c,
        )
    if (run_dir / "depth_accuracy.csv").exists():  # teacher-forced: every position, no surviving chain needed
        rows = [r for r in _read(run_dir / "depth_accuracy.csv") if int(r["counted"]) > 0]
        ax3.plot(
            [int(r["depth"]) for r in rows],
            [float(r["accuracy"]) for r in rows],
            ":",
            color=PALETTE[2],
            marker="^",
            label="teacher-forced accuracy",
        )
    ax3.set(
        xlabel="draft depth d",
        ylabel="accepted at d / rounds reaching d",
        ylim=(0, 1),
        title="acceptance by depth (n-α)",
        xticks=list(range(1, ks[-1] + 1)),
    )
    ax3.grid(alpha=0.3)
    ax3.legend(frameon=False, fontsize=8)
    suite = by_k[0]["suite"] if by_k else "?"
    fig.suptitle(f"{title} — {suite}", fontsize=10)
    out = run_dir / "acceptance.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def decoding(rows: list[dict]) -> str:
    """How the timed requests decoded: "greedy", or "sampled at t = 0.7" (throughput.csv's `temperature`)."""
    t = float(rows[0].get("temperature") or 0)
    return f"sampled at t = {t:g}" if t > 0 else "greedy"


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
            y = [float(sel[c]["speedup"]) for c in conc]
            lo, hi = ([float(sel[c].get(f"speedup_ci_{e}") or "nan") for c in conc] for e in ("low", "high"))
            err = [[v - low for v, low in zip(y, lo)], [high - v for v, high in zip(y, hi)]]
            ax2.errorbar(
                conc, y, yerr=None if any(map(math.isnan, lo)) else err, fmt="o-", color=color, capsize=3, label=label
            )
    ax1.set(
        xlabel="concurrent requests",
        ylabel="output throughput (tokens/s)",
        title="decode throughput",
        xticks=[j + 0.4 - width / 2 for j in range(len(conc))],
        xticklabels=[str(c) for c in conc],
    )
    ax1.set_ylim(0, 1.3 * max(float(r["output_tokens_per_s"]) for r in rows))  # headroom: the legend above the bars
    ax1.legend(frameon=False, fontsize=8, loc="upper left", ncols=2)
    ax1.grid(alpha=0.3, axis="y")
    ax2.axhline(1.0, color="grey", lw=1, ls="--")
    ax2.set(
        xlabel="concurrent requests",
        ylabel="speedup vs no speculation (×)",
        title="speedup",
        xscale="log",
        xticks=conc,
        xticklabels=[str(c) for c in conc],
    )
    ax2.legend(frameon=False, fontsize=8)
    ax2.grid(alpha=0.3)
    passes = int(rows[0].get("passes") or 1)
    fig.suptitle(f"{title} — vLLM served, {decoding(rows)}; 95% interval over {passes} passes a side", fontsize=10)
    out = run_dir / "speedup.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# --- evaluation suites (run_dir/suites/) ------------------------------------------------------------
def save_figure(fig, out: Path) -> Path:
    """PNG to look at, PDF for the paper. Drawn uninterrupted: Agg's C++ renderer calls back into Python and turns
    an interrupt raised there into a ValueError (eaglelab.core.preemption)."""
    with uninterruptible("figure"):
        fig.savefig(out, dpi=120)
        fig.savefig(out.with_suffix(".pdf"))
    plt.close(fig)
    return out


# drift.csv's measures as the drift figures show them: column -> (panel title, y label)
DRIFT_PANELS = {
    "hidden_rms": ("RMS of the state fed to step j", "RMS (‖x‖/√d)"),
    "sink_share": ("attention on the first token", "share of attention"),
    "recent_share": ("attention on the most recent keys", "share of attention"),
    "context_share": ("attention on verified context", "share of attention"),
    "entropy": ("attention entropy", "entropy (nats)"),
}


@dataclass
class Curve:
    """One line in each panel of a figure: a run's own values, or a setup's means over its seeds with ± `errors`
    bars. `y` and `errors` map a table column to one value per `x`."""

    label: str | None
    color: str
    x: Sequence[float]
    y: dict[str, Sequence[float]]
    errors: dict[str, Sequence[float]] | None = None
    fmt: str = "o-"
    style: dict = field(default_factory=dict)  # the line's other keyword arguments (marker size, error caps)

    def draw(self, ax, column: str) -> None:
        if self.errors is None:
            ax.plot(self.x, self.y[column], self.fmt, color=self.color, label=self.label, **self.style)
        else:
            ax.errorbar(
                self.x,
                self.y[column],
                yerr=self.errors[column],
                fmt=self.fmt,
                color=self.color,
                label=self.label,
                **self.style,
            )


def table_curve(rows: list[dict], columns, label: str | None = None, color: str = PALETTE[0]) -> Curve:
    """One run's table (drift.csv: a row per draft depth) as one line per column."""
    return Curve(label, color, [int(r["depth"]) for r in rows], {c: [float(r[c]) for r in rows] for c in columns})


def drift_figure(
    curves: list[Curve],
    out: Path,
    title: str,
    panels=("hidden_rms", "sink_share", "recent_share", "context_share"),
    ylabels: dict[str, str] | None = None,
    fc_balance: list[dict] | None = None,
    figsize: tuple[float, float] = (14, 3.4),
    title_size: float = 10,
    legend_below: bool = False,
    depth_axes: bool = False,
) -> Path:
    """drift.png (and .pdf): one panel per drift measure (`panels`: drift.csv columns, titled and labelled as
    DRIFT_PANELS says, `ylabels` overriding) against draft depth, a line per curve; with `fc_balance` (fc_balance.csv's
    rows) a last panel of the fc input share per aux layer. One row of panels up to four, else two rows. Labelled
    curves get a legend in the first panel, or below the panels (`legend_below`); `depth_axes`: a tick at each depth
    and the shares on 0..1 (one run's figure)."""
    ylabels = {column: DRIFT_PANELS[column][1] for column in panels} | (ylabels or {})
    n = len(panels) + (fc_balance is not None)
    rows = 1 if n <= 4 else 2
    fig, axes = plt.subplots(rows, math.ceil(n / rows), figsize=figsize, constrained_layout=True)
    axes = list(axes.flat)
    for ax, column in zip(axes, panels):
        for curve in curves:
            curve.draw(ax, column)
        ax.set(xlabel="draft depth j", ylabel=ylabels[column], title=DRIFT_PANELS[column][0])
        if depth_axes:
            ax.set_xticks(sorted({x for curve in curves for x in curve.x}))
            if "share" in column:
                ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    if fc_balance is not None:
        ax = axes[len(panels)]
        layers = [r["aux_layer"] for r in fc_balance]
        ax.bar(range(len(layers)), [float(r["input_share"]) for r in fc_balance], color=PALETTE[1])
        ax.axhline(1 / len(layers), color="grey", lw=1, ls="--", label="equal shares")
        ax.set(
            xticks=range(len(layers)),
            xticklabels=[f"layer {x}" for x in layers],
            ylim=(0, 1),
            ylabel="share of ‖fc input‖²",
            title="fc input balance per aux layer",
        )
        ax.legend(frameon=False, fontsize=8)
    if any(curve.label for curve in curves):
        if legend_below:
            handles = axes[0].get_legend_handles_labels()
            fig.legend(*handles, loc="outside lower center", ncol=len(curves), frameon=False)
        else:
            axes[0].legend(frameon=False, fontsize=8)
    fig.suptitle(title, fontsize=title_size)
    return save_figure(fig, out)


def plot_drift(suite_dir: Path, title: str) -> Path:
    """drift.png: the run's attention-drift measures per draft depth, and the fc input balance."""
    rows = _read(suite_dir / "drift.csv")
    panels = ("hidden_rms", "sink_share", "recent_share", "context_share", "entropy")
    return drift_figure(
        [table_curve(rows, panels)],
        suite_dir / "drift.png",
        f"{title} — attention drift per draft depth (held-out prompts)",
        panels,
        ylabels={"hidden_rms": "hidden-state RMS (‖x‖/√d)"},
        fc_balance=_read(suite_dir / "fc_balance.csv"),
        figsize=(11, 6),
        depth_axes=True,
    )


def plot_extrapolation(run_dir: Path, suite_dir: Path, title: str) -> Path:
    """extrapolation.png: τ(k)/τ(ttt_steps), and per-position acceptance at the deepest k."""
    rows = _read(suite_dir / "extrapolation.csv")
    ttt = int(rows[0]["ttt_steps"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), constrained_layout=True)
    for evaluator, color, marker in (("simulated", PALETTE[0], "o-"), ("vllm", PALETTE[1], "s--")):
        sel = [r for r in rows if r["evaluator"] == evaluator]
        if sel:
            ax1.plot(
                [int(r["k"]) for r in sel],
                [float(r["relative_to_ttt"]) for r in sel],
                marker,
                color=color,
                label=evaluator,
            )
    for ax in (ax1, ax2):
        ax.axvline(ttt, color="grey", lw=1, ls=":", label=f"trained depth (ttt_steps={ttt})")
        ax.grid(alpha=0.3)
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set(xlabel="draft tokens per round k", ylabel="τ(k) / τ(ttt_steps)", title="τ relative to the trained depth")
    ax1.legend(frameon=False, fontsize=8)
    by_pos = [r for r in _read(run_dir / "per_position.csv") if r["evaluator"] == "simulated"]
    deepest = max(int(r["k"]) for r in by_pos)
    sel = [r for r in by_pos if int(r["k"]) == deepest]
    ax2.plot([int(r["position"]) for r in sel], [float(r["acceptance_rate"]) for r in sel], "o-", color=PALETTE[2])
    ax2.set(
        xlabel="draft position i",
        ylabel="share of rounds accepting draft i",
        ylim=(0, 1),
        title=f"per-position acceptance at k={deepest} (simulated)",
        xticks=range(1, deepest + 1),
    )
    fig.suptitle(f"{title} — train→inference extrapolation", fontsize=10)
    return save_figure(fig, suite_dir / "extrapolation.png")


def plot_benchmarks(suite_dir: Path, title: str, published: list | None = None) -> Path:
    """benchmarks.png: τ against k on each benchmark, one panel each: the simulated evaluator (line) and vLLM
    (squares) over the same requests, and the published figures the run's recipe names for that benchmark (stars)."""
    rows = _read(suite_dir / "benchmarks.csv")
    names = list(dict.fromkeys(r["condition"] for r in rows))
    fig, axes = plt.subplots(
        1, len(names), figsize=(4.2 * len(names), 3.4), constrained_layout=True, squeeze=False, sharey=True
    )
    for ax, name in zip(axes[0], names):
        for evaluator, style, color in (("simulated", "o-", PALETTE[0]), ("vllm", "s", PALETTE[1])):
            sel = sorted((int(r["k"]), float(r["acceptance_length"])) for r in rows
                         if r["condition"] == name and r["evaluator"] == evaluator)  # fmt: skip
            if sel:
                ax.plot(*zip(*sel), style, color=color, label=evaluator, ms=6 if evaluator == "vllm" else 4)
        refs = [r for r in published or [] if r.benchmark == name]
        for source, color in zip(dict.fromkeys(r.source for r in refs), PALETTE[2:] * 4):  # a colour per source
            mine = sorted((r.k, r.acceptance_length) for r in refs if r.source == source)
            ax.plot(*zip(*mine), "*", ms=10, color=color, label=f"published: {source}"[:60])
        prompts = next(r["prompts"] for r in rows if r["condition"] == name)
        ax.set(xlabel="draft tokens per round k", ylabel="acceptance length τ", title=f"{name} ({prompts} requests)")
        ax.grid(alpha=0.3)
        ax.legend(frameon=False, fontsize=7)
    # (one scale for every panel: set once the panels are drawn, so that none cuts another's points off)
    tops = [float(r["acceptance_length"]) for r in rows] + [r.acceptance_length for r in published or []]
    axes[0][0].set_ylim(1.0, max(tops) * 1.05)
    fig.suptitle(f"{title} — τ per benchmark", fontsize=10)
    return save_figure(fig, suite_dir / "benchmarks.png")


def template_bars(ax, conditions: list[str], series: list[tuple[str, dict[str, dict]]]) -> None:
    """Grouped bars of τ per template condition, one bar per series (label, {condition: table row}),
    each labelled with its ratio to native."""
    width = 0.8 / len(series)
    for i, ((label, rows), color) in enumerate(zip(series, PALETTE)):
        xs = [j + i * width for j in range(len(conditions))]
        bars = ax.bar(xs, [float(rows[c]["acceptance_length"]) for c in conditions], width, color=color, label=label)
        ax.bar_label(bars, [f"{float(rows[c]['ratio_to_native']):.2f}×" for c in conditions], fontsize=6)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(conditions))], conditions, rotation=30, ha="right")
    ax.set(ylabel="acceptance length τ", title="τ per prompt condition (labels: ratio to native)")


def plot_suite(suite_dir: Path, suite: str, title: str) -> Path:
    """long_context.png: τ vs prompt length; templates.png: τ per condition with its ratio to native."""
    rows = _read(suite_dir / f"{suite}.csv")
    series = sorted({(r["evaluator"], int(r["k"])) for r in rows})
    fig, ax = plt.subplots(figsize=(8 if suite == "templates" else 6, 3.6), constrained_layout=True)
    if suite == "long_context":
        for (evaluator, k), color in zip(series, PALETTE):
            sel = [r for r in rows if (r["evaluator"], int(r["k"])) == (evaluator, k)]
            ax.plot(
                [float(r["prompt_tokens"]) for r in sel],
                [float(r["acceptance_length"]) for r in sel],
                "o-" if evaluator == "simulated" else "s--",
                color=color,
                label=f"{evaluator}, k={k}",
            )
        ax.set(xscale="log", xlabel="prompt length (tokens)", ylabel="acceptance length τ", title="τ vs context length")
        ticks = sorted({round(float(r["prompt_tokens"])) for r in rows})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
    else:
        by_series = {s: {r["condition"]: r for r in rows if (r["evaluator"], int(r["k"])) == s} for s in series}
        template_bars(
            ax,
            list(dict.fromkeys(r["condition"] for r in rows)),
            [(f"{evaluator}, k={k}", by_series[(evaluator, k)]) for evaluator, k in series],
        )
    ax.set_ylim(bottom=1.0)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, suite_dir / f"{suite}.png")


def plot_long_context_speed(suite_dir: Path, title: str) -> Path:
    """long_context_speed.png: the served speedup (95% interval over passes) and TPOT p50 of each method per prompt
    length, one line per drafter depth and concurrency (long_context_throughput.csv)."""
    rows = _read(suite_dir / "long_context_throughput.csv")
    lengths = sorted({int(r["group"]) for r in rows})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), constrained_layout=True)
    series = sorted({(r["method"], int(r["k"]), int(r["concurrency"])) for r in rows})
    for (method, k, c), color in zip(series, PALETTE * 4):
        sel = {int(r["group"]): r for r in rows if (r["method"], int(r["k"]), int(r["concurrency"])) == (method, k, c)}
        xs = [n for n in lengths if n in sel]
        label = f"{'no speculation' if method == 'none' else f'EAGLE drafter, k={k}'}, c={c}"
        ax2.plot(xs, [float(sel[n]["tpot_p50_ms"]) for n in xs], "o-", color=color, label=label)
        if method == "none":
            continue
        y = [float(sel[n]["speedup"]) for n in xs]
        lo, hi = ([float(sel[n].get(f"speedup_ci_{e}") or "nan") for n in xs] for e in ("low", "high"))
        err = None if any(map(math.isnan, lo)) else [[v - a for v, a in zip(y, lo)], [b - v for v, b in zip(y, hi)]]
        ax1.errorbar(xs, y, yerr=err, fmt="o-", color=color, capsize=3, label=label)
    for ax in (ax1, ax2):
        ax.set(xscale="log", xticks=lengths, xticklabels=[str(n) for n in lengths], xlabel="prompt tokens (nominal)")
        ax.minorticks_off()  # (the log axis' own labels would print over the lengths')
        ax.grid(alpha=0.3)
        ax.legend(frameon=False, fontsize=8)
    ax1.axhline(1.0, color="grey", lw=1, ls="--")
    ax1.set(ylabel="speedup vs no speculation (×)", title="decode speedup by context length")
    ax2.set(ylabel="TPOT p50 (ms)", title="time per output token")
    passes = int(rows[0].get("passes") or 1)
    fig.suptitle(f"{title} — vLLM served, {decoding(rows)}; 95% interval over {passes} passes a side", fontsize=10)
    return save_figure(fig, suite_dir / "long_context_speed.png")
