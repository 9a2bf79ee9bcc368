"""The whole loop on the tiny target, through the same `run` the CLI calls."""

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml
from run_tables import check_acceptance_tables, read_csv

from eaglelab.pipeline import run

from conftest import compose


class SmokeRuns(NamedTuple):
    a: Path
    b: Path  # the same config and seed again, on the cache `a` filled
    cache_after_a: dict[str, int]  # every file of the cache's regen/ and features/ entries -> mtime (ns)
    cache_after_b: dict[str, int]


def cache_files(cache_dir: Path) -> dict[str, int]:
    return {
        str(p.relative_to(cache_dir)): p.stat().st_mtime_ns
        for kind in ("regen", "features")
        for p in (cache_dir / kind).rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def smoke_runs(cache_dir, tmp_path_factory) -> SmokeRuns:
    root = tmp_path_factory.mktemp("smoke")
    first = run(compose(["experiment=smoke"], cache_dir, root / "a"))
    after_first = cache_files(cache_dir)
    second = run(compose(["experiment=smoke"], cache_dir, root / "b"))
    return SmokeRuns(first, second, after_first, cache_files(cache_dir))


def test_smoke_run_writes_the_documented_layout(smoke_runs):
    run_dir = smoke_runs.a
    for name in (
        "config.yaml",
        "run.json",
        "metrics.json",
        "acceptance.csv",
        "per_position.csv",
        "depth_accuracy.csv",
        "acceptance.png",
        "drafter/config.json",
        "drafter/model.safetensors",
        "lightning/last.ckpt",
        "logs/metrics.csv",
        "suites/drift.csv",
        "suites/drift_per_prompt.csv",
        "suites/drift_inputs.json",
        "suites/fc_balance.csv",
        "suites/drift.png",
        "suites/extrapolation.csv",
        "suites/extrapolation.png",
    ):
        assert (run_dir / name).is_file(), name
    metrics = json.loads((run_dir / "metrics.json").read_text())
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "complete" and info["variant"] == "eagle3.1"
    # τ for k = 1..2·ttt+2 = 8, recomputed from the tables; validation τ at k = ttt_steps and 2·ttt_steps,
    # per-depth accuracy.
    assert sorted(check_acceptance_tables(run_dir, metrics)) == list(range(1, 9))
    assert {"val/acceptance_length@k3", "val/acceptance_length@k6", "val/acc@d1", "val/acc@d6"} <= set(metrics)
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["resolved"]["aux_layer_ids"] == [2, 4, 5]  # (2, L//2, L-3) for the tiny L=8
    exported = json.loads((run_dir / "drafter/config.json").read_text())
    assert exported["fc_norm"] is True and exported["norm_output"] is True


def test_a_run_ends_by_saying_what_it_found(smoke_runs):
    """The summary src/run.py prints last (eaglelab.results.summary) quotes the run's own results: τ at the trained
    depth and the deepest one, the drift headline from the drift table, and the figures that exist."""
    from eaglelab.results.summary import has_results, run_summary

    run_dir = smoke_runs.a
    metrics = json.loads((run_dir / "metrics.json").read_text())
    lines = run_summary(run_dir)
    text = "\n".join(lines)
    assert lines[0].startswith("summary: eagle3.1 (seed 0) on ") and f"{int(metrics['train/steps'])} steps" in lines[0]
    n = metrics["held_out_prompts"]  # (every held-out prompt: what the simulated figure is over)
    assert f"τ@3 (the trained depth): simulated {metrics['acceptance_length@k3']:.3f} over {n} prompts\n" in text
    assert f"τ@8 (deepest measured): simulated {metrics['acceptance_length@k8']:.3f} over {n} prompts\n" in text
    assert "  vLLM: not run (eval.vllm.enabled=false, or not installed)" in lines  # (the smoke experiment's setting)
    drift = next(line for line in lines if line.startswith("  drift: "))
    first, deepest = metrics["drift/context_share@d1"], metrics["drift/context_share@d8"]
    assert f"{first:.2f} at depth 1 -> {deepest:.2f} at depth 8" in drift
    assert "served speedup" not in text  # no vLLM in this run: nothing to serve, nothing to hint
    figures = next(line for line in lines if line.startswith("  figures: "))
    for name in ("acceptance.png", "suites/drift.png", "suites/extrapolation.png"):
        assert name in figures and (run_dir / name).is_file()
    assert has_results(run_dir)


def test_the_drift_suite_agrees_with_its_independent_check_on_a_trained_run(smoke_runs, capsys):
    """analysis/drift_check.py recomputes every drift measure of a trained run from its exported drafter, the
    target's embedding and the suite's own sequences (drift_inputs.json); and refuses a table that was altered."""
    from analysis import drift_check

    run_dir = smoke_runs.a
    assert drift_check.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "agree" in out and "drafts per depth equal" in out
    altered = run_dir.parent / "altered"
    shutil.copytree(run_dir, altered)
    table = (altered / "suites/drift.csv").read_text().splitlines()
    head, row = table[0].split(","), table[3].split(",")
    row[head.index("sink_share")] = str(float(row[head.index("sink_share")]) + 1e-3)
    (altered / "suites/drift.csv").write_text("\n".join([*table[:3], ",".join(row), *table[4:]]) + "\n")
    assert drift_check.main([str(altered)]) == 1
    assert "sink_share     largest gap 1.00e-03 (depth 3)" in capsys.readouterr().out


def test_attention_regions_partition_every_drafts_attention(smoke_runs, tmp_path):
    """analysis/attention_regions.py: each key in exactly one region, so each depth's shares sum to 1; own drafts
    get nothing at depth 1 and the local context holds the query's own key."""
    import pandas as pd
    import torch

    from analysis import attention_regions

    regions = attention_regions.region_of(torch.arange(20), t=12, prompt_len=6, recent=4)
    names = [attention_regions.REGIONS[int(r)] for r in regions]
    assert names[0] == "first token" and set(names[1:6]) == {"prompt"} and set(names[6:9]) == {"earlier answer"}
    assert set(names[9:13]) == {"local context"} and set(names[13:]) == {"own drafts"}
    assert attention_regions.main([str(smoke_runs.a), "--sequences", "2", "--out", str(tmp_path)]) == 0
    table = pd.read_csv(tmp_path / "attention_regions.csv")
    assert table.groupby("depth")["mean"].sum().to_numpy() == pytest.approx(1.0, abs=1e-9)
    first = table[table["depth"] == 1].set_index("region")["mean"]
    assert first["own drafts"] == 0 and first["local context"] > 0
    assert (tmp_path / "attention_regions.png").stat().st_size > 1000


def test_same_seed_gives_identical_metrics(smoke_runs):
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (smoke_runs.a, smoke_runs.b))
    # (data/shards_prepared: a prepared the entries b reads)
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith(("time/", "memory/", "data/shards_prepared"))}
    assert strip(a) == strip(b)


