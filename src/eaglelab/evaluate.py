"""Held-out evaluation: the in-house simulated evaluator (greedy chain drafting), and the same drafter
served by vLLM next to its target (acceptance per k, decode speedup, parity with the simulator)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from eaglelab.acceptance import AcceptanceCounts, DepthAccuracy, SequenceCounts
from eaglelab.batches import FeatureDataset, acceptance_counts, collate, move
from eaglelab.config import RunConfig, max_k, vllm_ks
from eaglelab.drafter import Eagle3Drafter
from eaglelab.errors import EaglelabError
from eaglelab.io import write_csv
from eaglelab.plots import plot_speedup
from eaglelab.vllm_engine import INSTALL_HINT, vllm_available

log = logging.getLogger("eaglelab")


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
    keys = [prompt_key(ids[:p]) for ids, p in zip(features["input_ids"], features["prompt_len"])]
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


def held_out_in_vllm(cfg: RunConfig, run_dir: Path, drafter: Eagle3Drafter, serving: Serving, features) -> VllmReport:
    """`evaluate_in_vllm` with the run's settings, on its exported drafter."""
    v = cfg.eval.vllm
    return evaluate_in_vllm(
        drafter,
        run_dir / "drafter",
        serving.path,
        features,
        ks=vllm_ks(cfg),
        throughput_ks=[cfg.train.ttt_steps] if v.throughput_ks is None else v.throughput_ks,
        concurrencies=v.concurrencies,
        num_prompts=v.num_prompts,
        throughput_prompts=v.throughput_prompts,
        dtype=cfg.target.dtype,
        max_model_len=serving.max_model_len,
        suite=cfg.eval.prompts,
        workdir=run_dir / "vllm",
        enforce_eager=v.enforce_eager,
        timeout=v.timeout_s,
        gpu_memory_utilization=v.gpu_memory_utilization,
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


def parity_row(suite: str, group: str, prompts: int, sim: AcceptanceCounts, vllm: AcceptanceCounts, same: float):
    """Simulated vs vLLM on the same prompts and k: one row of parity.csv. Draft and accepted counts are compared
    as counts (identical when both evaluators decode the same sequences), per position as space-separated counts."""
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
    }


def parity_metrics(parity: list[dict]) -> dict:
    """Summary of parity.csv for metrics.json: the largest |Δτ|/τ and the rows whose counts differ."""
    if not parity:
        return {}
    return {
        "parity/max_abs_relative_difference": max(abs(p["relative_difference"]) for p in parity),
        "parity/draft_count_mismatches": sum(p["drafts_simulated"] != p["drafts_vllm"] for p in parity),
        "parity/accepted_count_mismatches": sum(p["accepted_simulated"] != p["accepted_vllm"] for p in parity),
    }


@dataclass
class VllmReport:
    acceptance: list[dict]  # rows like acceptance_rows' by_k, evaluator "vllm"
    per_position: list[dict]
    parity: list[dict]  # parity_row per k: counts and τ, simulated vs vLLM, on the same prompts
    throughput: list[dict]  # method, k, concurrency, output tokens/s, speedup vs no speculation
    metrics: dict


def evaluate_in_vllm(
    drafter: Eagle3Drafter,
    drafter_dir: Path,
    target_path: Path,
    features,
    *,
    ks: list[int],
    throughput_ks: list[int],
    concurrencies: list[int],
    num_prompts: int,
    throughput_prompts: int,
    dtype: str,
    max_model_len: int,
    suite: str,
    workdir: Path,
    enforce_eager: bool | None = None,
    timeout: int = 3600,
    gpu_memory_utilization: float | None = None,
) -> VllmReport:
    """τ per k and decode speed in vLLM, and the simulated evaluator on exactly the same prompts."""
    from eaglelab.vllm_engine import run_engine

    idx = evenly_spaced(len(features), num_prompts)
    subset = features.select(idx)
    prompts = prompt_ids(subset)
    job = {
        "mode": "evaluate",
        "target": str(target_path),
        "drafter": str(drafter_dir),
        "prompts": prompts,
        # Each sequence's own budget and stop ids, as it was regenerated: vLLM decodes the sequences scored.
        "max_tokens": [int(b) for b in subset["max_tokens"]],
        "stop_token_ids": subset.stop_token_ids,
        "ks": ks,
        "throughput_ks": throughput_ks,
        "concurrencies": concurrencies,
        "throughput_prompts": throughput_prompts,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "enforce_eager": enforce_eager,
        "gpu_memory_utilization": gpu_memory_utilization,
        "engines": len(set(ks) | set(throughput_ks)) + bool(throughput_ks),  # one per depth, one without drafts
    }
    result = run_engine(job, workdir, timeout=timeout, desc="evaluate (vLLM)")

    vllm_totals = {row["k"]: counts_from(row) for row in result["acceptance"]}
    acc_rows, pos_rows = acceptance_rows(vllm_totals, evaluator="vllm", suite=suite)
    sim_totals = evaluate_simulated(drafter, subset, max(ks)) if ks else {}
    parity, metrics = [], {}
    for row in result["acceptance"]:
        k = row["k"]
        same = same_output_share(row["outputs"], subset)
        parity.append(parity_row(suite, "", len(prompts), sim_totals[k], vllm_totals[k], same))
        metrics[f"vllm/acceptance_length@k{k}"] = vllm_totals[k].acceptance_length
        metrics[f"parity/relative_difference@k{k}"] = parity[-1]["relative_difference"]
    metrics.update(parity_metrics(parity))

    baseline = {
        r["concurrency"]: r["output_tokens"] / r["seconds"] for r in result["throughput"] if r["method"] == "none"
    }
    throughput = []
    for r in result["throughput"]:
        tps = r["output_tokens"] / r["seconds"]
        speedup = tps / baseline[r["concurrency"]]
        throughput.append(
            {**r, "output_tokens_per_s": tps, "per_user_tokens_per_s": tps / r["concurrency"], "speedup": speedup}
        )
        if r["method"] != "none":
            metrics[f"vllm/speedup@k{r['k']}@c{r['concurrency']}"] = speedup
        metrics[f"vllm/output_tokens_per_s@{r['method']}@k{r['k']}@c{r['concurrency']}"] = tps
    return VllmReport(acc_rows, pos_rows, parity, throughput, metrics)


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
    by_k: list[dict],
    by_pos: list[dict],
    metrics: dict,
) -> tuple[list[dict], list[dict]]:
    """vLLM's τ per k and decode speedup, appended to the simulated tables; parity.csv, throughput.csv.
    -> (acceptance rows of both evaluators, parity rows)."""
    report = held_out_in_vllm(cfg, run_dir, drafter, serving, held_out)
    by_k = by_k + report.acceptance
    write_csv(run_dir / "acceptance.csv", by_k)
    write_csv(run_dir / "per_position.csv", by_pos + report.per_position)
    write_csv(run_dir / "parity.csv", report.parity)
    write_csv(run_dir / "throughput.csv", report.throughput)
    metrics.update(report.metrics)
    if report.throughput:
        plot_speedup(run_dir, f"{cfg.variant} (seed {cfg.train.seed})")
    return by_k, report.parity
