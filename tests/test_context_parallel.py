"""Context parallelism of the TTT step (eaglelab.models.drafter.ContextShard): a sequence split over gloo ranks gives
the loss and every gradient of the same step on one rank, for each drafter layer, at TTT 3 and 7, with CE and a
distilled loss, and where a rank's positions all lie in the prompt (it drafts nothing after step 1). The figures at
4k tokens are benchmarks/context_parallel.py's own; this runs it at its smallest."""

import json

import pytest

from conftest import ROOT


@pytest.mark.parametrize(
    "args",
    [
        ["--layer=llama", "--ttt=3", "--loss=kl"],
        ["--layer=mla", "--ttt=7", "--loss=ce"],
        ["--layer=qwen3", "--ttt=3", "--loss=nla", "--cp=4", "--prompt=100"],  # rank 0's 64 positions: all prompt
    ],
)
def test_a_sequence_split_over_ranks_trains_as_on_one(args, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "cp.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "context_parallel.py"), "--length=256",
                           *args, f"--json={out}"], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text())
    assert not row["missing"] and row["parameters_compared"] >= 16  # every trained tensor has its gradient
    assert row["loss_abs_diff"] <= 1e-6 * row["loss_value"]
    assert row["grad_max_abs_diff"] <= 1e-5 * row["grad_max_abs"]