def test_a_second_run_reads_the_cache_the_first_filled(smoke_runs):
    """Same target and data: the second run adds no regeneration or capture entry and rewrites no file of the
    entries the first one left (tokens, states, their complete.json)."""
    after_a, after_b = smoke_runs.cache_after_a, smoke_runs.cache_after_b
    assert any(f.startswith("regen/") for f in after_a) and any(f.startswith("features/") for f in after_a)
    assert after_b == after_a
    metrics = [json.loads((d / "metrics.json").read_text()) for d in smoke_runs[:2]]
    assert metrics[1]["data/shards_prepared"] == 0
    # An HF regeneration loads the target's model (the first run's, unless another test of this process prepared the
    # same data first); the second run, training from the cache, never loads it.
    assert metrics[0]["memory/target_loaded"] == int(metrics[0]["data/shards_prepared"] > 0)
    assert metrics[1]["memory/target_loaded"] == 0


def test_stage_prepare_fills_the_cache_a_trial_then_trains_from(cache_dir, tmp_path):
    """`stage=prepare` runs the data stage alone (training, held-out and suite sets) and exits with its data
    metrics; a trial of the same config then prepares nothing and trains."""
    overrides = ["experiment=smoke", "data.seed=11"]  # a data set no other test prepares
    prepared = run(compose([*overrides, "stage=prepare"], cache_dir, tmp_path / "prepare"))
    metrics = json.loads((prepared / "metrics.json").read_text())
    assert metrics["data/shards_prepared"] > 0 and metrics["data/train_tokens"] > 0
    assert not (prepared / "drafter").exists() and "time/train_s" not in metrics
    trial = run(compose(overrides, cache_dir, tmp_path / "trial"))
    metrics = json.loads((trial / "metrics.json").read_text())
    assert metrics["data/shards_prepared"] == 0 and "val/acceptance_length@k3" in metrics


