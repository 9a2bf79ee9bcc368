"""All runs of a results store in one table: one row per setup (variant + what else differs), mean ± 95% CI
over its seeds. No W&B needed.

    python analysis/compare.py results/ [more roots or run directories] [--out DIR] [--reference eagle3]

Prints the markdown table and writes DIR/comparison.{md,csv} (default DIR: analysis/out). The CSV has, per
measure, `<measure>` (mean), `<measure>_ci95`, `<measure>_se` and `<measure>_n` (seeds that measured it).
Directories that are not readable finished runs are named on stderr and skipped.
"""

from __future__ import annotations

import csv
import math
import re
import sys
from pathlib import Path

from analysis import cli
from analysis.paired import paired_rows
from analysis.store import Run, add_seed_stats, setups


def _keyed(metrics: dict, pattern: str) -> dict[str, float]:
    """{captured group: value} for the metrics.json keys matching `pattern`."""
    return {m.group(1): v for k, v in metrics.items() if (m := re.fullmatch(pattern, k))}


def _nan(value) -> float:
    return math.nan if value is None else float(value)


def _deepest(metrics: dict, measure: str) -> tuple[int, float]:
    """(depth, value) of a drift measure at the deepest draft depth a draft reached (NaN beyond it)."""
    depths = {
        int(d): v
        for d, v in _keyed(metrics, rf"drift/{re.escape(measure)}@d(\d+)").items()
        if v is not None and not math.isnan(v)
    }
    return (max(depths), depths[max(depths)]) if depths else (0, math.nan)


def measures(run: Run) -> dict[str, float]:
    """The numbers a comparison reads per run (each NaN where that run did not measure it)."""
    m, ttt = run.metrics, run.ttt
    lengths = {int(n): v for n, v in _keyed(m, rf"long_context/simulated/acceptance_length@(\d+)@k{ttt}").items()}
    templates = {
        c: v for c, v in _keyed(m, rf"templates/simulated/ratio_to_native@(.+)@k{ttt}").items() if c != "native"
    }
    rms1, (_, rms_deep) = m.get("drift/hidden_rms@d1"), _deepest(m, "hidden_rms")
    return {
        "tau": _nan(m.get(f"acceptance_length@k{ttt}")),
        "tau_2ttt": _nan(m.get(f"acceptance_length@k{2 * ttt}")),
        "extrapolation": _nan(m.get(f"extrapolation/simulated/tau_ratio@k{2 * ttt}_vs_k{ttt}")),
        "val_tau": _nan(m.get(f"val/acceptance_length@k{ttt}")),
        "long_vs_short": lengths[max(lengths)] / lengths[min(lengths)] if len(lengths) > 1 else math.nan,
        "worst_template": min(templates.values()) if templates else math.nan,
        "context_share_deep": _deepest(m, "context_share")[1],
        "rms_growth": rms_deep / rms1 if rms1 else math.nan,
        "vllm_tau": _nan(m.get(f"vllm/acceptance_length@k{ttt}")),
        "vllm_speedup_c1": _nan(m.get(f"vllm/speedup@k{ttt}@c1")),
        "params_m": _nan(m.get("drafter/params")) / 1e6,
    }


# measure -> (column heading, LaTeX heading, decimals). Every heading says what k and which evaluator.
COLUMNS = {
    "tau": ("τ (k=ttt)", r"$\tau$ ($k{=}$ttt)", 3),
    "tau_2ttt": ("τ (k=2·ttt)", r"$\tau$ ($k{=}2\,$ttt)", 3),
    "extrapolation": ("τ(2·ttt)/τ(ttt)", r"$\tau_{2\mathrm{ttt}}/\tau_{\mathrm{ttt}}$", 3),
    "val_tau": ("val τ (k=ttt)", r"val $\tau$", 3),
    "long_vs_short": ("τ longest/shortest prompt", r"$\tau_{\mathrm{long}}/\tau_{\mathrm{short}}$", 3),
    "worst_template": ("worst template τ/native", r"worst templ./native", 3),
    "context_share_deep": ("context attention, deepest step", r"ctx.\ attn.\ (deepest)", 3),
    "rms_growth": ("state RMS deepest/step 1", r"RMS deepest/1", 2),
    "vllm_tau": ("vLLM τ (k=ttt)", r"vLLM $\tau$", 3),
    "vllm_speedup_c1": ("vLLM speedup (c=1)", r"speedup", 2),
    "params_m": ("drafter params (M)", r"params (M)", 2),
}


