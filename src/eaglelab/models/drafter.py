"""The EAGLE-3 / EAGLE-3.1 drafter, in one file.

Semantics follow vLLM's `llama_eagle3.py` so that an exported checkpoint drafts in vLLM exactly as
it drafts here. Notation (per verified position t of a target with L layers, hidden size H_t):

    a_t = concat(h_t^(i) for i in aux_layer_ids)        # [3·H_t]  captured target states
    g_t = fc(fuse_norm(a_t))                            # [H]      fused feature
    x   = concat(input_layernorm(embed(tok_{t+1})), hidden_norm(g_t))   # [2H] into q/k/v
    o_t = decoder_layers(x, residual=g_t)               # [H]      pre-norm output
    logits = lm_head(norm(o_t))                         # [V_draft]
    next step is fed  norm(o_t) if norm_output else o_t

Each EAGLE-3.1 flag is a boolean that acts in exactly one place:
    fc_norm              -> `Eagle3Drafter.fc_input`      (one RMSNorm per aux state)
    norm_before_fc       -> `Eagle3Drafter.fc_input`      (one RMSNorm over the concatenation)
    norm_output          -> `Eagle3Drafter.feedback`      (which state the next step is fed)
    norm_before_residual -> `DecoderLayer.forward`        (residual is hidden_norm(g) instead of g)
    layer                -> `Attention.project`           (llama: Llama's layer; qwen3: Qwen3's, an RMSNorm over each
                                                           head's q and k before RoPE, exported for vLLM's
                                                           `qwen3_eagle3.py`; mla: DeepSeek's multi-head latent
                                                           attention, `LatentAttention.project`, for vLLM's
                                                           `deepseek_eagle3.py`)
    attention_window     -> `in_window`                   (sliding window + kept sink tokens, over context and
                                                           own drafts; eaglelab only: vLLM's Eagle3 drafter has no
                                                           such flag)
The flags are the fields of `DrafterFlags` (the config group `drafter`, defaults EAGLE-3.1); a boolean missing
from a checkpoint's config.json reads as False (EAGLE-3), so old checkpoints load.

Training-time test (TTT) unrolls `steps` draft steps over a whole sequence at once. Step j (1-based)
at position t is the j-th draft from verified position t: it reads token x_{t+j}, is fed step j-1's
state at t, sits at position id t+j-1, and attends to the step-1 keys of positions <= t (the context,
exactly what vLLM's draft KV cache holds for verified tokens) plus its own steps 2..j at t.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# The decoder layer families (`drafter.layer`): the architecture name an export carries (vLLM's registry maps it
# to the model class that serves it) and its config.json model_type. Other names vLLM's registry maps to the same
# class are read as that layer; PEagle's (Peagle*, PEagleDraftModel) are not: vLLM drafts those in parallel, with
# mask tokens, not as EAGLE-3 chains.
LAYERS = {
    "llama": ("LlamaForCausalLMEagle3", "llama"),  # vllm/model_executor/models/llama_eagle3.py
    "qwen3": ("Eagle3Qwen3ForCausalLM", "qwen3"),  # vllm/model_executor/models/qwen3_eagle3.py
    # vllm/model_executor/models/deepseek_eagle3.py; as DeepSeek-V2's: vLLM takes a draft config of model_type
    # deepseek_v3 for DeepSeek's own MTP head (SpeculativeConfig.hf_config_override), not an Eagle3 drafter
    "mla": ("Eagle3DeepseekV2ForCausalLM", "deepseek_v2"),
}
READ_AS = {
    **{arch: layer for layer, (arch, _) in LAYERS.items()},
    "Eagle3LlamaForCausalLM": "llama",
    "Eagle3DeepseekV3ForCausalLM": "mla",
}
# The latent attention's shape (drafter.layer=mla), in config.json as DeepSeek's configs name it.
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(kw_only=True)
class DrafterFlags:
    """The drafter's design choices (conf: `drafter.*`; the defaults are EAGLE-3.1). Each acts in exactly one
    place (module docstring). A boolean's False is EAGLE-3's behaviour, which is also what a checkpoint without
    that key in its config.json means (`Eagle3Config.from_vllm_config`), so old checkpoints keep loading.
    Adding a flag: a field here, the line where it acts, a test."""

    fc_norm: bool = True  # one RMSNorm per aux state before fc
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states (excludes fc_norm)
    norm_output: bool = True  # feed norm(o_t) to the next draft step instead of o_t
    norm_before_residual: bool = False  # residual of the first layer is hidden_norm(g_t) instead of g_t
    num_layers: int = 1  # decoder layers
    layer: str = "llama"  # the decoder layer's family: llama | qwen3 | mla (LAYERS: the architecture vLLM serves)
    attention_window: int | None = None  # None: full causal attention; N: sliding window (eaglelab only)
    attention_sink_tokens: int = 4  # first tokens always visible under a window

    def __post_init__(self):
        if self.fc_norm and self.norm_before_fc:
            raise ValueError(
                "drafter.fc_norm and drafter.norm_before_fc are mutually exclusive (both would double-normalise "
                "the fc input); set one of them to false (+ablation=norm_before_fc turns fc_norm off)"
            )
        if self.num_layers < 1:
            raise ValueError(f"drafter.num_layers must be > 0, got {self.num_layers}")
        if self.layer not in LAYERS:
            raise ValueError(
                f"drafter.layer={self.layer!r} is not a layer eaglelab builds; choose {' or '.join(LAYERS)}"
            )
        if self.attention_window is not None and self.attention_window < 1:
            raise ValueError(f"drafter.attention_window must be >= 1 or null, got {self.attention_window}")
        if self.attention_sink_tokens < 0:
            raise ValueError(f"drafter.attention_sink_tokens must be >= 0, got {self.attention_sink_tokens}")


def check_aux_layer_ids(ids, num_target_layers: int = 0) -> None:
    """vLLM collects each aux state once, in ascending layer order, from ids 1..L-1: an unsorted list would swap
    fc's input blocks, a duplicate would drop one (docs/conventions.md#aux-layer-convention)."""
    ids = list(ids)
    if not ids:
        raise ValueError("drafter.aux_layer_ids is empty; give target layer ids or null for the default")
    if ids != sorted(set(ids)):
        raise ValueError(
            f"drafter.aux_layer_ids {ids} must be sorted and unique (vLLM reads them in ascending "
            f"order, once each); use {sorted(set(ids))}"
        )
    if ids[0] < 1:
        raise ValueError(
            f"drafter.aux_layer_ids {ids}: ids must be in 1..L-1 (id k is the state after k layers; "
            "0 would be the embeddings)"
        )
    if num_target_layers and ids[-1] > num_target_layers - 1:
        raise ValueError(
            f"drafter.aux_layer_ids {ids} out of range: the target has L={num_target_layers} layers, "
            f"ids must be in 1..{num_target_layers - 1}"
        )


