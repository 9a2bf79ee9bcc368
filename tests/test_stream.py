"""Streamed states (features=stream) with the real pieces: a `mooncake_master` started by the run, vLLM's capture
engine putting states through hs_connectors' Mooncake connector, the trainer reading them from the store. Nothing
stands in for any of them."""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from eaglelab.pipeline import run

from conftest import ROOT, cli_env, compose, error_line, run_cli

SMOKE = ["experiment=smoke", "eval.suites.drift.enabled=false", "eval.suites.extrapolation.enabled=false"]
COMPARED = ("acceptance_length@k1", "acceptance_length@k3", "val/acceptance_length@k3", "train/loss", "val/acc@d1")


def cmdline(process: psutil.Process) -> str:
    """A process's command line; "" for one that ended meanwhile (a zombie, or gone): not the engine."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def same_drafter_after_a_kill(metrics: dict, uninterrupted: dict) -> None:
    """A stream that lost its engine or its trial part-way trains the uninterrupted stream's drafter: τ, validation τ
    and accuracy exactly; the mean step loss to 1e-6. Measured on a 2-core Zen 4 (no AMX), at 5f0949c and after
    alike: what trains after the kill differs from the uninterrupted stream in its last bits (train/loss 2.4622893 vs
    2.4622891), where on the AMX Xeon the tests were written on it was bitwise equal. Cause not yet pinned down (not
    vLLM's prefix cache in the capture engine: measured without it too)."""
    for key in COMPARED:
        expected = pytest.approx(uninterrupted[key], rel=1e-6) if key == "train/loss" else uninterrupted[key]
        assert metrics[key] == expected, key


def du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def trained_once_each(run_dir: Path, metrics: dict) -> None:
    """Every epoch trained each training sequence once: none twice, none lost."""
    trained = json.loads((run_dir / "stream" / "trained-rank0.json").read_text())
    assert len(trained) == 4  # the smoke run's epochs
    for epoch, rows in trained.items():
        assert len(rows) == len(set(rows)) == metrics["data/train_sequences"], (epoch, sorted(rows))


@pytest.fixture(scope="module")
def paired(tmp_path_factory):
    """The smoke run with states captured by vLLM, once cached and once streamed, on one cache: the stream reads
    the cached run's regenerated tokens and captures their states again, epoch by epoch."""
    root = tmp_path_factory.mktemp("stream")
    cache, runs = root / "cache", {}
    for kind in ("cached", "stream"):
        features_before = du(cache / "features")
        run_dir = run(compose([*SMOKE, f"features={kind}", "data.capture_backend=vllm"], cache, root / kind))
        runs[kind] = (
            run_dir,
            json.loads((run_dir / "metrics.json").read_text()),
            du(cache / "features") - features_before,
        )
    runs["cache"] = cache
    return runs


def test_streamed_states_train_what_the_cache_trains(paired):
    """Same tokens, the same engine's states, the same order: the streamed run trains the cached run's drafter,
    figure for figure, and writes no state to disk (the cache's features/ grows only for the cached run)."""
    (_, cached, cached_bytes), (stream_dir, stream, stream_bytes) = paired["cached"], paired["stream"]
    for key in COMPARED:
        assert stream[key] == cached[key], key
    assert cached_bytes > 0 and stream_bytes == 0
    assert stream["data/disk_bytes_per_token"] < 0.01 * cached["data/disk_bytes_per_token"]  # token ids only
    plan = np.load(stream_dir / "stream" / "plan.npy")
    assert stream["stream/samples_streamed"] == len(plan) and stream["stream/engine_restarts"] == 0
    assert stream["stream/engine_tokens_per_s"] > 0
    trained_once_each(stream_dir, stream)


def test_a_killed_engine_is_started_again_and_nothing_is_trained_twice(paired, tmp_path):
    """SIGKILL to the stream's engine mid-stream (a window of ~12 samples keeps it waiting on the trainer): the
    supervisor starts it again, it resumes where it had published up to, and the run trains each row once per epoch
    and ends with the uninterrupted stream's drafter."""
    cache = paired["cache"]
    results = tmp_path / "results"
    args = [*SMOKE, "features=stream", "data.capture_backend=vllm", "features.stream.window_gb=0.002"]
    command = [sys.executable, str(ROOT / "src" / "run.py"), *args]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    proc = subprocess.Popen(command, cwd=ROOT, env=cli_env(cache, results), **pipes)
    try:
        deadline, engine = time.time() + 300, None
        while engine is None:
            assert time.time() < deadline and proc.poll() is None, proc.stderr.read()[-2000:] if proc.poll() else ""
            logs = list(results.glob("runs/*/stream/vllm.log"))
            if logs and "published samples 0-" in logs[0].read_text(errors="replace"):
                kids = psutil.Process(proc.pid).children(recursive=True)
                engine = next((p for p in kids if "-m eaglelab.engine " in cmdline(p)), None)  # its StreamJob
            time.sleep(0.02)
        engine.kill()
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    run_dir = next(results.glob("runs/*"))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["stream/engine_restarts"] == 1
    assert "the stream's engine died (vLLM engine failed (exit -9)" in (run_dir / "run.log").read_text()
    trained_once_each(run_dir, metrics)
    same_drafter_after_a_kill(metrics, paired["stream"][1])


def test_an_unreachable_store_is_one_line(tmp_path):
    """A store that is not there: one line naming it, before any work (Mooncake's own client would retry ~90 s)."""
    t0 = time.perf_counter()
    out = run_cli([*SMOKE, "features=stream", "features.stream.master=127.0.0.1:9"], tmp_path / "c", tmp_path / "r")
    line = error_line(out.returncode, out.stderr)
    assert "cannot reach the Mooncake store's master at 127.0.0.1:9" in line and "features.stream.master" in line
    assert time.perf_counter() - t0 < 60
    assert not (tmp_path / "c" / "regen").exists(), "refused before the data stage"


def test_a_window_too_small_for_the_loaders_is_one_line(paired, tmp_path):
    """A window that cannot hold what the loaders read ahead would deadlock the engine and the trainers: refused
    with the size that works, before the engine starts."""
    cache = paired["cache"]
    args = [*SMOKE, "features=stream", "data.capture_backend=vllm", "features.stream.window_gb=0.0001"]
    out = run_cli(args, cache, tmp_path / "r")
    line = error_line(out.returncode, out.stderr)
    assert "features.stream.window_gb=0.0001 holds" in line and "raise it to at least" in line
    assert not list((tmp_path / "r").glob("runs/*/stream/vllm.log")), "no engine started"


def test_one_stream_feeds_a_sweep(paired, tmp_path):
    """Two variants of a sweep (hydra/launcher=local: concurrent processes) with features.stream.share: one trial
    hosts the stream, the other subscribes, and one target pass (the plan's samples, once) feeds both; each trains
    what its own stream would have given it (the eagle3.1 trial is the paired stream run, figure for figure)."""
    args = ["-m", *SMOKE, "features=stream", "features.stream.share=true", "features.stream.join_s=20",
            "data.capture_backend=vllm", "+ablation=eagle3_1,eagle3", "hydra/launcher=local",
            "hydra.launcher.cpus_per_task=1", f"hydra.sweep.dir={tmp_path / 'sweep'}"]  # fmt: skip
    out = run_cli(args, paired["cache"], tmp_path / "results")
    assert out.returncode == 0, out.stderr[-2000:]
    trials = {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "sweep").glob("*/metrics.json")}
    assert len(trials) == 2
    hosts = [m for m in trials.values() if "stream/subscribers" in m]
    assert len(hosts) == 1 and hosts[0]["stream/subscribers"] == 2
    plan = np.load(next((tmp_path / "sweep").glob("*/stream/plan.npy")))
    assert hosts[0]["stream/samples_streamed"] == len(plan), "one target pass for both trials"
    ours = next(m for name, m in trials.items() if "eagle3.1" in name)
    for key in COMPARED:
        assert ours[key] == paired["stream"][1][key], key
    for name in trials:
        trained_once_each(tmp_path / "sweep" / name, trials[name])


