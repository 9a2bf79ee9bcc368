"""Held-out evaluation: the in-house simulated evaluator (greedy chain drafting), and the same drafter
served by vLLM next to its target (acceptance per k, decode speedup, parity with the simulator)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from eaglelab.core.config import RunConfig, max_k, vllm_ks
from eaglelab.core.errors import EaglelabError
from eaglelab.core.io import write_csv
from eaglelab.data.store import COMPLETE, Sequences, StateStore, TokenStore
from eaglelab.data.targets import LOGITS_CHUNK, target_head
from eaglelab.engine.jobs import EvaluateJob
from eaglelab.engine.process import INSTALL_HINT, cuda_available, vllm_available
from eaglelab.evaluate.plots import plot_speedup
from eaglelab.export.eagle3 import FORMAT_DIRS
from eaglelab.models.acceptance import AcceptanceCounts, DepthAccuracy, SequenceCounts
from eaglelab.models.drafter import Eagle3Drafter
from eaglelab.train.batches import FeatureDataset, acceptance_counts, collate, expected_acceptance, move

log = logging.getLogger("eaglelab")


def as_evaluated(drafter: Eagle3Drafter, device, embed_dtype: torch.dtype) -> Eagle3Drafter:
    """The trained drafter as both evaluators see it: float32 whatever train.precision trained it in (a "-true" one:
    16 bits), on `device`, its shared embedding rows in the target's dtype, as in training and in vLLM."""
    embed = drafter.embed_tokens.weight.data
    drafter.embed_tokens.weight.data = embed.new_empty(0)  # set aside, so .float() makes no copy of it
    drafter = drafter.float().to(device)
    # (A "-true" precision converted it with the module: 64-true's float64 rows would make every layer's input float64.)
    drafter.embed_tokens.weight.data = embed.to(drafter.d2t.device, embed_dtype)
    return drafter


@torch.no_grad()
def evaluate_simulated(
    drafter: Eagle3Drafter,
    features,
    max_k: int,
    batch_size: int = 4,
    depth: DepthAccuracy | None = None,
    per_sequence: list[SequenceCounts] | None = None,
) -> dict[int, AcceptanceCounts]:
    """τ and per-position acceptance for every k = 1..max_k over all sequences of `features` (and, into `depth`,
    teacher-forced accuracy at every depth; into `per_sequence`, both for each sequence)."""
    drafter.eval()
    data = FeatureDataset(features, list(range(len(features))), with_final=False, with_tail=True)
    totals = {k: AcceptanceCounts(k=k) for k in range(1, max_k + 1)}
    loader = DataLoader(data, batch_size=batch_size, collate_fn=collate)
    device = drafter.d2t.device
    for batch in tqdm(loader, desc="evaluate (simulated)", leave=False):
        # A multi-turn request is measured on its last answer, the one an engine generates for it: its earlier answers
        # (`spans`, which training drafts inside) are its history here, measured as requests of their own
        batch = dataclasses.replace(batch, spans=None)
        for k, counts in acceptance_counts(
            drafter, move(batch, device), max_k, depth=depth, per_sequence=per_sequence
        ).items():
            totals[k].add(counts)
    return totals


def acceptance_rows(totals: dict[int, AcceptanceCounts], evaluator: str, suite: str) -> tuple[list, list]:
    """Tidy tables: one row per k, and one row per (k, draft position)."""
    by_k = [
        {
            "suite": suite,
            "evaluator": evaluator,
            "k": k,
            "acceptance_length": c.acceptance_length,
            "drafts": c.drafts,
            "accepted": c.accepted,
        }
        for k, c in sorted(totals.items())
    ]
    by_pos = [
        {
            "suite": suite,
            "evaluator": evaluator,
            "k": k,
            "position": d + 1,
            "acceptance_rate": c.per_position[d],  # accepted at d / rounds
            "conditional_rate": c.conditional[d],  # n-α: accepted at d / rounds that reached d
            "accepted": c.accepted_per_pos[d],
            "reached": c.reached[d],
        }
        for k, c in sorted(totals.items())
        for d in range(k)
    ]
    return by_k, by_pos