def test_training_raises_tau_over_the_untrained_drafter(smoke_runs, cache_dir):
    """The smoke run's drafter against the same drafter before training (its initialisation from the target, the
    same draft vocabulary) on the same held-out sequences, with the simulated evaluator."""
    import lightning as L

    from eaglelab.core.config import max_k
    from eaglelab.data.stage import prepare_data, select_prompts
    from eaglelab.data.targets import load_target
    from eaglelab.evaluate.held_out import evaluate_simulated
    from eaglelab.export.eagle3 import TargetShape, load_checkpoint
    from eaglelab.pipeline import build_model_config
    from eaglelab.train.fit import init_from_target
    from eaglelab.train.ttt_module import DrafterModule

    cfg = compose(["experiment=smoke"], cache_dir, smoke_runs.a)
    target = load_target(cfg.target, cfg.paths.cache_dir)
    model_cfg = build_model_config(cfg, target)
    held_out = prepare_data(cfg, target, model_cfg, select_prompts(cfg), train=False).held_out
    weights = target.weights()
    shape = TargetShape(target.hidden_size, target.vocab_size, target.num_layers)
    trained = load_checkpoint(smoke_runs.a / "drafter", weights.embed.float(), shape)
    L.seed_everything(cfg.train.seed, verbose=False)
    untrained = DrafterModule(model_cfg, cfg.train)
    init_from_target(untrained, weights, trained.draft_ids, cfg.drafter.init_lm_head_from_target)
    K, ttt = max_k(cfg), cfg.train.ttt_steps
    tau = {
        name: {k: c.acceptance_length for k, c in evaluate_simulated(d, held_out, K).items()}
        for name, d in (("trained", trained), ("untrained", untrained.drafter))
    }
    metrics = json.loads((smoke_runs.a / "metrics.json").read_text())
    # the same held-out set and evaluator as the run's own numbers
    assert tau["trained"] == {k: pytest.approx(metrics[f"acceptance_length@k{k}"]) for k in range(1, K + 1)}
    # clearly higher: at the trained depth, at least twice the accepted drafts per round
    assert tau["trained"][ttt] - 1 >= 2 * (tau["untrained"][ttt] - 1) + 0.05, tau
    assert all(tau["trained"][k] > tau["untrained"][k] for k in range(1, K + 1)), tau


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

    from eaglelab.data.targets import smollm2_gguf_path

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


def test_run_writes_an_acceptance_figure_of_its_tables(smoke_runs, tmp_path, monkeypatch):
    """acceptance.png plots acceptance.csv's τ per k and per_position.csv's rates (for the first, a middle and the
    last k): the figure redrawn from the run's tables, kept open to read its lines, is the run's figure."""
    import matplotlib.pyplot as plt
    import numpy as np
    from PIL import Image

    from eaglelab.evaluate import plots

    for name in ("acceptance.csv", "per_position.csv", "depth_accuracy.csv"):
        shutil.copy(smoke_runs.a / name, tmp_path / name)
    kept = []
    monkeypatch.setattr(plots.plt, "close", kept.append)
    plots.plot_acceptance(tmp_path, "eagle3.1 (seed 0)")  # the run's title: variant, seed
    (fig,) = kept
    tau_ax, pos_ax, depth_ax = fig.axes
    by_k = [r for r in read_csv(tmp_path / "acceptance.csv") if r["evaluator"] == "simulated"]
    ((ks, taus),) = [line.get_data() for line in tau_ax.get_lines()]
    assert list(ks) == [int(r["k"]) for r in by_k] == list(range(1, 9))
    assert list(taus) == pytest.approx([float(r["acceptance_length"]) for r in by_k])
    rates = read_csv(tmp_path / "per_position.csv")
    for k, line in zip((1, 4, 8), pos_ax.get_lines(), strict=True):  # the first, a middle and the last k
        expected = [(int(r["position"]), float(r["acceptance_rate"])) for r in rates if int(r["k"]) == k]
        assert line.get_label() == f"k={k}"
        assert list(zip(*line.get_data())) == pytest.approx(expected)
    (depths, n_alpha), (tf_depths, tf_acc) = [line.get_data() for line in depth_ax.get_lines()]  # no vLLM here
    by_depth = read_csv(tmp_path / "depth_accuracy.csv")
    assert list(tf_depths) == list(range(1, 9)) == [int(r["depth"]) for r in by_depth]
    assert list(tf_acc) == pytest.approx([int(r["correct"]) / int(r["counted"]) for r in by_depth])
    metrics = json.loads((smoke_runs.a / "metrics.json").read_text())
    assert [metrics[f"acc@d{d}"] for d in range(1, 9)] == pytest.approx(list(tf_acc))
    deepest = [r for r in rates if r["evaluator"] == "simulated" and r["k"] == "8" and int(r["reached"]) > 0]
    assert list(depths) == [int(r["position"]) for r in deepest] and len(deepest) >= 3
    assert list(n_alpha) == pytest.approx([int(r["accepted"]) / int(r["reached"]) for r in deepest])
    plt.close(fig)
    drawn, written = (np.asarray(Image.open(d / "acceptance.png")) for d in (tmp_path, smoke_runs.a))
    assert drawn.shape == written.shape and (drawn == written).all()


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


