"""The plan of a run on a cluster (`stage=plan`): what it will need, printed before any weight is loaded.

    python src/run.py +recipe=llama3_8b stage=plan plan.gpu=H100 plan.gpus=8
    python src/run.py +recipe=kimi_k2 stage=plan plan.gpu=GB200 plan.gpus=4

A team about to ask for GPU-days reads here, from the run's own config and the target's shape alone (a recipe writes
the target's config.json in as `target.config`; an HF folder's config.json is read; no weight, prompt or tokenizer is
touched), which GPUs its engines and its trainers take, the memory each holds, the disk or store bytes of its
states, and the hours at a stated share of the GPU's dense bf16 peak. Every figure comes from FLOPs and bytes:

    target      parameters counted on the meta device (`transformers` builds the model without memory): total,
                routed experts, and active = the rest (less the embedding table, a lookup) + experts × (experts
                per token / experts), each multiplied once a token (2 FLOPs a parameter); weight bytes from
                the checkpoint's dtype or quantisation (fp8: 1 byte a linear weight, mxfp4: 4.25 bits an expert's).
    engines     the smallest tensor-parallel size (a power of two within a node; more nodes by pipeline stages)
                whose weight share is at most ENGINE_WEIGHT_SHARE of a GPU: vLLM's default 0.9 of memory, less
                a KV cache and activations for its batch.
    capture     prefill at U × peak over 2 × active parameters a token (the states of a given response are one
                forward); regeneration decodes DECODE_BATCH sequences per engine, each step the slower of reading
                the weights (bandwidth) and 2 × active × batch FLOPs.
    training    the drafter's FLOPs a token (`costs.drafter_flops_per_token`: 6 × parameters × TTT steps, attention
                left out) at U × peak; memory per trainer GPU from the same model as the preflight
                (`costs.train_bytes`, its batch at data.max_length).
    split       features=cached|hybrid|online: the data stage takes every GPU as engines, then training takes every
                GPU; features=stream: engines and trainers at once, engines sized so that their capture keeps up
                with the trainers (a target that does not fit the GPUs given is planned on engine nodes of its own).

The token count is an upper bound (every sample at data.max_length) unless `plan.mean_tokens` says how long a sample
is on average. U is `plan.utilization`; tests/test_plan.py checks the figures against hand counts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from eaglelab.core.config import STATES_ON_DISK, PlanConfig, RunConfig
from eaglelab.core.errors import ConfigError, EaglelabError
from eaglelab.core.io import size_text
from eaglelab.data.store import state_bytes
from eaglelab.data.targets import default_aux_layer_ids, load_target
from eaglelab.models.drafter import Eagle3Config
from eaglelab.plan.costs import (
    ALLOCATOR_SLACK,
    PromptSet,
    TargetShape,
    drafter_flops_per_token,
    train_bytes,
)

# What the engines' weights may take of a GPU: vLLM reserves 0.9 of its memory, and the rest of that share holds
# the KV cache of its batch and the activations (an 8B engine at 0.6 keeps ~30 GB of an H100 for KV: 230k tokens).
ENGINE_WEIGHT_SHARE = 0.6
DECODE_BATCH = 256  # sequences an engine decodes at once while it regenerates (vLLM's default max_num_seqs)


@dataclass(frozen=True)
class Gpu:
    """A GPU as its datasheet gives it: memory, dense bf16 peak (no sparsity), HBM bandwidth, GPUs a node (the
    NVLink domain a tensor-parallel engine stays in)."""

    name: str
    memory_gb: float
    bf16_tflops: float
    hbm_tb_s: float
    per_node: int


GPUS = {
    "A100": Gpu("A100 SXM 80 GB", 80, 312, 2.04, 8),
    "H100": Gpu("H100 SXM", 80, 989.4, 3.35, 8),
    "H200": Gpu("H200 SXM", 141, 989.4, 4.8, 8),
    "B200": Gpu("B200 (HGX)", 180, 2250, 8.0, 8),
    "GB200": Gpu("GB200 (a compute tray's B200)", 186, 2500, 8.0, 4),
}
QUANTIZED_BYTES = {"fp8": 1.0, "mxfp4": 4.25 / 8}  # a quantised weight's bytes (mxfp4: 4 bits + an 8-bit scale per 32)


@dataclass(frozen=True)
class TargetSize:
    parameters: float
    active: float  # parameters a token is multiplied by (a dense model's all but its embedding table)
    weight_bytes: float
    kv_bytes_per_token: float  # the engine's KV cache (MLA: the latent and its RoPE key)


def target_config(cfg: RunConfig):
    """The target's Hugging Face config, without its weights: written into the run's config (a recipe's
    `target.config`), or read from its folder's config.json."""
    from transformers import AutoConfig

    written = cfg.target.config
    if written:
        values = dict(written)
        if "model_type" not in values:
            raise ConfigError("target.config needs model_type (e.g. llama, qwen3, qwen3_moe, gpt_oss, deepseek_v3)")
        return AutoConfig.for_model(values.pop("model_type"), **values)
    try:  # the target's folder: its config.json and tokenizer, never its weights
        return load_target(cfg.target, cfg.paths.cache_dir).config
    except EaglelabError as e:
        raise ConfigError(
            f"stage=plan needs the target's shape without its weights, and {e}: use a recipe (+recipe=llama3_8b, "
            "conf/recipe/), or write target.config={model_type: ..., hidden_size: ...}"
        ) from None


