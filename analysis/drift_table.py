"""The drift diagnostics held to the paper: paired by seed and prompt, per flag, side by side with the paper's values.

    python analysis/drift_table.py results/ [more roots] [--reference eagle3] [--out DIR] [--resamples 2000]

Reads each run's suites/drift_per_prompt.csv (the drift suite's held-out sequences) and writes DIR/:
  paired_drift.{csv,md}  every variant − the reference, each measure at each depth, 95% two-stage bootstrap interval
                         (analysis/paired.py's machinery); which flag moves which measure
  depth_change.csv       per variant and measure: deepest depth − depth 1 on the same seeds and prompts
  drift_vs_paper.{csv,md} the measures the paper reports, its values, ours with intervals, a verdict per claim

The paper (EAGLE-3.1's announcement, Llama-3.1-8B, MT-Bench-style prompts, draft depths 1 → 8) makes two claims per
measure: how EAGLE-3's value moves from depth 1 to 8, and where EAGLE-3.1 ends against EAGLE-3 at depth 8. A claim
is *reproduced* when our interval for the same quantity excludes 0 on the paper's side, *reversed* when it excludes
0 on the other, *unresolved* otherwise.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd

from analysis import cli
from analysis.paired import DRIFT, MIN_COUNT, depth_change_rows, drift_paired_rows
from eaglelab.models.variants import VARIANT_FLAGS, VARIANTS

# The paper's values (depth 1 -> depth 8), EAGLE-3 and EAGLE-3.1: RMS of the fed state, attention on the first
# token, attention on the most recent tokens. context_share it states in words only: EAGLE-3 moves its attention
# from the context to its own drafts as depth grows, EAGLE-3.1 keeps it on the context.
PAPER = {
    "hidden_rms": {"eagle3": (3.92, 14.02), "eagle3.1": (1.21, 1.20)},
    "sink_share": {"eagle3": (0.46, 0.08), "eagle3.1": (0.11, 0.10)},
    "recent_share": {"eagle3": (0.14, 0.31), "eagle3.1": (0.50, 0.53)},
    "context_share": {"eagle3": None, "eagle3.1": None},
}
STATED = {"context_share": (-1, +1)}  # (EAGLE-3's change with depth, EAGLE-3.1 − EAGLE-3 at depth 8), in words
PAPER_DEPTH = 8  # the paper reports depths 1 -> 8
SAME = 0.25  # two values of the paper within this share of the larger one: no direction claimed
NAMES = {
    "hidden_rms": "RMS of the state fed to step d",
    "sink_share": "attention on the first (sink) token",
    "context_share": "attention on verified context",
    "draft_share": "attention on its own drafts",
    "recent_share": "attention on the most recent keys",
    "entropy": "attention entropy (nats)",
}


def flags_of(variant: str) -> str:
    """The design flags a variant turns on (what its difference from EAGLE-3 isolates)."""
    v = VARIANTS.get(variant)
    on = [f for f in VARIANT_FLAGS if v and v.get(f)]
    return " + ".join(on) or "neither"


def num(x: float) -> str:
    """A signed value to three decimals, or in scientific notation where that would show 0 (sink shares)."""
    return f"{x:+.3f}" if abs(x) >= 0.01 or x == 0 or math.isnan(x) else f"{x:+.1e}"


def level(x: float) -> str:
    """A value to three decimals, or in scientific notation below 0.01."""
    return f"{x:.3f}" if abs(x) >= 0.01 or x == 0 or math.isnan(x) else f"{x:.2e}"


def interval(r: dict, key: str = "") -> str:
    """`value [low, high]` of a row's difference (key "") or of its `key`, `key_low`, `key_high` fields."""
    names = ("difference", "ci_low", "ci_high") if not key else (key, f"{key}_low", f"{key}_high")
    value, low, high = (r[n] for n in names)
    return f"{num(value)} [{num(low)}, {num(high)}]"


def sign(x: float) -> int:
    return (x > 0) - (x < 0)


def direction(a: float, b: float) -> int:
    """How the paper's value moves from a to b: +1, -1, or 0 where the two are within SAME of the larger (the
    paper then claims no direction: EAGLE-3.1's sink share 0.10 against EAGLE-3's 0.08 is "about the same")."""
    return 0 if abs(b - a) <= SAME * max(abs(a), abs(b)) else sign(b - a)