def test_the_tiny_targets_greedy_text_varies(cache_dir, tmp_path):
    """What lets the tests tell drafters apart: the smoke target's greedy responses to the held-out prompts are
    not one token repeated and not one response for every prompt (a random Llama's are: every drafter then makes
    the same drafts). Its target.tiny.alphabet=0 is that random Llama, kept as the counter-example."""
    import torch

    from eaglelab.data.stage import select_prompts
    from eaglelab.data.targets import load_target
    from eaglelab.data.templates import template_prompt

    def responses(overrides):
        cfg = compose(["experiment=smoke", *overrides], cache_dir, tmp_path)
        target = load_target(cfg.target, cfg.paths.cache_dir)
        out = []
        for messages in select_prompts(cfg).held_out:
            prompt = template_prompt(target.tokenizer, messages, None)
            ids = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
            out.append(tuple(ids[0, len(prompt) :].tolist()))
        return out

    def distinct_share(rs):
        return len({t for r in rs for t in r}) / sum(len(r) for r in rs)

    smoke, random_llama = responses([]), responses(["target.tiny.alphabet=0"])
    print(f"distinct tokens: {distinct_share(smoke):.3f} (random Llama {distinct_share(random_llama):.3f})")
    assert distinct_share(random_llama) < 0.05  # the degenerate substrate this replaces
    assert distinct_share(smoke) > 0.15 and len(set(smoke)) >= 3
    assert all(len(set(r)) > len(r) // 2 for r in smoke)  # no response loops on a few tokens


def test_seeds_and_variants_give_different_drafters(smoke_runs, cache_dir, tmp_path):
    """Two seeds of EAGLE-3.1 and EAGLE-3 at the first seed, on the smoke substrate: no two give identical
    acceptance or validation metrics (on a degenerate target all three drafted the same tokens)."""
    runs = {
        "eagle3.1 seed 0": smoke_runs.a,
        "eagle3.1 seed 1": run(compose(["experiment=smoke", "train.seed=1"], cache_dir, tmp_path / "seed1")),
        "eagle3 seed 0": run(compose(["experiment=smoke", "+ablation=eagle3"], cache_dir, tmp_path / "eagle3")),
    }
    keys = ("acceptance_length@", "acceptance_rate@", "val/acc")
    metrics = {
        name: {k: v for k, v in json.loads((d / "metrics.json").read_text()).items() if k.startswith(keys)}
        for name, d in runs.items()
    }
    for name, m in metrics.items():
        print(name, {k: round(v, 4) for k, v in m.items() if k.startswith("acceptance_length@")})
    names = list(metrics)
    for i, x in enumerate(names):
        assert metrics[x] and metrics[x].keys() == metrics[names[0]].keys()
        for y in names[i + 1 :]:
            differ = [k for k in metrics[x] if metrics[x][k] != metrics[y][k]]
            # τ itself differs, not only some validation figure
            assert any(k.startswith("acceptance_length@") for k in differ), f"{x} and {y}: identical τ"


def test_keep_best_exports_the_epoch_with_the_best_validation_tau(cache_dir, tmp_path):
    """train.keep=best: the run's validation metrics are those of its best epoch (by validation τ at k = ttt), and
    the exported drafter is that epoch's: recomputed on the run's own validation sequences it gives that τ."""
    from torch.utils.data import DataLoader

    from eaglelab.data.stage import prepare_data, select_prompts
    from eaglelab.data.targets import load_target
    from eaglelab.export.eagle3 import TargetShape, load_checkpoint
    from eaglelab.models.acceptance import AcceptanceCounts
    from eaglelab.pipeline import build_model_config
    from eaglelab.train.batches import FeatureDataset, acceptance_counts, collate

    overrides = ["experiment=smoke", "train.keep=best", "train.precision=32-true"]  # fp32: recomputed exactly
    run_dir = run(compose(overrides, cache_dir, tmp_path / "best"))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    log = [r for r in read_csv(run_dir / "logs" / "metrics.csv") if r.get("val/acceptance_length@k3")]
    per_epoch = [float(r["val/acceptance_length@k3"]) for r in log]
    print("validation τ@k3 per epoch", per_epoch, "kept", metrics["train/kept_epoch"])
    assert len(per_epoch) == 4 and metrics["val/acceptance_length@k3"] == pytest.approx(max(per_epoch))
    assert int(metrics["train/kept_epoch"]) == int(log[per_epoch.index(max(per_epoch))]["epoch"])

    cfg = compose(overrides, cache_dir, run_dir)
    target = load_target(cfg.target, cfg.paths.cache_dir)
    data = prepare_data(cfg, target, build_model_config(cfg, target), select_prompts(cfg, target)).train
    drafter = load_checkpoint(
        run_dir / "drafter",
        target.weights().embed.float(),
        TargetShape(target.hidden_size, target.vocab_size, target.num_layers),
    ).eval()
    val = FeatureDataset(data, [i for i, v in enumerate(data["is_val"]) if v], with_final=False, with_tail=True)
    total = AcceptanceCounts(k=3)
    for batch in DataLoader(val, batch_size=cfg.train.batch_size, collate_fn=collate):
        total.add(acceptance_counts(drafter, batch, 3)[3])
    assert total.acceptance_length == pytest.approx(max(per_epoch), abs=1e-6)


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_a_true_precision_trains_on_states_the_target_computes(precision, cache_dir, tmp_path):
    """train.precision=bf16-true or 64-true with online features: Lightning casts a batch to that dtype before
    the transfer hook, where the target has not computed the states yet; they must reach fc in the weights'
    dtype. (hybrid computes its first epoch through the same hook; cached batches are cast by Lightning itself.)
    Evaluated in float32 afterwards, with the embedding back in the target's dtype (64-true's float64 rows made
    every layer's input float64). 16-true is refused (tests/test_bad_input.py)."""
    overrides = ["experiment=smoke", "features=online", f"train.precision={precision}", "train.epochs=1",
                 "eval.suites.drift.enabled=false", "eval.suites.extrapolation.enabled=false"]  # fmt: skip
    metrics = json.loads((run(compose(overrides, cache_dir, tmp_path / "r")) / "metrics.json").read_text())
    assert metrics["acceptance_length@k3"] >= 1.0 and metrics["train/loss"] == metrics["train/loss"]


def test_the_smoke_loop_names_the_device_of_every_tensor_it_makes(cache_dir, tmp_path):
    """Strict-device mode (eaglelab.core.strict_device): training, export, the simulated evaluation and the drift
    diagnostics make no tensor without naming its device, which on a GPU would land on the CPU beside CUDA
    states. The mode itself is checked first: a factory call from a file of the package without a device raises."""
    import torch

    from eaglelab.core.strict_device import PACKAGE, DeviceNotNamed, strict_device

    with strict_device():
        torch.arange(3)  # from a test file: not eaglelab's code, left alone
        with pytest.raises(DeviceNotNamed, match=r"eaglelab/probe.py:1: torch.arange without a device"):
            exec(compile("torch.arange(3)", str(PACKAGE / "probe.py"), "exec"), {"torch": torch})
        exec(compile("torch.arange(3, device='cpu')", str(PACKAGE / "probe.py"), "exec"), {"torch": torch})
        run_dir = run(compose(["experiment=smoke", "train.epochs=1"], cache_dir, tmp_path / "strict"))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["acceptance_length@k3"] >= 1.0 and (run_dir / "suites" / "drift.csv").is_file()
