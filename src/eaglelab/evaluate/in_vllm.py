"""Evaluation's handler in the engine process (eaglelab.engine.jobs.EvaluateJob): acceptance from vLLM's own counters
(`vllm:spec_decode_*`, τ = 1 + accepted / drafts), one in-process engine per draft depth; then, with `along_vllm`,
the target's states along vLLM's greedy outputs (eaglelab.data.vllm_capture.capture_outputs: the simulated evaluator
drafts along the very tokens vLLM produced, so the two differ by the drafter's numerics alone); then, where asked,
decode speed as served (eaglelab.evaluate.serving).

Each engine is built and dropped inside one call, then collected, so two engines never coexist: vLLM's in-process
distributed state is per process, and a late finaliser would tear down the next engine's.
"""

from __future__ import annotations

import dataclasses
import gc
import traceback
from pathlib import Path

from eaglelab.data.vllm_capture import capture_outputs
from eaglelab.engine.jobs import EvaluateJob
from eaglelab.engine.llm import complete, make_engine, tails
from eaglelab.engine.process import cuda_available, progress
from eaglelab.evaluate.serving import served_throughput


def evaluate(job: EvaluateJob) -> dict:
    """-> {"acceptance": [{group, k, temperature, drafts, accepted, accepted_per_pos, outputs[, sequence_rows]}],
    "throughput": [one row per timed pass (eaglelab.evaluate.serving)]}."""
    if job.along_vllm:
        job = dataclasses.replace(job, with_tails=True)  # (what a verifier scores drafts past each end against)
    result = {"acceptance": [], "throughput": []}
    ks = sorted(job.ks)
    then = job.served or bool(job.along_vllm)
    for i, k in enumerate(ks):  # one in-process engine per depth: counters and outputs (the process exits after
        result["acceptance"] += acceptance_at(job, k, teardown=then or i < len(ks) - 1)  # the last: no teardown)
    if job.along_vllm:
        capture_or_log(job, result["acceptance"])
    if job.served:  # then served: no speculation, then each timed depth
        if cuda_available():  # what the in-process engines' allocator kept is the servers' to use
            import torch

            torch.cuda.empty_cache()
        for k in [None, *sorted(job.throughput_ks)]:
            result["throughput"] += served_throughput(job, k, Path(job.log_dir))
    return result


def acceptance_at(job: EvaluateJob, k: int, teardown: bool = True) -> list[dict]:
    """One engine drafting k tokens -> its acceptance rows."""
    llm = make_engine(job, k)
    rows = acceptance(llm, job, k)
    greedy = [r for r in rows if r["temperature"] == 0]
    drafts, accepted = sum(r["drafts"] for r in greedy), sum(r["accepted"] for r in greedy)
    progress(f"k={k}: tau={1 + accepted / max(drafts, 1):.3f}")
    if teardown:  # ~2 s: the next engine (or a server) may start only once this one's distributed state is gone
        del llm
        gc.collect()
    return rows


def acceptance(llm, job: EvaluateJob, k: int) -> list[dict]:
    """Counters per prompt group and temperature at draft depth k (greedy first; `temperatures` adds speculative
    sampling): vLLM's counters are cumulative, so each pass's share is the difference across its generate call."""
    rows, before = [], spec_counters(llm, k)
    for temperature in job.temperatures or [0.0]:
        for name, group in job.groups.items():
            outs = complete(llm, group["prompts"], group["max_tokens"], job.stop_token_ids, temperature=temperature)
            after = spec_counters(llm, k)
            rows.append(
                {
                    "group": name,
                    "k": k,
                    "temperature": temperature,
                    "drafts": after[0] - before[0],
                    "accepted": after[1] - before[1],
                    "accepted_per_pos": [a - b for a, b in zip(after[2], before[2])],
                    "outputs": outs,
                }
            )
            if temperature == 0 and job.with_tails:  # (after the counters: no part of the measurement)
                rows[-1]["tails"] = tails(llm, group["prompts"], outs, k, job.max_model_len)
            before = spec_counters(llm, k)
    return rows


def _counter(metrics: dict, name: str, k: int | None = None):
    m = metrics.get(name)
    if m is None:
        return [0] * k if k else 0
    return list(m.values) if hasattr(m, "values") else m.value  # per-position counters are vectors


def spec_counters(llm, k: int) -> tuple[int, int, list[int]]:
    """vLLM's cumulative (drafts, accepted tokens, accepted tokens per position) of this engine."""
    metrics = {m.name: m for m in llm.get_metrics()}
    return (
        int(_counter(metrics, "vllm:spec_decode_num_drafts")),
        int(_counter(metrics, "vllm:spec_decode_num_accepted_tokens")),
        [int(x) for x in _counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos", k)],
    )


def capture_or_log(job: EvaluateJob, rows: list[dict]) -> None:
    """capture_outputs, whose failure costs the parity along vLLM and nothing else of the evaluation: the error goes
    to the engine's log, and no complete store tells the caller (eaglelab.evaluate.held_out.along_vllm)."""
    try:
        capture_outputs(job, rows)
    except Exception:  # noqa: BLE001 (any: the counters and the timed passes must survive it)
        traceback.print_exc()
        progress("capture along vLLM's outputs failed (see vllm.log)")
        gc.collect()