def verdict(expected: int, row: dict) -> str:
    """Where a paired row's 95% interval lies against the paper's direction: reproduced / reversed where it excludes
    0 on that side or the other (and each side counted MIN_COUNT drafts in every seed), unresolved otherwise; not
    claimed where the paper states no direction."""
    if expected == 0:
        return "not claimed"
    low, high = row["ci_low"], row["ci_high"]
    if math.isnan(low) or row["counted"] < MIN_COUNT or not (low > 0 or high < 0):
        return "unresolved"
    return "reproduced" if sign(low if low > 0 else high) == expected else "reversed"


def paper_rows(changes: list[dict], paired: list[dict], reference: str, variant: str) -> list[dict]:
    """Per paper measure, two claims on one setup pair (the first `variant` setup and its `reference` twin): the
    reference's change from depth 1 to depth D, and variant − reference at D, D = min(the pair's deepest, the
    paper's 8); the paper's values beside ours and the verdicts. Nothing unless the reference is EAGLE-3 (the
    paper's values are EAGLE-3's and EAGLE-3.1's)."""
    if reference != "eagle3":
        return []
    out = []
    for m, paper in PAPER.items():
        pairs = [r for r in paired if r["measure"] == m and r["setup"].split(" ")[0] == variant]
        if not pairs:
            continue
        setup, twin = pairs[0]["setup"], pairs[0]["reference"]
        depth = min(max(r["at"] for r in pairs if r["setup"] == setup), PAPER_DEPTH)
        pair = next((r for r in pairs if r["setup"] == setup and r["at"] == depth), None)
        at = lambda label: next(  # noqa: E731
            (r for r in changes if r["setup"] == label and r["measure"] == m and r["to"] == depth), None
        )
        change, ours31 = at(twin), at(setup)
        if pair is None or change is None or ours31 is None:
            continue
        p3, p31 = paper[reference], paper.get(variant)
        expect_change = direction(*p3) if p3 else STATED[m][0]
        expect_pair = direction(p3[1], p31[1]) if p3 and p31 else STATED[m][1]
        moves = {1: "rises", -1: "falls", 0: "stays"}
        out.append(
            {
                "measure": m,
                "setup": setup,
                "reference_setup": twin,
                "paper_reference": f"{p3[0]:.2f} → {p3[1]:.2f}" if p3 else "falls (stated, no values)",
                "paper_variant": f"{p31[0]:.2f} → {p31[1]:.2f}" if p31 else "stays (stated, no values)",
                "ours_reference": f"{level(change['first_mean'])} → {level(change['deepest_mean'])}",
                "ours_variant": f"{level(ours31['first_mean'])} → {level(ours31['deepest_mean'])}",
                "claim_change": f"{reference} {moves[expect_change]} from d=1 to d={depth}",
                "change": change["difference"],
                "change_low": change["ci_low"],
                "change_high": change["ci_high"],
                "verdict_change": verdict(expect_change, change),
                "claim_pair": f"{variant} {({1: 'above', -1: 'below', 0: 'about equal to'})[expect_pair]} "
                f"{reference} at d={depth}",
                "pair": pair["difference"],
                "pair_low": pair["ci_low"],
                "pair_high": pair["ci_high"],
                "verdict_pair": verdict(expect_pair, pair),
                "seeds": pair["seeds"],
                "prompts": pair["prompts"],
            }
        )
    return out


def _diff(r: dict | None) -> str:
    if r is None or math.isnan(r["difference"]):
        return "–"
    cell = interval(r)
    return f"**{cell}**" if r["resolved"] else cell


