"""The cost model of a run: the memory each stage adds at its peak, the disk and read bandwidth of its training data,
the device time of its work, all computed from the configs and the target's shape before any weight is loaded.

Memory model. The peak of this process is what it holds when the check runs (measured: resident memory, which
includes the imports, and the target's model if it is loaded already; on a GPU the memory torch has reserved there)
plus the largest of what each stage adds on top, each counted from what the code keeps alive at its worst moment. A
stage that runs the HF target here (HF regeneration or capture, online or hybrid training) also adds the target's
weights while they are not loaded yet (`Target.weights_bytes`: they load when that stage first needs them):

    regenerate  HF generate (`data.regen_backend=hf`; vLLM generates in its own process): the KV cache of a batch
                of data.regen_batch_size sequences, the prefill's eager attention scores and MLP of one layer,
                and the states captured in the same pass;
    capture     (HF capture only: vLLM captures in its own process) one whole-sequence forward of up to 4 sequences
                and 8192 tokens (`shards.batches`): one layer's activations, the aux states the hooks keep, the
                logits of the labelled positions;
    train       the drafter, its gradients and AdamW's two moments, and what autograd keeps for one batch of
                train.batch_size sequences (under train.tokens_per_batch, as many of the longest as the budget
                spans: `batch_rows`) over train.ttt_steps draft steps (`ttt_kept_bytes`) plus what the
                unroll holds besides (`unroll_alive_bytes`); with online or hybrid features the target's forward
                over that batch; validation unrolls 2·ttt_steps steps without gradients; on a CPU with 16-bit
                matmul kernels, what oneDNN keeps per matmul shape (`kernel_cache_bytes`);
    evaluate    the simulated evaluator's unroll to max_k draft steps (float32, no gradients) over a batch of the
                held-out sequences, or of a suite's.

A stage's working set is multiplied by the allocator's slack (`ALLOCATOR_SLACK`, measured). Sequence lengths come
from the prompts themselves, templated as regeneration will template them (`prompt_sets`): the longest prompt
plus its max_new_tokens, at most data.max_length; every batch is taken to be as long as the longest sequence.
"""

from __future__ import annotations

import itertools
import logging
import os
import resource
import sys
from dataclasses import dataclass, field, replace

import torch

from eaglelab.core.config import (
    STATES_ON_DISK,
    TARGET_IN_TRAINING,
    RunConfig,
    max_k,
    on_cuda,
    resolve_capture_backend,
)
from eaglelab.core.devices import cpu_bf16_kernels
from eaglelab.core.io import size_text
from eaglelab.data.stage import online_final, training_entry
from eaglelab.data.store import state_bytes
from eaglelab.data.stream import STORE_FILL
from eaglelab.data.targets import Target, free_memory, proc_bytes
from eaglelab.data.templates import renderer
from eaglelab.data.turns import history, is_multi_turn, longest_prompt, rounds
from eaglelab.models.drafter import Attention, Eagle3Config
from eaglelab.train.loss import chunk_rows, chunks_cost_more, keeps_teacher

log = logging.getLogger("eaglelab")
GB = 1e9
# A step's memory at its peak over what it holds: the allocator's slack (glibc's heap keeps freed fragments, CUDA's
# caching allocator rounds and splits blocks) and the transients beside the largest one counted. Measured on the
# CPU: 1.11-1.19 over training steps of the SmolLM2 drafter of one shape (B 2-16, T 256-1024, 1-8 draft steps);
# not measured on a GPU, taken the same.
ALLOCATOR_SLACK = {"cpu": 1.2, "cuda": 1.2}
KERNELS_PER_NEW_BATCH = 22_000_000  # oneDNN's compiled kernels for one batch of new shapes (measured, SmolLM2 drafter)
# After how many batches of new lengths a CPU training process under 16-bit autocast stops growing, by the
# instructions the CPU computes bfloat16 matmuls with (`devices.cpu_bf16_kernels`). The growth is a property of the
# CPU's 16-bit matmul path, oneDNN and glibc's heap (its dynamic mmap threshold keeps freed blocks of each new size;
# most of it is that, not oneDNN's kernels), so each entry is a reading of `make run` (192 new lengths) on one CPU:
#   AMX     an AMX Xeon: 5.1 GB peak; it levels off after ~64 batches (3.7 GB after 120-140 new row counts,
#           +0.4 GB over the next 20), where counting all 192 gave 13.5 GB;
#   AVX512  a Zen 4 EPYC (AVX512-BF16, no AMX): 3.87 GB peak where counting all 192 gave 13.18 GB: with the same
#           growth per batch (assumed: only the peak was read), it levelled off after ~40;
#   neither no 16-bit matmul kernels (AVX2, or AVX512 without BF16): `train.precision=auto` trains in float32 there,
#           and float32 keeps nothing per shape (benchmarks/memory_estimate.py on an AVX2 EPYC).
# Another CPU of a listed kind takes its entry; benchmarks/memory_estimate.py measures one.
KERNEL_BATCHES_MAX = {"AMX": 64, "AVX512": 40}
CAPTURE_TOKENS = 8192  # eaglelab.data.shard_claims.batches: padded tokens per whole-sequence capture forward
CAPTURE_BATCH = 4  # CaptureSettings.capture_batch_size


