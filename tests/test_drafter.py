"""The drafter: TTT unroll == a step-by-step engine with a KV cache; each flag acts where it should."""

import itertools

import pytest
import torch

from eaglelab.models.drafter import Eagle3Config, Eagle3Drafter, export_state_dict

from reference_drafter import ReferenceDrafter


def small_config(**flags) -> Eagle3Config:
    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=50,
        draft_vocab_size=30,
        target_hidden_size=48,
        aux_layer_ids=(1, 3, 5),
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        target_num_layers=8,
    )
    if flags.get("layer") == "mla":  # a latent narrower than the heads, q/k heads wider than the values (16 + 8, 16)
        base.update(kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    base.update(flags)
    return Eagle3Config(**base)


def random_drafter(cfg: Eagle3Config, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg)
    with torch.no_grad():  # non-trivial norm weights, so a misplaced norm cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".weight" in name and "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.set_vocab(torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values)
    return model.double().eval()


def max_logit_gap(cfg: Eagle3Config, T: int = 10, steps: int = 4) -> float:
    model = random_drafter(cfg)
    torch.manual_seed(1)
    # Target states of very different scales per aux layer: what makes fc_norm matter.
    aux = torch.randn(1, T, 3 * cfg.target_hidden_size, dtype=torch.float64) * torch.tensor(
        [1.0, 10.0, 100.0], dtype=torch.float64
    ).repeat_interleave(cfg.target_hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (1, T))
    with torch.no_grad():
        outs = model.unroll(aux, ids, steps)
    ref = ReferenceDrafter(export_state_dict(model), cfg.to_vllm_config(), model.embed_tokens.weight)
    expected = ref.draft_logits(aux[0], ids[0], steps)
    assert len(expected) > T  # several depths at many positions
    return max(
        (model.lm_head(outs[j - 1].normed[0, s]) - logits).abs().max().item() for (s, j), logits in expected.items()
    )


@pytest.mark.parametrize("fc_norm,norm_output", list(itertools.product([False, True], repeat=2)))
def test_unroll_matches_step_by_step_engine(fc_norm, norm_output):
    cfg = small_config(fc_norm=fc_norm, norm_output=norm_output)
    assert max_logit_gap(cfg) <= 1e-4


@pytest.mark.parametrize(
    "flags",
    [
        dict(norm_before_fc=True, fc_norm=False),
        dict(norm_before_residual=True),
        dict(num_layers=2),
        dict(layer="qwen3"),
        dict(layer="qwen3", num_layers=2, fc_norm=False, norm_output=False),
        dict(layer="mla"),
        dict(layer="mla", q_lora_rank=20, num_layers=2, attention_window=2, attention_sink_tokens=1),
        # windows shorter than the depth (4) less one: the deepest drafts' window excludes the step-1 key at t and
        # their earliest own drafts too, which an engine's KV cache holds at their positions like any other key
        dict(attention_window=2, attention_sink_tokens=2),
        dict(attention_window=1, attention_sink_tokens=1),
    ],
)
def test_unroll_matches_engine_for_other_flags(flags):
    assert max_logit_gap(small_config(**flags)) <= 1e-4


def test_unroll_matches_engine_in_fp32():
    cfg = small_config()
    model = random_drafter(cfg).float()
    T, steps = 12, 3
    torch.manual_seed(2)
    aux = torch.randn(1, T, 3 * cfg.target_hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (1, T))
    with torch.no_grad():
        outs = model.unroll(aux, ids, steps)
    ref = ReferenceDrafter(export_state_dict(model), cfg.to_vllm_config(), model.embed_tokens.weight)
    gap = max(
        (model.lm_head(outs[j - 1].normed[0, s]).double() - lg).abs().max().item()
        for (s, j), lg in ref.draft_logits(aux[0].double(), ids[0], steps).items()
    )
    assert gap <= 1e-4


def test_padding_does_not_change_real_positions():
    cfg = small_config()
    model = random_drafter(cfg)
    torch.manual_seed(3)
    aux = torch.randn(2, 9, 144, dtype=torch.float64)
    ids = torch.randint(0, 50, (2, 9))
    short = model.unroll(aux[:1, :6], ids[:1, :6], 3)
    long = model.unroll(aux[:1], ids[:1], 3)
    # A longer sequence (or right padding) never leaks backwards: positions whose inputs exist in both
    # (token x_{t+j} for step j) agree at every depth.
    for j in range(1, 4):
        assert torch.allclose(short[j - 1].normed[0, : 6 - j], long[j - 1].normed[0, : 6 - j], atol=1e-10)


def _param_names(**flags) -> set[str]:
    return set(export_state_dict(Eagle3Drafter(small_config(**flags))))


def test_each_flag_changes_exactly_its_parameters():
    base = _param_names(fc_norm=False, norm_output=False)  # EAGLE-3
    assert _param_names(fc_norm=True, norm_output=False) - base == {
        "fc_norm.0.weight",
        "fc_norm.1.weight",
        "fc_norm.2.weight",
    }
    assert _param_names(fc_norm=True, norm_output=False) >= base
    assert _param_names(fc_norm=False, norm_before_fc=True) ^ base == {"input_norm.weight"}
    assert _param_names(fc_norm=False, norm_output=True) == base  # a path change, no parameters
    assert _param_names(fc_norm=False, norm_before_residual=True) == base
    assert _param_names(fc_norm=False, norm_output=False, layer="qwen3") - base == {
        "midlayer.self_attn.q_norm.weight",  # vLLM's qwen3_eagle3.py names (Qwen3Attention's)
        "midlayer.self_attn.k_norm.weight",
    }
    assert "midlayer.hidden_norm.weight" in base and "d2t" in base and "t2d" in base
    assert not any(n.startswith("embed_tokens") for n in base)  # shared with the target


def test_norm_output_changes_only_the_fed_back_state():
    cfg3, cfg31 = small_config(norm_output=False), small_config(norm_output=True)
    a, b = random_drafter(cfg3), random_drafter(cfg31)
    b.load_state_dict(a.state_dict())
    torch.manual_seed(4)
    aux, ids = torch.randn(1, 8, 144, dtype=torch.float64), torch.randint(0, 50, (1, 8))
    oa, ob = a.unroll(aux, ids, 3), b.unroll(aux, ids, 3)
    assert torch.equal(oa[0].normed, ob[0].normed)  # step 1 never sees feedback
    assert not torch.allclose(oa[1].normed, ob[1].normed)  # step 2 does
    assert torch.allclose(ob[0].hidden, b.norm(ob[0].prenorm))
    assert torch.equal(oa[0].hidden, oa[0].prenorm)


def test_fc_norm_makes_fusion_scale_invariant_per_layer():
    torch.manual_seed(5)
    aux = torch.randn(1, 5, 144, dtype=torch.float64)
    scaled = aux.clone()
    scaled[..., 96:] *= 50.0  # one aux layer 50x louder
    m31 = random_drafter(small_config(fc_norm=True))
    m3 = random_drafter(small_config(fc_norm=False))
    assert torch.allclose(m31.fuse(aux), m31.fuse(scaled), atol=1e-6)
    assert not torch.allclose(m3.fuse(aux), m3.fuse(scaled))


def test_contradictory_and_out_of_range_flags_are_rejected():
    with pytest.raises(ValueError, match="mutually exclusive"):
        small_config(fc_norm=True, norm_before_fc=True)
    with pytest.raises(ValueError, match="L=8"):
        small_config(aux_layer_ids=(1, 3, 8))
    with pytest.raises(ValueError, match="layer='gqa' is not a layer eaglelab builds; choose llama or qwen3 or mla"):
        small_config(layer="gqa")
    with pytest.raises(ValueError, match="drafter.layer=mla needs kv_lora_rank"):
        small_config(layer="mla", kv_lora_rank=0)


def test_vllm_config_roundtrip_and_eagle3_defaults():
    cfg = small_config(norm_before_residual=True, attention_window=16)
    assert Eagle3Config.from_vllm_config(cfg.to_vllm_config()) == cfg
    legacy = cfg.to_vllm_config()
    for key in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual", "eaglelab"):
        legacy.pop(key)
    old = Eagle3Config.from_vllm_config(legacy)  # an EAGLE-3 checkpoint: 3.1 flags default off
    assert (old.fc_norm, old.norm_output, old.norm_before_fc) == (False, False, False)
    assert old.layer == "llama"


def test_each_layer_exports_as_the_architecture_vllm_serves_it_as():
    """drafter.layer names the architecture vLLM's registry maps to its model class; a config that names another
    of that class's aliases reads as the same layer; one eaglelab cannot build is one line naming what it can."""
    qwen3 = small_config(layer="qwen3").to_vllm_config()
    assert (qwen3["architectures"], qwen3["model_type"]) == (["Eagle3Qwen3ForCausalLM"], "qwen3")
    assert Eagle3Config.from_vllm_config(qwen3) == small_config(layer="qwen3")
    with pytest.raises(ValueError, match="PeagleQwen3ForCausalLM is not a drafter eaglelab builds"):  # (parallel)
        Eagle3Config.from_vllm_config({**qwen3, "architectures": ["PeagleQwen3ForCausalLM"]})
    llama = small_config().to_vllm_config()
    assert Eagle3Config.from_vllm_config({**llama, "architectures": ["Eagle3LlamaForCausalLM"]}).layer == "llama"
    mla = small_config(layer="mla", q_lora_rank=20).to_vllm_config()
    assert (mla["architectures"], mla["model_type"]) == (["Eagle3DeepseekV2ForCausalLM"], "deepseek_v2")
    assert (mla["kv_lora_rank"], mla["q_lora_rank"], mla["qk_rope_head_dim"]) == (24, 20, 8) and mla["rope_interleave"]
    assert Eagle3Config.from_vllm_config(mla) == small_config(layer="mla", q_lora_rank=20)
    assert small_config(layer="mla").to_vllm_config()["q_lora_rank"] is None  # q projected directly
    with pytest.raises(ValueError, match="DFlashDraftModel is not a drafter eaglelab builds: .*qwen3"):
        Eagle3Config.from_vllm_config({**llama, "architectures": ["DFlashDraftModel"]})


def test_drafting_only_from_first_position_changes_nothing_there():
    cfg = small_config(num_layers=2)
    model = random_drafter(cfg)
    torch.manual_seed(6)
    aux, ids = torch.randn(3, 11, 144, dtype=torch.float64), torch.randint(0, 50, (3, 11))
    first = torch.tensor([0, 4, 9])
    full, packed = model.unroll(aux, ids, 4), model.unroll(aux, ids, 4, first=first)
    for j in range(4):
        for b in range(3):
            start = 0 if j == 0 else int(first[b])
            assert torch.allclose(full[j].normed[b, start:], packed[j].normed[b, start:], atol=1e-10)
            assert torch.count_nonzero(packed[j].normed[b, :start]) == 0


def _unroll_with(model, attention: str, aux, ids, steps, first):
    """The unroll through the fused kernel, or through the explicit softmax (what a probe sees)."""
    probe = (lambda *a: None) if attention == "explicit" else None
    for layer in model.layers:
        layer.self_attn.probe = probe
    try:
        return model.unroll(aux, ids, steps, first=first)
    finally:
        for layer in model.layers:
            layer.self_attn.probe = None


@pytest.mark.parametrize(
    "flags", [dict(), dict(num_layers=2), dict(attention_window=3, attention_sink_tokens=1)], ids=["1L", "2L", "window"]
)
def test_fused_attention_is_the_explicit_softmax_forward_and_backward(flags):
    """The sink-merged SDPA path against the written-out softmax over context and own drafts: the same outputs
    at every depth and the same gradients, with sequences that start drafting at different positions."""
    cfg = small_config(**flags)
    torch.manual_seed(7)
    aux, ids = torch.randn(3, 13, 144, dtype=torch.float64), torch.randint(0, 50, (3, 13))
    first = torch.tensor([2, 6, 10])
    grads, outs = {}, {}
    for attention in ("fused", "explicit"):
        model = random_drafter(cfg).train()
        steps = _unroll_with(model, attention, aux, ids, 4, first)
        loss = sum((s.normed * torch.linspace(-1, 1, s.normed.shape[-1], dtype=torch.float64)).sum() for s in steps)
        loss.backward()
        outs[attention] = [s.normed.detach() for s in steps]
        grads[attention] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for a, b in zip(outs["fused"], outs["explicit"]):
        assert (a - b).abs().max() < 1e-10
    assert grads["fused"].keys() == grads["explicit"].keys() and len(grads["fused"]) > 5
    for name, g in grads["fused"].items():
        assert (g - grads["explicit"][name]).abs().max() < 1e-9 * max(1.0, g.abs().max().item()), name


def test_activation_checkpointing_changes_no_gradient():
    cfg = small_config(num_layers=2)
    torch.manual_seed(8)
    aux, ids = torch.randn(2, 12, 144, dtype=torch.float64), torch.randint(0, 50, (2, 12))
    grads = []
    for checkpointing in (False, True):
        model = random_drafter(cfg).train()
        model.activation_checkpointing = checkpointing
        loss = sum(s.normed.pow(2).sum() for s in model.unroll(aux, ids, 3, first=torch.tensor([3, 7])))
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-12), name