def paired_markdown(paired: list[dict], changes: list[dict]) -> str:
    """One table per measure: depth by row, each variant − reference by column (bold: resolved); then which flag
    moves which measure."""
    setups = list(dict.fromkeys(r["setup"] for r in paired))
    first = paired[0]
    out = [
        f"Paired by seed and prompt against {first['reference']} ({first['seeds']} seeds × {first['prompts']} "
        "sequences of the drift suite); 95% two-stage bootstrap intervals; **bold**: resolved (the interval "
        "excludes 0).",
        "",
    ]
    for m in DRIFT:
        mine = [r for r in paired if r["measure"] == m]
        if not mine:
            continue
        depths = sorted({r["at"] for r in mine})
        head = [f"{s} − {first['reference']} ({flags_of(s.split(' ')[0])})" for s in setups]
        out += [f"### {NAMES[m]}", "", "| d | " + " | ".join([first["reference"], *setups]) + " | "
                + " | ".join(head) + " |", "|---" * (1 + 1 + 2 * len(setups)) + "|"]  # fmt: skip
        for d in depths:
            at = {r["setup"]: r for r in mine if r["at"] == d}
            ref = next(iter(at.values()))["reference_mean"]
            levels = [f"{at[s]['variant_mean']:.3f}" if s in at else "–" for s in setups]
            out.append(f"| {d} | {ref:.3f} | " + " | ".join(levels) + " | "
                       + " | ".join(_diff(at.get(s)) for s in setups) + " |")  # fmt: skip
        out.append("")
    out += ["### Which flag moves which measure", ""]
    for m in DRIFT:
        parts = []
        for s in setups:
            hits = [r for r in paired if r["setup"] == s and r["measure"] == m and r["resolved"]]
            if hits:
                signs = {"+" if r["difference"] > 0 else "−" for r in hits}
                parts.append(f"{flags_of(s.split(' ')[0])} ({s}): {''.join(sorted(signs))} at d = "
                             f"{', '.join(str(r['at']) for r in hits)}")  # fmt: skip
            else:
                parts.append(f"{flags_of(s.split(' ')[0])} ({s}): not resolved")
        out.append(f"- **{NAMES[m]}**: " + "; ".join(parts))
    out += ["", "### Change from depth 1 to the deepest, per variant (same seeds and prompts)", "",
            "| variant | measure | d = 1 | deepest | change [95% CI] |", "|---|---|---|---|---|"]  # fmt: skip
    for r in changes:
        out.append(f"| {r['setup']} | {r['measure']} | {r['first_mean']:.3f} | {r['deepest_mean']:.3f} | {_diff(r)} |")
    return "\n".join(out) + "\n"


def sentence(r: dict) -> str:
    """One sentence per paper measure: what the paper reports and what we measured, with the verdicts."""
    return (
        f"{NAMES[r['measure']][0].upper() + NAMES[r['measure']][1:]} — the paper: EAGLE-3 {r['paper_reference']}, "
        f"EAGLE-3.1 {r['paper_variant']} (depth 1 → 8); here: {r['ours_reference']} and {r['ours_variant']}. "
        f"'{r['claim_change']}': {r['verdict_change']} ({interval(r, 'change')}); "
        f"'{r['claim_pair']}': {r['verdict_pair']} ({interval(r, 'pair')})."
    )


def paper_markdown(rows: list[dict]) -> str:
    head = (
        "| measure | paper EAGLE-3 (d 1 → 8) | ours | paper EAGLE-3.1 | ours | EAGLE-3's change [95% CI] | verdict "
        "| 3.1 − 3 at d 8 [95% CI] | verdict |"
    )
    out = [head, "|---" * 9 + "|"]
    for r in rows:
        out.append(
            f"| {NAMES[r['measure']]} | {r['paper_reference']} | {r['ours_reference']} | {r['paper_variant']} | "
            f"{r['ours_variant']} | {interval(r, 'change')} | {r['verdict_change']} | {interval(r, 'pair')} | "
            f"{r['verdict_pair']} |"
        )
    return "\n".join([*out, "", *(f"- {sentence(r)}" for r in rows)]) + "\n"


def tables(runs, reference: str = "eagle3", variant: str = "eagle3.1", count: int = 2000):
    """(paired rows, depth-change rows, paper rows): everything this module writes, for paper/build.py too."""
    paired = drift_paired_rows(runs, reference, count)
    changes = depth_change_rows(runs, count, to=PAPER_DEPTH)
    return paired, changes, paper_rows(changes, paired, reference, variant) if paired else []


def write(paired: list[dict], changes: list[dict], paper: list[dict], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(paired).to_csv(out / "paired_drift.csv", index=False)
    pd.DataFrame(changes).to_csv(out / "depth_change.csv", index=False)
    (out / "paired_drift.md").write_text(paired_markdown(paired, changes))
    paths = [out / "paired_drift.csv", out / "depth_change.csv", out / "paired_drift.md"]
    if paper:
        pd.DataFrame(paper).to_csv(out / "drift_vs_paper.csv", index=False)
        (out / "drift_vs_paper.md").write_text(paper_markdown(paper))
        paths += [out / "drift_vs_paper.csv", out / "drift_vs_paper.md"]
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__doc__, reference="the variant each one is paired with", resamples=True)
    args = ap.parse_args(argv)
    runs = cli.load_or_exit(args.roots)
    paired, changes, paper = tables(runs, args.reference, count=args.resamples)
    if not paired:
        return cli.fail(
            f"no variant has a {args.reference} twin with suites/drift_per_prompt.csv for a shared seed; "
            "evaluate both with the drift suite on, e.g. `python src/run.py -m +sweep=paper`"
        )
    paths = write(paired, changes, paper, args.out)
    print(paired_markdown(paired, changes))
    if paper:
        print(paper_markdown(paper))
    cli.wrote(paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