def prompt_key(ids) -> str:
    """A prompt's name across runs: the digest of its token ids (the same held-out prompt under two drafters,
    whatever order their sets were stored in)."""
    return hashlib.sha1(" ".join(map(str, ids)).encode()).hexdigest()[:12]


def per_prompt_rows(per_sequence: list[SequenceCounts], features, suite: str) -> tuple[list, list]:
    """Tidy per-prompt tables, what paired comparisons resample: one row per (prompt, k) with its rounds and
    accepted drafts per position, and one per (prompt, depth) with its teacher-forced correct/counted drafts."""
    # (a sequence's `index` is its row in the stores: keyed by row, a view of some of them reads right too)
    keys = {r: prompt_key(ids[:p]) for r, ids, p in zip(features.rows, features["input_ids"], features["prompt_len"])}
    acceptance = [
        {
            "suite": suite,
            "prompt": keys[s.index],
            "k": k,
            "drafts": c.drafts,
            "accepted": c.accepted,
            "accepted_per_pos": " ".join(map(str, c.accepted_per_pos)),
        }
        for s in per_sequence
        for k, c in sorted(s.by_k.items())
    ]
    depth = [
        {"suite": suite, "prompt": keys[s.index], "depth": d + 1, "correct": c, "counted": n}
        for s in per_sequence
        for d, (c, n) in enumerate(zip(s.depth.correct, s.depth.counted))
    ]
    return acceptance, depth


# --- the serving engine's view of the same drafter -------------------------------------------------
@dataclass(frozen=True)
class Serving:
    """What vLLM needs of the target to serve a drafter next to it."""

    path: Path  # the target's Hugging Face folder
    max_model_len: int  # its context window


def vllm_wanted(cfg: RunConfig) -> bool:
    """Whether vLLM evaluates this run (asked before any expensive work: a required but missing vLLM fails now)."""
    enabled = cfg.eval.vllm.enabled
    if enabled is False:
        return False
    if not vllm_available():
        if enabled:
            raise EaglelabError(INSTALL_HINT)
        log.warning("vLLM is not installed: evaluating with the simulated evaluator only (%s)", INSTALL_HINT)
        return False
    return True


def served_ks(cfg: RunConfig) -> list[int]:
    """The depths whose decode speed vLLM's OpenAI server times (`eval.vllm.throughput_ks`). Unset: the trained depth
    where the engine has a GPU, none on a CPU: there the timed passes share a few cores with everything else, and the
    speedup's 95% interval at the defaults (README, "Served speed on a CPU") is too wide to resolve what a drafter
    changes; `python src/run.py checkpoint=RUN eval.vllm.throughput_ks=[K]` serves it there on purpose."""
    if cfg.eval.vllm.throughput_ks is not None:
        return cfg.eval.vllm.throughput_ks
    return [cfg.train.ttt_steps] if cuda_available() else []


def held_out_job(cfg: RunConfig, run_dir: Path, drafter: Eagle3Drafter, serving: Serving, features) -> EvaluateJob:
    """The held-out set's engine job with the run's settings, on its exported drafter (run whole in one process, or
    spread over a trial's ranks: eaglelab.evaluate.over_ranks): τ per k on an evenly spaced subset of
    eval.vllm.num_prompts (with the capture along its greedy outputs when eval.vllm.parity_along_vllm), and decode
    speed as served over every held-out sequence."""
    v = cfg.eval.vllm
    subset = features.select(evenly_spaced(len(features), v.num_prompts))
    return EvaluateJob(
        target=str(serving.path),
        drafter=str(run_dir / FORMAT_DIRS[v.drafter_format]),  # the export vLLM serves
        # Each sequence's own budget and stop ids, as it was regenerated: vLLM decodes the sequences scored.
        groups={"": {"prompts": prompt_ids(subset), "max_tokens": [int(b) for b in subset["max_tokens"]]}},
        stop_token_ids=subset.stop_token_ids,
        ks=vllm_ks(cfg),
        temperatures=sorted({0.0, *map(float, cfg.eval.temperature)}),
        throughput_ks=served_ks(cfg),
        concurrencies=v.concurrencies,
        # Timed (served) requests: every held-out prompt, each with its own budget (eaglelab.evaluate.serving).
        timed_groups={"": {"prompts": prompt_ids(features), "max_tokens": [int(b) for b in features["max_tokens"]]}},
        waves=v.waves,
        repeats=v.repeats,
        temperature=v.served_temperature,
        dtype=cfg.target.dtype,
        max_model_len=serving.max_model_len,
        enforce_eager=v.enforce_eager,
        gpu_memory_utilization=v.gpu_memory_utilization,
        tensor_parallel_size=v.tensor_parallel_size,  # every engine and server of the job (eaglelab.core.devices)
        along_vllm=along_vllm_spec(drafter, v.parity_along_vllm, cfg.paths.scratch_dir),
    )


