"""Drafter variants side by side on the evaluation suites, from run directories only.

    python analysis/compare_suites.py RUN_DIR [RUN_DIR ...] --out DIR [--reference eagle3]

Each run is labelled `<variant> ttt<ttt_steps>`. Writes to DIR:
    suites_comparison.csv / .md   one row per run: τ at the trained depth, extrapolation, long-context,
                                  template and per-benchmark τ, drift at depth 1 and 8
    ratios.csv / .md              τ(variant) / τ(reference) per long-context length, template condition and benchmark,
                                  for runs with the same ttt_steps (the 3.1/3 ratios of the paper)
    drift.png, long_context.png, templates.png, extrapolation.png   (and .pdf)
A directory without metrics.json (running, failed, interrupted) is named and skipped.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import yaml

from analysis import cli
from eaglelab.evaluate.plots import (  # the runs' own style and colour-blind palette
    PALETTE,
    drift_figure,
    plt,
    save_figure,
    table_curve,
    template_bars,
)


def read_csv(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def load_run(run_dir: Path) -> dict | None:
    if not (run_dir / "metrics.json").is_file():
        cli.warn(f"skipped {run_dir}: no metrics.json (not a finished run)")
        return None
    info = json.loads((run_dir / "run.json").read_text())
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    suites = run_dir / "suites"
    window = (cfg.get("resolved") or {}).get("attention_window", cfg["drafter"].get("attention_window"))
    return {
        "dir": run_dir,
        "variant": info["variant"],
        "ttt": int(cfg["train"]["ttt_steps"]),
        "window": window,
        "label": f"{info['variant']} ttt{cfg['train']['ttt_steps']}" + (f" window{window}" if window else ""),
        "metrics": json.loads((run_dir / "metrics.json").read_text()),
        **{
            name: read_csv(suites / f"{name}.csv")
            for name in ("drift", "fc_balance", "extrapolation", "long_context", "templates", "benchmarks")
        },
    }


EVALUATOR = "preferred"  # --evaluator: simulated | vllm | preferred (vLLM where it measured, else simulated)


def preferred(rows: list[dict], k: int) -> dict[str, dict]:
    """condition -> row at depth k from the chosen evaluator."""
    out = {}
    for r in rows:
        if int(r["k"]) != k or EVALUATOR not in ("preferred", r["evaluator"]):
            continue
        if r["condition"] not in out or r["evaluator"] == "vllm":
            out[r["condition"]] = r
    return out


def summary_row(run: dict) -> dict:
    m, ttt = run["metrics"], run["ttt"]
    row = {"run": run["label"], "dir": run["dir"].name, "tau@k_ttt": m.get(f"acceptance_length@k{ttt}")}
    extra = {r["evaluator"]: r for r in run["extrapolation"] if int(r["k"]) == 2 * ttt}
    row["tau(2ttt)/tau(ttt)"] = float(extra["simulated"]["relative_to_ttt"]) if "simulated" in extra else None
    for cond, r in preferred(run["long_context"], ttt).items():
        row[f"tau@{cond}tok"] = float(r["acceptance_length"])
    for cond, r in preferred(run["templates"], ttt).items():
        row[f"tau@{cond}"] = float(r["acceptance_length"])
    for name, r in preferred(run["benchmarks"], ttt).items():  # (each benchmark on its own: MT-Bench, HumanEval)
        row[f"tau@{name}"] = float(r["acceptance_length"])
    for r in run["drift"]:
        if int(r["depth"]) in (1, 8):
            for name in ("hidden_rms", "sink_share", "recent_share", "context_share"):
                row[f"{name}@d{r['depth']}"] = float(r[name])
    return row


def ratios(runs: list[dict], reference: str) -> list[dict]:
    out = []
    for run in runs:
        same_setup = [r for r in runs if (r["ttt"], r["window"]) == (run["ttt"], run["window"])]
        ref = next((r for r in same_setup if r["variant"] == reference), None)
        if ref is None or run is ref:
            continue
        for suite in ("long_context", "templates", "benchmarks"):
            mine, theirs = preferred(run[suite], run["ttt"]), preferred(ref[suite], ref["ttt"])
            for cond in mine:
                if cond in theirs and mine[cond]["evaluator"] == theirs[cond]["evaluator"]:
                    a, b = float(mine[cond]["acceptance_length"]), float(theirs[cond]["acceptance_length"])
                    out.append(
                        {
                            "suite": suite,
                            "condition": cond,
                            "k": run["ttt"],
                            "evaluator": mine[cond]["evaluator"],
                            "run": run["label"],
                            "reference": ref["label"],
                            "tau": a,
                            "tau_reference": b,
                            "ratio": a / b,
                        }
                    )
    return out


def write_table(rows: list[dict], path: Path) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def plot_drift(runs: list[dict], out: Path) -> None:
    panels = ("hidden_rms", "sink_share", "recent_share", "context_share")
    drift_figure(
        [table_curve(run["drift"], panels, run["label"], color) for run, color in zip(runs, PALETTE)],
        out / "drift.png",
        "attention drift per draft depth (held-out prompts, in-house)",
        panels,
        ylabels=dict.fromkeys(panels[1:], "share"),
    )


def plot_long_context(runs: list[dict], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.6), constrained_layout=True)
    for run, color in zip(runs, PALETTE):
        rows = sorted(preferred(run["long_context"], run["ttt"]).values(), key=lambda r: float(r["prompt_tokens"]))
        ax.plot(
            [float(r["prompt_tokens"]) for r in rows],
            [float(r["acceptance_length"]) for r in rows],
            "o-",
            color=color,
            label=f"{run['label']} ({rows[0]['evaluator']}, k={run['ttt']})",
        )
    ticks = sorted(
        {round(float(r["prompt_tokens"])) for run in runs for r in preferred(run["long_context"], run["ttt"]).values()}
    )
    ax.set(xscale="log", xlabel="prompt length (tokens)", ylabel="acceptance length τ", title="τ vs context length")
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    save_figure(fig, out / "long_context.png")


def plot_templates(runs: list[dict], out: Path) -> None:
    conditions = list(dict.fromkeys(r["condition"] for run in runs for r in run["templates"]))
    fig, ax = plt.subplots(figsize=(9, 3.8), constrained_layout=True)
    template_bars(
        ax, conditions, [(f"{run['label']} (k={run['ttt']})", preferred(run["templates"], run["ttt"])) for run in runs]
    )
    ax.set_ylim(bottom=1.0)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(frameon=False, fontsize=8)
    save_figure(fig, out / "templates.png")


def plot_extrapolation(runs: list[dict], out: Path) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    for run, color in zip(runs, PALETTE):
        rows = [r for r in run["extrapolation"] if r["evaluator"] == "simulated"]
        ks = [int(r["k"]) for r in rows]
        style = "o-" if run["ttt"] == max(r["ttt"] for r in runs) else "s--"
        ax1.plot(ks, [float(r["acceptance_length"]) for r in rows], style, color=color, label=run["label"])
        ax2.plot(ks, [float(r["relative_to_ttt"]) for r in rows], style, color=color, label=run["label"])
    ax1.set(xlabel="draft tokens per round k", ylabel="acceptance length τ", title="τ vs k (simulated, exact)")
    ax2.set(xlabel="draft tokens per round k", ylabel="τ(k) / τ(ttt_steps)", title="relative to the trained depth")
    ax2.axhline(1.0, color="grey", lw=0.8)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(frameon=False, fontsize=8)
    save_figure(fig, out / "extrapolation.png")


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__doc__, roots=False, out=None, reference="variant every ratio is taken against")
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--evaluator",
        default="preferred",
        choices=["preferred", "simulated", "vllm"],
        help="rows compared for long_context/templates (same evaluator on both sides of a ratio)",
    )
    args = ap.parse_args(argv)
    global EVALUATOR
    EVALUATOR = args.evaluator
    runs = [r for r in map(load_run, args.runs) if r is not None]
    if not runs:
        return cli.fail("no finished run among the given directories; pass run directories with metrics.json")
    runs.sort(key=lambda r: (-r["ttt"], r["variant"]))
    args.out.mkdir(parents=True, exist_ok=True)
    write_table([summary_row(r) for r in runs], args.out / "suites_comparison")
    if rows := ratios(runs, args.reference):
        write_table(rows, args.out / "ratios")
    for suite, plot in (
        ("drift", plot_drift),
        ("long_context", plot_long_context),
        ("templates", plot_templates),
        ("extrapolation", plot_extrapolation),
    ):
        per_condition = suite in ("long_context", "templates")
        having = [r for r in runs if r[suite] and (not per_condition or preferred(r[suite], r["ttt"]))]
        if suite == "templates":  # bars need every condition: only the conditions all runs measured
            common = set.intersection(*(set(preferred(r[suite], r["ttt"])) for r in having)) if having else set()
            for r in having:
                r[suite] = [row for row in r[suite] if row["condition"] in common]
        if having:  # each figure shows the runs that ran its suite (with the chosen evaluator)
            plot(having, args.out)
    print((args.out / "suites_comparison.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