def mla_shape(target_config) -> dict:
    """The latent attention's shape for a target: a DeepSeek/Kimi target's own (its config names it), else one
    sized from the target's head_dim d and hidden size H as DeepSeek-V3's is (q/k heads of 128 + 64 without and with
    position, values of 128, a key-value latent of 512, a query latent of 3 × that): heads of d + d/2 and d, latents
    of min(4d, H) and min(3 × that, H). The query goes through its latent: vLLM 0.32's deepseek_eagle3.py loads only
    such drafters (it always fuses q_a_proj with kv_a_proj_with_mqa)."""
    tc = target_config
    if getattr(tc, "kv_lora_rank", None):  # (a target without a query latent, DeepSeek-V2-Lite: the drafter has one)
        own = {n: getattr(tc, n, None) or 0 for n in MLA_FIELDS}
        return {**own, "q_lora_rank": own["q_lora_rank"] or min(3 * own["kv_lora_rank"], tc.hidden_size)}
    d = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    kv_lora = min(4 * d, tc.hidden_size)
    return {"q_lora_rank": min(3 * kv_lora, tc.hidden_size), "kv_lora_rank": kv_lora, "qk_nope_head_dim": d,
            "qk_rope_head_dim": d // 2 // 2 * 2, "v_head_dim": d}  # fmt: skip


def layer_shape(hf_config) -> dict:
    """A decoder layer's shape as a Hugging Face config gives it (a target's, or a speculators drafter's
    transformer_layer_config): hidden and MLP sizes, heads, vocabulary, norm epsilon and RoPE base."""
    tc, heads = hf_config, hf_config.num_attention_heads
    rope_theta = getattr(tc, "rope_theta", None) or (getattr(tc, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0
    )
    return {
        "hidden_size": tc.hidden_size,
        "intermediate_size": tc.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(tc, "num_key_value_heads", None) or heads,
        "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        "vocab_size": tc.vocab_size,
        "rms_norm_eps": tc.rms_norm_eps,
        "rope_theta": float(rope_theta),
    }


@dataclass(kw_only=True)
class Eagle3Config(DrafterFlags):
    """Everything that determines the drafter (maps 1:1 to vLLM's config.json): the design flags plus the
    shape, which follows the target (vLLM shares the target's embeddings, so H matches)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    target_num_layers: int = 0  # L of the target; only used for validation
    # drafter.layer=mla: the latent attention's shape (0: not an MLA drafter; q_lora_rank 0: q projected directly).
    # A DeepSeek/Kimi target's own; on another target, from its head_dim (`for_target`).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self):
        super().__post_init__()
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
        if self.layer == "mla" and not (self.kv_lora_rank > 0 and self.qk_rope_head_dim > 0 and self.v_head_dim > 0):
            raise ValueError("drafter.layer=mla needs kv_lora_rank, qk_rope_head_dim and v_head_dim > 0")
        if self.layer == "mla" and self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "draft_vocab_size",
            "target_hidden_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"drafter {name} must be >= 1, got {getattr(self, name)}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"drafter.draft_vocab_size={self.draft_vocab_size} exceeds the target's vocabulary "
                f"({self.vocab_size} tokens); lower drafter.draft_vocab_size"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        check_aux_layer_ids(self.aux_layer_ids, self.target_num_layers)

    @classmethod
    def for_target(
        cls, flags: DrafterFlags, target_config, *, aux_layer_ids, draft_vocab_size: int, max_context: int
    ) -> Eagle3Config:
        """The design flags of `flags` on the shape of a Hugging Face target config (`target_config`)."""
        tc = target_config
        return cls(
            **{f.name: getattr(flags, f.name) for f in fields(DrafterFlags)},
            **layer_shape(tc),
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=tc.hidden_size,
            aux_layer_ids=tuple(aux_layer_ids),
            max_position_embeddings=max_context,
            target_num_layers=tc.num_hidden_layers,
            **(mla_shape(tc) if flags.layer == "mla" else {}),
        )

    # --- vLLM's config.json ------------------------------------------------------------------
    def to_vllm_config(self) -> dict:
        architecture, model_type = LAYERS[self.layer]
        cfg = {
            "architectures": [architecture],
            "model_type": model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            **{name: getattr(self, name) for name in _boolean_flags()},  # fc_norm, norm_output, ...
            # the latent attention's shape (q_lora_rank null: q projected directly), its RoPE on interleaved pairs
            **(
                {**{n: getattr(self, n) or None for n in MLA_FIELDS}, "rope_interleave": True}
                if self.layer == "mla"
                else {}
            ),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)},
            # also at the top level: some vLLM versions read it there and otherwise use the default ids
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
        }
        # eaglelab-only fields (vLLM ignores unknown keys); recorded so the checkpoint is complete.
        cfg["eaglelab"] = {
            "attention_window": self.attention_window,
            "attention_sink_tokens": self.attention_sink_tokens,
            "target_num_layers": self.target_num_layers,
        }
        return cfg

    @classmethod
    def from_vllm_config(cls, cfg: dict) -> Eagle3Config:
        extra = cfg.get("eaglelab", {})
        architecture = (cfg.get("architectures") or ["LlamaForCausalLMEagle3"])[0]
        if architecture not in READ_AS:
            known = ", ".join(f"{arch} ({layer})" for arch, layer in READ_AS.items())
            raise ValueError(f"config.json's architecture {architecture} is not a drafter eaglelab builds: {known}")
        if cfg.get("attention_bias"):
            raise ValueError("config.json has attention_bias=true: eaglelab's drafter layers have no q/k/v bias")
        aux = (cfg.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids")
        )
        if aux is None:
            raise ValueError("config.json has no eagle_config.eagle_aux_hidden_state_layer_ids")
        rope_theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
            aux_layer_ids=tuple(aux),
            num_layers=cfg.get("num_hidden_layers", 1),
            layer=READ_AS[architecture],
            **({n: cfg.get(n) or 0 for n in MLA_FIELDS} if READ_AS[architecture] == "mla" else {}),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            # A missing flag means EAGLE-3 behaviour (False): old checkpoints keep loading.
            **{name: bool(cfg.get(name, False)) for name in _boolean_flags()},
            attention_window=extra.get("attention_window"),
            attention_sink_tokens=extra.get("attention_sink_tokens", 4),
            target_num_layers=extra.get("target_num_layers", 0),
        )

    def to_dict(self) -> dict:
        return asdict(self)


def _boolean_flags() -> list[str]:
    """The boolean design flags: written to config.json as top-level keys, the way vLLM reads them."""
    return [f.name for f in fields(DrafterFlags) if f.type == "bool"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama rotary embedding (rotate-half convention). x: [B, h, T, d], positions: [T] or [B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.float()[..., None] * inv_freq  # [(B,) T, d/2]
    angles = torch.cat([angles, angles], dim=-1)
    if angles.dim() == 3:
        angles = angles[:, None]  # [B, 1, T, d]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def in_window(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, sink: int) -> torch.Tensor:
    """Whether a key at position id `k_pos` is inside the sliding window of a query at `q_pos` (broadcast), or is
    one of the `sink` first tokens, which stay visible. By position, for every key: the verified context and the
    query's own earlier drafts alike, since a served drafter's draft keys sit in its KV cache at their positions."""
    return ((q_pos - k_pos) < window) | (k_pos < sink)


def context_mask(
    q_pos: torch.Tensor, q_t: torch.Tensor, k_pos: torch.Tensor, window: int | None, sink: int
) -> torch.Tensor:
    """Which context keys a query sees. q_pos: [B, Tq] position ids (t + j - 1), q_t: [B, Tq] the
    verified position t the query drafts from, k_pos: [Tk] -> bool [B, Tq, Tk]. Causal up to t;
    optionally a sliding window (relative to the query's position id) that keeps `sink` first tokens."""
    visible = k_pos <= q_t[..., None]
    if window is not None:
        visible = visible & in_window(q_pos[..., None], k_pos, window, sink)
    return visible


@dataclass(frozen=True)
class ContextShard:
    """Context parallelism: this rank's share of every sequence, positions [start, end) of T = size · (end - start),
    among `size` ranks of `group` (torch.distributed) that hold the rest in order. Everything in the TTT unroll is
    per position but the attention over the verified context: a query at t reads the step-1 keys 0..t, which lie on
    this rank and the ranks before it. So step 1's keys and values are gathered from the group (`gather`, exact: the
    backward pass hands each rank the gradient of its own keys summed over every rank's queries), and every draft
    step's queries attend to them here; a query's own draft keys (steps >= 2, at its t) never leave its rank. The
    memory per rank is its share of the activations plus the context's keys and values ([B, kv, T, d] per layer)."""

    start: int
    end: int
    rank: int
    size: int
    group: object = None  # torch.distributed's ProcessGroup (None: the default group)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, kv, T / size, d] this rank's keys (or values) -> [B, kv, end, d]: every rank's, up to this one's."""
        return _GatherSequence.apply(x, self)[:, :, : self.end]


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 2); backward: every rank's gradient of the whole, summed (all-reduce, which
    every backend has, gloo included), then this rank's slice."""

    @staticmethod
    def forward(ctx, x, shard):
        import torch.distributed as dist

        ctx.shard = shard
        parts = [torch.empty_like(x) for _ in range(shard.size)]
        dist.all_gather(parts, x.contiguous(), group=shard.group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        shard, grad = ctx.shard, grad.contiguous()
        dist.all_reduce(grad, group=shard.group)
        n = grad.shape[2] // shard.size
        return grad[:, :, shard.rank * n : (shard.rank + 1) * n], None


class Attention(nn.Module):
    """Self-attention of one draft step, through PyTorch's fused kernel (`scaled_dot_product_attention`).

    A query of step j at verified position t sees the context keys 0..t (the step-1 keys: what the engine's KV
    cache holds for verified tokens) and its own drafts of steps 2..j, one key each at that same t. The context
    is ordinary causal attention; the own drafts are a per-query "diagonal" no fused kernel takes. They are
    folded in through one extra key, the *sink*, whose score for each query is the log-sum-exp c of that
    query's own-draft scores (an extra q/k dimension carries it) and whose value is a unit column:

        SDPA([q, c/scale] · [sink; ctx]) = ( A + e^c · e_d ) / ( S + e^c ),   A = Σ_ctx e^s v,  S = Σ_ctx e^s
        out = (A + Σ_own e^o v) / (S + Σ_own e^o) = SDPA[:d] + SDPA[d] · softmax(o) · v_own

    which is the softmax over context and own drafts together, exactly; autograd differentiates it like any
    other composition. So what a training step keeps grows with T (queries, keys, outputs, one log-sum-exp per
    query), not with B·h·T² probabilities. The queries of steps >= 2 are the last Tq verified positions
    (`Eagle3Drafter.unroll` packs them so); T - Tq + 1 zero queries in front of them align the kernel's causal
    mask with theirs, so no mask is built unless the drafter has a sliding window.

    The explicit softmax (`_attend_explicit`, query blocks bounding its memory without gradients) stays for the
    drift diagnostics, which read the probabilities themselves (`probe`)."""

    # Query blocks of the explicit path hold a score tensor [B, h, block, T] of at most this many elements.
    MAX_SCORES = 1 << 25
    PAD = 8  # the extra q/k/v dimensions (1 used): fused CUDA kernels want head dims in multiples of 8

    def __init__(self, cfg: Eagle3Config, in_dim: int):
        super().__init__()
        self.cfg = cfg
        self.build(cfg, in_dim)
        # Diagnostics hook (eaglelab.evaluate.drift): called as probe(probs [B, h, Tq, T + j - 1], positions, query_t).
        self.probe = None

    def build(self, cfg: Eagle3Config, in_dim: int) -> None:
        """The projections (vLLM's names): Llama's q/k/v/o, and Qwen3's per-head q/k norms."""
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, h * d, bias=False)
        self.k_proj = nn.Linear(in_dim, kv * d, bias=False)
        self.v_proj = nn.Linear(in_dim, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        if cfg.layer == "qwen3":
            self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, Tq, in_dim] at position ids [B, Tq] -> q [B, h, Tq, d], k and v [B, kv, Tq, d], RoPE applied."""
        cfg = self.cfg
        B, Tq, _ = x.shape
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, k = self.q_proj(x).view(B, Tq, h, d), self.k_proj(x).view(B, Tq, kv, d)
        if cfg.layer == "qwen3":  # Qwen3's layer: each head's q and k RMS-normed before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope(q.transpose(1, 2), positions, cfg.rope_theta)
        k = rope(k.transpose(1, 2), positions, cfg.rope_theta)
        return q, k, self.v_proj(x).view(B, Tq, kv, d).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, query_t: torch.Tensor, past: tuple, shard=None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Draft step j = len(past) + 1 for queries x: [B, Tq, in_dim] at position ids `positions` [B, Tq]
        (t + j - 1), drafting from verified positions `query_t` [B, Tq] (the last Tq of the context, t = T - Tq + i).
        `past` holds (k, v) of steps 1..j-1 of this layer: step 1's over the context [B, kv, T, d], later steps in
        the queries' layout [B, kv, Tq, d]. `shard` (a ContextShard, step 1 only): the queries are this rank's
        positions, the context every position up to its last, gathered. -> (output [B, Tq, H], this step's (k, v):
        at step 1 the context's)."""
        B, Tq, _ = x.shape
        q, k, v = self.project(x, positions)
        if past:
            k_ctx, v_ctx = past[0]  # step-1 keys: the verified context
        else:
            k_ctx, v_ctx = (shard.gather(k), shard.gather(v)) if shard is not None else (k, v)
        own = [*past[1:], (k, v)] if past else []  # steps 2..j at the same t ("diagonal" keys)
        attend = self._attend_explicit if self.probe is not None else self._attend_fused
        out = attend(q, k_ctx, v_ctx, own, positions, query_t)  # [B, h, Tq, d_v]
        return self.o_proj(out.transpose(1, 2).reshape(B, Tq, -1)), ((k, v) if past else (k_ctx, v_ctx))

    def _own_scores(self, q, own, positions) -> list[torch.Tensor]:
        """q: [B, h, tq, d] · each own draft's key at the same t -> scores [B, h, tq, 1], the sliding window applied:
        the drafts of steps 2..j sit at position ids t+1..t+j-1 (own[i] is len(own)-1-i positions before the
        query), masked by position as the context is; the query's own key (distance 0) is always visible."""
        cfg, rep = self.cfg, q.shape[1] // own[0][0].shape[1] if own else 1
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = [(q * k_i.repeat_interleave(rep, 1)).sum(-1, keepdim=True) * scale for k_i, _ in own]
        if cfg.attention_window is None:
            return scores
        return [
            s.masked_fill(
                ~in_window(positions, positions - (len(own) - 1 - i), cfg.attention_window, cfg.attention_sink_tokens)[
                    :, None, :, None
                ],
                float("-inf"),
            )
            for i, s in enumerate(scores)
        ]

    def _attend_fused(self, q, k_ctx, v_ctx, own, positions, query_t):
        """q: [B, h, Tq, d], k_ctx/v_ctx: [B, kv, T, d | d_v], own: [(k, v) [B, kv, Tq, d | d_v]] -> [B, h, Tq, d_v].
        Values narrower than queries and keys (the latent attention's) are zero-padded to their width: the fused
        kernels take one head dim, and the math path they would fall back to keeps [B, h, T, T] probabilities."""
        cfg, (B, h, Tq, d), T, dv = self.cfg, q.shape, k_ctx.shape[2], v_ctx.shape[-1]
        scale = 1.0 / math.sqrt(d)
        if not own:  # step 1: causal attention over the context (whose last Tq positions are the queries)
            mask = None
            if cfg.attention_window is not None:
                mask = self._window_mask(positions[0], query_t[0], torch.arange(T, device=q.device))
            front = T - Tq  # (context parallelism: the earlier ranks' positions) zero queries align the causal mask
            q_x = torch.cat([q.new_zeros(B, h, front, d), q], dim=2) if front else q
            return self._sdpa(q_x, k_ctx, F.pad(v_ctx, (0, d - dv)), mask, scale)[:, :, front:, :dv]
        rep = h // k_ctx.shape[1]
        scores = torch.cat(self._own_scores(q, own, positions), dim=-1)  # [B, h, Tq, j-1]
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # softmax in float32 at least
        c = torch.logsumexp(scores, dim=-1, keepdim=True)  # [B, h, Tq, 1]: finite, the query sees itself
        weights = torch.softmax(scores, dim=-1)
        own_out = sum(weights[..., i : i + 1] * v_i.repeat_interleave(rep, 1) for i, (_, v_i) in enumerate(own))
        pad, front = self.PAD, T - Tq + 1  # zero queries ahead of the real ones: causal alignment (class docstring)
        q_x = torch.cat([q, (c / scale).to(q.dtype), q.new_zeros(B, h, Tq, pad - 1)], dim=-1)
        q_x = torch.cat([q_x.new_zeros(B, h, front, d + pad), q_x], dim=2)  # [B, h, T + 1, d + pad]
        sink_k, sink_v = k_ctx.new_zeros(B, k_ctx.shape[1], 1, d + pad), v_ctx.new_zeros(B, v_ctx.shape[1], 1, d + pad)
        sink_k[..., d], sink_v[..., dv] = 1.0, 1.0
        k_x = torch.cat([sink_k, F.pad(k_ctx, (0, pad))], dim=2)  # [B, kv, T + 1, d + pad]
        v_x = torch.cat([sink_v, F.pad(v_ctx, (0, d + pad - dv))], dim=2)  # [B, kv, T + 1, d + pad]: the sink at d_v
        mask = None
        if cfg.attention_window is not None:
            rows = torch.arange(-1, T, device=q.device)  # query row r drafts from t = r - 1 (zero rows: any)
            shift = positions[0, 0] - query_t[0, 0]  # j - 1
            ctx = self._window_mask(rows + shift, rows, torch.arange(T, device=q.device))  # [T + 1, T]
            mask = torch.cat([torch.ones_like(ctx[:, :1]), ctx], dim=1)  # the sink always visible
        o_x = self._sdpa(q_x, k_x, v_x, mask, scale)[:, :, front:]  # [B, h, Tq, d + pad]
        return (o_x[..., :dv] + o_x[..., dv : dv + 1] * own_out).to(q.dtype)  # own_out is float32 at least

    @staticmethod
    def _sdpa(q, k, v, mask, scale):
        """Causal (top-left aligned) unless a mask is given. Grouped KV heads go to the kernel as they are where it
        takes them (the CPU's flash kernel; CUDA's flash kernel, 16-bit only); in float32 on CUDA they are repeated
        to every head, which the memory-efficient kernel needs (else SDPA would fall back to the math path, which
        materialises the scores)."""
        gqa = q.device.type == "cpu" or q.dtype in (torch.float16, torch.bfloat16)
        if not gqa and k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )

    def _window_mask(self, q_pos, q_t, k_pos):
        """[tq] position ids and verified positions of queries, [T] key positions -> bool [tq, T]."""
        return context_mask(q_pos[None], q_t[None], k_pos, self.cfg.attention_window, self.cfg.attention_sink_tokens)[0]

    def _attend_explicit(self, q, k_ctx, v_ctx, own, positions, query_t):
        """The softmax written out, in query blocks: the probabilities [B, h, tq, T + j - 1] go to `probe`."""
        B, h, Tq, _ = q.shape
        T, rep = k_ctx.shape[2], h // k_ctx.shape[1]
        k_ctx, v_ctx = k_ctx.repeat_interleave(rep, 1), v_ctx.repeat_interleave(rep, 1)
        block = max(1, self.MAX_SCORES // (B * h * T))
        outs = []
        for s in range(0, Tq, block):
            qb, pb, tb = q[:, :, s : s + block], positions[:, s : s + block], query_t[:, s : s + block]
            own_b = [(k_i[:, :, s : s + block], v_i[:, :, s : s + block]) for k_i, v_i in own]
            scale = 1.0 / math.sqrt(q.shape[-1])
            mask = context_mask(
                pb, tb, torch.arange(T, device=q.device), self.cfg.attention_window, self.cfg.attention_sink_tokens
            )  # [B, tq, T]
            scores = ((qb @ k_ctx.transpose(-1, -2)) * scale).masked_fill(~mask[:, None], float("-inf"))
            own_scores = self._own_scores(qb, own_b, pb) if own_b else []
            probs = torch.softmax(torch.cat([scores, *own_scores], dim=-1), dim=-1)  # [B, h, tq, T + j - 1]
            if self.probe is not None:
                self.probe(probs, pb, tb)
            out = probs[..., :T] @ v_ctx
            for i, (_, v_i) in enumerate(own_b):
                out = out + probs[..., T + i : T + i + 1] * v_i.repeat_interleave(rep, 1)
            outs.append(out)
        return torch.cat(outs, dim=2)


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """DeepSeek's RoPE: pairs (2i, 2i + 1) rotated (vLLM's is_neox_style=False). x: [B, h, T, d], positions [B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = (positions.float()[..., None] * inv_freq)[:, None]  # [B, 1, T, d/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


class LatentAttention(Attention):
    """DeepSeek's multi-head latent attention (MLA), as vLLM's `deepseek_eagle3.py` serves it (weights by its
    names). Keys and values come from one latent per position, c = RMSNorm(x W_kv_a) [kv_lora_rank], expanded per
    head by kv_b_proj; each head's query and key are [no-position part (qk_nope) ; RoPE part (qk_rope)], the key's
    RoPE part shared by every head and taken from x directly. A served engine caches only the latent and the
    shared RoPE key (and absorbs kv_b_proj into the queries): the same attention, computed in another order."""

    def build(self, cfg: Eagle3Config, in_dim: int) -> None:
        h, nope, rope_d, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank:  # q through a low-rank latent of its own
            self.q_a_proj = nn.Linear(in_dim, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * (nope + rope_d), bias=False)
        else:
            self.q_proj = nn.Linear(in_dim, h * (nope + rope_d), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_dim, cfg.kv_lora_rank + rope_d, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (nope + dv), bias=False)
        self.o_proj = nn.Linear(h * dv, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, Tq, in_dim] -> q, k [B, h, Tq, qk_nope + qk_rope], v [B, h, Tq, v_head_dim]."""
        cfg = self.cfg
        B, Tq, _ = x.shape
        h, nope, rope_d, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if cfg.q_lora_rank else self.q_proj(x)
        q = q.view(B, Tq, h, nope + rope_d).transpose(1, 2)  # [B, h, Tq, nope + rope]
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, rope_d], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, Tq, h, nope + dv).transpose(1, 2)
        k_nope, v = kv.split([nope, dv], dim=-1)
        k_rope = rope_interleaved(k_rope[:, None], positions, cfg.rope_theta)  # [B, 1, Tq, rope]: every head's
        q = torch.cat([q[..., :nope], rope_interleaved(q[..., nope:], positions, cfg.rope_theta)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, h, Tq, rope_d)], dim=-1)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama (or Qwen3: `drafter.layer`, in its attention) decoder layer; the first one reads [embedding ; hidden]
    (2H) into q/k/v."""

    def __init__(self, cfg: Eagle3Config, layer_idx: int):
        super().__init__()
        self.cfg, self.first = cfg, layer_idx == 0
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        if self.first:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = (LatentAttention if cfg.layer == "mla" else Attention)(cfg, 2 * H if self.first else H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, positions, query_t, past, shard=None):
        """embeds, hidden: [B, Tq, H] -> ([B, Tq, H] pre-norm residual stream, this step's (k, v)). A pure
        function of its inputs, so activation checkpointing can run it again for the backward pass."""
        if self.first:
            if self.cfg.norm_before_residual:
                hidden = self.hidden_norm(hidden)
                residual = hidden
            else:
                residual = hidden
                hidden = self.hidden_norm(hidden)
            x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)  # [B, T, 2H]
        else:
            residual = hidden
            x = self.input_layernorm(hidden)
        attended, kv = self.self_attn(x, positions, query_t, past, shard)
        residual = residual + attended
        return residual + self.mlp(self.post_attention_layernorm(residual)), kv


@dataclass
class StepOutput:
    normed: torch.Tensor  # [B, T, H] norm(o_t); logits = lm_head(normed), computed by the caller only
    #                       where needed (the draft-vocab projection is the largest matmul)
    hidden: torch.Tensor  # [B, T, H] state fed to the next step (see `feedback`)
    prenorm: torch.Tensor  # [B, T, H] o_t, for diagnostics


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        H, Ht, n_aux = cfg.hidden_size, cfg.target_hidden_size, len(cfg.aux_layer_ids)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(Ht, cfg.rms_norm_eps) for _ in range(n_aux))
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(n_aux * Ht, cfg.rms_norm_eps)
        self.fc = nn.Linear(n_aux * Ht, H, bias=False)
        # Shared with the target and frozen, as in vLLM (not exported).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        # d2t[i] = target_id(i) - i ; t2d[target_id] = token is in the draft vocabulary.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # A training switch, not part of the design (nothing exported): recompute each decoder layer in the
        # backward pass instead of keeping its activations (train.activation_checkpointing).
        self.activation_checkpointing = False
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    def set_vocab(self, draft_ids: torch.Tensor):
        """draft_ids: [V_draft] ascending target ids of the draft vocabulary."""
        ids = draft_ids.to(self.d2t.device).long()
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def fc_input(self, aux: torch.Tensor) -> torch.Tensor:
        """aux: [B, T, n_aux·H_t] captured target states -> what fc reads (same shape). The states come in the dtype
        they were stored in (the target's, often 16 bits: a quarter of the bytes through the loader and to the
        device) and are read in the drafter's own here, on its device."""
        aux = aux.to(self.fc.weight.dtype)
        if self.cfg.norm_before_fc:
            aux = self.input_norm(aux)
        if self.cfg.fc_norm:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return aux

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux: [B, T, n_aux·H_t] -> g: [B, T, H]."""
        return self.fc(self.fc_input(aux))

    def feedback(self, prenorm: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The state the next draft step is fed: EAGLE-3 feeds o_t, EAGLE-3.1 feeds norm(o_t)."""
        return normed if self.cfg.norm_output else prenorm

    def step(self, tokens, hidden, positions, query_t, caches, shard=None) -> StepOutput:
        """One draft step. tokens: [B, Tq]; hidden: [B, Tq, H]; positions, query_t: [B, Tq]; caches: per layer,
        the (k, v) of the earlier steps, to which this step's are appended; shard: step 1 under context
        parallelism (ContextShard)."""
        embeds = self.embed_tokens(tokens)
        x = hidden
        for layer, cache in zip(self.layers, caches):
            if self.activation_checkpointing and torch.is_grad_enabled():
                # Keep only the layer's inputs; its activations are recomputed in the backward pass (a gather
                # among them: every rank recomputes its layers in the same order, so the collectives meet again).
                x, kv = checkpoint(layer, embeds, x, positions, query_t, tuple(cache), shard, use_reentrant=False)
            else:
                x, kv = layer(embeds, x, positions, query_t, tuple(cache), shard)
            cache.append(kv)
        normed = self.norm(x)
        return StepOutput(normed, self.feedback(x, normed), x)

    def unroll(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        steps: int,
        first: torch.Tensor | None = None,
        shard: ContextShard | None = None,
    ) -> list[StepOutput]:
        """Training-time test: `steps` draft steps at every position of a teacher-forced sequence.

        aux: [B, T, n_aux·H_t] target states at positions 0..T-1; input_ids: [B, T] tokens x_0..x_{T-1}.
        Step j (1-based) at position t reads x_{t+j} (0 past the end; no loss there) and its
        `lm_head(normed)` predicts x_{t+j+1}. Step 1 runs at every position (it is the context every
        later step attends to). `first` [B]: the first position that drafts (prompt length - 1);
        steps >= 2 then run only from there on, as an engine drafts only from verified positions
        after the prompt. Outputs are [B, T, ·], zero where a step did not run.

        `shard` (context parallelism): this rank runs positions [start, end) only; aux holds theirs
        ([B, end - start, ·]), input_ids and `first` the whole sequences', and the outputs are its positions'.
        """
        B, T = input_ids.shape
        lo, hi = (shard.start, shard.end) if shard is not None else (0, T)
        if shard is not None and self.cfg.attention_window is not None:
            raise ValueError("context parallelism does not take a sliding attention window (drafter.attention_window)")
        device = input_ids.device
        padded = F.pad(input_ids, (0, steps))  # [B, T + steps]
        caches = [[] for _ in self.layers]
        mine = torch.arange(lo, hi, device=device).expand(B, hi - lo)
        out = self.step(padded[:, lo + 1 : hi + 1], self.fuse(aux), mine, mine, caches, shard)
        outs = [out]
        # Queries of steps >= 2: the last Tq positions, from the earliest first[b] on, the same for every sequence
        # ([B, Tq]); those before a sequence's own first[b] run but are not kept (`real`).
        first = torch.zeros(B, dtype=torch.long, device=device) if first is None else first.clamp(0, T - 1)
        start = min(max(lo, int(first.min())), hi)
        Tq = hi - start
        t = (start + torch.arange(Tq, device=device)).expand(B, Tq)  # [B, Tq]
        real = t >= first[:, None]
        rows = torch.arange(B, device=device)[:, None]
        hidden = out.hidden[:, start - lo :]
        keep = real[..., None]  # [B, Tq, 1]
        for j in range(2, steps + 1):
            if not Tq:  # (context parallelism: a rank whose positions all lie in the prompts drafts nothing)
                outs.append(StepOutput(*(torch.zeros_like(x) for x in (out.normed, out.hidden, out.prenorm))))
                continue
            step = self.step(padded[rows, t + j], hidden, t + (j - 1), t, caches)
            hidden = step.hidden
            # [B, Tq, H] -> [B, T, H]: the queries are the last Tq positions, zeros where no query ran (no
            # boolean indexing: it would wait for the device to count the kept rows, three times a step)
            outs.append(
                StepOutput(*(F.pad(x * keep, (0, 0, start - lo, 0)) for x in (step.normed, step.hidden, step.prenorm)))
            )
        return outs

    def to_target_ids(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        return draft_tokens + self.d2t[draft_tokens]


# --- vLLM weight names -----------------------------------------------------------------------
def export_state_dict(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """State dict in vLLM's Eagle3 naming (single layer as `midlayer.*`, embeddings omitted)."""
    out = {}
    for name, t in model.state_dict().items():
        if name.startswith("embed_tokens."):
            continue
        if model.cfg.num_layers == 1 and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0.") :]
        out[name] = t.detach().contiguous()
    return out


def import_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in sd.items()}


def config_fields() -> list[str]:
    return [f.name for f in fields(Eagle3Config)]
