"""Bad input through the real CLI: one clear error line naming the fix, non-zero exit, and no run
directory that looks complete (no metrics.json; run.json says failed)."""

import json
import shutil
from pathlib import Path

import pytest

from conftest import error_line, run_cli

SMOKE = ["experiment=smoke"]


def assert_nothing_looks_complete(results: Path):
    for run_json in results.rglob("run.json"):
        assert json.loads(run_json.read_text())["status"] == "failed"
    assert not list(results.rglob("metrics.json"))


def test_unknown_ablation_lists_the_valid_names(cache_dir, tmp_path):
    proc = run_cli([*SMOKE, "+ablation=no_such_thing"], cache_dir, tmp_path)
    assert proc.returncode != 0
    for name in ("no_fc_norm", "no_norm_output", "eagle3", "norm_before_fc"):
        assert name in proc.stderr
    assert not list(tmp_path.rglob("metrics.json"))


@pytest.fixture(scope="module")
def bad_files(cache_dir, tmp_path_factory) -> Path:
    """Inputs that are wrong in the ways users get them wrong: a masked LM, a tokenizer without a chat
    template, a corrupt GGUF, non-UTF-8 and empty conversations, a folder under a regular file."""
    from transformers import BertConfig, BertForMaskedLM

    from eaglelab.targets import load_target

    from conftest import compose

    root = tmp_path_factory.mktemp("bad")
    tiny = load_target(compose(SMOKE, cache_dir, root).target, cache_dir).path
    BertForMaskedLM(
        BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=49152)
    ).save_pretrained(root / "bert")
    shutil.copytree(tiny, root / "no_template")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, root / "bert" / name)
    (root / "no_template" / "chat_template.jinja").unlink()
    (root / "model.gguf").write_bytes(b"GGUF" + bytes(100))
    (root / "latin1.jsonl").write_bytes('{"messages": [{"role": "user", "content": "café"}]}\n'.encode("latin-1"))
    (root / "empty.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": []}\n')
    (root / "a_file").write_text("not a folder")
    return root


# (overrides, the message the one error line must hold); {bad} is the bad_files folder
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["drafter.norm_before_fc=true"], "mutually exclusive"),
        (["train.ttt_steps=0"], "train.ttt_steps must be > 0"),
        (["train.lr=0"], "train.lr must be > 0"),
        (["train.batch_size=-1"], "train.batch_size must be > 0"),
        (["data.num_prompts=0"], "data.num_prompts must be > 0"),
        (["drafter.draft_vocab_size=0"], "drafter.draft_vocab_size must be > 0"),
        (["train.step_decay=1.5"], "train.step_decay must be in (0, 1]"),
        (
            ["drafter.draft_vocab_size=60000"],
            "exceeds the target's vocabulary (49152 tokens); lower drafter.draft_vocab_size",
        ),
        (["drafter.aux_layer_ids=[2,4,8]"], "L=8"),
        (["data.max_length=16"], "empty after filtering"),
        (["data.max_length=100000"], "exceeds the target's context window (8192 tokens); lower data.max_length"),
        (["data.sources=[wikipedia]"], "unknown data source 'wikipedia'"),
        (["eval.suites.templates.conditions=[native,klingon]"], "klingon"),
        (["target=hf", "target.name_or_path=/nonexistent/model"], "not a local folder"),
        (["target=hf", "target.name_or_path={bad}/bert"], "is not a decoder-only causal LM"),
        (["target=hf", "target.name_or_path={bad}/no_template"], "tokenizer has no chat template"),
        (["target=hf", "target.name_or_path={bad}/model.gguf"], "cannot read GGUF"),
        (["data.sources=[jsonl:/nonexistent.jsonl]"], "file not found"),
        (["data.sources=[jsonl:{bad}/latin1.jsonl]"], "latin1.jsonl:1: not UTF-8 text; re-encode the file as UTF-8"),
        (["data.sources=[jsonl:{bad}/empty.jsonl]"], "empty.jsonl:2: empty conversation"),
        (["checkpoint=/nonexistent"], "holds no drafter"),
        (["paths.results_dir={bad}/a_file/results"], "cannot write to"),
        (["paths.results_dir=/proc/eaglelab"], "cannot write to /proc/eaglelab"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(overrides, message, bad_files, cache_dir, tmp_path):
    overrides = [o.replace("{bad}", str(bad_files)) for o in overrides]
    proc = run_cli([*SMOKE, *overrides], cache_dir, tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in error_line(proc.returncode, proc.stderr)
    assert_nothing_looks_complete(tmp_path)


@pytest.mark.parametrize(
    "override,choices",
    [
        ("train.loss=mse", "['ce', 'kl']"),
        ("train.precision=fp8", "'bf16-mixed'"),
    ],
)
def test_a_value_outside_its_choices_is_refused_by_composition(override, choices, cache_dir, tmp_path):
    """Fixed choices are typed (Literal): Hydra refuses them before anything runs, naming the key and the choices."""
    proc = run_cli([*SMOKE, override], cache_dir, tmp_path)
    assert proc.returncode != 0
    assert f"full_key: {override.split('=')[0]}" in proc.stderr and choices in proc.stderr
    assert not list(tmp_path.rglob("run.json"))


def test_unknown_config_group_entry_lists_the_choices(cache_dir, tmp_path):
    proc = run_cli([*SMOKE, "target=llama3"], cache_dir, tmp_path)
    assert proc.returncode != 0
    assert "Could not find 'target/llama3'" in proc.stderr and all(
        name in proc.stderr for name in ("smollm2", "tiny", "hf")
    )
    assert not list(tmp_path.rglob("run.json"))


def test_corrupt_target_files(cache_dir, tmp_path):
    bad = tmp_path / "broken-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    proc = run_cli([*SMOKE, "target=hf", f"target.name_or_path={bad}"], cache_dir, tmp_path / "results")
    assert proc.returncode == 2
    assert "cannot load target" in error_line(proc.returncode, proc.stderr)
    assert_nothing_looks_complete(tmp_path / "results")


def test_malformed_jsonl_row_is_named_by_line(cache_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [oops\n')
    proc = run_cli([*SMOKE, f"data.sources=[jsonl:{data}]"], cache_dir, tmp_path / "results")
    assert proc.returncode == 2
    assert f"{data}:2" in error_line(proc.returncode, proc.stderr)
