"""Evaluation suites: where EAGLE-3 is said to degrade and EAGLE-3.1 to hold
(docs/conventions.md#what-eagle-31-claims).

    extrapolation  τ and per-position acceptance past the trained depth, k = 1..max(8, 2·ttt+2)
    long_context   τ on prompts of 0.5k..8k tokens (standard-library source, a request at the end)
    templates      τ under each prompt condition (eaglelab.data.templates), and its ratio to native
    benchmarks     τ per benchmark the field reports (MT-Bench, HumanEval), at the held-out set's depths
    drift          attention-drift diagnostics per draft depth (eaglelab.evaluate.drift)

Suite prompts are prepared with the training data (the target regenerates under each condition; the
cache is shared by every drafter of that target), then each drafter is measured by both evaluators:
the in-house simulated one always, vLLM whenever it is installed and can express the drafter (it has
no sliding-window flag for Eagle3 drafters). Every table says which evaluator produced each row.
Results go to `run_dir/suites/` (CSV + PNG/PDF).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from eaglelab.core.config import RunConfig, max_k, suite_ks
from eaglelab.core.errors import ConfigError
from eaglelab.core.io import atomic_write_json, write_csv
from eaglelab.core.ranks import current as current_ranks
from eaglelab.data.cache_entry import CaptureSettings, SetRequest
from eaglelab.data.long_context import MODULES, long_context_prompts
from eaglelab.data.prepare_set import prepare_features
from eaglelab.data.prompts import load_source
from eaglelab.data.templates import CONDITIONS, renderer
from eaglelab.engine.jobs import EvaluateJob
from eaglelab.evaluate.drift import drift_diagnostics, drift_inputs
from eaglelab.evaluate.held_out import (
    Serving,
    along_vllm_spec,
    counts_from,
    evaluate_simulated,
    evenly_spaced,
    parity_metrics,
    parity_row,
    per_prompt_rows,
    prompt_ids,
    same_output_share,
    throughput_rows,
)
from eaglelab.evaluate.plots import (
    plot_benchmarks,
    plot_drift,
    plot_extrapolation,
    plot_long_context_speed,
    plot_suite,
)
from eaglelab.export.eagle3 import FORMAT_DIRS
from eaglelab.models.acceptance import tail_tokens

log = logging.getLogger("eaglelab")


@dataclass
class SuiteInputs:
    """Captured held-out sequences per suite condition (prepared while the target is loaded)."""

    long_context: dict[int, object] = field(default_factory=dict)  # nominal length -> features
    templates: dict[str, object] = field(default_factory=dict)  # condition -> features
    benchmarks: dict[str, object] = field(default_factory=dict)  # benchmark name -> features
    same_as: dict[str, str] = field(default_factory=dict)  # condition -> condition it renders identically
    seconds: float = 0.0


def check_suites(cfg: RunConfig) -> None:
    """The suite settings that need the suites' own tables (template conditions, source modules); run before
    any work starts."""
    s = cfg.eval.suites
    if s.long_context.num_prompts > len(MODULES):
        raise ConfigError(
            f"eval.suites.long_context.num_prompts={s.long_context.num_prompts}: at most "
            f"{len(MODULES)} distinct source modules are available"
        )
    if len(set(s.templates.conditions)) < len(s.templates.conditions):
        raise ConfigError(f"eval.suites.templates.conditions lists a condition twice: {s.templates.conditions}")
    unknown = [c for c in s.templates.conditions if c not in CONDITIONS]
    if unknown or "native" not in s.templates.conditions:
        raise ConfigError(
            f"eval.suites.templates.conditions: {unknown or 'native missing'}; choose from "
            f"{', '.join(CONDITIONS)} (native is the reference every ratio is taken against)"
        )


def prepare_suites(cfg: RunConfig, target, eval_prompts: list, capture: CaptureSettings) -> SuiteInputs:
    """Regenerate and capture the long-context and template prompts (cached like training data). Every rank of a
    trial prepares them, each starting at its own condition: the ranks' engines prepare different conditions at once
    (each condition a cache entry: a rank finds the others' complete, or waits on their locks), and every rank then
    holds the inputs its share of the evaluation needs (eaglelab.evaluate.over_ranks)."""
    s, out = cfg.eval.suites, SuiteInputs()
    native = renderer("native", cfg.data.system_prompt)
    tail = tail_tokens(max(suite_ks(cfg)))
    todo = []  # (suite, condition, prompts, what is asked of them, how they are prepared)
    if s.long_context.enabled:
        lc = s.long_context
        room = target.max_context - lc.max_new_tokens - 8  # prompt + answer inside the target's window
        done = set()
        for length in sorted(set(lc.lengths)):
            if min(length, room) in done:
                log.warning("long_context: %d tokens clip to %d, already measured: skipped", length, room)
                continue
            done.add(min(length, room))
            if length > room:
                log.warning(
                    "long_context: %d-token prompts clipped to %d (the target's window is %d)",
                    length,
                    room,
                    target.max_context,
                )
            prompts = long_context_prompts(target.tokenizer, native, min(length, room), lc.num_prompts)
            how = replace(capture, max_length=target.max_context, batch_size=min(capture.batch_size, lc.num_prompts))
            request = SetRequest(f"long_context-{length}", lc.max_new_tokens, tail_tokens=tail)
            todo.append(("long_context", length, prompts, request, how))
    if s.templates.enabled:
        tp = s.templates
        prompts = [eval_prompts[i] for i in evenly_spaced(len(eval_prompts), tp.num_prompts)]
        rendered = {}
        for condition in tp.conditions:
            render = renderer(condition, cfg.data.system_prompt)
            ids = [render(target.tokenizer, m) for m in prompts]
            twin = next((c for c, other in rendered.items() if other == ids), None)
            if twin:  # e.g. bos_on under a template that already starts with BoS: same prompts, same τ
                out.same_as[condition] = twin
                continue
            rendered[condition] = ids
            request = SetRequest(f"templates-{condition}", tp.max_new_tokens, render=render, tail_tokens=tail)
            todo.append(("templates", condition, prompts, request, replace(capture, max_length=target.max_context)))
    if s.benchmarks.enabled:
        bm = s.benchmarks
        for name in bm.names:
            # a multi-turn request (MT-Bench's second turns) answered turn by turn: its history the target's own
            request = SetRequest(f"benchmarks-{name}", bm.max_new_tokens, source=name, turns="all", tail_tokens=tail)
            how = replace(capture, max_length=target.max_context)
            todo.append(("benchmarks", name, benchmark_prompts(name, bm.num_prompts), request, how))
    ranks = current_ranks()
    first = ranks.rank % len(todo) if todo else 0
    for suite, condition, prompts, request, how in todo[first:] + todo[:first]:
        feats, stats = prepare_features(target, prompts, request, how)
        getattr(out, suite)[condition] = feats
        out.seconds += sum(stats.seconds.values())
    out.long_context = dict(sorted(out.long_context.items()))  # (each suite's conditions in their own order again)
    out.templates = {c: out.templates[c] for c in rendered} if s.templates.enabled else {}
    out.benchmarks = {n: out.benchmarks[n] for n in s.benchmarks.names} if s.benchmarks.enabled else {}
    return out


def benchmark_prompts(name: str, count: int | None) -> list:
    """A benchmark's requests, or `count` of them evenly spaced: MT-Bench's are questions, both turns each."""
    prompts = load_source(name)
    if count is None:
        return prompts
    if name == "mt_bench":  # (first and second turns alternate)
        return [prompts[2 * q + turn] for q in evenly_spaced(len(prompts) // 2, count) for turn in (0, 1)]
    return [prompts[i] for i in evenly_spaced(len(prompts), count)]


def _rows(
    suite: str, groups: dict[str, object], drafter, cfg: RunConfig, vllm_rows: dict, along: dict
) -> tuple[list, list, tuple[list, list]]:
    """τ per condition: simulated for every k <= max(suite ks), vLLM at the suite ks when measured (`along`: the
    simulator along vLLM's outputs per (group, k), eaglelab.evaluate.held_out.along_vllm). -> (the suite's table, its
    parity rows, its per-prompt rows: what paired comparisons of two drafters resample, one `suite` per condition)."""
    ks = suite_ks(cfg, suite)
    rows, parity, per_prompt = [], [], ([], [])
    for condition, feats in groups.items():
        tokens = sum(feats["prompt_len"]) / len(feats)
        per_sequence = []
        sim = evaluate_simulated(drafter, feats, max(ks), cfg.train.batch_size, per_sequence=per_sequence)
        for table, more in zip(per_prompt, per_prompt_rows(per_sequence, feats, f"{suite}/{condition}")):
            table += more
        measured = [("simulated", k, sim[k], None) for k in ks]
        for k in ks:
            if (row := vllm_rows.get((f"{suite}/{condition}", k))) is not None:
                same = same_output_share(row["outputs"], feats)
                measured.append(("vllm", k, counts_from(row), same))
                along_row = along.get((f"{suite}/{condition}", k))
                parity.append(parity_row(suite, condition, len(feats), sim[k], counts_from(row), same, along_row))
        for evaluator, k, counts, same in measured:
            rows.append(
                {
                    "suite": suite,
                    "condition": condition,
                    "evaluator": evaluator,
                    "k": k,
                    "prompts": len(feats),
                    "prompt_tokens": round(tokens, 1),
                    "acceptance_length": counts.acceptance_length,
                    "drafts": counts.drafts,
                    "accepted": counts.accepted,
                    "same_output_share": same,
                }
            )
    return rows, parity, per_prompt


def _vllm_sets(inputs: SuiteInputs) -> dict:
    """Every suite condition's features, by the group name its vLLM rows carry (`suite/condition`)."""
    sets = {f"long_context/{n}": f for n, f in inputs.long_context.items()}
    sets.update({f"templates/{c}": f for c, f in inputs.templates.items()})
    sets.update({f"benchmarks/{n}": f for n, f in inputs.benchmarks.items()})
    return sets


def _vllm_groups(inputs: SuiteInputs) -> dict:
    """The suites' prompt sets for one engine, each with its sequences' own budgets."""
    return {name: _group(f) for name, f in _vllm_sets(inputs).items()}


def served_job(cfg: RunConfig, inputs: SuiteInputs) -> dict:
    """The suites' engine job's served part: each long-context length timed on its own at
    eval.suites.long_context.concurrencies, and (`eval.suites.benchmarks.served`) each benchmark over every one of its
    requests a pass at batch 1 (eaglelab.evaluate.serving's `timed_groups`), with and without the drafter; nothing to
    time without either."""
    lc, bm, v = cfg.eval.suites.long_context, cfg.eval.suites.benchmarks, cfg.eval.vllm
    timed = {}
    if inputs.long_context and lc.concurrencies:
        timed.update({str(n): {**_group(f), "concurrencies": lc.concurrencies} for n, f in inputs.long_context.items()})
    if inputs.benchmarks and bm.served:
        timed.update({f"benchmarks/{n}": {**_group(f), "waves": len(f), "concurrencies": [1]}
                      for n, f in inputs.benchmarks.items()})  # fmt: skip
    if not timed:
        return {}
    return {
        "throughput_ks": suite_ks(cfg, "long_context"),  # (eval.suites.ks: the depths vLLM times the suites at)
        "concurrencies": sorted({c for g in timed.values() for c in g["concurrencies"]}),
        "timed_groups": timed,
        "waves": v.waves,
        "repeats": v.repeats,
        "temperature": v.served_temperature,
    }


def _group(features) -> dict:
    """A prompt set as an engine takes it: each sequence's prompt ids and the budget it was regenerated with."""
    return {"prompts": prompt_ids(features), "max_tokens": [int(b) for b in features["max_tokens"]]}


def served_speed(cfg: RunConfig, out_dir: Path, passes: list[dict]) -> dict:
    """The suites' timed passes -> long_context_throughput.csv (one row per length, method, k and c: speedup with its
    interval, TTFT/TPOT) and benchmarks_throughput.csv (one row per benchmark, method and k at c = 1), their passes
    and figure -> metrics `long_context/vllm/{speedup,...}@{length}@k{k}@c{c}`, `benchmarks/vllm/...@{name}@k{k}@c1`."""
    metrics = {}
    for suite, mine in (
        ("long_context", [p for p in passes if not str(p["group"]).startswith("benchmarks/")]),
        ("benchmarks", [{**p, "group": p["group"].split("/", 1)[1]} for p in passes
                        if str(p["group"]).startswith("benchmarks/")]),
    ):  # fmt: skip
        if not mine:
            continue
        rows = throughput_rows(mine)
        write_csv(out_dir / f"{suite}_throughput.csv", rows)
        write_csv(out_dir / f"{suite}_throughput_passes.csv", mine)
        if suite == "long_context":
            plot_long_context_speed(out_dir, cfg.label)
        for r in rows:
            at = f"{r['group']}@k{r['k']}@c{r['concurrency']}"
            if r["method"] != "none":
                metrics[f"{suite}/vllm/speedup@{at}"] = r["speedup"]
                if not math.isnan(r["speedup_ci_low"]):
                    metrics[f"{suite}/vllm/speedup_ci_low@{at}"] = r["speedup_ci_low"]
                    metrics[f"{suite}/vllm/speedup_ci_high@{at}"] = r["speedup_ci_high"]
            for what in ("output_tokens_per_s", "ttft_p50_ms", "tpot_p50_ms"):
                metrics[f"{suite}/vllm/{what}@{r['method']}@{at}"] = r[what]
    return metrics


def suites_job(cfg: RunConfig, drafter, inputs: SuiteInputs, run_dir: Path, serving: Serving) -> EvaluateJob | None:
    """The long-context, template and benchmark prompt sets' engine job (None without any): τ at the suite depths per
    condition, the capture along vLLM's outputs, and each long-context length (and benchmark, where asked) served
    with and without the drafter."""
    if not (inputs.long_context or inputs.templates or inputs.benchmarks):
        return None
    v = cfg.eval.vllm
    return EvaluateJob(
        target=str(serving.path),
        drafter=str(run_dir / FORMAT_DIRS[v.drafter_format]),  # the export vLLM serves
        groups=_vllm_groups(inputs),
        stop_token_ids=next(iter(_vllm_sets(inputs).values())).stop_token_ids,
        ks=suite_ks(cfg),
        temperatures=[0.0],
        dtype=cfg.target.dtype,
        max_model_len=serving.max_model_len,
        enforce_eager=v.enforce_eager,
        gpu_memory_utilization=v.gpu_memory_utilization,
        tensor_parallel_size=v.tensor_parallel_size,
        along_vllm=along_vllm_spec(drafter, v.parity_along_vllm, cfg.paths.scratch_dir),
        **served_job(cfg, inputs),
    )


def evaluate_suites(
    cfg: RunConfig,
    drafter,
    inputs: SuiteInputs,
    eval_feats,
    by_k: list[dict],
    run_dir: Path,
    engine: dict | None = None,
    parity: list[dict] | None = None,
) -> dict:
    """Run the enabled suites on `drafter`; `engine`: vLLM's rows of `suites_job` when vLLM measured too
    (eaglelab.evaluate.over_ranks). Returns flat metrics; tables and plots are written to run_dir/suites/, and the
    suites' parity rows are added to the held-out evaluation's (`parity`) in run_dir/parity.csv."""

    s, out_dir, metrics = cfg.eval.suites, run_dir / "suites", {}
    if s.drift.enabled:
        subset = eval_feats.select(evenly_spaced(len(eval_feats), s.drift.num_prompts))
        per_depth, balance, per_prompt = drift_diagnostics(
            drafter, subset, max_k(cfg), s.drift.recent_tokens, batch_size=cfg.train.batch_size
        )
        write_csv(out_dir / "drift.csv", per_depth)
        write_csv(out_dir / "drift_per_prompt.csv", per_prompt)  # what analysis/paired.py pairs, prompt by prompt
        # What was measured, by name: analysis/drift_check.py recomputes every measure from these and the export.
        atomic_write_json(out_dir / "drift_inputs.json", drift_inputs(subset, max_k(cfg), s.drift.recent_tokens))
        write_csv(out_dir / "fc_balance.csv", balance)
        for row in per_depth:
            metrics.update({f"drift/{m}@d{row['depth']}": v for m, v in row.items() if m not in ("depth", "drafts")})
        metrics.update({f"drift/fc_input_share@layer{r['aux_layer']}": r["input_share"] for r in balance})
        plot_drift(out_dir, cfg.label)
    if s.extrapolation.enabled:
        ttt = cfg.train.ttt_steps
        rows = []
        for evaluator in ("simulated", "vllm"):
            tau = {int(r["k"]): r["acceptance_length"] for r in by_k if r["evaluator"] == evaluator}
            if ttt not in tau:
                continue
            rows += [
                {
                    "evaluator": evaluator,
                    "k": k,
                    "ttt_steps": ttt,
                    "acceptance_length": t,
                    "relative_to_ttt": t / tau[ttt],
                }
                for k, t in sorted(tau.items())
            ]
            if 2 * ttt in tau:
                metrics[f"extrapolation/{evaluator}/tau_ratio@k{2 * ttt}_vs_k{ttt}"] = tau[2 * ttt] / tau[ttt]
        write_csv(out_dir / "extrapolation.csv", rows)
        if rows:
            plot_extrapolation(run_dir, out_dir, cfg.label)

    if not (inputs.long_context or inputs.templates or inputs.benchmarks):
        return metrics
    vllm_rows, along = {}, {}
    if engine is not None:
        vllm_rows = {(r["group"], r["k"]): r for r in engine["acceptance"]}
        along = engine["along"]
        if engine["throughput"]:
            metrics.update(served_speed(cfg, out_dir, engine["throughput"]))
    per_prompt, per_prompt_depth = [], []  # every suite's, one `suite` per condition (analysis/paired.py)
    for suite, groups in (
        ("long_context", inputs.long_context),
        ("templates", inputs.templates),
        ("benchmarks", inputs.benchmarks),
    ):
        if not groups:
            continue
        rows, suite_parity, (prompts, depths) = _rows(
            suite, {str(c): f for c, f in groups.items()}, drafter, cfg, vllm_rows, along
        )
        per_prompt, per_prompt_depth = per_prompt + prompts, per_prompt_depth + depths
        parity = [*(parity or []), *suite_parity]
        if suite == "templates":
            for r in rows:
                r["same_as"] = ""
            rows += [
                {**r, "condition": cond, "same_as": ref}  # measured once, reported under both names
                for cond, ref in inputs.same_as.items()
                for r in rows
                if r["condition"] == ref
            ]
            native = {(r["evaluator"], r["k"]): r["acceptance_length"] for r in rows if r["condition"] == "native"}
            for r in rows:
                r["ratio_to_native"] = r["acceptance_length"] / native[(r["evaluator"], r["k"])]
        if suite == "benchmarks":  # (the summary says over how many requests)
            metrics.update({f"benchmarks/prompts@{name}": len(f) for name, f in groups.items()})
        write_csv(out_dir / f"{suite}.csv", rows)
        for r in rows:  # the evaluator is part of the key: the two are never mixed silently
            at = f"{r['condition']}@k{r['k']}"
            metrics[f"{suite}/{r['evaluator']}/acceptance_length@{at}"] = r["acceptance_length"]
            if "ratio_to_native" in r:
                metrics[f"{suite}/{r['evaluator']}/ratio_to_native@{at}"] = r["ratio_to_native"]
        if suite == "benchmarks":
            plot_benchmarks(out_dir, cfg.label, cfg.recipe.published)
        else:
            plot_suite(out_dir, suite, cfg.label)
    write_csv(out_dir / "per_prompt.csv", per_prompt)
    write_csv(out_dir / "per_prompt_depth.csv", per_prompt_depth)
    if vllm_rows:
        write_csv(run_dir / "parity.csv", parity)
        metrics.update(parity_metrics(parity))
    return metrics
