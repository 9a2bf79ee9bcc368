"""Drafters in speculators' format: eaglelab writes it with every tensor, reads it back (and what speculators' own
converter writes) as the same drafter, reads each flag as vLLM does, and names what a file it cannot read lacks."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from test_drafter import random_drafter, small_config

from eaglelab.core.errors import EaglelabError
from eaglelab.export.eagle3 import TargetShape, load_drafter, main, save_drafter, save_speculators
from eaglelab.export.speculators import from_speculators_config, to_speculators_config


def _verifier(folder):
    """A target's config.json, all a converter and a speculators export read of the verifier."""
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 50, "hidden_size": 48}
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 8}))
    return folder


@pytest.mark.parametrize(
    "flags",
    [
        dict(),
        dict(fc_norm=False, norm_output=False, norm_before_residual=True),
        dict(layer="qwen3", num_layers=2),
        dict(fc_norm=False, norm_before_fc=True),
    ],  # fmt: skip
    ids=["eagle3.1", "eagle3_residual", "qwen3_two_layers", "norm_before_fc"],
)
def test_a_speculators_export_reads_back_as_the_same_drafter(flags, tmp_path):
    model = random_drafter(small_config(**flags)).float()
    out = save_speculators(model, tmp_path / "spec", str(_verifier(tmp_path / "target")))
    config = json.loads((out / "config.json").read_text())
    assert config["transformer_layer_config"]["model_type"] == model.cfg.layer
    assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    names = set(load_file(str(out / "model.safetensors")))
    assert not [n for n in names if n.startswith("midlayer.")]  # speculators' names: layers.{i}.*
    back = load_drafter(out, model.embed_tokens.weight)
    assert back.cfg == replace(model.cfg, target_num_layers=0)  # (eaglelab's own field: vLLM's export keeps it)
    theirs = back.state_dict()
    assert all(torch.equal(t, theirs[n]) for n, t in model.state_dict().items())


def test_flags_are_read_as_vllm_reads_them():
    """vLLM's update_eagle3: a missing norm_before_residual is true, the other flags false; null aux ids are the
    target's default ones; only eagle3 drafters are EAGLE-3 drafters."""
    config = to_speculators_config(small_config(), "t", ["LlamaForCausalLM"])
    for flag in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"):
        config.pop(flag)
    config["eagle_aux_hidden_state_layer_ids"] = None
    cfg = from_speculators_config(config, default_aux=[2, 4, 5])
    assert (cfg.fc_norm, cfg.norm_output, cfg.norm_before_fc, cfg.norm_before_residual) == (False, False, False, True)
    assert cfg.aux_layer_ids == (2, 4, 5)
    with pytest.raises(ValueError, match="null and no target"):
        from_speculators_config(config, default_aux=None)
    with pytest.raises(ValueError, match="'dflash': eaglelab reads EAGLE-3 drafters"):
        from_speculators_config({**config, "speculators_model_type": "dflash"}, [2, 4, 5])
    layer = {**config["transformer_layer_config"], "model_type": "deepseek_v3"}
    with pytest.raises(ValueError, match="'deepseek_v3': speculators' eagle3 layers are llama, qwen3"):
        from_speculators_config({**config, "transformer_layer_config": layer}, [2, 4, 5])


def test_speculators_converter_output_that_lost_its_fc_norm_is_refused_naming_the_tensors(tmp_path):
    """speculators 0.9.0's Eagle3Converter builds its legacy model without per-layer fc_norm, so it drops those
    tensors ("Unexpected keys") while writing fc_norm: true: such a drafter would be served with norms it never had.
    eaglelab refuses it in one line naming them; a drafter without fc_norm converts whole."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    target = _verifier(tmp_path / "target")
    for flags, name in ((dict(fc_norm=True), "fc31"), (dict(fc_norm=False), "fc3")):
        model = random_drafter(small_config(**flags)).float()
        save_drafter(model, tmp_path / name)
        Eagle3Converter().convert(tmp_path / name, tmp_path / f"{name}-spec", base_model=str(target), validate=False)
    shape = TargetShape(hidden_size=48, vocab_size=50, num_layers=8)  # the converter nulls the aux ids: the target's
    with pytest.raises(EaglelabError, match=r"missing \['fc_norm.0.weight', 'fc_norm.1.weight', 'fc_norm.2.weight'\]"):
        load_drafter(tmp_path / "fc31-spec", torch.zeros(50, 64), shape)
    with pytest.raises(EaglelabError, match="eagle_aux_hidden_state_layer_ids is null and no target is given"):
        load_drafter(tmp_path / "fc3-spec", torch.zeros(50, 64))
    whole = load_drafter(tmp_path / "fc3-spec", torch.zeros(50, 64), shape)
    assert not whole.cfg.fc_norm and whole.cfg.aux_layer_ids == (2, 4, 5)  # vLLM's default ids of an 8-layer target
    # the export CLI reads the target's shape (its default ids) from --verifier
    assert main([str(tmp_path / "fc3-spec"), str(tmp_path / "back"), "--verifier", str(target)]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def test_an_mla_drafter_has_no_speculators_form(tmp_path):
    with pytest.raises(EaglelabError, match="drafter.layer=mla: speculators' format has llama and qwen3 layers only"):
        save_speculators(random_drafter(small_config(layer="mla")).float(), tmp_path / "s", "t")
    assert not (tmp_path / "s").exists()


def test_the_export_cli_writes_either_format(tmp_path, capsys):
    model = random_drafter(small_config(layer="qwen3")).float()
    save_drafter(model, tmp_path / "drafter")
    assert main([str(tmp_path / "drafter"), str(tmp_path / "spec"), "--format", "speculators"]) == 2
    assert "names no target; pass --verifier TARGET" in capsys.readouterr().err
    assert not (tmp_path / "spec").exists()  # nothing half-written
    target = _verifier(tmp_path / "target")
    assert main([str(tmp_path / "drafter"), str(tmp_path / "spec"), "--format", "speculators", "--verifier",
                 str(target)]) == 0  # fmt: skip
    assert load_drafter(tmp_path / "spec", torch.zeros(50, 64)).cfg.layer == "qwen3"
