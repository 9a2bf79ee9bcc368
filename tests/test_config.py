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


@pytest.mark.parametrize("override,message", [
    ("drafter.norm_before_fc=true", "mutually exclusive"),
    ("train.ttt_steps=0", "train.ttt_steps must be > 0"),
    ("train.lr=-1", "train.lr must be > 0"),
    ("train.loss=mse", "train.loss"),
    ("train.step_decay=1.5", "train.step_decay"),
    ("+train.no_such_key=1", "no_such_key"),
])
def test_bad_values_fail_with_the_key_named(override, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        compose([override], tmp_path, tmp_path / "r")
