"""The real embedded target end to end with a tiny budget, so the SmolLM2 path (GGUF conversion, chat
template, capture at vLLM's layer ids) can never rot unseen."""

import json

import pytest
import torch

from eaglelab.data.capture import aux_hooks
from eaglelab.pipeline import run
from eaglelab.targets import load_target

from conftest import compose


@pytest.fixture(scope="module")
def smollm2_run(cache_dir, tmp_path_factory):
    overrides = [
        "data.num_prompts=6",
        "data.max_new_tokens=16",
        "data.regen_batch_size=6",
        "eval.num_prompts=4",
        "eval.max_new_tokens=16",
        "train.epochs=1",
        "drafter.draft_vocab_size=512",
        "data.val_fraction=0.3",
    ]
    return run(compose(overrides, cache_dir, tmp_path_factory.mktemp("smollm2") / "run"))


def test_whole_loop_on_the_embedded_target(smollm2_run):
    metrics = json.loads((smollm2_run / "metrics.json").read_text())
    assert metrics["data/train_sequences"] >= 1 and metrics["data/eval_sequences"] == 4
    assert 1.0 <= metrics["acceptance_length@k3"] <= 4.0
    exported = json.loads((smollm2_run / "drafter/config.json").read_text())
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # L = 30
    assert exported["target_hidden_size"] == 576 and exported["vocab_size"] == 49152
    assert (exported["fc_norm"], exported["norm_output"]) == (True, True)


def test_capture_uses_vllm_layer_ids(smollm2_run, cache_dir):
    """vLLM id k = hidden state after k layers = HF hidden_states[k]; the hooks must grab exactly it."""
    from eaglelab.config import TargetConfig

    target = load_target(TargetConfig(kind="smollm2"), cache_dir)  # converted by the run above
    ids = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=True
    )
    ids = torch.tensor([list(ids["input_ids"] if hasattr(ids, "keys") else ids)])
    assert target.tokenizer.decode(ids[0]).startswith("<|im_start|>system")  # ChatML, SmolLM2's template
    with torch.no_grad(), aux_hooks(target.model, [2, 15, 27]) as grabbed:
        out = target.model(ids, output_hidden_states=True)
    for k in (2, 15, 27):
        assert torch.equal(grabbed[k], out.hidden_states[k])
    assert torch.equal(grabbed["final"], out.hidden_states[-1])
