"""The paper's figures from a results store: every setup's seeds aggregated, mean ± standard error as error bars
(data_scaling: ± 95% CI, as its table).

    python analysis/figures.py results/ [more roots] [--out DIR]

One colour per setup (Okabe-Ito, colour-blind safe), the same in every figure (data_scaling: one per setup without
its data size); each figure as PNG (to look at) and PDF (for the paper). A figure whose suite no run measured is not
drawn (and not listed), nor data_scaling when no setup was trained at two data sizes.
Simulated evaluator throughout (exact for greedy chain drafting, all held-out prompts); vLLM numbers are in
the comparison table and the per-run speedup figure.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd

from analysis import cli
from analysis.paired import MIN_COUNT, paired_rows, setup_levels
from analysis.scaling import DEEP_K, scaling_rows
from analysis.store import Run, aggregate, setups
from eaglelab.evaluate.plots import (  # the runs' own palette, lines and PNG+PDF saving
    PALETTE,
    Curve,
    drift_figure,
    plt,
    save_figure,
)

plt.rcParams.update(
    {
        "font.size": 9,
        "axes.titlesize": 9,
        "axes.labelsize": 9,
        "legend.fontsize": 8,
        "axes.spines.top": False,
        "axes.spines.right": False,
    }
)
ERR = dict(capsize=3, elinewidth=1, markersize=4)
MARKERS = "osD^v<>p"  # past 8 setups the colours repeat: the marker tells them apart


def seed_frames(members: list[Run], table: str, **where) -> list[pd.DataFrame]:
    """Each seed's rows of `table` matching `where` (column == value)."""
    out = []
    for r in members:
        if table not in r.tables:
            continue
        df = r.tables[table]
        for column, value in where.items():
            df = df[df[column] == (value(r) if callable(value) else value)]
        if len(df):
            out.append(df)
    return out


def seed_curves(groups, colors, table, x, ys, log_x: bool = False, **where) -> list[Curve]:
    """One curve per setup with rows in `table`: each column of `ys` by `x`, mean over its seeds ± standard error.
    Setups are dodged sideways a little so that overlapping lines and error bars stay visible."""
    curves = []
    for i, (label, members) in enumerate(groups.items()):
        if frames := seed_frames(members, table, **where):
            aggs = {y: aggregate(frames, [x], y) for y in ys}
            at = aggs[ys[0]][x]
            shift = (i - (len(groups) - 1) / 2) * 0.04
            curves.append(
                Curve(
                    f"{label} (n={len(frames)})",
                    colors[label],
                    at * (1 + shift / 2) if log_x else at + shift,
                    {y: agg["mean"] for y, agg in aggs.items()},
                    {y: agg["se"] for y, agg in aggs.items()},
                    fmt=f"{MARKERS[i // len(PALETTE) % len(MARKERS)]}-",
                    style=ERR,
                )
            )
    return curves


def _curve(ax, groups, colors, table, x, y, log_x: bool = False, **where) -> bool:
    """One line per setup (`seed_curves`) on `ax`; False when no setup has rows in `table`."""
    curves = seed_curves(groups, colors, table, x, [y], log_x, **where)
    for curve in curves:
        curve.draw(ax, y)
    ax.grid(alpha=0.3)
    return bool(curves)


def fig_tau_vs_k(groups, colors, out: Path) -> Path | None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), constrained_layout=True)
    if not _curve(ax1, groups, colors, "acceptance", "k", "acceptance_length", evaluator="simulated"):
        return plt.close(fig)
    ax1.set(
        xlabel="draft tokens per round k", ylabel="acceptance length τ (tokens / target step)", title="τ vs draft depth"
    )
    ax1.legend(frameon=False)
    _curve(
        ax2,
        groups,
        colors,
        "per_position",
        "position",
        "acceptance_rate",
        evaluator="simulated",
        k=lambda r: int(r.tables["per_position"]["k"].max()),
    )
    ax2.set(
        xlabel="draft position i",
        ylabel="share of rounds accepting draft i",
        ylim=(0, 1),
        title="per-position acceptance at the deepest k",
    )
    return save_figure(fig, out / "tau_vs_k.png")