def target_size(config) -> TargetSize:
    """Parameters (total and active), weight bytes and KV bytes a token, counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = routed = quantizable = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".experts." in name:  # routed experts (shared experts are named shared_experts: always active)
            routed += p.numel()
        if p.dim() >= 2 and "embed" not in name and "lm_head" not in name:
            quantizable += p.numel()
    experts = _first(config, "n_routed_experts", "num_experts", "num_local_experts")
    per_token = getattr(config, "num_experts_per_tok", None)
    table = model.get_input_embeddings().weight.numel()  # read a row a token, never multiplied: no FLOPs
    active = total - table - routed + (routed * per_token / experts if experts and per_token else routed)
    dtype_bytes = torch.finfo(getattr(config, "dtype", None) or torch.bfloat16).bits / 8
    quant = (getattr(config, "quantization_config", None) or {}).get("quant_method")
    if quant == "fp8":  # every linear weight in 8 bits (the embeddings, head and norms in 16)
        weights = quantizable * QUANTIZED_BYTES["fp8"] + (total - quantizable) * dtype_bytes
    elif quant == "mxfp4":  # the routed experts in 4 bits
        weights = routed * QUANTIZED_BYTES["mxfp4"] + (total - routed) * dtype_bytes
    elif quant is None:
        weights = total * dtype_bytes
    else:
        raise ConfigError(f"stage=plan knows fp8 and mxfp4 checkpoints, not quant_method={quant!r}")
    layers = config.num_hidden_layers
    if getattr(config, "kv_lora_rank", None):
        kv = layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 2
    else:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv = layers * 2 * (getattr(config, "num_key_value_heads", None) or heads) * head_dim * 2
    return TargetSize(float(total), float(active), float(weights), float(kv))


def _n(count: int, thing: str) -> str:
    return f"{count} {thing}" + ("" if count == 1 else "s")


def _count(n: float) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.1f} M" if n >= 1e6 else f"{n:,.0f}"


def hours(seconds: float) -> str:
    if seconds >= 3600 or seconds != seconds:  # (nan: no engine to time)
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 60:,.1f} min" if seconds >= 60 else f"{seconds:,.0f} s"


def _first(config, *names):
    return next((getattr(config, n) for n in names if getattr(config, n, None)), None)


@dataclass(frozen=True)
class EngineShape:
    tensor_parallel: int
    pipeline_parallel: int

    @property
    def gpus(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


def engine_shape(size: TargetSize, gpu: Gpu) -> EngineShape:
    """The smallest engine that holds the target: TP a power of two within a node, then pipeline stages of a node."""
    budget = ENGINE_WEIGHT_SHARE * gpu.memory_gb * 1e9
    tp = 1
    while size.weight_bytes / tp > budget and tp < gpu.per_node:
        tp *= 2
    pp = max(1, math.ceil(size.weight_bytes / (tp * budget)))
    return EngineShape(tp, pp)


@dataclass
class Plan:
    lines: list[str]
    seconds: float  # how long the plan took to make


@dataclass(frozen=True)
class Rates:
    """Tokens a second at the stated share of peak: one GPU's capture (a forward over a given sequence), one engine's
    regeneration (a decode step reads every weight once and computes DECODE_BATCH tokens), one trainer GPU's."""

    capture: float
    decode: float
    train: float

    @classmethod
    def of(cls, size: TargetSize, engine: EngineShape, gpu: Gpu, utilization: float, drafter_flops: float) -> Rates:
        peak = utilization * gpu.bf16_tflops * 1e12
        step_s = max(
            size.weight_bytes / (engine.gpus * gpu.hbm_tb_s * 1e12),
            2 * size.active * DECODE_BATCH / (engine.gpus * peak),
        )
        return cls(capture=peak / (2 * size.active), decode=DECODE_BATCH / step_s, train=peak / drafter_flops)