def held_out_report(cfg: RunConfig, drafter: Eagle3Drafter, serving: Serving, features, engine: dict) -> VllmReport:
    """`vllm_report` of the held-out job's rows, with the run's settings."""
    return vllm_report(
        engine,
        drafter,
        features,
        num_prompts=cfg.eval.vllm.num_prompts,
        suite=cfg.eval.prompts,
        # the target's distribution, where its final states are cached beside the aux ones (eval.temperature > 0)
        head=target_head(serving.path).lm_head if any(cfg.eval.temperature) and has_final(features) else None,
    )


def evenly_spaced(n_total: int, n: int) -> list[int]:
    """n indices spread over 0..n_total-1 (the cached sequences are in length order: a prefix would
    be the shortest prompts only)."""
    n = min(n, n_total)
    return sorted({round(i * (n_total - 1) / max(n - 1, 1)) for i in range(n)})


def counts_from(row: dict) -> AcceptanceCounts:
    return AcceptanceCounts(
        k=row["k"], drafts=row["drafts"], accepted=row["accepted"], accepted_per_pos=row["accepted_per_pos"]
    )


def prompt_ids(features) -> list[list[int]]:
    """Each sequence's prompt ids: what an engine is sent to decode the stored response."""
    return [list(map(int, ids[:p])) for ids, p in zip(features["input_ids"], features["prompt_len"])]


def same_output_share(outputs: list[list[int]], features) -> float:
    """Share of prompts whose served greedy output is exactly the stored response the simulator scored."""
    responses = [list(map(int, ids[p:])) for ids, p in zip(features["input_ids"], features["prompt_len"])]
    return sum(o == r for o, r in zip(outputs, responses)) / len(responses)


@dataclass
class AlongVllm:
    """The simulated evaluator teacher-forced on vLLM's own greedy outputs, their states captured by vLLM's engine
    (eaglelab.data.vllm_capture.capture_outputs): both evaluators then draft along the same tokens from the same
    target's states, so what still differs is the drafter's numerics (torch's here, vLLM's kernels there)."""

    counts: AcceptanceCounts
    prefill_agreement: float  # share of vLLM's output tokens that the target's prefill over them also predicts


ALONG = "along_vllm"  # the folder of an engine job's workdir that holds the sequences it decoded, captured


def along_vllm_spec(drafter: Eagle3Drafter, wanted: bool, scratch_dir: str) -> dict | None:
    """What an evaluation job needs to capture the states along its greedy outputs (None when not `wanted`): which
    layers (the folder is its part's: eaglelab.evaluate.over_ranks) and where its connector writes (node-local
    `scratch_dir`)."""
    if not wanted:
        return None
    return {"layer_ids": list(drafter.cfg.aux_layer_ids), "scratch_dir": str(Path(scratch_dir).expanduser())}


def along_vllm_room(job: EvaluateJob, drafter: Eagle3Drafter) -> int:
    """The room an evaluation job's process needs beside its engines on a GPU when it captures along its outputs (the
    target's LM head and one chunk of logits, for the labels: as the data stage's capture job); else none."""
    c, size = drafter.cfg, 4 if job.dtype == "float32" else 2
    return (c.target_hidden_size + LOGITS_CHUNK) * c.vocab_size * size if job.along_vllm else 0


