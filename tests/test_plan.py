"""`stage=plan` (eaglelab.plan.cluster): the recipes' targets counted against hand counts of their architectures, the
engine shapes their weights need, and the plan the CLI's function prints for every recipe with no weight read."""

from pathlib import Path

import pytest

from eaglelab.core.errors import ConfigError
from eaglelab.plan.cluster import GPUS, EngineShape, engine_shape, plan, target_config, target_size

from conftest import compose

RECIPES = sorted(p.stem for p in (Path(__file__).parents[1] / "conf" / "recipe").glob("*.yaml"))


def recipe(name: str, cache_dir, tmp_path, *more: str):
    return compose([f"+recipe={name}", "stage=plan", *more], cache_dir, tmp_path / "run")


def test_a_dense_and_a_moe_target_are_counted_as_their_architectures_add_up(cache_dir, tmp_path):
    # Llama-3.1-8B: embedding and head, 32 layers of attention (GQA: 8 KV heads of 128), SwiGLU MLP and two norms
    H, V, L, F, kv = 4096, 128256, 32, 14336, 8 * 128
    layer = H * H + 2 * H * kv + H * H + 3 * H * F + 2 * H
    llama = target_size(target_config(recipe("llama3_8b", cache_dir, tmp_path)))
    assert llama.parameters == 2 * V * H + L * layer + H == 8_030_261_248  # (Meta's published count)
    assert llama.active == llama.parameters - V * H  # dense: all but the embedding table, a lookup
    assert llama.weight_bytes == 2 * llama.parameters  # bf16
    assert llama.kv_bytes_per_token == L * 2 * kv * 2

    # Qwen3-30B-A3B: 48 layers of attention (32 heads, 4 KV heads, q/k norms), a router and 128 experts of 768, 8 a
    # token
    H, V, L, E, k, F = 2048, 151936, 48, 128, 8, 768
    attention = H * 32 * 128 + 2 * H * 4 * 128 + 32 * 128 * H + 2 * 128
    experts = E * 3 * H * F
    layer = attention + E * H + experts + 2 * H
    moe = target_size(target_config(recipe("qwen3_30b_a3b", cache_dir, tmp_path)))
    assert moe.parameters == 2 * V * H + L * layer + H
    assert moe.active == moe.parameters - V * H - L * experts + L * experts * k / E
    assert 3.0e9 < moe.active < 3.1e9  # (Qwen's 3.3B counts the embedding table too: 3.04 + 0.31)


def test_quantised_weights_and_the_engines_they_need(cache_dir, tmp_path):
    kimi = target_size(target_config(recipe("kimi_k2", cache_dir, tmp_path)))
    assert 1.0e12 < kimi.parameters < 1.05e12 and 3.0e10 < kimi.active < 3.3e10  # "1T total, 32B activated"
    assert 1.0e12 < kimi.weight_bytes < 1.05e12  # fp8: a byte a linear weight
    assert kimi.kv_bytes_per_token == 61 * (512 + 64) * 2  # MLA's latent and RoPE key, bf16
    gpt_oss = target_size(target_config(recipe("gpt_oss_120b", cache_dir, tmp_path)))
    assert 6.0e10 < gpt_oss.weight_bytes < 7.0e10  # mxfp4 experts: the published checkpoint is ~65 GB
    llama = target_size(target_config(recipe("llama3_8b", cache_dir, tmp_path)))
    # An engine's weights take at most 60 % of a GPU: an 8B fits one H100; 1 TB needs 8-way TP and 3 stages
    # (1.03 TB / (8 × 48 GB) = 2.7), on H200s 2 stages (1.03 TB / (8 × 84.6 GB) = 1.5)
    assert engine_shape(llama, GPUS["H100"]) == EngineShape(tensor_parallel=1, pipeline_parallel=1)
    assert engine_shape(kimi, GPUS["H100"]) == EngineShape(tensor_parallel=8, pipeline_parallel=3)
    assert engine_shape(kimi, GPUS["H200"]).gpus == 16
    assert engine_shape(kimi, GPUS["GB200"]).tensor_parallel == 4  # a GB200 tray holds 4


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_plans_on_gb200_and_an_h100_node_without_its_weights(name, cache_dir, tmp_path):
    """The CLI's function on the recipe: plan.txt holds the plan, nothing else is written (no weights, prompts or
    tokenizer: the recipes' targets are nowhere on this machine), and a target that needs more GPUs than given is
    planned on engine nodes."""
    from eaglelab.pipeline import run

    for gpus in (["plan.gpu=H100", "plan.gpus=8"], ["plan.gpu=GB200", "plan.gpus=4"]):
        cfg = recipe(name, cache_dir, tmp_path, *gpus)
        run_dir = run(cfg)
        text = (run_dir / "plan.txt").read_text()
        assert sorted(p.name for p in run_dir.iterdir()) == ["plan.txt"]
        assert text.startswith(f"target: {cfg.recipe.name}") and "GPU-hours" in text and "assumed:" in text
        assert ("published: τ" in text) == bool(cfg.recipe.published)
        if name == "kimi_k2":
            assert "on engine nodes of their own" in text  # ~1 TB of weights never fits beside the trainers
        assert "does NOT fit" not in text  # every recipe's batch fits its trainers


def test_the_published_reference_is_the_recipes(cache_dir, tmp_path):
    cfg = recipe("llama3_8b", cache_dir, tmp_path)
    lines = [line for line in plan(cfg).lines if line.startswith("published:")]
    assert "published: τ 2.90 at k = 3 on mt_bench (SpecBundle dashboard" in lines[0]


def test_a_plan_that_cannot_be_made_is_one_line(cache_dir, tmp_path):
    with pytest.raises(ConfigError, match="plan.gpu=X100 is not known: one of A100, H100"):
        plan(recipe("llama3_8b", cache_dir, tmp_path, "plan.gpu=X100"))
    with pytest.raises(ConfigError, match=r"plan.utilization must be in \(0, 1\]"):
        recipe("llama3_8b", cache_dir, tmp_path, "plan.utilization=0")
    with pytest.raises(ConfigError, match="target.config needs model_type"):
        plan(compose(["stage=plan", "+target.config={hidden_size: 64}"], cache_dir, tmp_path / "r"))
