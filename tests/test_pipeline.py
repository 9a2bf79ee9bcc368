"""The whole loop on the tiny target, through the same `run` the CLI calls."""

import json

import pytest
import yaml

from eaglelab.pipeline import run

from conftest import compose


@pytest.fixture(scope="module")
def smoke_runs(cache_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("smoke")
    first = run(compose(["experiment=smoke"], cache_dir, root / "a"))
    second = run(compose(["experiment=smoke"], cache_dir, root / "b"))
    return first, second


def test_smoke_run_writes_the_documented_layout(smoke_runs):
    run_dir, _ = smoke_runs
    for name in (
        "config.yaml",
        "run.json",
        "metrics.json",
        "acceptance.csv",
        "per_position.csv",
        "acceptance.png",
        "drafter/config.json",
        "drafter/model.safetensors",
        "lightning/last.ckpt",
        "logs/metrics.csv",
        "suites/drift.csv",
        "suites/fc_balance.csv",
        "suites/drift.png",
        "suites/extrapolation.csv",
        "suites/extrapolation.png",
    ):
        assert (run_dir / name).is_file(), name
    metrics = json.loads((run_dir / "metrics.json").read_text())
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "complete" and info["variant"] == "eagle3.1"
    # τ for k = 1..2·ttt+2 = 8, validation τ at k = ttt_steps and 2·ttt_steps, per-depth accuracy.
    for k in range(1, 9):
        assert 1.0 <= metrics[f"acceptance_length@k{k}"] <= k + 1
    assert {"val/acceptance_length@k3", "val/acceptance_length@k6", "val/acc@d1", "val/acc@d6"} <= set(metrics)
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["resolved"]["aux_layer_ids"] == [2, 4, 5]  # (2, L//2, L-3) for the tiny L=8
    exported = json.loads((run_dir / "drafter/config.json").read_text())
    assert exported["fc_norm"] is True and exported["norm_output"] is True


def test_same_seed_gives_identical_metrics(smoke_runs):
    a, b = (json.loads((d / "metrics.json").read_text()) for d in smoke_runs)
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith(("time/", "memory/"))}
    assert strip(a) == strip(b)
    # The second run reused the cache prepared by the first.
    assert b["time/regenerate_s"] < a["time/regenerate_s"] or a["time/regenerate_s"] < 1.0


def test_ablation_changes_the_exported_flags_and_kl_loss_trains(cache_dir, tmp_path):
    run_dir = run(
        compose(["experiment=smoke", "+ablation=eagle3", "train.epochs=1", "train.loss=kl"], cache_dir, tmp_path / "e3")
    )
    exported = json.loads((run_dir / "drafter/config.json").read_text())
    assert (exported["fc_norm"], exported["norm_output"]) == (False, False)
    assert json.loads((run_dir / "run.json").read_text())["variant"] == "eagle3"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["train/loss"] == metrics["train/loss"] and metrics["train/loss"] > 0  # finite KL


def test_hf_target_of_another_family(cache_dir, tmp_path):
    """target=hf on a local Qwen2-architecture folder (random weights, a ChatML tokenizer)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from eaglelab.targets import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tok),
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=6,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
    )
    model.save_pretrained(tmp_path / "qwen2-tiny")
    tok.save_pretrained(tmp_path / "qwen2-tiny")
    run_dir = run(
        compose(
            [
                "experiment=smoke",
                "target=hf",
                f"target.name_or_path={tmp_path / 'qwen2-tiny'}",
                "target.dtype=float32",
                "train.epochs=1",
            ],
            cache_dir,
            tmp_path / "run",
        )
    )
    exported = json.loads((run_dir / "drafter/config.json").read_text())
    # (2, L//2, L-3) = (2, 3, 3) at L=6: vLLM collects each id once, so the default keeps the distinct ones
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3]
    assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 3]  # also at the top level, for older vLLM
    assert json.loads((run_dir / "run.json").read_text())["target"].startswith("hf:")


def test_run_writes_an_acceptance_figure(smoke_runs):
    from PIL import Image

    image = Image.open(smoke_runs[0] / "acceptance.png")
    assert image.size[0] > 600 and image.size[1] > 200


def test_online_and_hybrid_features_train_like_cached(tmp_path):
    """features=hybrid computes the states in epoch 1 and publishes them as the cached entry; features=online
    stores only tokens; all three train the same drafter (the tiny target is float32 and the cache keeps bf16
    states, so cached and online differ by that rounding only)."""
    cache = tmp_path / "cache"
    overrides = ["experiment=smoke", "eval.suites.drift.enabled=false", "eval.suites.extrapolation.enabled=false"]
    runs = {}
    for kind in ("hybrid", "online", "cached"):  # cached last: it reuses what hybrid published
        run_dir = run(compose([*overrides, f"features={kind}"], cache, tmp_path / kind))
        runs[kind] = json.loads((run_dir / "metrics.json").read_text())
    entries = [p for p in (cache / "features").iterdir()]
    published = [p for p in entries if (p / "complete.json").is_file()]
    assert not [p for p in entries if ".partial-" in p.name], "hybrid leaves no partial entry behind"
    first_file = lambda p: json.loads((p / "complete.json").read_text())["shards"][0]["file"]
    # hybrid's entry: one shard per process and attempt (not the capture's shard-NNNNN)
    written_online = [p for p in published if not first_file(p).startswith("shard")]
    assert len(written_online) == 1, "hybrid published the training states it computed in its first epoch"
    assert runs["cached"]["time/capture_s"] < runs["hybrid"]["time/train_s"]  # reused: no capture pass
    for kind in ("online", "cached"):
        for key in ("acceptance_length@k3", "val/acc@d1"):
            assert runs[kind][key] == pytest.approx(runs["hybrid"][key], rel=0.05), (kind, key)
    # Tokens only: int32 ids against bf16 states of 3 aux layers (H = 128): ~1% of the bytes.
    assert runs["online"]["data/disk_bytes_per_token"] < 0.02 * runs["cached"]["data/disk_bytes_per_token"]
