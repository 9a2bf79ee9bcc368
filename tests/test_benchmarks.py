"""Benchmarks that cannot rot: each script runs here at its smallest size, the way a user types it, so an API change
breaks a test rather than the next person who wants the figure. (benchmarks/preemption.py and faults.py run inside
tests/test_sweeps.py and test_slurm.py; scale_rehearsal.py and step_scaling.py inside tests/test_gpu_check.py.)"""

import json
import subprocess
import sys

from conftest import ROOT


def bench(script: str, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_train_throughput_at_its_smallest(tmp_path):
    out = tmp_path / "train.json"
    proc = bench("train_throughput.py", "--configs", "peer", "--precision", "fp32", "--steps", "1", "--repeats", "1",
                 "--gemm-size", "256", "--json", out)  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert row["config"] == "peer" and row["positions_per_s"] > 0 and row["achieved_flops"] > 0
    assert "peer" in proc.stdout and "GEMM roofline (256^3" in proc.stdout


def test_train_throughput_beside_speculators(tmp_path):
    """The side-by-side comparison with vLLM's speculators (installed by scripts/setup.sh): both trainers run the same
    step on the same shapes, each in its own process, and the table gives eaglelab's ratio to it."""
    out = tmp_path / "peers.json"
    proc = bench("train_throughput.py", "--trainers", "eaglelab,speculators", "--loss", "kl", "--configs", "peer",
                 "--precision", "fp32", "--steps", "1", "--repeats", "1", "--gemm-size", "256",
                 "--json", out)  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["trainer"] for r in rows] == ["eaglelab", "speculators"]
    assert all(r["positions_per_s"] > 0 and r["flops_per_step"] > 0 for r in rows)
    eaglelab_line = next(line for line in proc.stdout.splitlines() if line.startswith("eaglelab"))
    assert eaglelab_line.split()[4].endswith("x") and "lm_head frozen" in proc.stdout


def test_capture_throughput_at_its_smallest(cache_dir, tmp_path):
    out = tmp_path / "capture.json"
    bench("capture_throughput.py", "--target", "tiny", "--cache-dir", cache_dir, "--seqs", "2", "--len", "16",
          "--batch", "2", "--repeats", "1", "--gen-prompts", "2", "--gen-tokens", "2", "--json", out)  # fmt: skip
    figures = json.loads(out.read_text())
    assert figures and all(v > 0 for v in figures.values() if isinstance(v, int | float)), figures


def test_attention_memory_at_its_smallest(tmp_path):
    out = tmp_path / "attention.json"
    proc = bench("attention_memory.py", "--lengths", "64", "--json", out)
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows.keys() == {"explicit", "fused", "checkpointed"} and all(r["peak_gb"] > 0 for r in rows.values())
    assert rows["fused"]["max_logit_gap"] < 1e-4 and rows["checkpointed"]["estimate_gb"] < rows["fused"]["estimate_gb"]
    assert "explicit / fused peak" in proc.stdout


def test_rank_memory_at_its_smallest(tmp_path):
    """What a rank holds privately: the token shards read in place hold none of the data (the page cache does),
    the copy all of it; the draft vocabulary streamed holds none, the int64 list twice the int32 data."""
    out = tmp_path / "rank_memory.json"
    proc = bench("rank_memory.py", "--tokens", "16000000", "--json", out)
    held = {r["case"]: r["held_gb"] for r in json.loads(out.read_text())["measured"]}
    data = 16e6 * 4 / 2**30
    assert held["token store, copied"] - held["token store, read in place"] > 0.6 * data, held
    assert held["draft vocab, listed"] - held["draft vocab, streamed"] > 1.5 * data, held
    assert "8 ranks in all" in proc.stdout


def test_checkpoint_cost_at_its_smallest(tmp_path):
    out = tmp_path / "ckpt.json"
    proc = bench("checkpoint_cost.py", "--configs", "peer", "--saves", "1", "--steps-after", "1", "--json", out)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["ckpt_gb"] > 0 and 0 < row["async_blocked_s"] and 0 < row["sync_blocked_s"] <= row["sync_written_s"]
    assert "keep=best copy before GB" in proc.stdout


def test_padding_at_its_smallest(tmp_path):
    out = tmp_path / "padding.json"
    bench("padding.py", "--sequences", "300", "--json", out)
    rows = {(r["mix"], r["batching"]): r for r in json.loads(out.read_text())}
    tailed = rows["long-tailed", "tokens_per_batch=4096"]["padding_share"]
    assert tailed < rows["long-tailed", "batch_size=2"]["padding_share"]


def test_stream_benchmark_at_its_smallest(tmp_path):
    """benchmarks/stream.py on the tiny target: one engine, one trainer, one epoch, the figures it prints."""
    out = tmp_path / "stream.json"
    proc = bench("stream.py", "--target", "tiny", "--prompts", "24", "--epochs", "1", "--devices", "1",
                 "--repeats", "1", "--window-gb", "0.01", "--json", out)  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert row["engine_tokens_per_s"] > 0 and row["trainer_positions_per_s"] > 0
    assert row["cache_bytes_written"] == 0 and 0 < row["store_peak_bytes"] <= row["store_bytes"]
    assert "bottleneck:" in proc.stdout


def test_source_memory_at_its_smallest(tmp_path):
    """The prompt side's host memory for a streamed JSONL source (benchmarks/source_memory.py), at 300 conversations."""
    proc = bench("source_memory.py", "--conversations", "300", "--cache", tmp_path)
    (row,) = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert row[0] == "300" and int(row[2].replace(",", "")) > 300 and float(row[3]) >= 0
