"""Exported drafters load and draft in the real vLLM engine (CPU build), and the in-house simulated
evaluator agrees with vLLM's own acceptance counters on the same prompts, k and checkpoint."""

import json

import pytest

from conftest import compose
from eaglelab.config import TargetConfig
from eaglelab.data.prompts import humaneval_prompts
from eaglelab.data.regenerate import template_prompt
from eaglelab.pipeline import run
from eaglelab.targets import load_target
from eaglelab.vllm_eval import measure_acceptance

K = 3


@pytest.mark.parametrize("ablation", [None, "eagle3"])  # an EAGLE-3.1 and an EAGLE-3 checkpoint
def test_vllm_loads_the_export_and_matches_the_simulated_evaluator(ablation, cache_dir, tmp_path):
    overrides = ["experiment=smoke"] + ([f"+ablation={ablation}"] if ablation else [])
    run_dir = run(compose(overrides, cache_dir, tmp_path / "run"))
    cfg = json.loads((run_dir / "drafter" / "config.json").read_text())
    assert cfg["fc_norm"] is (ablation is None) and cfg["norm_output"] is (ablation is None)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    target = load_target(TargetConfig(kind="tiny", dtype="float32"), cache_dir)
    prompts = [template_prompt(target.tokenizer, m, None) for m in humaneval_prompts()[:8]]  # smoke's eval set
    counts = measure_acceptance(target.path, run_dir / "drafter", prompts, k=K, max_new_tokens=24)
    tau_sim, tau_vllm = metrics[f"acceptance_length@k{K}"], counts.acceptance_length
    print(f"\n{ablation or 'eagle3.1'}: tau_sim={tau_sim:.4f} tau_vllm={tau_vllm:.4f} "
          f"per_pos_vllm={counts.per_position} drafts={counts.drafts}")
    assert counts.drafts > 0
    assert abs(tau_sim - tau_vllm) / tau_vllm <= 0.03, (tau_sim, tau_vllm)
    for i, rate in enumerate(counts.per_position, start=1):
        assert abs(metrics[f"acceptance_rate@k{K}@pos{i}"] - rate) <= 0.05