def split(cfg: RunConfig, engine: EngineShape, rates: Rates) -> tuple[int, int, bool]:
    """(engine GPUs, trainer GPUs, whether the engines are on nodes of their own). Cached, online and hybrid
    features prepare the data on every GPU and then train on every GPU; a stream runs both at once, with as many
    engines as keep up with the trainers (capture × engines ≥ training × trainers). A target that does not fit the
    GPUs given, or `plan.engine_gpus`, puts the engines on nodes of their own."""
    G, asked = cfg.plan.gpus, cfg.plan.engine_gpus
    apart = engine.gpus > G or asked is not None
    if cfg.features.kind != "stream":
        return asked or (G // engine.gpus) * engine.gpus, G, apart
    if apart:
        return asked or engine.gpus * max(1, math.ceil(G * rates.train / rates.capture / engine.gpus)), G, True
    share = rates.train / (rates.train + rates.capture)
    engines = min(G - 1, engine.gpus * max(1, math.ceil(G * share / engine.gpus)))
    return engines, G - engines, False


def plan(cfg: RunConfig) -> Plan:
    """The plan's lines for `cfg` on plan.gpus × plan.gpu (the module's docstring says what each rests on)."""
    t0 = time.perf_counter()
    p: PlanConfig = cfg.plan
    if p.gpu not in GPUS:
        raise ConfigError(f"plan.gpu={p.gpu} is not known: one of {', '.join(GPUS)}")
    gpu, G, U = GPUS[p.gpu], p.gpus, p.utilization
    config = target_config(cfg)
    size = target_size(config)
    aux = cfg.drafter.aux_layer_ids or default_aux_layer_ids(config.num_hidden_layers)
    max_context = int(getattr(config, "max_position_embeddings", cfg.data.max_length))
    d = Eagle3Config.for_target(
        cfg.drafter, config, aux_layer_ids=aux, draft_vocab_size=cfg.drafter.draft_vocab_size, max_context=max_context
    )
    data, train, kind = cfg.data, cfg.train, cfg.features.kind
    T = min(data.max_length, max_context)
    mean = min(p.mean_tokens or T, T)
    samples = data.num_prompts + data.val_prompts
    tokens, new_tokens = samples * mean, samples * min(data.max_new_tokens, mean)
    engine = engine_shape(size, gpu)
    flops = drafter_flops_per_token(cfg, d)
    rates = Rates.of(size, engine, gpu, U, flops)
    engines, trainers, apart = split(cfg, engine, rates)
    out = [
        f"target: {cfg.recipe.name or cfg.target.name_or_path or cfg.target.kind} ({_count(size.parameters)} "
        f"parameters, {_count(size.active)} active a token; weights {size_text(size.weight_bytes)}; "
        f"KV {size_text(size.kv_bytes_per_token)} a token) on {G} × {gpu.name} ({gpu.memory_gb:.0f} GB, "
        f"{gpu.bf16_tflops:,.0f} TFLOP/s bf16 dense, {gpu.hbm_tb_s} TB/s)",
        f"data: {samples:,} samples × {'≤ ' if not p.mean_tokens else '~'}{mean:,} tokens = "
        f"{_count(tokens)} tokens ({_count(new_tokens)} of them regenerated), features={kind}",
        _engine_line(config, size, engine, gpu, rates),
    ]

    # The engines (none where the target needs more GPUs than these and no engine nodes are named)
    if engines < engine.gpus:
        out.append(f"engines: the target needs {engine.gpus} GPUs of this type: more than the {G} given; plan them on "
                   f"engine nodes with plan.engine_gpus={engine.gpus} (or more)")  # fmt: skip
        engines = 0
    else:
        where = "on engine nodes of their own" if apart else f"of the {G}"
        out.append(f"engines: {engines} GPUs {where} ({_n(engines // engine.gpus, 'engine')} of {engine.gpus})")

    # The trainers: the preflight's own memory model, its batch at the run's longest sequence
    batch = PromptSet("train", 1, T - min(data.max_new_tokens, T // 2), T, min(data.max_new_tokens, T), "plan")
    shape = TargetShape.of_config(config, dtype_bytes=2, max_context=max_context)
    memory = train_bytes(cfg, shape, d, batch, ALLOCATOR_SLACK["cuda"], torch.device("cuda"))
    memory += size.weight_bytes if kind in ("online", "hybrid") else 0  # (the target computes states in each trainer)
    fits = memory <= 0.95 * gpu.memory_gb * 1e9
    out.append(
        f"trainers: {_n(trainers, 'rank')}; the drafter ({_n(d.num_layers, d.layer + ' layer')}, "
        f"TTT {train.ttt_steps}, {flops / 1e9:.1f} GFLOP a token) trains {rates.train / 1e3:,.1f}k tokens/s a GPU; "
        f"{size_text(memory)} a GPU at T = {T:,} ({'fits' if fits else 'does NOT fit'} in {gpu.memory_gb:.0f} GB"
        + ("" if fits else ": lower train.tokens_per_batch or data.max_length, or set train.activation_checkpointing")
        + ")"
    )

    # Bytes: the cached states on disk, or a stream's token ids and the states in flight
    per_token = state_bytes(len(d.aux_layer_ids), d.target_hidden_size, train.distills or data.keep_final) + 4
    if kind in STATES_ON_DISK:
        out.append(f"disk: {size_text(tokens * per_token)} of states ({per_token:,} bytes a token) in the cache")
    else:
        window = cfg.features.stream.window_gb
        out.append(
            f"disk: token ids only ({size_text(tokens * 8)})"
            + (f"; the store: {window:g} GB of states in flight (features.stream.window_gb: "
               f"{window * 1e9 / (mean * per_token):,.0f} samples of ~{mean:,} tokens)" if kind == "stream" else "")
        )  # fmt: skip

    # Hours: the data stage, then training; a stream's epochs at the pace of the slower side
    regenerate = new_tokens / (rates.decode * (engines // engine.gpus)) if engines else math.nan
    if kind == "stream":
        feed = rates.capture * engines if engines else math.nan
        streamed = tokens * train.epochs / min(feed, rates.train * trainers)  # (every epoch streamed again)
        total = regenerate + streamed
        out.append(
            f"time at {U:.0%} of peak: regenerate {hours(regenerate)}, then {_n(train.epochs, 'epoch')} streamed "
            f"{hours(streamed)} (engines feed {feed / 1e3:,.1f}k tokens/s, trainers take "
            f"{rates.train * trainers / 1e3:,.1f}k): {hours(total)}, {total * (engines + trainers) / 3600:,.0f} "
            "GPU-hours"
        )
    else:
        capture = tokens / (rates.capture * engines) if engines and kind in STATES_ON_DISK else 0.0
        trained = tokens * train.epochs / (rates.train * trainers)
        total = regenerate + capture + trained
        out.append(
            f"time at {U:.0%} of peak: regenerate {hours(regenerate)}"
            + (f", capture {hours(capture)}" if kind in STATES_ON_DISK else "")
            + f", train {_n(train.epochs, 'epoch')} {hours(trained)}: {hours(total)} on {G} GPUs, "
            f"{total * G / 3600:,.0f} GPU-hours"
        )
    out += [
        f"published: τ {r.acceptance_length:.2f} at k = {r.k} on {r.benchmark} ({r.source}): what this recipe's "
        "drafter should reach"
        for r in cfg.recipe.published
    ]
    out.append(
        f"assumed: {U:.0%} of the dense bf16 peak (plan.utilization), engines' weights ≤ {ENGINE_WEIGHT_SHARE:.0%} of "
        f"a GPU, {DECODE_BATCH} sequences a decoding engine, a pipelined engine's stages all busy, drafter "
        "attention FLOPs left out (they grow with T)"
    )
    return Plan(out, time.perf_counter() - t0)


def _engine_line(config, size: TargetSize, engine: EngineShape, gpu: Gpu, rates: Rates) -> str:
    weights = size.weight_bytes / engine.gpus
    kv_room = max(0.9 * gpu.memory_gb * 1e9 - weights, 0.0)  # (vLLM's default share of the GPU, less the weights)
    # A token's KV is split over the pipeline's stages (their layers) and, but for MLA's latent, which every
    # tensor-parallel rank keeps whole, over the TP ranks (their heads)
    kv_split = engine.pipeline_parallel * (1 if getattr(config, "kv_lora_rank", None) else engine.tensor_parallel)
    return (
        f"engine: TP {engine.tensor_parallel}"
        + (f" × PP {engine.pipeline_parallel}" if engine.pipeline_parallel > 1 else "")
        + f" = {_n(engine.gpus, 'GPU')} on {_n(math.ceil(engine.gpus / gpu.per_node), 'node')}; "
        f"{size_text(weights)} of weights a GPU, {size_text(kv_room)} left for KV "
        f"(~{kv_room * kv_split / size.kv_bytes_per_token / 1e3:,.0f}k tokens an engine); "
        f"captures {rates.capture * engine.gpus / 1e3:,.1f}k tokens/s, regenerates {rates.decode / 1e3:,.1f}k "
        f"tokens/s at {DECODE_BATCH} sequences"
    )
