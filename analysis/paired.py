"""Paired comparisons: each variant against a reference variant on the same held-out prompts and the same seeds.

    python analysis/paired.py results/ [more roots] [--reference eagle3] [--out DIR] [--resamples 2000]
    python analysis/paired.py results/multirun/tpb --reference tokens_per_batch=None   # a setting, within variants

Two drafters scored on the same prompts differ far less than their seed means suggest: most of the spread of τ is
which prompts are easy, and both drafters see the same ones. So every measure is compared per prompt and seed
(the run's per_prompt.csv and per_prompt_depth.csv, simulated evaluator) and its uncertainty comes from a
two-stage bootstrap: seeds resampled, then prompts resampled (the same prompts for both drafters and every seed),
each measure recomputed as the ratio of sums it is. Measures, each at every depth or k the runs hold:

  tau@k     acceptance length at k drafts a round: (rounds + accepted) / rounds
  n_alpha@d at the deepest k: accepted at depth d / rounds whose chain reached d (EAGLE's n-α)
  tf_acc@d  teacher-forced accuracy at depth d: correct d-th drafts / drafted positions (needs no surviving chain)

Per measure: each side's mean, the difference (variant − reference, mean over seeds), its 95% bootstrap interval,
`resolved` when that interval excludes 0 (and each side counted MIN_COUNT rounds or more in every seed:
`counted`), and the power line `mde80` = (z₀.₉₇₅ + z₀.₈)·SE: the smallest true
difference this evaluation (its prompts and seeds) resolves four times in five, and `prompts_for_10pct`, the prompts
that would bring it to a tenth of the reference's value. Writes DIR/paired.{csv,md}; where the runs evaluated suites,
the same per suite condition (suites/per_prompt*.csv: each long-context length, each template condition) in
DIR/paired_suites.{csv,md}.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from analysis import cli
from analysis.store import Run, setups

MDE_Z = float(stats.norm.ppf(0.975) + stats.norm.ppf(0.8))  # 2.80: two-sided 5% test, 80% power
PER_PROMPT = ("per_prompt", "per_prompt_depth")
# A difference is called resolved only where each side counted at least this many rounds (n-α: rounds that reached
# d) in every seed: a depth a handful of chains reached gives intervals of zero width around 0/1 rates.
MIN_COUNT = 30
# `prompts_for_10pct`: the prompts whose power line would be this share of the reference's value (issue-sized effects:
# a 10 % change in n-α at depth 2 is what the suites are sized to resolve; POWER_DEPTH is where the paper quotes it).
POWER_SHARE = 0.10
POWER_DEPTH = 2


@dataclass
class Sums:
    """A ratio-of-sums measure per seed and prompt: the measure of a set is Σ numerator / Σ denominator."""

    numerator: np.ndarray  # [seeds, prompts]
    denominator: np.ndarray


HELD_OUT = "held_out"  # the scope of the held-out prompts (per_prompt.csv); a suite's are "long_context/512", ...
DRIFT_SCOPE = "drift"  # the drift suite's held-out sequences (suites/drift_per_prompt.csv)
DRIFT = (
    "hidden_rms",
    "sink_share",
    "context_share",
    "draft_share",
    "recent_share",
    "entropy",
)  # eaglelab.evaluate.drift


def scoped(run: Run, scope: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-prompt acceptance, per-prompt depth) rows of one scope: the held-out set, or one suite condition
    (suites/per_prompt*.csv, `suite` = "long_context/512", "templates/native", ...)."""
    if scope == HELD_OUT:
        return run.tables["per_prompt"], run.tables["per_prompt_depth"]
    acc, depth = run.tables["suites/per_prompt"], run.tables["suites/per_prompt_depth"]
    return acc[acc["suite"] == scope], depth[depth["suite"] == scope]


def suite_scopes(runs: list[Run]) -> list[str]:
    """The suite conditions every one of `runs` measured per prompt, in the order the first wrote them."""
    if not all("suites/per_prompt" in r.tables for r in runs):
        return []
    shared = set.intersection(*(set(r.tables["suites/per_prompt"]["suite"]) for r in runs))
    return [s for s in dict.fromkeys(runs[0].tables["suites/per_prompt"]["suite"]) if s in shared]


