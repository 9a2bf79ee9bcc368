"""Config groups compose into the typed schema; ablations are derived configs, not code."""

import pytest

from conftest import compose
from eaglelab.errors import ConfigError


@pytest.mark.parametrize("ablation,flags", [
    (None, dict(fc_norm=True, norm_output=True, norm_before_fc=False)),
    ("no_fc_norm", dict(fc_norm=False, norm_output=True, norm_before_fc=False)),
    ("no_norm_output", dict(fc_norm=True, norm_output=False, norm_before_fc=False)),
    ("eagle3", dict(fc_norm=False, norm_output=False, norm_before_fc=False)),
    ("norm_before_fc", dict(fc_norm=False, norm_output=True, norm_before_fc=True)),
])
def test_ablations(ablation, flags, tmp_path):
    overrides = [f"+ablation={ablation}"] if ablation else []
    cfg = compose(overrides, tmp_path, tmp_path / "run")
    assert {k: getattr(cfg.drafter, k) for k in flags} == flags
    assert cfg.variant == (ablation or "eagle3.1")


def test_defaults_and_smoke_experiment(tmp_path):
    cfg = compose([], tmp_path, tmp_path / "r")
    assert (cfg.target.kind, cfg.train.ttt_steps, cfg.train.step_decay, cfg.eval.prompts) == ("smollm2", 3, 0.8, "humaneval")
    smoke = compose(["experiment=smoke"], tmp_path, tmp_path / "r")
    assert smoke.target.kind == "tiny"


def test_suites_are_config_group_entries(tmp_path):
    from eaglelab.config import max_k, suite_ks

    cfg = compose([], tmp_path, tmp_path / "r")
    s = cfg.eval.suites
    assert (s.extrapolation.enabled, s.drift.enabled, s.long_context.enabled, s.templates.enabled) == (
        True, True, False, False)
    assert max_k(cfg) == 8 and suite_ks(cfg) == [3]
    assert max_k(compose(["train.ttt_steps=2"], tmp_path, tmp_path / "r")) == 8  # max(8, 2·ttt+2)
    assert max_k(compose(["train.ttt_steps=5"], tmp_path, tmp_path / "r")) == 12
    assert max_k(compose(["eval.suites.extrapolation.enabled=false"], tmp_path, tmp_path / "r")) == 3
    both = compose(["+suite=[long_context,templates]"], tmp_path, tmp_path / "r").eval.suites
    assert both.long_context.enabled and both.templates.enabled
    every = compose(["+suite=all"], tmp_path, tmp_path / "r").eval.suites
    assert all(getattr(every, name).enabled for name in ("extrapolation", "long_context", "templates", "drift"))


@pytest.mark.parametrize("override,message", [
    ("drafter.norm_before_fc=true", "mutually exclusive"),
    ("train.ttt_steps=0", "train.ttt_steps must be > 0"),
    ("train.lr=-1", "train.lr must be > 0"),
    ("train.loss=mse", "train.loss"),
    ("train.step_decay=1.5", "train.step_decay"),
    ("+train.no_such_key=1", "no_such_key"),
    ("eval.suites.templates.conditions=[native,chatml_v9]", "chatml_v9"),
    ("eval.suites.templates.conditions=[no_template]", "native missing"),
    ("eval.suites.long_context.lengths=[8]", "lengths must be token counts"),
    ("eval.suites.drift.num_prompts=0", "eval.suites.drift.num_prompts must be > 0"),
])
def test_bad_values_fail_with_the_key_named(override, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        compose([override], tmp_path, tmp_path / "r")
