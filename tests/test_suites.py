"""Evaluation suites: prompt conditions, long-context prompts, drift diagnostics by their definitions,
and the suites on a run (the vLLM side: tests/test_vllm.py::test_evaluate_a_checkpoint_on_its_own_over_two_ranks)."""

import csv
import json

import pytest
import torch
from test_drafter import random_drafter, small_config

from eaglelab.data.long_context import long_context_prompts
from eaglelab.data.templates import CONDITIONS, renderer
from eaglelab.evaluate.drift import drift_diagnostics
from eaglelab.models.drafter import Attention
from eaglelab.pipeline import run
from eaglelab.results.summary import run_summary

from conftest import compose

MESSAGES = [{"role": "user", "content": "Write a Python function that reverses a list."}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from eaglelab.data.targets import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def test_each_template_condition_renders_what_it_says(tokenizer):
    ids = {c: renderer(c, None)(tokenizer, MESSAGES) for c in CONDITIONS}
    text = {c: tokenizer.decode(v) for c, v in ids.items()}
    bos = tokenizer.bos_token_id
    assert ids["native"][0] == bos and "You are a helpful AI assistant" in text["native"]
    assert ids["bos_on"] == ids["native"]  # SmolLM2's template already starts with its BoS
    assert ids["bos_off"] == ids["native"][1:]
    assert text["no_template"] == MESSAGES[0]["content"]
    assert "[INST]" in text["foreign_mistral"] and "<|start_header_id|>" in text["foreign_llama3"]
    assert bos not in ids["foreign_mistral"] + ids["foreign_llama3"]  # written as text: no native control tokens
    assert "system\n<|im_end|>" in text["system_empty"]
    assert "harbour master" in text["system_long"] and len(ids["system_long"]) > len(ids["native"]) + 200
    assert all(MESSAGES[0]["content"] in t for t in text.values())


@pytest.mark.parametrize("length", [512, 2048, 32768])
def test_long_context_prompts_have_the_requested_length(tokenizer, length):
    """Past what one module holds (~14k tokens at most), further standard-library modules follow: 32k here (a 128k
    window's prompts are built the same way: 131,065 tokens in 6 s)."""
    render = renderer("native", None)
    prompts = long_context_prompts(tokenizer, render, length, 3)
    lengths = [len(render(tokenizer, p)) for p in prompts]
    assert all(length - 8 <= n <= length for n in lengths), lengths
    assert len({p[0]["content"][:200] for p in prompts}) == 3  # three different modules
    assert ("# file: " in prompts[0][0]["content"]) == (length > 20000)  # several modules only where one is short


def test_a_long_context_prompt_is_a_prefix_of_the_longer_ones(tokenizer):
    """Lengths differ only in how much context comes before the request, across the step from one module to
    several too (the text, not its wording, which names the modules where there are several)."""
    render = renderer("native", None)
    short, long = (long_context_prompts(tokenizer, render, n, 1)[0][0]["content"] for n in (4096, 24576))
    body = lambda content: content.split("```python\n")[1].rsplit("\n```", 1)[0]  # noqa: E731
    assert "# file: " in long and body(long).startswith(body(short)[:-20])  # (a decoded token may end differently)


def test_query_blocking_changes_nothing(monkeypatch):
    """The explicit softmax (what drift's probes read) attends in query blocks on long contexts; the result must be
    the one-block result, and the fused kernel's."""
    from test_drafter import _unroll_with

    model = random_drafter(small_config())
    torch.manual_seed(0)
    aux, ids = torch.randn(2, 40, 144, dtype=torch.float64), torch.randint(0, 50, (2, 40))
    first = torch.tensor([5, 11])
    with torch.no_grad():
        whole = _unroll_with(model, "explicit", aux, ids, 4, first)
        fused = _unroll_with(model, "fused", aux, ids, 4, first)
        monkeypatch.setattr(Attention, "MAX_SCORES", 7 * 4 * 40)  # blocks of 3-7 queries
        blocked = _unroll_with(model, "explicit", aux, ids, 4, first)
    for a, b, c in zip(whole, blocked, fused):
        assert torch.equal(a.normed, b.normed)
        assert (a.normed - c.normed).abs().max() < 1e-10


def features_for(model, n=3, T=24, seed=0):
    """Captured sequences (the cache's stores, in a temporary folder) with random aux states of very different
    scales."""
    import tempfile
    from pathlib import Path

    from eaglelab.data.store import (
        Sequences,
        StateStore,
        StateWriter,
        TokenStore,
        mark_complete,
        shard_name,
        state_shards_meta,
        write_token_shard,
    )

    g = torch.Generator().manual_seed(seed)
    H = model.cfg.target_hidden_size
    root = Path(tempfile.mkdtemp())
    tokens = []
    with StateWriter(root / "states" / shard_name(0), with_final=False) as writer:
        for i in range(n):
            scale = torch.tensor([1.0, 10.0, 100.0]).repeat_interleave(H)
            tokens.append((torch.randint(0, 50, (T,), generator=g).tolist(), 6 + i, False, T - 6 - i, []))
            writer.write(i, torch.randn(T, 3 * H, generator=g) * scale, torch.zeros(T, dtype=torch.long))
    write_token_shard(root / "tokens" / shard_name(0), tokens)
    mark_complete(root / "tokens", {"shards": 1, "stop_token_ids": [], "tail_tokens": 0})
    mark_complete(root / "states", state_shards_meta([(shard_name(0), list(range(n)))], with_final=False))
    return Sequences(TokenStore(root / "tokens"), StateStore(root / "states"))


@pytest.mark.parametrize("norm_output", [False, True])
def test_drift_diagnostics_follow_their_definitions(norm_output):
    """Shares sum as defined; norm_output feeds states of RMS exactly |norm weight| (1 at init);
    fc_norm equalises the fc input shares, which otherwise follow the aux layers' scales."""
    for fc_norm in (False, True):
        model = random_drafter(small_config(fc_norm=fc_norm, norm_output=norm_output)).float()
        if norm_output:
            model.norm.weight.data.fill_(1.0)
        per_depth, balance, _ = drift_diagnostics(model, features_for(model), depth=5, recent_tokens=100)
        for row in per_depth:
            assert row["context_share"] + row["draft_share"] == pytest.approx(1.0, abs=1e-5)
            assert row["recent_share"] == pytest.approx(1.0, abs=1e-5)  # R covers every key
            assert 0 < row["sink_share"] < 1 and row["entropy"] > 0 and row["drafts"] > 0
        assert per_depth[0]["draft_share"] == 0.0  # step 1 attends to the context only
        deeper = [r["hidden_rms"] for r in per_depth[1:]]
        if norm_output:
            assert deeper == pytest.approx([1.0] * 4, abs=1e-3)
        else:
            assert not deeper == pytest.approx([1.0] * 4, abs=1e-2)
        shares = [r["input_share"] for r in balance]
        assert sum(shares) == pytest.approx(1.0)
        if fc_norm:  # unit-RMS chunks (norm weights ~1 ± 0.3): no layer dominates
            assert max(shares) < 0.5
        else:  # scales 1 : 10 : 100 -> energies 1 : 100 : 10^4
            assert shares[2] > 0.98


def test_recent_share_with_a_window_of_the_same_size():
    """With a sliding window of W keys and no sink tokens, all attention is on the W most recent keys."""
    model = random_drafter(small_config(attention_window=6, attention_sink_tokens=0)).float()
    per_depth, _, _ = drift_diagnostics(model, features_for(model), depth=4, recent_tokens=6)
    for row in per_depth:
        assert row["recent_share"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    "flags",
    [
        dict(fc_norm=False, norm_output=False),  # EAGLE-3
        dict(fc_norm=True, norm_output=False),
        dict(fc_norm=False, norm_output=True),
        dict(fc_norm=True, norm_output=True),  # EAGLE-3.1
        dict(fc_norm=False, norm_before_fc=True, norm_output=True, norm_before_residual=True),
        dict(fc_norm=True, norm_output=True, num_layers=2, attention_window=7, attention_sink_tokens=2),
        dict(fc_norm=True, norm_output=True, num_layers=2, layer="qwen3"),
        dict(fc_norm=True, norm_output=True, num_layers=2, layer="mla", q_lora_rank=20),
    ],
    ids=[
        "eagle3",
        "no_norm_output",
        "no_fc_norm",
        "eagle3.1",
        "norm_before_fc_and_residual",
        "two_layers_window",
        "qwen3_two_layers",
        "mla_two_layers",
    ],  # fmt: skip
)
def test_an_independent_engine_style_drafter_gives_every_drift_measure(flags, tmp_path):
    """analysis/drift_check.py drafts as an engine does (one position at a time into a KV cache, each chain's keys
    in a copy, explicit float64 softmax, measures by the keys' position ids) from the exported folder only; the
    suite's measures, read from the training-time-test unroll, must be the same numbers."""
    from analysis.drift_check import PlainDrafter, measures
    from eaglelab.export.eagle3 import save_drafter

    model = random_drafter(small_config(**flags))
    feats = features_for(model, n=3, T=24)
    suite, _, per_prompt = drift_diagnostics(model, feats, depth=5, recent_tokens=3)
    save_drafter(model, tmp_path / "drafter")
    check = measures(PlainDrafter(tmp_path / "drafter", model.embed_tokens.weight.double()), feats, 5, 3)
    for a, b in zip(suite, check):
        assert a["drafts"] == b["drafts"] > 0
        for m in ("sink_share", "context_share", "draft_share", "recent_share", "entropy"):
            assert a[m] == pytest.approx(b[m], abs=1e-5), (m, a["depth"])
        assert a["hidden_rms"] == pytest.approx(b["hidden_rms"], rel=1e-6), a["depth"]
    # The per-prompt table is the same sums, split by sequence: its drafts-weighted means are the suite's.
    for a in suite:
        rows = [r for r in per_prompt if r["depth"] == a["depth"] and r["drafts"] > 0]
        assert len(rows) == 3 and sum(r["drafts"] for r in rows) == a["drafts"]
        for m in ("hidden_rms", "sink_share", "recent_share"):
            weighted = sum(r[m] * r["drafts"] for r in rows) / a["drafts"]
            assert weighted == pytest.approx(a[m], rel=1e-9), m


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_suites_on_a_training_run(cache_dir, tmp_path, capsys):
    """+suite=all on the tiny target, simulated evaluator; a windowed drafter is never sent to vLLM."""
    run_dir = run(
        compose(
            [
                "experiment=smoke",
                "+suite=all",
                "train.epochs=1",
                "drafter.attention_window=64",
                "eval.vllm.enabled=true",
                "eval.suites.long_context.lengths=[128,384]",
                "eval.suites.long_context.num_prompts=2",
                "eval.suites.templates.num_prompts=3",
                "eval.suites.templates.conditions=[native,no_template,bos_on,system_long]",
                "eval.suites.benchmarks.num_prompts=2",
                "eval.suites.benchmarks.max_new_tokens=32",
            ],
            cache_dir,
            tmp_path / "run",
        )
    )
    suites = run_dir / "suites"
    for name in ("drift", "extrapolation", "long_context", "templates", "benchmarks"):
        assert (suites / f"{name}.csv").is_file() and (suites / f"{name}.png").is_file(), name
        assert (suites / f"{name}.pdf").is_file(), name
    info = json.loads((run_dir / "run.json").read_text())
    assert info["evaluator"] == "simulated" and "attention_window" in info["vllm_skipped"]
    lc = read_csv(suites / "long_context.csv")
    assert [int(r["condition"]) for r in lc] == [128, 384] and {r["evaluator"] for r in lc} == {"simulated"}
    assert all(abs(float(r["prompt_tokens"]) - int(r["condition"])) <= 8 for r in lc)
    templates = {r["condition"]: r for r in read_csv(suites / "templates.csv")}
    assert set(templates) == {"native", "no_template", "bos_on", "system_long"}
    assert templates["bos_on"]["same_as"] == "native"  # identical prompts are measured once
    metrics = json.loads((run_dir / "metrics.json").read_text())
    native_tau = float(templates["native"]["acceptance_length"])
    for condition in ("no_template", "system_long"):  # their own prompts, measured on their own
        ratio = float(templates[condition]["acceptance_length"]) / native_tau
        assert float(templates[condition]["ratio_to_native"]) == pytest.approx(ratio), condition
        assert metrics[f"templates/simulated/ratio_to_native@{condition}@k3"] == pytest.approx(ratio), condition
    assert {
        "drift/hidden_rms@d8",
        "drift/sink_share@d1",
        "extrapolation/simulated/tau_ratio@k6_vs_k3",
        "long_context/simulated/acceptance_length@384@k3",
        "templates/simulated/ratio_to_native@no_template@k3",
    } <= set(metrics)
    # Each benchmark on its own at the held-out set's depths: MT-Bench's 2 questions are 4 requests, HumanEval's 2
    benchmarks = {(r["condition"], int(r["k"])): r for r in read_csv(suites / "benchmarks.csv")}
    assert set(benchmarks) == {(n, k) for n in ("mt_bench", "humaneval") for k in (1, 3, 8)}
    assert metrics["benchmarks/prompts@mt_bench"] == 4 and metrics["benchmarks/prompts@humaneval"] == 2
    for n in ("mt_bench", "humaneval"):
        tau = metrics[f"benchmarks/simulated/acceptance_length@{n}@k3"]
        assert tau == pytest.approx(float(benchmarks[(n, 3)]["acceptance_length"])) and tau >= 1.0
    assert "MT-Bench (4 requests): τ@1/3/8 simulated" in "\n".join(run_summary(run_dir))
    drift = read_csv(suites / "drift.csv")
    assert [int(r["depth"]) for r in drift] == list(range(1, 9))

    # The comparison reads run directories only; an unfinished one is named and skipped.
    from analysis import compare_suites

    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    assert compare_suites.main([str(run_dir), str(unfinished), "--out", str(tmp_path / "cmp")]) == 0
    assert "skipped" in capsys.readouterr().err
    table = read_csv(tmp_path / "cmp" / "suites_comparison.csv")
    assert len(table) == 1 and table[0]["run"] == "eagle3.1 ttt3 window64"
    for name in ("drift", "long_context", "templates", "extrapolation"):
        assert (tmp_path / "cmp" / f"{name}.png").is_file(), name
    assert compare_suites.main([str(unfinished), "--out", str(tmp_path / "cmp2")]) == 2


def test_mt_bench_is_run_as_the_field_runs_it(cache_dir, tmp_path):
    """MT-Bench's 80 questions are 160 requests, each question's first turn and then its second turn after the first,
    whose answer is the target's own: prepared on the tiny target, each two-turn request's history holds, token for
    token, the answer the target gave its first-turn request (where the template lets it be located: `spans`)."""
    from eaglelab.data.cache_entry import CaptureSettings
    from eaglelab.data.prompts import load_source
    from eaglelab.data.targets import load_target
    from eaglelab.evaluate.suites import benchmark_prompts, prepare_suites

    prompts = load_source("mt_bench")
    assert len(prompts) == 160 and all(len(p) == 1 for p in prompts[::2])
    for first, second in zip(prompts[::2], prompts[1::2]):
        assert (
            second[0] == first[0] and second[1] == {"role": "assistant", "content": ""} and second[2]["role"] == "user"
        )
    picked = benchmark_prompts("mt_bench", 3)  # whole questions, evenly spaced: 0, 40, 79
    assert picked == [prompts[i] for q in (0, 40, 79) for i in (2 * q, 2 * q + 1)]

    cfg = compose(["experiment=smoke", "+suite=benchmarks", "eval.suites.benchmarks.names=[mt_bench]",
                   "eval.suites.benchmarks.num_prompts=3", "eval.suites.benchmarks.max_new_tokens=32"],
                  cache_dir, tmp_path / "run")  # fmt: skip
    target = load_target(cfg.target, cache_dir)
    how = CaptureSettings(cache_dir=cache_dir, aux_layer_ids=[1, 2], system_prompt=None, max_length=256, batch_size=4)
    feats = prepare_suites(cfg, target, [], how).benchmarks["mt_bench"]
    ids = [list(map(int, x)) for x in feats["input_ids"]]
    answers = [x[p:] for x, p in zip(ids, feats["prompt_len"])]
    located = 0
    for x, row in zip(ids, feats.rows):
        for start, end in feats.tokens.spans(row):
            assert any(a[: end - start] == x[start:end] for a in answers)  # a first-turn request's own answer
            located += 1
    assert len(ids) == 6 and located >= 1


def test_the_summary_reads_each_benchmark_beside_what_its_recipe_publishes():
    from eaglelab.results.summary import _benchmark_lines

    metrics = {"benchmarks/prompts@humaneval": 164, "benchmarks/prompts@mt_bench": 160}
    for name, sim, vllm in (("mt_bench", (1.2, 1.5, 1.6), (1.2, 1.49, 1.61)), ("humaneval", (1.3, 1.7, 1.8), ())):
        metrics.update({f"benchmarks/simulated/acceptance_length@{name}@k{k}": t for k, t in zip((1, 3, 8), sim)})
        metrics.update({f"benchmarks/vllm/acceptance_length@{name}@k{k}": t for k, t in zip((1, 3, 8), vllm)})
    published = [{"benchmark": "mt_bench", "k": 3, "acceptance_length": 2.9, "source": "SpecBundle"}]
    lines = _benchmark_lines(metrics, {"recipe": {"published": published}})
    assert lines == [
        "  MT-Bench (160 requests): τ@1/3/8 simulated 1.200/1.500/1.600, vLLM 1.200/1.490/1.610; published for this "
        "target: τ@3 2.90 (SpecBundle)",
        "  HumanEval (164 requests): τ@1/3/8 simulated 1.300/1.700/1.800",
    ]