def comparison(runs: list[Run], reference: str = "eagle3") -> list[dict]:
    """One row per setup: n seeds, per measure mean, 95% CI half-width, standard error and n; and τ relative
    to the reference variant's setup with the same other settings (a ratio of seed means)."""
    groups = setups(runs)
    rows = []
    for label, members in groups.items():
        row = {
            "setup": label,
            "variant": members[0].variant,
            "seeds": len(members),
            "seed_list": " ".join(str(r.seed) for r in members),
        }
        rows.append(add_seed_stats(row, [measures(r) for r in members], COLUMNS))
    for row in rows:  # the reference setup: same label once the variant is swapped
        twin = next(
            (
                r
                for r in rows
                if r["variant"] == reference
                and r["setup"].removeprefix(reference) == row["setup"].removeprefix(row["variant"])
            ),
            None,
        )
        row["tau_vs_reference"] = row["tau"] / twin["tau"] if twin else math.nan
    # τ against the reference paired per prompt and seed (analysis/paired.py): the difference the ratio above hides
    # the uncertainty of, with its bootstrap interval and whether it is resolved
    paired = {(p["setup"], p["at"]): p for p in paired_rows(runs, reference) if p["measure"] == "tau"}
    for row in rows:
        p = paired.get((row["setup"], groups[row["setup"]][0].ttt), {})
        row["tau_paired_difference"] = p.get("difference", math.nan)
        row["tau_paired_ci_low"], row["tau_paired_ci_high"] = p.get("ci_low", math.nan), p.get("ci_high", math.nan)
        row["tau_paired_resolved"] = p.get("resolved", "")
    return rows


def shown_columns(rows: list[dict]) -> list[str]:
    """The measures at least one setup measured."""
    return [k for k in COLUMNS if any(not math.isnan(r[k]) for r in rows)]


def cell(row: dict, key: str, decimals: int, pm: str = " ± ") -> str:
    mean, ci = row[key], row[f"{key}_ci95"]
    if math.isnan(mean):
        return "–"
    return f"{mean:.{decimals}f}" + ("" if math.isnan(ci) else f"{pm}{ci:.{decimals}f}")


def markdown(rows: list[dict], reference: str) -> str:
    keys = shown_columns(rows)
    head = ["setup", "seeds", *(COLUMNS[k][0] for k in keys), f"τ / {reference}", f"Δτ − {reference}, paired"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = "–" if math.isnan(r["tau_vs_reference"]) else f"{r['tau_vs_reference']:.3f}×"
        paired = "–"
        if not math.isnan(r["tau_paired_difference"]):
            paired = (
                f"{r['tau_paired_difference']:+.3f} [{r['tau_paired_ci_low']:+.3f}, {r['tau_paired_ci_high']:+.3f}]"
            )
            paired += " resolved" if r["tau_paired_resolved"] else ""
        cells = [r["setup"], str(r["seeds"]), *(cell(r, k, COLUMNS[k][2]) for k in keys), ratio, paired]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write(rows: list[dict], out: Path, reference: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "comparison.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "comparison.md").write_text(
        "Mean ± 95% CI (Student t) over seeds; simulated evaluator on the held-out prompts unless the column says "
        f"vLLM; ratios of seed means against `{reference}` with the same other settings; Δτ paired: per prompt and "
        "seed at k = ttt, 95% bootstrap interval (analysis/paired.py).\n\n" + markdown(rows, reference)
    )
    return [out / "comparison.csv", out / "comparison.md"]


def main(argv: list[str] | None = None) -> int:
    args = cli.parser(__doc__, reference="variant τ is compared against").parse_args(argv)
    runs = cli.load_or_exit(args.roots)
    rows = comparison(runs, args.reference)
    write(rows, args.out, args.reference)
    print(markdown(rows, args.reference))
    print(f"{len(runs)} runs, {len(rows)} setups -> {args.out / 'comparison.md'}, {args.out / 'comparison.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