def fig_extrapolation(groups, colors, out: Path) -> Path | None:
    fig, ax = plt.subplots(figsize=(5, 3.4), constrained_layout=True)
    if not _curve(ax, groups, colors, "suites/extrapolation", "k", "relative_to_ttt", evaluator="simulated"):
        return plt.close(fig)
    ttts = sorted({r.ttt for members in groups.values() for r in members})
    for t in ttts:
        ax.axvline(t, color="grey", lw=0.8, ls=":")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(
        xlabel="draft tokens per round k (dotted: trained depth ttt_steps)",
        ylabel="τ(k) / τ(ttt_steps)",
        title="train → inference extrapolation",
    )
    ax.legend(frameon=False)
    return save_figure(fig, out / "extrapolation.png")


def fig_acceptance_by_depth(groups, colors, out: Path, reference: str = "eagle3") -> Path | None:
    """n-α(d) and teacher-forced accuracy by depth, each setup with its 95% bootstrap band (seeds and prompts);
    below, each setup minus its reference twin, paired per prompt and seed, with the power line (dashed: the
    smallest difference resolvable with 80% power). Dotted: the trained depth. Depths where a seed counted fewer than
    MIN_COUNT rounds (n-α: rounds that reached d) are left out."""
    runs = [r for members in groups.values() for r in members]
    levels = pd.DataFrame(setup_levels(runs))
    if levels.empty:
        return None
    levels = levels[levels["counted"] >= MIN_COUNT]  # depths a handful of chains reached: no measurement to plot
    diffs = pd.DataFrame(paired_rows(runs, reference))
    diffs = diffs[diffs["counted"] >= MIN_COUNT] if len(diffs) else diffs
    depths = sorted(levels["at"].unique())
    fig, axes = plt.subplots(2 if len(diffs) else 1, 2, figsize=(9, 6.4 if len(diffs) else 3.4), squeeze=False)
    panels = [("n_alpha", "n-α(d): accepted at d / rounds that reached d"), ("tf_acc", "teacher-forced accuracy at d")]
    for col, (measure, title) in enumerate(panels):
        ax = axes[0][col]
        for i, (label, rows) in enumerate(levels[levels["measure"] == measure].groupby("setup", sort=False)):
            shift = (i - (levels["setup"].nunique() - 1) / 2) * 0.06
            ax.fill_between(rows["at"] + shift, rows["low"], rows["high"], color=colors[label], alpha=0.18, lw=0)
            seeds = int(rows["seeds"].iloc[0])
            ax.plot(rows["at"] + shift, rows["mean"], f"{MARKERS[i % len(MARKERS)]}-", color=colors[label],
                    label=f"{label} (n={seeds})", markersize=4)  # fmt: skip
        for t in sorted(levels["ttt"].unique()):
            ax.axvline(t, color="grey", lw=0.8, ls=":")
        ax.set(xlabel="draft depth d (dotted: trained depth)", title=title, ylim=(0, None), xticks=depths)
        ax.grid(alpha=0.3)
        if len(diffs):
            ax = axes[1][col]
            for i, (label, rows) in enumerate(diffs[diffs["measure"] == measure].groupby("setup", sort=False)):
                shift = (i - (diffs["setup"].nunique() - 1) / 2) * 0.08
                err = [rows["difference"] - rows["ci_low"], rows["ci_high"] - rows["difference"]]
                ax.errorbar(rows["at"] + shift, rows["difference"], yerr=err, fmt="o-", color=colors[label],
                            label=f"{label} − {reference}", **ERR)  # fmt: skip
                ax.plot(rows["at"], rows["mde80"], "--", color=colors[label], lw=0.9)
            ax.axhline(0, color="grey", lw=0.8)
            for t in sorted(levels["ttt"].unique()):
                ax.axvline(t, color="grey", lw=0.8, ls=":")
            ax.set(
                xlabel="draft depth d",
                title="paired difference, 95% CI (dashed: resolvable at 80% power)",
                xticks=depths,
            )
            ax.grid(alpha=0.3)
    axes[0][0].legend(frameon=False)
    if len(diffs):
        axes[1][0].legend(frameon=False)
    fig.suptitle("acceptance by depth (simulated evaluator, held-out prompts; bands: 95% bootstrap over seeds and "
                 "prompts)", fontsize=9)  # fmt: skip
    fig.set_layout_engine("constrained")
    return save_figure(fig, out / "acceptance_by_depth.png")


