"""Data scaling: τ against the training data, one row per (line, data size), mean ± 95% CI over seeds.

    python analysis/scaling.py results/ [more roots] [--out DIR]

A *line* is a setup without its data size (`analysis.store.data_sizes`): one variant with the same other settings
trained on more or fewer prompts (sweeps/data_scaling.yaml). Per size: the training response tokens (metrics.json
`data/response_tokens`, the assistant tokens the drafter learns from), τ at k = ttt_steps and at k = 8 (simulated
evaluator, held-out prompts), and τ(8)/τ(ttt) per run — how much of the gain at the trained depth survives deeper
drafting. Prints the markdown table and writes DIR/data_scaling.{md,csv} (default DIR: analysis/out); a store with
no line measured at two data sizes has no scaling to show (exit status 1, nothing written).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from analysis import cli
from analysis.compare import cell
from analysis.store import DATA_SIZE, Run, add_seed_stats, data_sizes
from eaglelab.core.io import write_csv

DEEP_K = 8  # past the trained depth: every run measures k = 1 … max(8, 2·ttt_steps+2)

# measure -> (column heading, LaTeX heading, decimals), as analysis.compare.COLUMNS
MEASURES = {
    "tau": ("τ (k=ttt)", r"$\tau$ ($k{=}$ttt)", 3),
    "tau_deep": (f"τ (k={DEEP_K})", rf"$\tau$ ($k{{=}}{DEEP_K}$)", 3),
    "deep_ratio": (f"τ({DEEP_K})/τ(ttt)", rf"$\tau_{{{DEEP_K}}}/\tau_{{\mathrm{{ttt}}}}$", 3),
}


def _measures(run: Run) -> dict[str, float]:
    tau, deep = run.metrics.get(f"acceptance_length@k{run.ttt}"), run.metrics.get(f"acceptance_length@k{DEEP_K}")
    tau, deep = (math.nan if v is None else float(v) for v in (tau, deep))
    return {"tau": tau, "tau_deep": deep, "deep_ratio": deep / tau if tau else math.nan}


def scaling_rows(runs: list[Run]) -> list[dict]:
    """One row per line and data size: the training tokens, and per measure the mean, 95% CI half-width, standard
    error and n over seeds. Empty unless some line was trained at two data sizes or more."""
    lines = data_sizes(runs)
    if not any(len(sizes) > 1 for sizes in lines.values()):
        return []
    rows = []
    for line, sizes in lines.items():
        for size, members in sizes.items():
            row = {
                "line": line,
                "variant": members[0].variant,
                "num_prompts": size,
                # one training set per size: the seeds (train.seed) share it, data.seed would be another line
                "response_tokens": int(members[0].metrics["data/response_tokens"]),
                "train_tokens": int(members[0].metrics["data/train_tokens"]),
                "seeds": len(members),
                "seed_list": " ".join(str(r.seed) for r in members),
            }
            rows.append(add_seed_stats(row, [_measures(r) for r in members], MEASURES))
    return rows


def markdown(rows: list[dict]) -> str:
    head = ["variant", "prompts", "response tokens", "seeds", *(heading for heading, _, _ in MEASURES.values())]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["line"], str(r["num_prompts"]), f"{r['response_tokens']:,}", str(r["seeds"])]
        cells += [cell(r, "tau", 3), cell(r, "tau_deep", 3)]
        cells.append("–" if math.isnan(r["deep_ratio"]) else f"{r['deep_ratio']:.3f}")  # per-run ratio, seed mean
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write(rows: list[dict], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "data_scaling.csv", rows)
    (out / "data_scaling.md").write_text(
        f"τ against the training data ({DATA_SIZE}; response tokens: the assistant tokens trained on). Mean ± 95% CI "
        "(Student t) over seeds, simulated evaluator on the held-out prompts; the last column is the seed mean of "
        "each run's ratio.\n\n" + markdown(rows)
    )
    return [out / "data_scaling.csv", out / "data_scaling.md"]


def main(argv: list[str] | None = None) -> int:
    args = cli.parser(__doc__).parse_args(argv)
    rows = scaling_rows(cli.load_or_exit(args.roots))
    if not rows:
        cli.warn(f"no setup was trained at two data sizes ({DATA_SIZE}); see sweeps/data_scaling.yaml")
        return 1
    write(rows, args.out)
    print(markdown(rows))
    print(f"{len(rows)} rows -> {args.out / 'data_scaling.md'}, {args.out / 'data_scaling.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