def along_vllm(drafter: Eagle3Drafter, folder: Path, rows: list[dict], batch_size: int = 4) -> dict[tuple, AlongVllm]:
    """Each greedy acceptance row of an engine job with `along_vllm` simulated along its own outputs ->
    {(group, k): AlongVllm}. Rows that decoded the same sequences (every k, where vLLM's outputs do not depend on
    it) share one simulation at their deepest k."""

    if not (folder / "states" / COMPLETE).is_file():  # the capture failed (its error is in the engine's log)
        log.warning("parity along vLLM's outputs: no states were captured (see the engine's vllm.log); skipped")
        return {}
    store = Sequences(TokenStore(folder / "tokens"), StateStore(folder / "states"))
    deepest: dict[tuple, int] = {}
    for row in rows:
        key = tuple(row["sequence_rows"])
        deepest[key] = max(deepest.get(key, 0), row["k"])
    simulated = {key: evaluate_simulated(drafter, store.select(list(key)), k, batch_size) for key, k in deepest.items()}
    out = {}
    for row in rows:
        same = total = 0
        for r in row["sequence_rows"]:  # where decode (vLLM's tokens) and one prefill over them disagree: the target
            ids, p = torch.from_numpy(store.tokens.input_ids(r).astype(np.int64)), int(store.tokens.prompt_len[r])
            same += int((store.states.read(r)["target_next"][p - 1 : -1] == ids[p:]).sum())
            total += len(ids) - p
        out[row["group"], row["k"]] = AlongVllm(simulated[tuple(row["sequence_rows"])][row["k"]], same / max(total, 1))
    return out


def parity_row(suite: str, group: str, prompts: int, sim: AcceptanceCounts, vllm: AcceptanceCounts, same: float,
               along: AlongVllm | None = None):  # fmt: skip
    """Simulated vs vLLM on the same prompts and k: one row of parity.csv. Draft and accepted counts are compared
    as counts (identical when both evaluators decode the same sequences), per position as space-separated counts.
    Along HF's continuation (the stored responses: the target's numerics and the drafter's mixed) and, with `along`,
    along vLLM's own outputs (the drafter's alone)."""
    along_columns = {}
    if along is not None:
        a = along.counts
        along_columns = {
            "drafts_simulated_along_vllm": a.drafts,
            "accepted_simulated_along_vllm": a.accepted,
            "tau_simulated_along_vllm": a.acceptance_length,
            "relative_difference_along_vllm": (a.acceptance_length - vllm.acceptance_length) / vllm.acceptance_length,
            "accepted_per_pos_simulated_along_vllm": " ".join(map(str, a.accepted_per_pos)),
            "prefill_agreement": along.prefill_agreement,
        }
    return {
        "suite": suite,
        "group": group,
        "k": sim.k,
        "prompts": prompts,
        "drafts_simulated": sim.drafts,
        "drafts_vllm": vllm.drafts,
        "accepted_simulated": sim.accepted,
        "accepted_vllm": vllm.accepted,
        "tau_simulated": sim.acceptance_length,
        "tau_vllm": vllm.acceptance_length,
        "relative_difference": (sim.acceptance_length - vllm.acceptance_length) / vllm.acceptance_length,
        "accepted_per_pos_simulated": " ".join(map(str, sim.accepted_per_pos)),
        "accepted_per_pos_vllm": " ".join(map(str, vllm.accepted_per_pos)),
        "same_output_share": same,
        **along_columns,
    }


def parity_metrics(parity: list[dict]) -> dict:
    """Summary of parity.csv for metrics.json: the largest |Δτ|/τ and the rows whose counts differ, along HF's
    continuation and (`_along_vllm`) along vLLM's own."""
    out = {}
    for suffix, simulated in (("", "simulated"), ("_along_vllm", "simulated_along_vllm")):
        rows = [p for p in parity if f"tau_{simulated}" in p]
        if rows:
            out[f"parity/max_abs_relative_difference{suffix}"] = max(
                abs(p[f"relative_difference{suffix}"]) for p in rows
            )
            out[f"parity/draft_count_mismatches{suffix}"] = sum(
                p[f"drafts_{simulated}"] != p["drafts_vllm"] for p in rows
            )
            out[f"parity/accepted_count_mismatches{suffix}"] = sum(
                p[f"accepted_{simulated}"] != p["accepted_vllm"] for p in rows
            )
    return out


