"""Config groups compose into the typed schema; ablations are derived configs, not code."""

import pytest
from hydra.errors import ConfigCompositionException

from eaglelab.core.errors import ConfigError
from eaglelab.evaluate.suites import check_suites

from conftest import compose


@pytest.mark.parametrize(
    "ablation,flags",
    [
        (None, dict(fc_norm=True, norm_output=True, norm_before_fc=False)),
        ("no_fc_norm", dict(fc_norm=False, norm_output=True, norm_before_fc=False)),
        ("no_norm_output", dict(fc_norm=True, norm_output=False, norm_before_fc=False)),
        ("eagle3", dict(fc_norm=False, norm_output=False, norm_before_fc=False)),
        ("norm_before_fc", dict(fc_norm=False, norm_output=True, norm_before_fc=True)),
    ],
)
def test_ablations(ablation, flags, tmp_path):
    """Written out by hand here, so a change to the variants table (eaglelab.models.variants) shows up as a failure."""
    overrides = [f"+ablation={ablation}"] if ablation else []
    cfg = compose(overrides, tmp_path, tmp_path / "run")
    assert {k: getattr(cfg.drafter, k) for k in flags} == flags
    assert cfg.variant == (ablation or "eagle3.1")


def test_every_variant_is_an_ablation_config_and_labels_its_own_flags(tmp_path):
    from eaglelab.models.variants import VARIANTS, ablation_name

    for name, flags in VARIANTS.items():
        cfg = compose([f"+ablation={ablation_name(name)}"], tmp_path, tmp_path / "r")
        assert cfg.variant == name and all(getattr(cfg.drafter, k) == v for k, v in flags.items())
    # A flag flipped by hand is labelled by what it is, not by the default's name
    assert compose(["drafter.norm_output=false"], tmp_path, tmp_path / "r").variant == "no_norm_output"
    assert compose(["+ablation=eagle3", "drafter.norm_before_fc=true"], tmp_path, tmp_path / "r").variant == "custom"


def test_conf_holds_only_what_differs_from_the_schema():
    """Every default has one home, the dataclasses: no YAML under conf/ restates a schema default."""
    from pathlib import Path

    import yaml
    from omegaconf import OmegaConf

    from eaglelab.core.config import RunConfig

    defaults = OmegaConf.to_container(OmegaConf.structured(RunConfig))
    root = Path(__file__).resolve().parents[1] / "conf"
    restated = []

    def walk(where, tree, ref, prefix=""):
        for k, v in tree.items():
            if isinstance(v, dict) and isinstance(ref.get(k), dict):
                walk(where, v, ref[k], f"{prefix}{k}.")
            elif isinstance(ref, dict) and k in ref and ref[k] == v and not (k == "kind" and v == Path(where).stem):
                restated.append(f"{where}: {prefix}{k}: {v}")  # (an entry's own `kind` names it: not a default)

    for path in sorted(root.rglob("*.yaml")):
        rel = path.relative_to(root)
        if rel.parts[0] == "hydra":
            continue  # Hydra's own settings
        text = path.read_text()
        node = yaml.safe_load(text) or {}
        node.pop("defaults", None)
        package = next(
            (line.split()[-1] for line in text.splitlines() if line.startswith("# @package")),
            "_global_" if rel.name == "config.yaml" else rel.parts[0],
        )
        base = defaults
        for key in [] if package == "_global_" else package.split("."):
            base = base.get(key, {}) if isinstance(base, dict) else {}
        walk(str(rel), node, base)
    assert not restated, restated


def test_defaults_and_smoke_experiment(tmp_path):
    cfg = compose([], tmp_path, tmp_path / "r")
    assert (cfg.target.kind, cfg.train.ttt_steps, cfg.train.step_decay, cfg.eval.prompts) == (
        "smollm2",
        3,
        0.8,
        "humaneval",
    )
    smoke = compose(["experiment=smoke"], tmp_path, tmp_path / "r")
    assert smoke.target.kind == "tiny"
    assert cfg.features.kind == "cached" and cfg.data.shard_size == 128
    for kind in ("online", "hybrid"):  # the features group
        assert compose([f"features={kind}"], tmp_path, tmp_path / "r").features.kind == kind