def test_a_subscriber_that_stops_reading_is_dropped_and_the_host_goes_on(paired, tmp_path):
    """A trial that subscribes to a shared stream and then reads nothing (what a preempted or stalled trial does):
    after features.stream.stall_s the engine drops it and the hosting trial trains on, to the drafter its own stream
    gives; the dropped trial's reader stops with one line."""
    from eaglelab.core.errors import EaglelabError
    from eaglelab.core.io import file_lock
    from eaglelab.data.stream import StreamReader, connect, read_json
    from eaglelab.train.stream_plan import admitted, subscribe

    cache, results = paired["cache"], tmp_path / "results"
    args = [*SMOKE, "features=stream", "features.stream.share=true", "features.stream.join_s=15",
            "features.stream.stall_s=3", "features.stream.window_gb=0.002", "data.capture_backend=vllm"]  # fmt: skip
    before = set((cache / "streams").glob("*/host.json")) if (cache / "streams").exists() else set()
    command = [sys.executable, str(ROOT / "src" / "run.py"), *args]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    host = subprocess.Popen(command, cwd=ROOT, env=cli_env(cache, results), **pipes)
    try:
        deadline = time.time() + 300
        while not (found := set((cache / "streams").glob("*/host.json")) - before):
            assert time.time() < deadline and host.poll() is None, host.stderr.read()[-2000:] if host.poll() else ""
            time.sleep(0.05)
        rendezvous = next(iter(found)).parent
        with file_lock(rendezvous / "lock"):
            spec = subscribe(rendezvous)
        assert spec is not None and admitted(spec, 120), "subscribed within the joining time"
        store = connect(spec.store)
        while read_json(store, f"{spec.name}-dropped-{spec.subscriber}") is None:
            assert time.time() < deadline and host.poll() is None, "the engine drops a subscriber that reads nothing"
            time.sleep(0.05)
        with pytest.raises(EaglelabError, match="fell a whole window behind the stream it shared and was dropped"):
            StreamReader(spec).read(0, 8)
        store.close()
        _, err = host.communicate(timeout=600)
    finally:
        if host.poll() is None:
            host.kill()
    assert host.returncode == 0, err[-2000:]
    run_dir = next(results.glob("runs/*"))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["stream/subscribers"] == 2
    assert "dropped subscriber 1" in (run_dir / "stream" / "vllm.log").read_text()
    for key in COMPARED:
        assert metrics[key] == paired["stream"][1][key], key