# --- precision -----------------------------------------------------------------------------------------------
LEGACY_PRECISIONS = {16: "16-mixed", "16": "16-mixed", "bf16": "bf16-mixed", 32: "32-true", 64: "64-true"}


def precision_name(precision: str | int) -> str:
    """Lightning's name for a train.precision value (16, 32, 64 and bf16 are its older spellings)."""
    return LEGACY_PRECISIONS.get(precision, str(precision))


def activation_bytes(precision: str | int) -> tuple[int, int]:
    """(bytes of a matmul's input and output, bytes of a residual-stream state) under a Lightning precision.
    Mixed precision autocasts matmuls to 16 bits; RMSNorm computes in float32 (`eaglelab.models.drafter.RMSNorm`)."""
    p = precision_name(precision)
    if p == "64-true":
        return 8, 8
    return (2, 4) if p.startswith(("bf16", "16")) else (4, 4)


def parameter_bytes(precision: str | int) -> int:
    """Bytes per parameter, gradient and Adam moment: 16 bits under *-true half precision, else float32 masters."""
    p = precision_name(precision)
    return {"bf16-true": 2, "16-true": 2, "64-true": 8}.get(p, 4)


# --- memory --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TargetShape:
    """The sizes of the target the memory terms are made of (from its config)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int
    max_context: int

    @classmethod
    def of(cls, target: Target) -> TargetShape:
        return cls.of_config(target.config, dtype_bytes=target.dtype.itemsize, max_context=target.max_context)

    @classmethod
    def of_config(cls, c, *, dtype_bytes: int, max_context: int) -> TargetShape:
        """From a Hugging Face config (a target's, or one a recipe writes in: eaglelab.plan.cluster)."""
        heads = c.num_attention_heads
        return cls(
            layers=c.num_hidden_layers,
            hidden=c.hidden_size,
            heads=heads,
            kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            intermediate=c.intermediate_size,
            vocab=c.vocab_size,
            dtype_bytes=dtype_bytes,
            max_context=max_context,
        )


@dataclass(frozen=True)
class PromptSet:
    """A prompt set this run regenerates, as far as memory goes: its longest prompt and sequence in tokens."""

    name: str  # "train", "held-out", "long_context", "templates"
    batch: int  # regeneration batch
    prompt: int  # longest prompt
    sequence: int  # longest prompt + response, at most the length limit
    response: int  # longest response
    bound: str  # what limits `sequence`, for an error line: "data.max_length=1024" or "sequences of up to 487 tokens"
    trained_on: int = 0  # sequences outside the validation split (the training set only)
    sequences: int = 0  # prompts kept (those with room for an answer)
    tokens_bound: int = 0  # their sequences' tokens at most: each prompt + its max_new_tokens, within the limit


def prompt_sets(
    cfg: RunConfig, target: Target, train_prompts: list, held_out_prompts: list, validation_prompts: list = ()
) -> list[PromptSet]:
    """The longest prompt of each set in the target's template (prompts that leave no room for an answer are
    skipped, as `eaglelab.data.render` skips them), and so the longest sequence regeneration can make. The
    training set is prepared from the training and validation prompts together."""

    data, suites = cfg.data, cfg.eval.suites
    native = renderer("native", data.system_prompt)
    sets = []

    def add(name, measured, max_new_tokens, limit, batch, at_limit, trained_on=0):
        kept = [(n, answers) for n, fits, answers in measured if fits]
        totals = {
            "sequences": len(kept),
            "tokens_bound": sum(min(n + max_new_tokens, limit) for n, _ in kept),
        }
        if kept:
            prompt = min(max(n for n, _ in kept), limit - 8)  # (a conversation answered turn by turn: up to the limit)
            sequence = min(prompt + max_new_tokens, limit)
            bound = at_limit if sequence == limit else f"sequences of up to {sequence} tokens"
            # Labelled positions: the last answer, and each earlier one the target gave in turn (data.turns=all), a
            # span inside the prompt at up to its budget; never more than the sequence.
            answers = max(a for _, a in kept)
            response = min(min(max_new_tokens, sequence - prompt) + (answers - 1) * max_new_tokens, sequence)
            sets.append(PromptSet(name, batch, prompt, sequence, response, bound, trained_on, **totals))

    # As eaglelab.data.render keeps and sizes a prompt: it leaves room for an answer; a training conversation the
    # target answers turn by turn (data.turns=all) when its first round does, sized by its longest last prompt.
    def measure(prompts, render, max_new_tokens: int, limit: int, turn_by_turn: bool = False) -> list[tuple]:
        """(length, whether it fits, the answers it is trained on) of each prompt, each read and rendered once (a
        streamed source's conversations are not held)."""
        out = []
        for messages in prompts:
            if turn_by_turn and is_multi_turn(messages):
                n = longest_prompt(messages, lambda m: render(target.tokenizer, m), max_new_tokens)
                answered = rounds(messages)
                first = len(native(target.tokenizer, history(messages, answered[0], [])))
                out.append((n, first + 8 <= limit, len(answered)))
            else:
                n = len(render(target.tokenizer, messages))
                out.append((n, n + 8 <= limit, 1))
        return out

    limit, at_limit = min(data.max_length, target.max_context), f"data.max_length={data.max_length}"
    turns = data.turns == "all" and data.responses == "regenerate"
    measured = measure(itertools.chain(train_prompts, validation_prompts), native, data.max_new_tokens, limit, turns)
    trained_on = sum(fits for _, fits, _ in measured[: len(train_prompts)])
    batch = data.regen_batch_size
    add("train", measured, data.max_new_tokens, limit, batch, at_limit, trained_on)
    held_out = measure(held_out_prompts, native, cfg.eval.max_new_tokens, limit)
    add("held-out", held_out, cfg.eval.max_new_tokens, limit, data.regen_batch_size, at_limit)
    if suites.templates.enabled:  # the held-out prompts under every condition, in the target's whole window
        for condition in suites.templates.conditions:
            render = renderer(condition, data.system_prompt)
            window = target.max_context
            add(
                "templates", measure(held_out_prompts, render, suites.templates.max_new_tokens, window),
                suites.templates.max_new_tokens, window, data.regen_batch_size,
                f"the target's window of {window} tokens",
            )  # fmt: skip
    lc = suites.long_context
    if lc.enabled:  # prompts built to each length, clipped to the window
        prompt = min(max(lc.lengths), target.max_context - lc.max_new_tokens - 8)
        batch = min(data.regen_batch_size, lc.num_prompts)
        bound = f"eval.suites.long_context.lengths up to {max(lc.lengths)}"
        sets.append(PromptSet("long_context", batch, prompt, prompt + lc.max_new_tokens, lc.max_new_tokens, bound))
    return sets


# --- the training data's disk and read bandwidth -----------------------------------------------------------------
# The training rate per GPU the read-bandwidth line assumes: this share of a bf16 dense peak (the H100's and H200's,
# 989.4 TFLOP/s) on the drafter's dense FLOPs. benchmarks/step_scaling.py measured the 8B drafter's step at 24-41 % of
# that peak on an H200; 35 % is taken. A CPU run gets no such line (its rate is the run's own, time/train_s).
ASSUMED_UTILIZATION, PEAK_FLOPS = 0.35, 989.4e12


@dataclass(frozen=True)
class DataPlan:
    """What the training set costs in disk and reads (features=cached: its states; online: its token ids only),
    counted from its prompts before anything is regenerated: every response taken at its full budget, so the disk
    and read figures are upper bounds (responses that stop early make them smaller)."""

    sequences: int
    tokens: int  # at most: each prompt + its max_new_tokens, within data.max_length
    bytes_per_token: int  # on disk, and read per token: int32 ids (tokens), the int32 label and the states' bf16 bits
    epoch_read: int  # bytes an epoch reads: the tokens and states of the training split
    step_tokens: int  # tokens a step trains on, per rank
    flops_per_token: float  # the drafter's dense FLOPs per trained token, forward and backward, all TTT steps
    on_gpu: bool

    @property
    def disk(self) -> int:
        return self.tokens * self.bytes_per_token

    def lines(self, free: int | None = None) -> list[str]:
        """The preflight's lines (`free`: the cache's free bytes, said beside its need when given)."""
        out = [
            f"the training set holds at most {size_text(self.disk)} in the cache ({self.sequences:,} sequences, "
            f"≤ {self.tokens:,} tokens × {self.bytes_per_token:,} bytes)"
            + (f"; {size_text(free)} free there" if free is not None else ""),
            f"an epoch reads at most {size_text(self.epoch_read)}; a step of {self.step_tokens:,} tokens reads "
            f"{size_text(self.step_tokens * self.bytes_per_token)} per rank",
        ]
        if self.on_gpu:
            rate = ASSUMED_UTILIZATION * PEAK_FLOPS / self.flops_per_token
            out.append(
                f"at {rate / 1e3:,.0f}k tokens/s per GPU ({ASSUMED_UTILIZATION:.0%} of {PEAK_FLOPS / 1e12:.0f} "
                f"TFLOP/s on the drafter's {self.flops_per_token / 1e9:.1f} GFLOP a token) each GPU reads "
                f"{size_text(rate * self.bytes_per_token)}/s"
            )
        return out


def data_plan(cfg: RunConfig, d: Eagle3Config, train: PromptSet) -> DataPlan:
    """The training set's disk and read figures for this run (`train`: its prompts, as `prompt_sets` counts them)."""

    with_final = training_entry(cfg)["with_final"]
    on_disk = cfg.features.kind in STATES_ON_DISK
    states = state_bytes(len(d.aux_layer_ids), d.target_hidden_size, with_final) if on_disk else 0
    mean = train.tokens_bound / max(train.sequences, 1)
    step = cfg.train.tokens_per_batch or int(cfg.train.batch_size * mean)
    return DataPlan(
        sequences=train.sequences,
        tokens=train.tokens_bound,
        bytes_per_token=4 + states,
        epoch_read=int(train.tokens_bound * train.trained_on / max(train.sequences, 1)) * (4 + states),
        step_tokens=step,
        flops_per_token=drafter_flops_per_token(cfg, d),
        on_gpu=on_cuda(cfg.train.accelerator),
    )


def drafter_flops_per_token(cfg: RunConfig, d: Eagle3Config) -> float:
    """The drafter's dense FLOPs per trained token, forward and backward (6 × parameters), over its TTT steps: fc
    once (step 1's input), the decoder layer(s) and the LM head at every step; attention's FLOPs left out."""
    fc = len(d.aux_layer_ids) * d.target_hidden_size * (d.hidden_size + 1)
    per_step = _trainable_parameters(d) - fc - d.hidden_size
    return float(6 * (fc + cfg.train.ttt_steps * per_step))


@dataclass(frozen=True)
class StageCost:
    """What one stage adds at its peak, and the settings that size it (for the error line)."""

    bytes: int
    sized_by: str  # e.g. "train.batch_size=64 × data.max_length=2048 × train.ttt_steps=12"
    fix: str  # e.g. "train.batch_size, data.max_length or train.ttt_steps"


@dataclass(frozen=True)
class MemoryEstimate:
    device: torch.device
    base: int  # bytes this process holds now (measured)
    free: int | None  # bytes free on the device now; None where it cannot be known
    stages: dict[str, StageCost] = field(default_factory=dict)

    @property
    def peak_stage(self) -> str:
        return max(self.stages, key=lambda s: self.stages[s].bytes)

    @property
    def peak(self) -> int:
        return self.base + (self.stages[self.peak_stage].bytes if self.stages else 0)

    def metrics(self) -> dict[str, float]:
        return {"memory/estimate_gb": round(self.peak / GB, 3)}

    def __str__(self) -> str:
        free = "unknown" if self.free is None else f"{self.free / GB:.1f} GB"
        stages = ", ".join(f"{name} +{cost.bytes / GB:.2f}" for name, cost in self.stages.items())
        return (
            f"~{self.peak / GB:.2f} GB at the peak on {self.device} ({self.base / GB:.2f} GB held now; {stages}); "
            f"{free} free"
        )


def estimate_memory(cfg: RunConfig, target: Target, drafter: Eagle3Config, sets: list[PromptSet]) -> MemoryEstimate:
    """This process's peak memory on the training device for this run (see the module's docstring)."""
    t, device, n_aux = TargetShape.of(target), target.device, len(drafter.aux_layer_ids)
    slack = ALLOCATOR_SLACK["cuda" if device.type == "cuda" else "cpu"]
    stages: dict[str, StageCost] = {}
    # A stage that runs the HF target in this process holds its weights too, once it has loaded them.
    weights = 0 if target.loaded else target.weights_bytes
    hf_regenerates = cfg.data.regen_backend == "hf" or (cfg.data.regen_backend == "auto" and not _vllm_installed())
    regen = "hf" if hf_regenerates else "vllm"
    hf_captures = resolve_capture_backend(cfg.data.capture_backend, regen, torch.cuda.is_available()) == "hf"
    if sets and hf_regenerates:
        worst = max(sets, key=lambda s: regeneration_bytes(t, n_aux, s.batch, s.prompt, s.sequence))
        stages["regenerate"] = StageCost(
            weights + int(slack * regeneration_bytes(t, n_aux, worst.batch, worst.prompt, worst.sequence)),
            f"data.regen_batch_size={cfg.data.regen_batch_size} × {worst.bound} ({worst.name})",
            "data.regen_batch_size or data.max_length",
        )
    if sets and hf_captures:  # (a vLLM capture computes in the engine's process)
        worst = max(sets, key=lambda s: cached_capture_bytes(t, n_aux, s.sequence, s.response))
        stages["capture"] = StageCost(
            weights + int(slack * cached_capture_bytes(t, n_aux, worst.sequence, worst.response)),
            f"{worst.bound} ({worst.name})",
            "data.max_length",
        )
    train = next((s for s in sets if s.name == "train"), None) if cfg.stage == "all" else None
    if train is not None:
        batching = (
            f"train.tokens_per_batch={cfg.train.tokens_per_batch} ({batch_rows(cfg.train, train)} rows)"
            if cfg.train.tokens_per_batch
            else f"train.batch_size={cfg.train.batch_size}"
        )
        holds_target = cfg.features.kind in TARGET_IN_TRAINING  # (streamed states come from an engine's process)
        stream = stream_host_bytes(cfg, target.weights_bytes) if device.type == "cpu" else 0
        stages["train"] = StageCost(
            int(train_bytes(cfg, t, drafter, train, slack, device)) + (weights if holds_target else 0) + stream,
            f"{batching} × {train.bound} × train.ttt_steps={cfg.train.ttt_steps}"
            + (f" + the stream's store and engine ({stream / GB:.1f} GB)" if stream else ""),
            f"{batching.split('=')[0]}, data.max_length or train.ttt_steps"
            + (", features.stream.window_gb or features.stream.engine_launcher" if stream else ""),
        )
    if sets and cfg.stage == "all":  # on the training device, as training (the pipeline moves the drafter there)
        stages["evaluate"] = evaluation_cost(cfg, t, drafter, sets, slack)
    return MemoryEstimate(device, _held_now(device) + cublas_workspace_bytes(device), free_memory(device), stages)


def stream_host_bytes(cfg: RunConfig, target_weights: int) -> int:
    """Host memory a streamed run adds beside trainer rank 0 (features=stream): the store's memory (the window, with
    the room Mooncake's eviction needs: eaglelab.data.stream.STORE_FILL), and, with the engine on the same machine
    (no features.stream.engine_launcher), the target's weights in the engine's process."""
    if cfg.features.kind != "stream":
        return 0

    store = int(cfg.features.stream.window_gb * 1e9 / STORE_FILL)
    return store + (0 if cfg.features.stream.engine_launcher else target_weights)


def regeneration_bytes(t: TargetShape, n_aux: int, batch: int, prompt: int, sequence: int) -> int:
    """`eaglelab.data.regenerate.generate`, one batch: prompts of up to `prompt` tokens growing to `sequence`."""
    e = t.dtype_bytes
    kv_cache = batch * sequence * t.layers * 2 * t.kv_heads * t.head_dim * e
    # Eager attention of one prefill layer: scores in the target's dtype, softmax in float32, cast back.
    prefill = batch * t.heads * prompt * prompt * (e + 4 + e) + 3 * batch * prompt * t.intermediate * e
    captured = 2 * batch * sequence * (n_aux + 1) * t.hidden * e  # per step, then concatenated per sequence
    logits = batch * t.vocab * (e + 4)  # the last position's (logits_to_keep=1), for the greedy token
    return kv_cache + prefill + captured + logits


def capture_bytes(t: TargetShape, n_aux: int, tokens: int, labelled: int) -> int:
    """`eaglelab.data.capture.capture_states`: one forward of `tokens` padded positions without gradients (SDPA:
    no T×T scores): one layer's hidden states, q/k/v and MLP activations, the aux and final states the hooks
    keep, and the target's logits at the `labelled` positions (the responses')."""
    e = t.dtype_bytes
    layer = tokens * (4 * t.hidden + 2 * t.kv_heads * t.head_dim + 3 * t.intermediate) * e
    kept = tokens * (n_aux + 2) * t.hidden * e  # aux states, final, last hidden
    return layer + kept + labelled * (t.vocab + t.hidden) * e


def cached_capture_bytes(t: TargetShape, n_aux: int, longest: int, response: int) -> int:
    """Cached capture (`eaglelab.data.make_shards.capture_shards`): batches of up to 4 sequences and 8192 padded
    tokens."""
    per_batch = max(1, min(CAPTURE_BATCH, CAPTURE_TOKENS // longest))
    return capture_bytes(t, n_aux, per_batch * longest, per_batch * min(response, longest))


def ttt_kept_bytes(
    batch: int,
    length: int,
    steps: int,
    response: int,
    d: Eagle3Config,
    lowp: int,
    stream: int,
    checkpointing: bool = False,
    kl: bool = False,
) -> int:
    """What autograd keeps for the backward pass of one training batch (`DrafterModule.ttt` over
    `Eagle3Drafter.unroll`), term by term; counted by shape with torch.autograd.graph.saved_tensors_hooks
    (tests/test_limits.py, within 2%). B sequences of T positions (steps >= 2 run from the prompt's last token on:
    at most all T). Bytes per position, decoder layer and draft step j:

        7·H         residual-stream states: the RMSNorms' inputs and outputs (float32 under mixed precision)
        4·M         the MLP's gate, SiLU, up and product (M its width), in the autocast dtype, as are:
        12·H, 9·H   the projections' inputs (step 1 reads [embedding; hidden] into q/k/v; later steps less)
        4·d         the rotary embedding's cos and sin, for q and for k
        step 1:     fc's input (n_aux·H_t); what the fused kernel keeps: q and its output (2·h·d), k and v
                    (2·kv·d), one float32 log-sum-exp per head (4·h)
        step j>=2:  q, the j-1 own drafts' keys and values repeated to every head (2·(j-1)·h·d + h·d); the
                    kernel's padded q, k, v and output over T + 1 rows ((2·h + 2·kv)·(d + 8)) and its
                    log-sum-exp (4·h); float32: the own-draft scores, their softmax and log-sum-exp
                    (4·h·(2·(j-1) + 1)) and their weighted values (4·h·d)

    No term grows with T per position (`eaglelab.models.drafter.Attention`), except a sliding window's mask, float32
    [T + 1, T + 1] per layer and step. Per label and step (at most `response` - j per sequence), as
    `draft_loss.draft_head_loss` chooses: the gradient of lm_head's input taken in the forward pass, in the stream's
    dtype (H), and per step lm_head's float32 gradient (V_d·H); or, with few labels, the log-probabilities over the
    draft vocabulary in float32 (4·V_d; KL keeps the teacher's distribution too) and lm_head's input; and the labels'
    (row, position) indices. With
    activation checkpointing, a layer keeps only its inputs (the float32 embeddings and the hidden state) and one
    layer-step's share is rebuilt at a time in the backward pass."""
    B, T, H = batch, length, d.hidden_size
    per_step = layer_step_bytes(B, T, steps, d, lowp, stream)
    if checkpointing:  # the layers keep their inputs; one layer-step is rebuilt at a time in the backward pass
        aux = B * T * (4 + lowp) * len(d.aux_layer_ids) * d.target_hidden_size  # the states, fc's input
        # per step: the embeddings, each layer's input hidden state, the last one's output and its norm; step 1's
        # stream (fc's output, then the layer's sum) in the autocast dtype until the norm takes it to float32
        stream_states = steps * B * T * stream * H * (d.num_layers + 3) - 2 * B * T * H * (stream - lowp)
        layers = stream_states + aux + max(per_step)
    else:
        layers = d.num_layers * sum(per_step)
    labels = sum(B * max(response - j, 0) for j in range(1, steps + 1))
    V, head = d.draft_vocab_size, 0
    for j in range(1, steps + 1):  # per step, what `draft_head_loss` keeps, as it chooses
        n = batch * max(response - j, 0)
        if chunks_cost_more(n, V, H, kl):  # autograd's log-probabilities (KL: the teacher's too), lm_head's input
            head += n * (4 * V * (2 if kl else 1) + lowp * H)
        else:  # the gradient of lm_head's input and of lm_head (float32)
            head += n * stream * H + 4 * V * H
    return layers + head + 16 * labels  # (+ the labels' two int64 indices)


def as_plain_attention(d: Eagle3Config) -> Eagle3Config:
    """For the memory model: a latent-attention drafter (drafter.layer=mla) as the attention it trains as, every head
    with keys and values of its own at the query's width (qk_nope + qk_rope: the fused kernel's values are padded to
    it). The latents' own activations are left out: 3 % of what autograd keeps on the test's shape
    (tests/test_limits.py)."""
    if d.layer != "mla":
        return d
    return replace(d, num_key_value_heads=d.num_attention_heads, head_dim=d.qk_nope_head_dim + d.qk_rope_head_dim)


def layer_step_bytes(B: int, T: int, steps: int, d: Eagle3Config, lowp: int, stream: int) -> list[int]:
    """What one decoder layer keeps for backward at draft step j = 1..steps (`ttt_kept_bytes`'s terms)."""
    d = as_plain_attention(d)
    H, M, h, hd = d.hidden_size, d.intermediate_size, d.num_attention_heads, d.num_attention_heads * d.head_dim
    kvd, padded = d.num_key_value_heads * d.head_dim, (d.num_attention_heads + d.num_key_value_heads) * (d.head_dim + 8)
    n_aux_width = len(d.aux_layer_ids) * d.target_hidden_size
    window = 4 * (T + 1) ** 2 if d.attention_window is not None else 0
    per_step = [
        B * T * (stream * 7 * H + lowp * (4 * M + 12 * H + 2 * hd + 2 * kvd + 4 * d.head_dim) + 4 * h)
        + B * T * lowp * n_aux_width
        + window
    ]
    for j in range(2, steps + 1):
        own = lowp * (2 * (j - 1) * hd + hd) + 4 * h * (2 * (j - 1) + 1) + 4 * hd
        per_step.append(
            B * T * (stream * 7 * H + lowp * (4 * M + 9 * H + 4 * d.head_dim) + own)
            + B * (T + 1) * (lowp * 2 * padded + 4 * h)
            + window
        )
    return per_step


def unroll_alive_bytes(
    batch: int,
    length: int,
    steps: int,
    rows: int,
    d: Eagle3Config,
    lowp: int,
    stream: int,
    probed: bool = False,
    kl: bool = False,
) -> int:
    """What an unroll holds besides autograd's share (or, without gradients, all it holds): every step's
    states scattered to the full length (3 × [B, T, H]), the attention caches (k, v per step and layer), and the
    largest transient: the fused kernel's padded inputs and output over T + 1 rows, or the logits over the draft
    vocabulary: the loss's chunk of rows (`draft_loss.chunk_rows`, its buffers below) or, with few labels, all of a
    step's `rows` at once (the plain expression), or validation's drafts at a step's `rows` labelled positions (16
    bits each); and KL's teacher log-probabilities at every position where they are kept (`draft_loss.keeps_teacher`).
    `probed` (the drift suite): the explicit softmax instead, one query block's score chain at a time (scores,
    masked, concatenated) with the context's keys and values repeated to every head."""
    d = as_plain_attention(d)
    H, h, B, T = d.hidden_size, d.num_attention_heads, batch, length
    kv = d.num_key_value_heads * d.head_dim
    outs = 3 * steps * B * T * H * stream
    caches = d.num_layers * 2 * steps * B * T * kv * lowp
    if probed:
        context = 2 * B * T * h * d.head_dim * lowp
        attention = context + 3 * lowp * min(B * h * T * (T + steps), max(Attention.MAX_SCORES, B * h * T))
    else:
        attention = 2 * B * (T + 1) * (h + d.num_key_value_heads) * (d.head_dim + Attention.PAD) * lowp
        attention += 4 * (T + 1) ** 2 if d.attention_window is not None else 0  # the window's mask, float32
    V = d.draft_vocab_size
    # a chunk: 16 bits out of lm_head, its float32 buffer, the gradient cast back (KL: the teacher's logits, and its
    # log-probabilities and their exponentials in float32)
    chunk = (2 * lowp + 4) + (lowp + 8 if kl else 0)
    logits = max(rows * V * lowp, min(rows, chunk_rows(V, H)) * V * chunk)
    if chunks_cost_more(rows, V, H, kl=False):  # (few labels: the loss's plain expression, all rows at once)
        logits = max(logits, rows * V * (lowp + 4 + 4))
    teacher = 4 * B * T * V if kl and keeps_teacher(B * T, V) else 0  # KL's log-probabilities, kept for every step
    return outs + caches + teacher + max(attention, logits)


def train_bytes(
    cfg: RunConfig, t: TargetShape, d: Eagle3Config, data: PromptSet, slack: float, device: torch.device
) -> float:
    """The train stage: the drafter (the target's embeddings, in its dtype, included) and the KL teacher's head rows;
    gradients, AdamW's two moments and the update's temporaries per trainable parameter; one batch's
    activations (autograd's share and the rest), or validation's 2·ttt_steps-step unroll without gradients."""
    train = cfg.train
    lowp, stream = activation_bytes(train.precision)
    p = parameter_bytes(train.precision)
    trainable = _trainable_parameters(d)
    embed = p if p != 4 else t.dtype_bytes  # the target's dtype, unless a "-true" precision converts the module
    teacher = d.draft_vocab_size * d.target_hidden_size * 4 if train.distills else 0  # the teacher's head rows
    drafter = trainable * p + d.vocab_size * d.hidden_size * embed + teacher
    optimizer = trainable * p * 4 + (trainable * lowp if lowp < p else 0)  # + autocast's 16-bit weight copies
    B, T, S, response = batch_rows(train, data), data.sequence, train.ttt_steps, data.response

    kl = train.distills
    final = online_final(cfg)  # KL's teacher, or the final state a hybrid run publishes
    inputs = B * T * (len(d.aux_layer_ids) + final) * d.target_hidden_size * 6  # the stored 16 bits, then float32
    rows = B * response  # labelled positions: the responses'
    kept = ttt_kept_bytes(B, T, S, response, d, lowp, stream, train.activation_checkpointing, kl)
    step = kept + unroll_alive_bytes(B, T, S, rows, d, lowp, stream, kl=kl)
    validation = unroll_alive_bytes(B, T, 2 * S, rows, d, lowp, stream, kl=kl)
    online = capture_bytes(t, len(d.aux_layer_ids), B * T, rows) if cfg.features.kind in TARGET_IN_TRAINING else 0
    kernels = kernel_cache_bytes(cfg, d, data) if device.type == "cpu" else 0
    return drafter + optimizer + slack * (inputs + online + max(step, validation)) + kernels


def batch_rows(train, data: PromptSet) -> int:
    """Rows of the longest sequences a training batch holds: train.batch_size, or under a token budget as many as it
    spans, rounded up (`training.EpochBatches` keeps rows × the longest within it, so a batch of shorter sequences
    holds no more positions; a sequence longer than the budget is a batch of its own)."""
    if train.tokens_per_batch:
        return max(1, -(-train.tokens_per_batch // data.sequence))
    return train.batch_size


def kernel_cache_bytes(cfg: RunConfig, d: Eagle3Config, data: PromptSet) -> int:
    """What a CPU with 16-bit matmul kernels (AVX512, AMX) keeps per matmul shape under 16-bit precisions: each
    new shape leaves oneDNN's compiled kernels, a 16-bit copy of the weights it multiplied and heap blocks of new
    sizes. A training batch brings two new row counts when its length is new (step 1 runs over B·T rows, steps >= 2
    over the drafting positions), so the process grows by about two 16-bit copies of the drafter's weights and
    ~22 MB of kernels per batch of a new length, and levels off once the lengths repeat (after about as many
    batches as there are training sequences) or after the ISA's KERNEL_BATCHES_MAX, whichever comes first
    (not freed by setting ONEDNN_PRIMITIVE_CACHE_CAPACITY)."""
    lowp, _ = activation_bytes(cfg.train.precision)
    level_off = KERNEL_BATCHES_MAX.get(cpu_bf16_kernels(), 0)
    if lowp != 2 or not level_off:
        return 0
    world = cfg.train.devices * cfg.train.num_nodes
    steps = cfg.train.epochs * -(-data.trained_on // (cfg.train.batch_size * world))
    steps = min(steps, cfg.train.max_steps) if cfg.train.max_steps > 0 else steps
    new_lengths = min(steps, data.trained_on, level_off)
    return new_lengths * (2 * lowp * _trainable_parameters(d) + KERNELS_PER_NEW_BATCH)


def evaluation_cost(cfg: RunConfig, t: TargetShape, d: Eagle3Config, sets: list[PromptSet], slack: float) -> StageCost:
    """The simulated evaluator (and the drift suite, the same unroll with probes): float32, no gradients, a
    batch of train.batch_size sequences unrolled to max_k steps, plus the drafts and their matches [B, T, K]."""
    B, K = cfg.train.batch_size, max_k(cfg)
    drafter = _trainable_parameters(d) * 4 + d.vocab_size * d.hidden_size * t.dtype_bytes  # embeddings: target's

    def unroll(s: PromptSet) -> int:
        T = s.sequence
        inputs = B * T * len(d.aux_layer_ids) * d.target_hidden_size * 6
        return unroll_alive_bytes(B, T, K, B * s.response, d, 4, 4, probed=True) + B * T * K * (8 + 8 + 1) + inputs

    evaluated = [s for s in sets if s.name != "train"] or sets
    worst = max(evaluated, key=unroll)
    return StageCost(
        int(drafter + slack * unroll(worst)),
        f"train.batch_size={B} × {worst.bound} ({worst.name}) × max_k={K}",
        "train.batch_size, data.max_length or eval.max_k",
    )


def _trainable_parameters(d: Eagle3Config) -> int:
    """The drafter's parameters without the frozen embeddings (`eaglelab.models.drafter.Eagle3Drafter`)."""
    H, M, n = d.hidden_size, d.intermediate_size, len(d.aux_layer_ids)
    q, kv = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    layer = 2 * H * (q + 2 * kv) + q * H + 3 * H * M + 3 * H  # (first layer: [embedding; hidden] into q/k/v)
    layer += 2 * d.head_dim if d.layer == "qwen3" else 0  # (its per-head q/k norms)
    if (
        d.layer == "mla"
    ):  # the latent attention's projections and norms instead (eaglelab.models.drafter.LatentAttention)
        h, qk, r, rq = d.num_attention_heads, d.qk_nope_head_dim + d.qk_rope_head_dim, d.kv_lora_rank, d.q_lora_rank
        query = (2 * H * rq + rq + rq * h * qk) if rq else 2 * H * h * qk
        latent = 2 * H * (r + d.qk_rope_head_dim) + r + r * h * (d.qk_nope_head_dim + d.v_head_dim)
        layer = query + latent + h * d.v_head_dim * H + 3 * H * M + 3 * H
    return n * d.target_hidden_size * (H + 1) + d.num_layers * layer + H + H * d.draft_vocab_size


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def cublas_workspace_bytes(device: torch.device) -> int:
    """The cuBLAS workspace torch allocates on `device` at its first matmul, through its own allocator: 32 MiB on
    Hopper and later, 4 MiB × 2 + 16 KiB × 8 before (torch's defaults), or CUBLAS_WORKSPACE_CONFIG's ":KiB:count"
    pairs. On the H200 the tiny loop's peak was the estimate plus this (0.206 GB reserved, 0.174 estimated without
    it); nothing on a CPU."""
    if device.type != "cuda":
        return 0
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = [int(x) for x in config.split(":")[1:] if x.isdigit()]
    if pairs and len(pairs) % 2 == 0:
        return sum(size * 1024 * count for size, count in zip(pairs[::2], pairs[1::2]))
    major, _ = torch.cuda.get_device_capability(device)
    return 32 << 20 if major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def _held_now(device: torch.device) -> int:
    """Bytes this process holds on `device` now: resident memory on the host, torch's reservation on a GPU."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    rss = proc_bytes("/proc/self/status", "VmRSS")
    return rss if rss is not None else peak_rss()  # no /proc (macOS): the peak so far, an upper bound


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (ru_maxrss is in KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def measured_peaks(device: torch.device | None = None) -> dict[str, float]:
    """memory/peak_rss_gb (and memory/peak_gpu_gb on a GPU), for metrics.json next to the estimate."""
    out = {"memory/peak_rss_gb": round(peak_rss() / GB, 3)}
    if device is not None and device.type == "cuda":
        out["memory/peak_gpu_gb"] = round(torch.cuda.max_memory_reserved(device) / GB, 3)
    return out