@pytest.mark.parametrize(
    "flags,cuda,accelerator,resolved",
    [
        ("fpu avx2 fma", None, "cpu", ("float32", "32-true")),  # an AVX2-only CPU (Zen 3): bf16 is emulated there
        ("fpu avx2 avx512f avx512_bf16", None, "cpu", ("bfloat16", "bf16-mixed")),  # Zen 4
        ("fpu avx2 avx512f amx_bf16 amx_tile", None, "cpu", ("bfloat16", "bf16-mixed")),  # Sapphire Rapids
        ("fpu avx2", "ampere", "gpu", ("bfloat16", "bf16-mixed")),
        ("fpu avx2", "volta", "gpu", ("float16", "16-mixed")),
        ("fpu avx2", "ampere", "auto", ("bfloat16", "bf16-mixed")),
        ("fpu avx2 avx512_bf16", None, "auto", ("bfloat16", "bf16-mixed")),
    ],
)
def test_auto_precision_is_what_the_machine_computes_fast(flags, cuda, accelerator, resolved, tmp_path, monkeypatch):
    """The defaults (target.dtype and train.precision `auto`) resolve at composition from the CPU's flags and the
    GPU's bfloat16 support. The CPU's /proc/cpuinfo and torch's CUDA queries are substituted (no such machines
    here); the file-reading query itself is tested on a written cpuinfo."""
    import torch

    import eaglelab.core.devices

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    real = eaglelab.core.devices.native_bf16_cpu
    monkeypatch.setattr(eaglelab.core.devices, "native_bf16_cpu", lambda: real(str(cpuinfo)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda is not None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda == "ampere")
    cfg = compose([f"train.accelerator={accelerator}"], tmp_path, tmp_path / "r")
    assert (cfg.target.dtype, cfg.train.precision) == resolved
    explicit = compose(["train.precision=bf16-mixed", "target.dtype=bfloat16"], tmp_path, tmp_path / "r")
    assert (explicit.target.dtype, explicit.train.precision) == ("bfloat16", "bf16-mixed")  # asked for: kept


def test_vllm_measures_k_1_ttt_and_max_k_unless_asked_for_every_k_or_named_ks(tmp_path):
    """One engine per depth: the run's default is below, at and past the trained depth; every_k is the full sweep
    (each engine of it is started the same way: tests/test_vllm.py runs the default three)."""
    from eaglelab.core.config import vllm_ks

    assert vllm_ks(compose(["experiment=smoke"], tmp_path, tmp_path / "r")) == [1, 3, 8]
    assert vllm_ks(compose(["experiment=smoke", "eval.vllm.every_k=true"], tmp_path, tmp_path / "r")) == list(
        range(1, 9)
    )
    assert vllm_ks(compose(["train.ttt_steps=1", "eval.vllm.ks=[5,2,5]"], tmp_path, tmp_path / "r")) == [2, 5]


def test_suites_are_config_group_entries(tmp_path):
    from eaglelab.core.config import max_k, suite_ks

    cfg = compose([], tmp_path, tmp_path / "r")
    s = cfg.eval.suites
    assert (s.extrapolation.enabled, s.drift.enabled, s.long_context.enabled, s.templates.enabled) == (
        True,
        True,
        False,
        False,
    )
    assert max_k(cfg) == 8 and suite_ks(cfg) == [3]
    assert max_k(compose(["train.ttt_steps=2"], tmp_path, tmp_path / "r")) == 8  # max(8, 2·ttt+2)
    assert max_k(compose(["train.ttt_steps=5"], tmp_path, tmp_path / "r")) == 12
    assert max_k(compose(["eval.suites.extrapolation.enabled=false"], tmp_path, tmp_path / "r")) == 3
    both = compose(["+suite=[long_context,templates]"], tmp_path, tmp_path / "r").eval.suites
    assert both.long_context.enabled and both.templates.enabled
    every = compose(["+suite=all"], tmp_path, tmp_path / "r").eval.suites
    assert all(getattr(every, name).enabled for name in ("extrapolation", "long_context", "templates", "drift"))


@pytest.mark.parametrize(
    "override,message",
    [
        ("drafter.norm_before_fc=true", "mutually exclusive"),
        ("train.ttt_steps=0", "train.ttt_steps must be > 0"),
        ("train.lr=-1", "train.lr must be > 0"),
        ("train.step_decay=1.5", "train.step_decay"),
        ("+train.no_such_key=1", "no_such_key"),
        ("eval.suites.long_context.lengths=[8]", "lengths must be token counts"),
        ("eval.suites.drift.num_prompts=0", "eval.suites.drift.num_prompts must be > 0"),
        ("data.val_prompts=-1", r"data.val_prompts must be >= 0"),
        ("eval.vllm.concurrencies=[0]", "eval.vllm.concurrencies must hold values >= 1"),
        ("eval.vllm.served_temperature=-0.5", "eval.vllm.served_temperature must be >= 0"),
        ("drafter.aux_layer_ids=[15,2,27]", r"must be sorted and unique .*; use \[2, 15, 27\]"),
        ("drafter.aux_layer_ids=[]", "drafter.aux_layer_ids is empty"),
        ("drafter.aux_layer_ids=[0,2]", "ids must be in 1..L-1"),
        ("data.shard_size=0", "data.shard_size must be > 0"),
        ("data.tail_for_ttt=-1", r"data.tail_for_ttt must be >= 0 \(a TTT length"),
        ("train.prefetch_gb=0", "train.prefetch_gb must be > 0"),
        ("data.val_prompts=0", "train.keep=best chooses by validation τ .* or set train.keep=last"),
        ("data.self_chat.temperature=0", "data.self_chat needs temperature > 0"),
        ("train.freeze_lm_head=true drafter.init_lm_head_from_target=false", "would keep a random lm_head"),
    ],
)
def test_bad_values_fail_with_the_key_named(override, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        compose(override.split(" "), tmp_path, tmp_path / "r")  # one or more overrides


@pytest.mark.parametrize(
    "override,choices",
    [
        ("train.loss=mse", "['ce', 'kl', 'rkl', 'jsd', 'tv', 'nla', 'lk_hybrid']"),
        ("train.precision=fp8", "'bf16-mixed'"),
        ("target.dtype=int4", "'bfloat16'"),
        ("logger.mode=live", "'offline'"),
        ("data.regen_backend=sglang", "'vllm'"),
        ("features.kind=streamed", "'hybrid'"),
    ],
)
def test_fixed_choices_are_rejected_by_composition_with_the_choices_listed(override, choices, tmp_path):
    with pytest.raises(ConfigCompositionException) as info:
        compose([override], tmp_path, tmp_path / "r")
    assert choices in str(info.value.__cause__) and override.split("=")[0].split(".")[-1] in str(info.value.__cause__)


@pytest.mark.parametrize(
    "override,message",
    [
        ("eval.suites.templates.conditions=[native,chatml_v9]", "chatml_v9"),
        ("eval.suites.templates.conditions=[no_template]", "native missing"),
        ("eval.suites.templates.conditions=[native,native]", "lists a condition twice"),
    ],
)
def test_suite_settings_are_checked_by_the_suites(override, message, tmp_path):
    cfg = compose([override], tmp_path, tmp_path / "r")  # the schema cannot know the suites' tables
    with pytest.raises(ConfigError, match=message):
        check_suites(cfg)


def test_capture_backend_auto_is_vllm_where_vllm_regenerates_on_cuda():
    from eaglelab.core.config import resolve_capture_backend

    assert resolve_capture_backend("auto", "vllm", cuda=True) == "vllm"
    assert resolve_capture_backend("auto", "vllm", cuda=False) == "hf"  # measured faster on a CPU (docs)
    assert resolve_capture_backend("auto", "hf", cuda=True) == "hf"  # captured inside the HF regeneration
    assert resolve_capture_backend("vllm", "hf", cuda=False) == "vllm"  # asked for: kept


@pytest.mark.parametrize(
    "overrides, gpus, mem_gb",
    [
        (["train.devices=8", "train.accelerator=gpu"], 8, 72),  # an 8B trial's node: 8 ranks of 7 + 2 GB
        (["train.devices=1", "data.tensor_parallel_size=16", "stage=prepare"], 16, 112),  # a large target's prepare
        (["train.devices=8", "train.prefetch_gb=3.5"], 8, 88),
        (["train.devices=2"], 2, 64),  # never under the 64 GB asked before (the engines beside the ranks)
    ],
)
def test_the_slurm_launcher_asks_for_the_gpus_and_memory_the_trial_needs(overrides, gpus, mem_gb):
    """gpus_per_node: the ranks' or the data engine's, whichever is more; mem_gb: every rank's host memory, 8B-sized
    (eaglelab.core.resolvers.RANK_HOST_GB), plus its loader's read-ahead, or as much for each of the data engine's
    workers; at least 64 GB."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from conftest import ROOT

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = hydra_compose("config", overrides=["hydra/launcher=slurm", *overrides], return_hydra_config=True)
    assert OmegaConf.select(cfg, "hydra.launcher.gpus_per_node") == gpus
    assert OmegaConf.select(cfg, "hydra.launcher.mem_gb") == mem_gb
