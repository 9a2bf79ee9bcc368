"""Bad input through the real CLI: one clear error line naming the fix, non-zero exit, and no run
directory that looks complete (no metrics.json; run.json says failed)."""

import json
from pathlib import Path

import pytest

from conftest import run_cli

SMOKE = ["experiment=smoke"]


def error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


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


@pytest.mark.parametrize("overrides,message", [
    (["drafter.norm_before_fc=true"], "mutually exclusive"),
    (["train.ttt_steps=0"], "train.ttt_steps must be > 0"),
    (["drafter.aux_layer_ids=[2,4,8]"], "L=8"),
    (["data.max_length=16"], "empty after filtering"),
    (["target=hf", "target.name_or_path=/nonexistent/model"], "not a local folder"),
    (["data.sources=[jsonl:/nonexistent.jsonl]"], "file not found"),
])
def test_bad_input_is_one_line_and_nonzero(overrides, message, cache_dir, tmp_path):
    proc = run_cli([*SMOKE, *overrides], cache_dir, tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in error_line(proc)
    assert_nothing_looks_complete(tmp_path)


def test_corrupt_target_files(cache_dir, tmp_path):
    bad = tmp_path / "broken-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    proc = run_cli([*SMOKE, "target=hf", f"target.name_or_path={bad}"], cache_dir, tmp_path / "results")
    assert proc.returncode == 2
    assert "cannot load target" in error_line(proc)
    assert_nothing_looks_complete(tmp_path / "results")


def test_malformed_jsonl_row_is_named_by_line(cache_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [oops\n')
    proc = run_cli([*SMOKE, f"data.sources=[jsonl:{data}]"], cache_dir, tmp_path / "results")
    assert proc.returncode == 2
    assert f"{data}:2" in error_line(proc)