def test_a_killed_trial_resumes_on_a_stream_of_its_own(paired, tmp_path):
    """SIGKILL to the whole trial mid-training (trainer, engine and store together, as a dead node takes them):
    nothing of it outlives it, and the same command resumes from its checkpoint on a new stream whose engine starts
    at the first unread batch, to the uninterrupted stream's drafter."""
    import os
    import signal

    run_dir = tmp_path / "run"
    args = [*SMOKE, "features=stream", "data.capture_backend=vllm", "train.checkpoint_every_n_steps=3",
            f"hydra.run.dir={run_dir}"]  # fmt: skip
    command = [sys.executable, str(ROOT / "src" / "run.py"), *args]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "start_new_session": True}
    proc = subprocess.Popen(command, cwd=ROOT, env=cli_env(paired["cache"], tmp_path), **pipes)
    try:
        deadline = time.time() + 300
        while not (run_dir / "lightning" / "last.ckpt").exists():
            assert time.time() < deadline and proc.poll() is None, proc.stderr.read()[-2000:] if proc.poll() else ""
            time.sleep(0.02)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("mooncake_master" in " ".join(p.cmdline()) for p in children)
        proc.kill()  # (the run's process alone: what it started must die with it)
        proc.wait()
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [p.cmdline()[:2] for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    resumed = run_cli(args, paired["cache"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert json.loads((run_dir / "run.json").read_text())["attempt"] == 2
    plan = np.load(run_dir / "stream" / "plan.npy")
    assert 0 < metrics["stream/samples_streamed"] < len(plan), "the new stream starts at the first unread batch"
    same_drafter_after_a_kill(metrics, paired["stream"][1])