def measure_sums(run: Run, prompts: list[str], scope: str = HELD_OUT) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """measure -> (numerator, denominator) per prompt of `prompts`, for one run (in one scope)."""
    acc, depth = scoped(run, scope)
    out = {}
    for k, rows in acc.groupby("k"):
        rows = rows.set_index("prompt").loc[prompts]
        out[f"tau@{k}"] = ((rows["drafts"] + rows["accepted"]).to_numpy(float), rows["drafts"].to_numpy(float))
    deepest = acc[acc["k"] == acc["k"].max()].set_index("prompt").loc[prompts]
    per_pos = np.array([list(map(int, str(s).split())) for s in deepest["accepted_per_pos"]], dtype=float)  # [P, k]
    reached = np.concatenate([deepest["drafts"].to_numpy(float)[:, None], per_pos[:, :-1]], axis=1)
    for d in range(per_pos.shape[1]):
        out[f"n_alpha@{d + 1}"] = (per_pos[:, d], reached[:, d])
    for d, rows in depth.groupby("depth"):
        rows = rows.set_index("prompt").loc[prompts]
        out[f"tf_acc@{d}"] = (rows["correct"].to_numpy(float), rows["counted"].to_numpy(float))
    return out


def drift_sums(run: Run, prompts: list[str], scope: str = DRIFT_SCOPE) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each drift measure at each depth as (Σ over the prompt's drafts, drafts) per prompt of `prompts`
    (suites/drift_per_prompt.csv holds each prompt's mean: a depth none of its drafts reached adds nothing)."""
    table = run.tables["suites/drift_per_prompt"]
    out = {}
    for d, rows in table.groupby("depth"):
        rows = rows.set_index("prompt").loc[prompts]
        drafts = rows["drafts"].to_numpy(float)
        for m in DRIFT:  # (a NaN mean with drafts stays NaN: a diverged drafter is not scored as 0)
            out[f"{m}@{d}"] = (np.where(drafts > 0, rows[m].to_numpy(float) * drafts, 0.0), drafts)
    return out


def stack(runs: list[Run], prompts: list[str], scope: str = HELD_OUT) -> dict[str, Sums]:
    """measure -> Sums over the runs (one row per seed, in the runs' order)."""
    per_run = [(drift_sums if scope == DRIFT_SCOPE else measure_sums)(r, prompts, scope) for r in runs]
    shared = set.intersection(*(set(m) for m in per_run))
    return {
        name: Sums(np.stack([m[name][0] for m in per_run]), np.stack([m[name][1] for m in per_run]))
        for name in sorted(shared, key=order)
    }


def order(name: str) -> tuple:
    family, at = name.split("@")
    families = ["tau", "n_alpha", "tf_acc", *DRIFT]
    return (families.index(family), int(at))


def resamples(n_seeds: int, n_prompts: int, count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(seed picks [count, n_seeds], prompt weights [count, n_prompts]): the two-stage bootstrap's draws, shared by
    every measure and both sides, so each resample compares the two drafters on the same prompts and seeds."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, n_seeds, size=(count, n_seeds))
    weights = rng.multinomial(n_prompts, np.full(n_prompts, 1 / n_prompts), size=count).astype(float)
    return picks, weights


def ratio(s: Sums, weights: np.ndarray | None = None) -> np.ndarray:
    """Each seed's measure over the prompts, once per resample's prompt weights: [resamples, seeds] (or [seeds])."""
    if weights is None:
        num, den = s.numerator.sum(1), s.denominator.sum(1)
    else:
        num, den = weights @ s.numerator.T, weights @ s.denominator.T
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def seed_mean(values: np.ndarray, picks: np.ndarray) -> np.ndarray:
    """Mean over each resample's picked seeds: [resamples] (NaN where none of them measured it)."""
    with warnings.catch_warnings(action="ignore"):  # (all-NaN columns: numpy's "Mean of empty slice")
        return np.nanmean(np.take_along_axis(values, picks, axis=1), axis=1)


def nanmean(values: np.ndarray) -> float:
    """Mean of what was measured (NaN: a seed none of whose rounds reached that depth); NaN if nothing was."""
    return float(np.nanmean(values)) if not np.isnan(values).all() else math.nan


def interval(draws: np.ndarray) -> tuple[float, float, float]:
    """(2.5 %, 97.5 % percentile, standard deviation) of the resamples that measured something."""
    draws = draws[~np.isnan(draws)]
    if len(draws) < 2:
        return math.nan, math.nan, math.nan
    return float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5)), float(draws.std(ddof=1))


def level(s: Sums, picks, weights) -> dict:
    """One side's mean over seeds and its 95% bootstrap interval."""
    low, high, _ = interval(seed_mean(ratio(s, weights), picks))
    return {"mean": nanmean(ratio(s)), "low": low, "high": high}


def compare(variant: Sums, reference: Sums, picks, weights) -> dict:
    """variant − reference, paired by seed and prompt: the difference, its interval, SE and power line; resolved
    when the interval excludes 0 and every seed of both sides counted MIN_COUNT rounds or more."""
    point = ratio(variant) - ratio(reference)
    draws = seed_mean(ratio(variant, weights) - ratio(reference, weights), picks)
    low, high, se = interval(draws)
    counted = int(min(variant.denominator.sum(1).min(), reference.denominator.sum(1).min()))  # fewest, any seed
    return {
        "difference": nanmean(point),
        "ci_low": low,
        "ci_high": high,
        "se": se,
        "mde80": MDE_Z * se,
        "prompts_for_10pct": prompts_for(
            MDE_Z * se, POWER_SHARE * nanmean(ratio(reference)), variant.numerator.shape[1]
        ),
        "counted": counted,
        "resolved": bool((low > 0 or high < 0) and counted >= MIN_COUNT),
    }


def prompts_for(mde: float, wanted: float, prompts: int) -> float:
    """Prompts (at the same seeds) whose power line would be `wanted`: the SE of a mean over prompts falls as
    1/√prompts, so mde·√(prompts/needed) = wanted. The prompt stage's share of the spread is taken as all of it (the
    seed stage does not shrink with prompts: an underestimate where seeds dominate). NaN where nothing measured."""
    if not (mde > 0 and wanted > 0):
        return math.nan
    return float(math.ceil(prompts * (mde / wanted) ** 2))


def twins(runs: list[Run], reference: str) -> list[tuple[str, list[Run], str, list[Run]]]:
    """(setup, its runs, reference setup, its runs) for every non-reference setup whose twin exists: the same label
    with the reference variant, or (`reference` a setting as setup labels write it, `tokens_per_batch=None`) the same
    label with that setting instead of its own (a recipe change paired within each variant)."""
    groups = setups(runs)
    key = reference.split("=")[0] + "=" if "=" in reference else None
    out = []
    for label, members in groups.items():
        if key is None:
            variant = members[0].variant
            if variant == reference:
                continue
            ref_label = reference + label.removeprefix(variant)
        else:
            words = label.split(" ")
            mine = [w for w in words if w.startswith(key)]
            if not mine or mine[0] == reference:
                continue
            ref_label = " ".join(reference if w == mine[0] else w for w in words)
        if ref_label in groups:
            out.append((label, members, ref_label, groups[ref_label]))
    return out


_LAST: list = [None, None]  # the last (runs, reference, count) and its rows: the paper, its table and its figure


def paired_rows(runs: list[Run], reference: str = "eagle3", count: int = 2000) -> list[dict]:
    """One row per (setup, measure): the paired comparison of each setup with its reference twin. The same runs
    asked again, in any order (`make paper` asks in its table, the comparison and the figure; `setups` orders
    them), are not bootstrapped again."""
    asked = (sorted(runs, key=id), reference, count)  # the objects themselves, held here: their ids stay unique
    last = _LAST[0]
    if (
        last is None
        or last[1:] != asked[1:]
        or len(last[0]) != len(runs)
        or any(a is not b for a, b in zip(last[0], asked[0]))
    ):
        _LAST[:] = [asked, _paired_rows(runs, reference, count)]
    return [dict(row) for row in _LAST[1]]


def _paired_rows(runs: list[Run], reference: str, count: int, suites: bool = False, drift: bool = False) -> list[dict]:
    """The held-out scope's rows, or (`suites`) one scope per suite condition both sides measured per prompt, or
    (`drift`) the drift suite's measures by depth."""
    rows = []
    for label, members, ref_label, ref_members in twins(runs, reference):
        seeds = sorted({r.seed for r in members} & {r.seed for r in ref_members})
        mine = [next(r for r in members if r.seed == s) for s in seeds]
        theirs = [next(r for r in ref_members if r.seed == s) for s in seeds]
        both = mine + theirs
        needed = ["suites/drift_per_prompt"] if drift else PER_PROMPT
        if not seeds or not all(all(t in r.tables for t in needed) for r in both):
            if not (suites or drift):  # (said once: the held-out pass is made first)
                cli.warn(f"skipped {label} vs {ref_label}: no seed with per-prompt tables on both sides")
            continue
        for scope in [DRIFT_SCOPE] if drift else suite_scopes(both) if suites else [HELD_OUT]:
            prompts = sorted(set.intersection(*(set(prompts_of(r, scope)) for r in both)))
            ours, ref = stack(mine, prompts, scope), stack(theirs, prompts, scope)
            picks, weights = resamples(len(seeds), len(prompts), count)
            for name in (n for n in ours if n in ref):
                family, at = name.split("@")
                rows.append(
                    {
                        "setup": label,
                        "reference": ref_label,
                        **({"scope": scope} if suites else {}),
                        "measure": family,
                        "at": int(at),
                        "ttt": mine[0].ttt,
                        "seeds": len(seeds),
                        "prompts": len(prompts),
                        **{f"variant_{k}": v for k, v in level(ours[name], picks, weights).items()},
                        **{f"reference_{k}": v for k, v in level(ref[name], picks, weights).items()},
                        **compare(ours[name], ref[name], picks, weights),
                    }
                )
    return rows


def prompts_of(run: Run, scope: str) -> pd.Series:
    """The prompts a run measured in one scope."""
    return run.tables["suites/drift_per_prompt"]["prompt"] if scope == DRIFT_SCOPE else scoped(run, scope)[0]["prompt"]


def drift_paired_rows(runs: list[Run], reference: str = "eagle3", count: int = 2000) -> list[dict]:
    """Each drift measure at each depth (suites/drift_per_prompt.csv), paired with the reference twin by seed and
    prompt as the acceptance measures are: one row per (setup, measure, depth); `counted` is drafts."""
    return _paired_rows(runs, reference, count, drift=True)


def depth_change_rows(runs: list[Run], count: int = 2000, to: int | None = None) -> list[dict]:
    """Per setup and drift measure: the value at depth `to` (None, or past the deepest: the deepest) minus the first
    depth's, on the same seeds and prompts (the change with depth the paper reports, with its 95% interval)."""
    rows = []
    for label, members in setups(runs).items():
        members = [r for r in members if "suites/drift_per_prompt" in r.tables]
        if not members:
            continue
        prompts = sorted(set.intersection(*(set(prompts_of(r, DRIFT_SCOPE)) for r in members)))
        sums = stack(members, prompts, DRIFT_SCOPE)
        deepest = max(int(n.split("@")[1]) for n in sums)
        deepest = min(deepest, to) if to else deepest
        picks, weights = resamples(len(members), len(prompts), count)
        for m in DRIFT:
            first, last = sums[f"{m}@1"], sums[f"{m}@{deepest}"]
            rows.append(
                {"setup": label, "variant": members[0].variant, "measure": m, "from": 1, "to": deepest,
                 "seeds": len(members), "prompts": len(prompts),
                 **{f"first_{k}": v for k, v in level(first, picks, weights).items()},
                 **{f"deepest_{k}": v for k, v in level(last, picks, weights).items()},
                 **compare(last, first, picks, weights)}
            )  # fmt: skip
    return rows


def suite_paired_rows(runs: list[Run], reference: str = "eagle3", count: int = 2000) -> list[dict]:
    """paired_rows for every suite condition (long-context length, template condition) both sides of a pair
    measured per prompt (suites/per_prompt*.csv, simulated evaluator): one row per (setup, scope, measure)."""
    return _paired_rows(runs, reference, count, suites=True)


def setup_levels(runs: list[Run], count: int = 2000) -> list[dict]:
    """One row per (setup, measure): its mean over seeds and 95% bootstrap interval (seeds, then prompts), for
    every setup whose runs hold per-prompt tables: the levels the depth figure overlays."""
    rows = []
    for label, members in setups(runs).items():
        members = [r for r in members if all(t in r.tables for t in PER_PROMPT)]
        if not members:
            continue
        prompts = sorted(set.intersection(*(set(r.tables["per_prompt"]["prompt"]) for r in members)))
        picks, weights = resamples(len(members), len(prompts), count)
        for name, sums in stack(members, prompts).items():
            family, at = name.split("@")
            rows.append(
                {"setup": label, "variant": members[0].variant, "ttt": members[0].ttt, "measure": family,
                 "at": int(at), "seeds": len(members), "counted": int(sums.denominator.sum(1).min()),
                 **level(sums, picks, weights)}
            )  # fmt: skip
    return rows


def first_resolved(rows: list[dict], setup: str, measure: str, scope: str | None = None) -> int | None:
    """The first depth (or k) at which `measure`'s difference is resolved, for one setup (in one suite scope)."""
    hits = [
        r["at"]
        for r in rows
        if r["setup"] == setup and r["measure"] == measure and r["resolved"] and r.get("scope") == scope
    ]
    return min(hits) if hits else None


NAMES = {"tau": "τ@k", "n_alpha": "n-α(d)", "tf_acc": "teacher-forced acc.(d)"}


def markdown(rows: list[dict]) -> str:
    out = []
    for setup in dict.fromkeys(r["setup"] for r in rows):
        mine = [r for r in rows if r["setup"] == setup]
        first = mine[0]
        out += [
            f"### {setup} − {first['reference']} ({first['seeds']} seeds × {first['prompts']} prompts, paired; "
            f"trained depth {first['ttt']})",
            "",
            "| measure | at | variant | reference | difference [95% CI] | resolved | smallest resolvable (80% power) "
            "| fewest rounds counted |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in mine:
            if math.isnan(r["difference"]):  # a depth no round reached on one side: no measurement, no row
                continue
            ci = f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]"
            out.append(
                f"| {NAMES[r['measure']]} | {r['at']} | {r['variant_mean']:.3f} | {r['reference_mean']:.3f} | "
                f"{r['difference']:+.3f} {ci} | {'yes' if r['resolved'] else 'no'} | {r['mde80']:.3f} | "
                f"{r['counted']} |"
            )
        firsts = {m: first_resolved(rows, setup, m) for m in NAMES}
        out += ["", "First resolved: " + ", ".join(f"{NAMES[m]} at {v or '–'}" for m, v in firsts.items()), ""]
    return "\n".join(out)


def suite_markdown(rows: list[dict]) -> str:
    """One table per setup: τ and n-α per suite condition, with the first depth each is resolved at and the prompts
    a condition would need for its power line to reach 10 % of the reference's value."""
    out = []
    for setup in dict.fromkeys(r["setup"] for r in rows):
        mine = [r for r in rows if r["setup"] == setup and r["measure"] in ("tau", "n_alpha")]
        first = mine[0]
        out += [
            f"### {setup} − {first['reference']} by suite condition ({first['seeds']} seeds, paired; trained depth "
            f"{first['ttt']})",
            "",
            "| condition | prompts | measure | at | variant | reference | difference [95% CI] | resolved "
            "| smallest resolvable (80% power) | prompts for 10% |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in mine:
            if math.isnan(r["difference"]):
                continue
            need = "–" if math.isnan(r["prompts_for_10pct"]) else f"{r['prompts_for_10pct']:.0f}"
            out.append(
                f"| {r['scope']} | {r['prompts']} | {NAMES[r['measure']]} | {r['at']} | {r['variant_mean']:.3f} | "
                f"{r['reference_mean']:.3f} | {r['difference']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] | "
                f"{'yes' if r['resolved'] else 'no'} | {r['mde80']:.3f} | {need} |"
            )
        out += ["", "First resolved (n-α(d)): " + ", ".join(
            f"{scope} at {first_resolved(rows, setup, 'n_alpha', scope) or '–'}"
            for scope in dict.fromkeys(r["scope"] for r in mine)
        ), ""]  # fmt: skip
    return "\n".join(out)


def write(rows: list[dict], out: Path, suite_rows: list[dict] = ()) -> list[Path]:
    """paired.csv/.md (held-out prompts) and, where the runs measured suites per prompt, paired_suites.csv/.md."""
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out / "paired.csv", index=False)
    head = (
        "Paired by seed and prompt (simulated evaluator, {what}); 95% two-stage bootstrap intervals (seeds, then "
        "prompts); resolved: the interval excludes 0; smallest resolvable: (z0.975 + z0.8)·SE; prompts for 10%: the "
        "prompts that would bring it to a tenth of the reference's value (analysis.paired.prompts_for).\n\n"
    )
    (out / "paired.md").write_text(head.format(what="held-out prompts") + markdown(rows))
    paths = [out / "paired.csv", out / "paired.md"]
    if suite_rows:
        pd.DataFrame(suite_rows).to_csv(out / "paired_suites.csv", index=False)
        (out / "paired_suites.md").write_text(head.format(what="each suite condition") + suite_markdown(suite_rows))
        paths += [out / "paired_suites.csv", out / "paired_suites.md"]
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(
        __doc__,
        reference="the variant every other one is paired with, or a setting as the setup labels write it "
        "(tokens_per_batch=None): each setup paired with its twin at that setting",
        resamples=True,
    )
    args = ap.parse_args(argv)
    runs = cli.load_or_exit(args.roots)
    rows = paired_rows(runs, args.reference, args.resamples)
    if not rows:
        return cli.fail(
            f"no setup has a {args.reference} twin with per-prompt tables (per_prompt.csv) for a shared seed; "
            f"train both, e.g. `python src/run.py -m +sweep=paper`"
        )
    suite_rows = suite_paired_rows(runs, args.reference, args.resamples)
    paths = write(rows, args.out, suite_rows)
    print(markdown(rows))
    if suite_rows:
        print(suite_markdown(suite_rows))
    cli.wrote(paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