def has_final(features) -> bool:
    return features.states is not None and features.states.with_final


def sampling_rows(sampled: list[dict], drafter, subset, head, suite: str, metrics: dict) -> list[dict]:
    """vLLM's acceptance under speculative sampling (one row per temperature and k) and, where the target's
    distribution is cached (final states, held-out sets prepared for eval.temperature > 0) and its LM head given,
    the simulated expectation on the same prompts along the stored greedy continuation
    (batches.expected_acceptance)."""
    rows = []
    for row in sampled:
        t, k, c = row["temperature"], row["k"], counts_from(row)
        tau = c.acceptance_length
        rows.append(dict(suite=suite, evaluator="vllm", temperature=t, k=k, acceptance_length=tau, drafts=c.drafts))
        rows[-1]["accepted"] = c.accepted
        metrics[f"vllm/acceptance_length@k{k}@t{t:g}"] = tau
    if not (sampled and has_final(subset) and head is not None):
        return rows
    ks = {
        t: sorted({r["k"] for r in sampled if r["temperature"] == t})
        for t in sorted({r["temperature"] for r in sampled})
    }
    deepest = max(max(k) for k in ks.values())
    device = drafter.d2t.device
    weight = head.to(device, torch.float32)  # [V, H], once
    modes = (("greedy", "simulated_expected"), ("probabilistic", "simulated_expected_sampled"))  # greedy: vLLM's drafts
    rounds = {(t, m): [0.0] * deepest for t in ks for m, _ in modes}  # expected, per k (batches.expected_acceptance)
    accepted = {(t, m): [0.0] * deepest for t in ks for m, _ in modes}
    data = FeatureDataset(subset, list(range(len(subset))), with_final=True)
    for batch in DataLoader(data, batch_size=2, collate_fn=collate):
        batch = move(batch, device)
        outs = drafter.unroll(batch.aux, batch.input_ids, deepest, first=batch.first)  # one unroll for every t, mode
        for t in ks:
            for mode, _ in modes:
                n, acc = expected_acceptance(drafter, batch, weight, deepest, t, mode, outs=outs)
                rounds[t, mode] = [a + b for a, b in zip(rounds[t, mode], n)]
                accepted[t, mode] = [a + b for a, b in zip(accepted[t, mode], acc)]
    for t, t_ks in ks.items():
        for mode, evaluator in modes:
            for k in t_ks:
                n, acc = rounds[t, mode][k - 1], accepted[t, mode][k - 1]
                tau = 1 + acc / max(n, 1e-12)
                rows.append(dict(suite=suite, evaluator=evaluator, temperature=t, k=k, acceptance_length=tau))
                rows[-1].update(drafts=n, accepted=acc)  # expected rounds and accepted drafts
                metrics[f"{evaluator.replace('simulated_', '')}_acceptance_length@k{k}@t{t:g}"] = tau
    return rows


