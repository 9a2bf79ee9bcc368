"""The paired bootstrap of analysis/paired.py on per-prompt tables made here: it finds no difference where there is
none, resolves one that every prompt shows, computes n-α from the counts as EAGLE does, and its power line shrinks
as 1/√prompts, and it says how many prompts a 10 % difference needs; suite conditions are paired each on its own."""

import numpy as np
import pandas as pd
import pytest

from analysis.paired import paired_rows, prompts_for, suite_paired_rows
from analysis.store import Run


def run(variant: str, seed: int, accepted: np.ndarray, prompts: list[str]) -> Run:
    """A run whose k=2 rounds per prompt are 10 drafts, `accepted[p]` of them accepted at depth 1 and half of those
    again at depth 2; its teacher-forced accuracy counts the same."""
    per_prompt, depth = [], []
    for p, a in zip(prompts, accepted):
        a = int(a)
        per_prompt += [
            {"prompt": p, "k": 1, "drafts": 10, "accepted": a, "accepted_per_pos": f"{a}"},
            {"prompt": p, "k": 2, "drafts": 10, "accepted": a + a // 2, "accepted_per_pos": f"{a} {a // 2}"},
        ]
        depth += [
            {"prompt": p, "depth": 1, "correct": a, "counted": 10},
            {"prompt": p, "depth": 2, "correct": a // 2, "counted": 10},
        ]
    tables = {"per_prompt": pd.DataFrame(per_prompt), "per_prompt_depth": pd.DataFrame(depth)}
    return Run(dir=None, variant=variant, seed=seed, ttt=1, config={}, metrics={}, tables=tables, setup=variant)


def rows_of(runs) -> dict:
    return {(r["measure"], r["at"]): r for r in paired_rows(runs, "eagle3", count=1000)}


def test_identical_drafters_differ_by_nothing_and_are_not_resolved():
    rng = np.random.default_rng(0)
    prompts = [f"p{i}" for i in range(40)]
    runs = []
    for seed in range(3):
        accepted = rng.integers(0, 10, size=40)
        runs += [run("eagle3.1", seed, accepted, prompts), run("eagle3", seed, accepted, prompts)]
    for row in rows_of(runs).values():
        assert row["difference"] == 0 and not row["resolved"]


def test_a_difference_every_prompt_shows_is_resolved_and_n_alpha_is_accepted_over_reached():
    rng = np.random.default_rng(1)
    prompts = [f"p{i}" for i in range(40)]
    runs = []
    for seed in range(3):
        base = rng.integers(2, 8, size=40)
        runs += [run("eagle3.1", seed, base + 2, prompts), run("eagle3", seed, base, prompts)]
    rows = rows_of(runs)
    for key in (("tau", 1), ("tau", 2), ("tf_acc", 1), ("n_alpha", 1)):
        assert rows[key]["resolved"] and rows[key]["ci_low"] > 0, key
    # n-α at depth 2 = accepted at 2 / rounds that reached 2 (= accepted at 1), summed over prompts, seed-averaged
    ours = np.mean([np.sum(a // 2) / np.sum(a) for a in _accepted_at_depth_1(runs)])
    assert rows[("n_alpha", 2)]["variant_mean"] == pytest.approx(ours)
    assert rows[("tau", 1)]["difference"] == pytest.approx(0.2)  # 2 more accepted of 10 drafts at every prompt


def _accepted_at_depth_1(runs):
    """Each EAGLE-3.1 run's accepted-at-depth-1 counts, back from its table."""
    for r in runs:
        if r.variant == "eagle3.1":
            t = r.tables["per_prompt"]
            yield t[t["k"] == 1]["accepted"].to_numpy()


def test_the_power_line_shrinks_as_one_over_root_prompts():
    rng = np.random.default_rng(2)
    se = {}
    for n in (50, 200):
        prompts = [f"p{i}" for i in range(n)]
        runs = []
        for seed in range(3):
            base = rng.integers(0, 10, size=n)
            noise = rng.integers(-2, 3, size=n)
            runs += [run("eagle3.1", seed, np.clip(base + noise, 0, 10), prompts), run("eagle3", seed, base, prompts)]
        se[n] = rows_of(runs)[("tf_acc", 1)]["mde80"]
    assert se[200] == pytest.approx(se[50] / 2, rel=0.35)


def test_prompts_for_a_power_line_scale_as_its_square():
    assert prompts_for(0.2, 0.1, 40) == 160  # half the power line: four times the prompts
    assert prompts_for(0.05, 0.1, 40) == 10
    assert np.isnan(prompts_for(0.0, 0.1, 40)) and np.isnan(prompts_for(0.1, 0.0, 40))


def test_a_setting_as_the_reference_pairs_each_variant_with_its_own_twin():
    """--reference tokens_per_batch=None: a recipe change paired within each variant (EAGLE-3.1 with EAGLE-3.1,
    EAGLE-3 with EAGLE-3), never across; the reference setting's own setups are not rows."""
    rng = np.random.default_rng(4)
    prompts = [f"p{i}" for i in range(40)]
    runs = []
    for seed in range(3):
        base = rng.integers(2, 8, size=40)
        for variant, gain in (("eagle3.1", 2), ("eagle3", 0)):  # the budget helps EAGLE-3.1 only
            for setting, accepted in (("None", base), ("1024", base + gain)):
                r = run(variant, seed, accepted + (variant == "eagle3.1"), prompts)  # (10 drafts: at most 10)
                r.setup = f"{variant} tokens_per_batch={setting}"
                runs.append(r)
    rows = paired_rows(runs, "tokens_per_batch=None", count=1000)
    pairs = {(r["setup"], r["reference"]) for r in rows}
    assert pairs == {
        ("eagle3.1 tokens_per_batch=1024", "eagle3.1 tokens_per_batch=None"),
        ("eagle3 tokens_per_batch=1024", "eagle3 tokens_per_batch=None"),
    }
    tau1 = {r["setup"].split()[0]: r for r in rows if (r["measure"], r["at"]) == ("tau", 1)}
    assert tau1["eagle3.1"]["resolved"] and tau1["eagle3.1"]["difference"] == pytest.approx(0.2)
    assert tau1["eagle3"]["difference"] == 0 and not tau1["eagle3"]["resolved"]


def test_each_suite_condition_is_paired_on_its_own_prompts():
    """Two suite conditions in suites/per_prompt*.csv: in "long_context/512" EAGLE-3.1 accepts 2 more drafts of 10 at
    every prompt, in "templates/native" the same counts; each scope is paired on its own and only the first is
    resolved. Its prompts_for_10pct is what its power line says."""
    rng = np.random.default_rng(3)
    prompts = [f"p{i}" for i in range(40)]
    runs = []
    for seed in range(3):
        base = rng.integers(2, 8, size=40)
        ours, ref = run("eagle3.1", seed, base, prompts), run("eagle3", seed, base, prompts)
        for r, extra in ((ours, 2), (ref, 0)):
            long_context = run(r.variant, seed, base + extra, prompts).tables
            suites = {
                name: pd.concat(
                    [
                        long_context[name].assign(suite="long_context/512"),
                        r.tables[name].assign(suite="templates/native"),
                    ]
                )
                for name in ("per_prompt", "per_prompt_depth")
            }
            r.tables.update({f"suites/{name}": t for name, t in suites.items()})
        runs += [ours, ref]
    rows = {(r["scope"], r["measure"], r["at"]): r for r in suite_paired_rows(runs, "eagle3", count=1000)}
    assert {scope for scope, _, _ in rows} == {"long_context/512", "templates/native"}
    assert rows[("long_context/512", "tau", 1)]["resolved"]
    assert rows[("long_context/512", "tau", 1)]["difference"] == pytest.approx(0.2)
    assert not any(r["resolved"] for (scope, _, _), r in rows.items() if scope == "templates/native")
    row = rows[("long_context/512", "n_alpha", 2)]
    assert row["prompts_for_10pct"] == prompts_for(row["mde80"], 0.1 * row["reference_mean"], 40)


def drift_run(variant: str, seed: int, rms: np.ndarray, sink: np.ndarray, prompts: list[str]) -> Run:
    """A run whose drift suite measured `rms[p, d]` and `sink[p, d]` (depths 1..D) on each prompt, 10 drafts each,
    every other measure 0.5; the last prompt reached no draft at the deepest depth (an empty mean)."""
    rows = []
    for i, p in enumerate(prompts):
        for d in range(rms.shape[1]):
            none = i == len(prompts) - 1 and d == rms.shape[1] - 1
            values = {m: 0.5 for m in ("context_share", "draft_share", "recent_share", "entropy")}
            values["hidden_rms"], values["sink_share"] = (np.nan, np.nan) if none else (rms[i, d], sink[i, d])
            rows.append({"prompt": p, "depth": d + 1, "drafts": 0 if none else 10, **values})
    tables = {"suites/drift_per_prompt": pd.DataFrame(rows)}
    return Run(dir=None, variant=variant, seed=seed, ttt=3, config={}, metrics={}, tables=tables, setup=variant)


def test_drift_measures_are_paired_per_flag_and_held_to_the_papers_directions():
    """EAGLE-3's fed state grows with depth (the paper's claim: reproduced) while EAGLE-3.1's stays; EAGLE-3.1 puts
    more on the sink at depth 4 than EAGLE-3, whose sink share stays (the paper: EAGLE-3's falls: unresolved);
    no_norm_output (fc_norm alone) measures what EAGLE-3 does: nothing resolved."""
    from analysis.drift_table import paired_markdown, paper_rows
    from analysis.paired import depth_change_rows, drift_paired_rows

    rng = np.random.default_rng(3)
    prompts = [f"p{i}" for i in range(30)]
    depths = np.arange(1, 5)
    runs = []
    for seed in range(3):
        base = rng.uniform(1, 2, size=(30, 1))
        grow = base * (1 + 0.5 * (depths - 1))  # [P, D]: grows with depth from the same first state
        sink = rng.uniform(0.1, 0.2, size=(30, 1)) * np.ones(4)
        runs += [
            drift_run("eagle3", seed, grow, sink, prompts),
            drift_run("eagle3.1", seed, base * np.ones(4), sink + 0.05 * (depths == 4), prompts),
            drift_run("no_norm_output", seed, grow, sink, prompts),
        ]
    paired = drift_paired_rows(runs, "eagle3", count=500)
    at = {(r["setup"], r["measure"], r["at"]): r for r in paired}
    assert at[("eagle3.1", "hidden_rms", 4)]["resolved"] and at[("eagle3.1", "hidden_rms", 4)]["difference"] < 0
    assert not at[("eagle3.1", "hidden_rms", 1)]["resolved"]  # the same first state
    assert at[("eagle3.1", "sink_share", 4)]["difference"] == pytest.approx(0.05)
    assert not any(r["resolved"] for r in paired if r["setup"] == "no_norm_output")
    assert at[("eagle3.1", "hidden_rms", 4)]["counted"] == 29 * 10  # per seed; the empty prompt adds no drafts
    changes = depth_change_rows(runs, count=500)
    grew = next(r for r in changes if r["variant"] == "eagle3" and r["measure"] == "hidden_rms")
    assert grew["resolved"] and grew["difference"] > 0 and (grew["from"], grew["to"]) == (1, 4)
    verdicts = {r["measure"]: r for r in paper_rows(changes, paired, "eagle3", "eagle3.1")}
    assert verdicts["hidden_rms"]["verdict_change"] == "reproduced"  # the paper: 3.92 -> 14.02
    assert verdicts["hidden_rms"]["verdict_pair"] == "reproduced"  # the paper: 1.20 < 14.02 at depth 8
    assert verdicts["sink_share"]["verdict_change"] == "unresolved"  # flat here; the paper: 0.46 -> 0.08
    assert verdicts["sink_share"]["verdict_pair"] == "not claimed"  # the paper: 0.10 against 0.08, about equal
    assert verdicts["context_share"]["verdict_pair"] == "unresolved"  # 0.5 both sides
    text = paired_markdown(paired, changes)
    assert "fc_norm (no_norm_output): not resolved" in text and "fc_norm + norm_output (eagle3.1): − at d" in text