def fig_long_context(groups, colors, out: Path) -> Path | None:
    fig, ax = plt.subplots(figsize=(5, 3.4), constrained_layout=True)
    if not _curve(
        ax,
        groups,
        colors,
        "suites/long_context",
        "prompt_tokens",
        "acceptance_length",
        log_x=True,
        evaluator="simulated",
        k=lambda r: r.ttt,
    ):
        return plt.close(fig)
    ticks = sorted(
        {
            round(t)
            for members in groups.values()
            for f in seed_frames(members, "suites/long_context")
            for t in f["prompt_tokens"]
        }
    )
    ax.set(
        xscale="log",
        xlabel="prompt length (tokens)",
        ylabel="acceptance length τ at k = ttt_steps",
        title="τ vs context length",
    )
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.legend(frameon=False)
    return save_figure(fig, out / "long_context.png")


def fig_templates(groups, colors, out: Path) -> Path | None:
    series = {
        label: aggregate(frames, ["condition"], "acceptance_length")
        for label, members in groups.items()
        if (frames := seed_frames(members, "suites/templates", evaluator="simulated", k=lambda r: r.ttt))
    }
    if not series:
        return None
    conditions = list(
        dict.fromkeys(
            c for members in groups.values() for f in seed_frames(members, "suites/templates") for c in f["condition"]
        )
    )
    conditions = [c for c in conditions if all(c in set(a["condition"]) for a in series.values())]
    ratios = {
        label: aggregate(
            seed_frames(groups[label], "suites/templates", evaluator="simulated", k=lambda r: r.ttt),
            ["condition"],
            "ratio_to_native",
        ).set_index("condition")
        for label in series
    }
    fig, ax = plt.subplots(figsize=(9, 3.6), constrained_layout=True)
    width = 0.8 / len(series)
    for i, (label, agg) in enumerate(series.items()):
        agg = agg.set_index("condition").loc[conditions]
        bars = ax.bar(
            [j + i * width for j in range(len(conditions))],
            agg["mean"],
            width,
            yerr=agg["se"],
            color=colors[label],
            label=label,
            capsize=2,
            error_kw={"elinewidth": 0.8},
        )
        ax.bar_label(
            bars, [f"{ratios[label].loc[c, 'mean']:.2f}×" for c in conditions], fontsize=6, padding=2, rotation=90
        )  # upright labels overlap once there are more than two setups
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(conditions))], conditions, rotation=30, ha="right")
    ax.set(ylabel="acceptance length τ at k = ttt_steps", title="τ per prompt condition (labels: ratio to native)")
    ax.set_ylim(bottom=1.0)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_figure(fig, out / "templates.png")


def fig_drift(groups, colors, out: Path) -> Path | None:
    panels = ("hidden_rms", "sink_share", "context_share", "recent_share")
    if not (curves := seed_curves(groups, colors, "suites/drift", "depth", panels)):
        return None
    title = "attention drift per draft depth (held-out prompts)"
    return drift_figure(curves, out / "drift.png", title, panels, figsize=(13, 3.7), title_size=9, legend_below=True)


def fig_fc_balance(groups, colors, out: Path) -> Path | None:
    series = {
        label: aggregate(frames, ["aux_layer"], "input_share")
        for label, members in groups.items()
        if (frames := seed_frames(members, "suites/fc_balance"))
    }
    if not series:
        return None
    layers = sorted(set.intersection(*(set(a["aux_layer"]) for a in series.values())))
    fig, ax = plt.subplots(figsize=(5, 3.2), constrained_layout=True)
    width = 0.8 / len(series)
    for i, (label, agg) in enumerate(series.items()):
        agg = agg.set_index("aux_layer").loc[layers]
        ax.bar(
            [j + i * width for j in range(len(layers))],
            agg["mean"],
            width,
            yerr=agg["se"],
            capsize=2,
            color=colors[label],
            label=label,
        )
    ax.axhline(1 / len(layers), color="grey", lw=0.8, ls="--", label="equal shares")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(layers))], [f"layer {x}" for x in layers])
    ax.set(ylabel="share of ‖fc input‖²", ylim=(0, 1), title="fc input balance per aux layer")
    ax.legend(frameon=False)
    return save_figure(fig, out / "fc_balance.png")