def ratio_interval(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """a / b for two sets of independent repeated measurements -> (ratio of geometric means, its interval): Welch's
    t on the logs, as throughput varies multiplicatively. One pass on either side has no interval (NaN)."""
    from scipy import stats

    la, lb = np.log(a), np.log(b)
    ratio = float(np.exp(la.mean() - lb.mean()))
    if len(a) < 2 or len(b) < 2:
        return ratio, math.nan, math.nan
    va, vb = la.var(ddof=1) / len(a), lb.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return ratio, ratio, ratio
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = float(stats.t.ppf(0.5 + level / 2, df)) * se
    return ratio, ratio * math.exp(-half), ratio * math.exp(half)


def throughput_rows(passes: list[dict]) -> list[dict]:
    """Timed passes -> one row per (group, method, k, concurrency): the mean of every figure over its passes, the
    requests and output tokens it rests on, and the speedup over no speculation at the same concurrency (and group)
    with its 95% interval over the passes (eaglelab.evaluate.serving)."""
    groups: dict[tuple, list[dict]] = {}
    for p in passes:  # (`group`: a prompt set timed on its own, e.g. a long-context length; "" for the one set)
        groups.setdefault((p.get("group", ""), p["method"], p["k"], p["concurrency"]), []).append(p)
    baseline = {(g, c): [p["output_tokens_per_s"] for p in ps] for (g, m, _, c), ps in groups.items() if m == "none"}
    rows = []
    for (group, method, k, c), ps in groups.items():
        means = {
            key: float(np.mean([p[key] for p in ps]))
            for key, value in ps[0].items()
            if isinstance(value, float)
            and key not in ("startup_s", "temperature")
            and all(p[key] is not None for p in ps)
        }
        speedup = (math.nan,) * 3
        if (group, c) in baseline:
            speedup = ratio_interval([p["output_tokens_per_s"] for p in ps], baseline[group, c])
        rows.append(
            {
                **({"group": group} if group else {}),
                "method": method,
                "k": k,
                "concurrency": c,
                "temperature": ps[0].get("temperature", 0.0),  # (the served requests', eval.vllm.served_temperature)
                "passes": len(ps),
                "requests": sum(p["requests"] for p in ps),
                "output_tokens": sum(p["output_tokens"] for p in ps),
                "startup_s": ps[0]["startup_s"],
                **means,
                "speedup": speedup[0],
                "speedup_ci_low": speedup[1],
                "speedup_ci_high": speedup[2],
            }
        )
    return rows


@dataclass
class VllmReport:
    acceptance: list[dict]  # rows like acceptance_rows' by_k, evaluator "vllm"
    per_position: list[dict]
    parity: list[dict]  # parity_row per k: counts and τ, simulated vs vLLM, on the same prompts
    throughput: list[dict]  # throughput_rows: per method, k and concurrency, speedup vs no speculation
    passes: list[dict]  # every timed pass (throughput_passes.csv)
    sampling: list[dict]  # sampling_rows: τ under speculative sampling per temperature and k (sampling.csv)
    metrics: dict


def vllm_report(
    engine: dict, drafter: Eagle3Drafter, features, *, num_prompts: int, suite: str, head: torch.Tensor | None = None
) -> VllmReport:
    """vLLM's rows of `held_out_job` (`engine`: its acceptance rows, timed passes and the simulator along its outputs,
    eaglelab.evaluate.over_ranks) beside the simulated evaluator on exactly the same prompts: τ per k, parity (along
    the stored continuation and along vLLM's own outputs), speculative sampling against its expectation, and decode
    speed."""
    subset = features.select(evenly_spaced(len(features), num_prompts))
    greedy = [row for row in engine["acceptance"] if row.get("temperature", 0.0) == 0]
    vllm_totals = {row["k"]: counts_from(row) for row in greedy}
    acc_rows, pos_rows = acceptance_rows(vllm_totals, evaluator="vllm", suite=suite)
    sim_totals = evaluate_simulated(drafter, subset, max(vllm_totals)) if vllm_totals else {}
    parity, metrics = [], {}
    sampled = [row for row in engine["acceptance"] if row.get("temperature", 0.0) > 0]
    sampling = sampling_rows(sampled, drafter, subset, head, suite, metrics)
    along = engine["along"]
    for row in greedy:
        k = row["k"]
        same = same_output_share(row["outputs"], subset)
        parity.append(parity_row(suite, "", len(subset), sim_totals[k], vllm_totals[k], same, along.get(("", k))))
        metrics[f"vllm/acceptance_length@k{k}"] = vllm_totals[k].acceptance_length
        # the simulated evaluator on the very prompts vLLM measured: the figure to set beside vLLM's
        metrics[f"vllm/simulated_acceptance_length@k{k}"] = sim_totals[k].acceptance_length
        metrics[f"parity/relative_difference@k{k}"] = parity[-1]["relative_difference"]
        if along:
            metrics[f"parity/relative_difference_along_vllm@k{k}"] = parity[-1]["relative_difference_along_vllm"]
    metrics.update(parity_metrics(parity))
    metrics["vllm/prompts"] = len(subset)

    throughput = throughput_rows(engine["throughput"])
    for r in throughput:
        at = f"k{r['k']}@c{r['concurrency']}"
        if r["method"] != "none":
            metrics[f"vllm/speedup@{at}"] = r["speedup"]
            if not math.isnan(r["speedup_ci_low"]):  # one pass a side has no interval
                metrics[f"vllm/speedup_ci_low@{at}"] = r["speedup_ci_low"]
                metrics[f"vllm/speedup_ci_high@{at}"] = r["speedup_ci_high"]
        for what in ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
            metrics[f"vllm/{what}@{r['method']}@{at}"] = r[what]
    return VllmReport(acc_rows, pos_rows, parity, throughput, engine["throughput"], sampling, metrics)


def evaluate_held_out(
    cfg: RunConfig, run_dir: Path, drafter: Eagle3Drafter, held_out, metrics: dict
) -> tuple[list[dict], list[dict]]:
    """Simulated τ and per-position acceptance for k = 1..max_k: acceptance.csv, per_position.csv, metrics.
    Written before vLLM runs: if the engine fails, the trained drafter and these tables stay."""
    depth, per_sequence = DepthAccuracy(max_k(cfg)), []
    totals = evaluate_simulated(
        drafter, held_out, max_k(cfg), batch_size=cfg.train.batch_size, depth=depth, per_sequence=per_sequence
    )
    per_prompt, per_prompt_depth = per_prompt_rows(per_sequence, held_out, cfg.eval.prompts)
    write_csv(run_dir / "per_prompt.csv", per_prompt)  # what paired comparisons resample (analysis/paired.py)
    write_csv(run_dir / "per_prompt_depth.csv", per_prompt_depth)
    by_k, by_pos = acceptance_rows(totals, evaluator="simulated", suite=cfg.eval.prompts)
    by_depth = [
        {"suite": cfg.eval.prompts, "depth": d + 1, "accuracy": depth.accuracy[d], "correct": c, "counted": n}
        for d, (c, n) in enumerate(zip(depth.correct, depth.counted))
    ]  # teacher-forced, on the held-out sequences (validation's val/acc@d is the same measure on its split)
    metrics.update({f"acc@d{r['depth']}": r["accuracy"] for r in by_depth if r["counted"]})
    write_csv(run_dir / "depth_accuracy.csv", by_depth)
    metrics.update({f"acceptance_length@k{row['k']}": row["acceptance_length"] for row in by_k})
    metrics["held_out_prompts"] = len(held_out)  # (every held-out prompt: the simulated figures' count)
    metrics.update({f"acceptance_rate@k{row['k']}@pos{row['position']}": row["acceptance_rate"] for row in by_pos})
    metrics.update(  # n-α where some round reached the position (else it is no measurement, and not in the JSON)
        {f"conditional_rate@k{r['k']}@pos{r['position']}": r["conditional_rate"] for r in by_pos if r["reached"]}
    )
    write_csv(run_dir / "acceptance.csv", by_k)
    write_csv(run_dir / "per_position.csv", by_pos)
    return by_k, by_pos


def evaluate_held_out_in_vllm(
    cfg: RunConfig,
    run_dir: Path,
    drafter: Eagle3Drafter,
    serving: Serving,
    held_out,
    engine: dict,
    by_k: list[dict],
    by_pos: list[dict],
    metrics: dict,
) -> tuple[list[dict], list[dict]]:
    """vLLM's τ per k and decode speedup (`engine`: the held-out job's rows), appended to the simulated tables;
    parity.csv, throughput.csv. -> (acceptance rows of both evaluators, parity rows)."""
    report = held_out_report(cfg, drafter, serving, held_out, engine)
    by_k = by_k + report.acceptance
    write_csv(run_dir / "acceptance.csv", by_k)
    write_csv(run_dir / "per_position.csv", by_pos + report.per_position)
    write_csv(run_dir / "parity.csv", report.parity)
    write_csv(run_dir / "throughput.csv", report.throughput)
    write_csv(run_dir / "throughput_passes.csv", report.passes)
    if report.sampling:
        write_csv(run_dir / "sampling.csv", report.sampling)
    metrics.update(report.metrics)
    if report.throughput:
        plot_speedup(run_dir, f"{cfg.label} (seed {cfg.train.seed})")
    return by_k, report.parity
