"""Drafters in speculators' format (vllm-project/speculators), read and written beside vLLM's Eagle3 format.

A speculators checkpoint is a folder of config.json + model.safetensors, like vLLM's Eagle3 one, with the config
split in two (docs/conventions.md#speculators-format):

    speculators_model_type        "eagle3" (the only one eaglelab reads: PEagle/DFlash draft differently)
    transformer_layer_config      the decoder layer's Hugging Face config: model_type llama | qwen3 picks the layer;
                                  vocab_size is the target's, hidden sizes the drafter's (to_diff_dict: defaults
                                  left out, so it is read through transformers' config class of that model_type)
    fc_norm, norm_before_fc, norm_output, norm_before_residual, draft_vocab_size, target_hidden_size,
    eagle_aux_hidden_state_layer_ids (null: vLLM's default ids of the target), speculators_config (the verifier,
    the proposal method)

vLLM reads it as `vllm/transformers_utils/configs/speculators/algos.py:update_eagle3` does: a missing
`norm_before_residual` is *true* there (the other flags false), and so it is here. Weights are named as eaglelab's
own (`layers.{i}.*`, never `midlayer.*`; `fc_norm.{i}`, `input_norm`, `norm`, `lm_head`, `d2t`, `t2d`).
"""

from __future__ import annotations

from eaglelab.models.drafter import Eagle3Config, _boolean_flags, layer_shape

# What vLLM's update_eagle3 reads a missing flag as.
MISSING_FLAG = {"norm_before_residual": True}
# The layers speculators' eagle3 format has (vLLM's update_eagle3 maps these model types, and no other).
SPECULATORS_LAYERS = ("llama", "qwen3")


def is_speculators_config(cfg: dict) -> bool:
    return "speculators_config" in cfg or "speculators_model_type" in cfg


def from_speculators_config(cfg: dict, default_aux: list[int] | None) -> Eagle3Config:
    """The drafter a speculators config.json describes. `default_aux`: the target's default aux ids (vLLM's
    2, L/2, L-3), used where the config names none, as vLLM does; None where no target is known."""
    from transformers import AutoConfig

    kind = cfg.get("speculators_model_type")
    if kind != "eagle3":
        raise ValueError(f"speculators_model_type {kind!r}: eaglelab reads EAGLE-3 drafters (eagle3) only")
    if not isinstance(cfg.get("transformer_layer_config"), dict):
        raise ValueError("the speculators config has no transformer_layer_config (the decoder layer's config)")
    layer_cfg = dict(cfg["transformer_layer_config"])
    model_type = layer_cfg.pop("model_type", "llama")
    if model_type not in SPECULATORS_LAYERS:
        known = ", ".join(SPECULATORS_LAYERS)
        raise ValueError(f"transformer_layer_config.model_type {model_type!r}: speculators' eagle3 layers are {known}")
    tc = AutoConfig.for_model(model_type, **layer_cfg)  # its family's defaults for what to_diff_dict left out
    aux = cfg.get("eagle_aux_hidden_state_layer_ids") or default_aux
    if not aux:
        raise ValueError("eagle_aux_hidden_state_layer_ids is null and no target is given to take vLLM's default from")
    if getattr(tc, "attention_bias", False) or getattr(tc, "mlp_bias", False):
        raise ValueError("transformer_layer_config has a q/k/v or MLP bias: eaglelab's drafter layers have none")
    rope = getattr(tc, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"transformer_layer_config's RoPE is {rope.get('rope_type')}: eaglelab's drafter is unscaled")
    return Eagle3Config(
        **layer_shape(tc),
        draft_vocab_size=cfg.get("draft_vocab_size") or tc.vocab_size,
        target_hidden_size=cfg.get("target_hidden_size") or tc.hidden_size,
        aux_layer_ids=tuple(aux),
        num_layers=tc.num_hidden_layers,
        layer=model_type,
        max_position_embeddings=tc.max_position_embeddings,
        **{name: bool(cfg.get(name, MISSING_FLAG.get(name, False))) for name in _boolean_flags()},
    )


def to_speculators_config(
    cfg: Eagle3Config, verifier: str, verifier_architectures: list[str], speculative_tokens: int = 3
) -> dict:
    """`cfg` as speculators writes an Eagle3 drafter's config.json (`Eagle3SpeculatorConfig`), its verifier (the
    target) named by `verifier` (a path or hub name) and its architectures; `speculative_tokens`: the depth a server
    drafts at unless told (vLLM: a speculative_config's num_speculative_tokens wins). eaglelab-only settings (a
    window) have no place there: `eaglelab.export.eagle3.save_speculators` refuses them."""
    if cfg.layer not in SPECULATORS_LAYERS:
        layers = " and ".join(SPECULATORS_LAYERS)
        raise ValueError(f"drafter.layer={cfg.layer}: speculators' format has {layers} layers")
    vllm = cfg.to_vllm_config()
    layer = {
        k: vllm[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "hidden_act",
            "vocab_size",
            "rms_norm_eps",
            "max_position_embeddings",
            "attention_bias",
            "tie_word_embeddings",
        )  # fmt: skip
    }
    layer.update(model_type=vllm["model_type"], num_hidden_layers=cfg.num_layers, mlp_bias=False)
    layer["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        **{name: getattr(cfg, name) for name in _boolean_flags()},  # every flag written: none read by default
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }  # fmt: skip
            ],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }


def speculators_names(state: dict) -> dict:
    """eaglelab's exported names (`midlayer.*` for one layer) -> speculators' (`layers.0.*`)."""
    return {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in state.items()}