def fig_speedup(groups, colors, out: Path) -> Path | None:
    fig, ax = plt.subplots(figsize=(5, 3.4), constrained_layout=True)
    if not _curve(
        ax, groups, colors, "throughput", "concurrency", "speedup", log_x=True, method="eagle3", k=lambda r: r.ttt
    ):
        return plt.close(fig)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(
        xscale="log",
        xlabel="concurrent requests",
        ylabel="speedup vs no speculation (×)",
        title="vLLM decode speedup at k = ttt_steps",
    )
    ax.legend(frameon=False)
    return save_figure(fig, out / "speedup.png")


def _tokens(n: float) -> str:
    return f"{n / 1000:.3g}k" if n >= 1000 else f"{n:.0f}"


def fig_data_scaling(groups, colors, out: Path) -> Path | None:
    """τ at k = ttt_steps and at k = 8 against the training response tokens: one line per setup without its data
    size (analysis.scaling), each point mean ± 95% CI over seeds, as its table. Drawn when a line has two sizes."""
    rows = scaling_rows([r for members in groups.values() for r in members])
    if not rows:
        return None
    lines = list(dict.fromkeys(row["line"] for row in rows))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True, constrained_layout=True)
    panels = [("tau", "τ at k = ttt_steps"), ("tau_deep", f"τ at k = {DEEP_K}")]
    for ax, (key, title) in zip(axes, panels):
        for i, line in enumerate(lines):
            points = [row for row in rows if row["line"] == line]
            shift = 1 + (i - (len(lines) - 1) / 2) * 0.02  # dodged a little, so that error bars stay apart
            seeds = sorted({row["seeds"] for row in points})
            n = str(seeds[0]) if len(seeds) == 1 else f"{seeds[0]}–{seeds[-1]}"
            ax.errorbar(
                [row["response_tokens"] * shift for row in points],
                [row[key] for row in points],
                yerr=[0.0 if math.isnan(row[f"{key}_ci95"]) else row[f"{key}_ci95"] for row in points],  # 1 seed
                fmt=f"{MARKERS[i // len(PALETTE) % len(MARKERS)]}-",
                color=PALETTE[i % len(PALETTE)],
                label=f"{line} (n={n})",
                **ERR,
            )
        ticks = sorted({(row["response_tokens"], row["num_prompts"]) for row in rows})
        ax.set(xscale="log", xlabel="training response tokens (prompts)", title=title)
        ax.set_xticks([t for t, _ in ticks], [f"{_tokens(t)}\n({prompts})" for t, prompts in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].set(ylabel="acceptance length τ")
    axes[0].set_ylim(bottom=1.0)  # τ ≥ 1 by definition: a wide CI (two seeds) reaching below says nothing more
    axes[0].legend(frameon=False)
    fig.suptitle("τ vs training data (mean ± 95% CI over seeds, simulated evaluator)", fontsize=9)
    return save_figure(fig, out / "data_scaling.png")


FIGURES = [
    fig_tau_vs_k,
    fig_acceptance_by_depth,
    fig_extrapolation,
    fig_long_context,
    fig_templates,
    fig_drift,
    fig_fc_balance,
    fig_speedup,
    fig_data_scaling,
]


def draw_all(runs: list[Run], out: Path) -> list[Path]:
    """Every figure the store has data for; returns the PNG paths (each with its PDF)."""
    out.mkdir(parents=True, exist_ok=True)
    groups = setups(runs)
    colors = {label: PALETTE[i % len(PALETTE)] for i, label in enumerate(groups)}
    return [p for fig in FIGURES if (p := fig(groups, colors, out)) is not None]


def main(argv: list[str] | None = None) -> int:
    args = cli.parser(__doc__, out=cli.OUT / "figures").parse_args(argv)
    runs = cli.load_or_exit(args.roots)
    for path in draw_all(runs, args.out):
        print(path, path.with_suffix(".pdf"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
