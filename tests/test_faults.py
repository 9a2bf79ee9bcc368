"""Faults, with real processes, signals and files: nothing lost, nothing half-written picked up, nothing
silent. (Kills at each stage resuming to the uninterrupted result: tests/test_sweeps.py; concurrent sweep
processes on one study: test_sweeps.py; a killed Slurm job requeued: test_slurm.py; the case table:
docs/reliability.md.)"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import ROOT, cli_env, compose, error_line, run_cli
from wandb_records import read_run

SMOKE = ["experiment=smoke", "eval.suites.drift.enabled=false"]


def ignore_sigint():  # what a shell does to a background job (`cmd &` in a script)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def cli(args: list[str], cache_dir: Path, results: Path, **kw) -> subprocess.Popen:
    env = cli_env(cache_dir, results, kw.pop("env", None))
    return subprocess.Popen(
        [sys.executable, str(ROOT / "src" / "run.py"), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if found := condition():
            return found
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def cache_entries(cache: Path) -> dict[str, list[Path]]:
    return {kind: sorted((cache / kind).glob("*")) if (cache / kind).exists() else [] for kind in ("regen", "features")}


# --- crashes while writing -------------------------------------------------------------------------------------
WRITER = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from eaglelab.core.io import atomic_dir, atomic_file
    from eaglelab.train.ttt_module import AtomicCheckpointIO
    kind, path = sys.argv[1], Path(sys.argv[2])
    chunk = bytes(1 << 20)
    if kind == "file":
        with atomic_file(path, "wb") as f:
            for _ in range(2000):  # at most 2 GB; killed after the first MB
                f.write(chunk); f.flush(); time.sleep(0.001)
    elif kind == "dir":
        with atomic_dir(path) as tmp:
            for i in range(2000):
                (tmp / f"part{i}").write_bytes(chunk); time.sleep(0.001)
    else:  # a checkpoint, again and again, each version bigger
        for version in range(1, 200):
            AtomicCheckpointIO().save_checkpoint({"version": version, "w": torch.ones(version * (1 << 18))}, path)
""")


def _size(path: Path) -> int:
    """Bytes under `path` (0 once it is gone: a temporary is renamed the moment it is complete)."""
    try:
        return sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("kind", ["file", "dir", "checkpoint"])
def test_a_writer_killed_mid_write_leaves_the_previous_version(kind, tmp_path):
    """SIGKILL while a result file, a cache folder or a checkpoint is being written: under its final name there
    is only ever a complete version (the previous one, or none), never a torn one."""
    target = tmp_path / ("entry" if kind == "dir" else "last.ckpt")
    if kind == "file":
        target.write_bytes(b"version 1")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, kind, str(target)], env=env)
    try:
        if kind == "checkpoint":  # let a few versions land, then kill during a save
            wait_for(lambda: target.exists() and target.stat().st_size > 4 << 20, 120, "a few checkpoints", proc)
        wait_for(
            lambda: [p for p in tmp_path.glob(".*.tmp-*") if _size(p) > 1 << 20], 120, "a half-written temporary", proc
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert list(tmp_path.glob(".*.tmp-*")), "the kill did not land mid-write"
    if kind == "file":
        assert target.read_bytes() == b"version 1"
    elif kind == "dir":
        assert not target.exists()
    else:
        state = torch.load(target, weights_only=False)  # loads: complete
        assert state["w"].numel() == state["version"] * (1 << 18) and bool((state["w"] == 1).all())


def test_a_torn_checkpoint_is_never_resumed_from(cache_dir, tmp_path):
    """A last.ckpt torn by something outside eaglelab (a full disk, a copy cut short) is not loaded: the run
    warns, trains again from the start and completes."""
    run_dir = tmp_path / "run"
    args = [*SMOKE, "train.checkpoint_every_n_steps=1", f"hydra.run.dir={run_dir}"]
    proc = cli(args, cache_dir, tmp_path)
    ckpt = run_dir / "lightning" / "last.ckpt"
    wait_for(ckpt.exists, 300, "the first checkpoint", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    stale = ckpt.parent / ".last.ckpt.tmp-killedsave"  # what a save killed mid-write leaves behind
    stale.write_bytes(data[:1000])
    done = run_cli(args, cache_dir, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    log = (run_dir / "run.log").read_text()
    assert "last.ckpt cannot be read" in log and "training starts again" in log
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "complete" and info["attempt"] == 2
    assert torch.load(ckpt, weights_only=False)["global_step"] > 0
    assert not stale.exists()  # cleared at the next start, never taken for a checkpoint


# --- interrupted data preparation, then two runs at once on what it left ------------------------------------------
def test_ctrl_c_during_data_preparation_leaves_no_partial_cache_and_two_runs_then_share_it(no_flock, tmp_path):
    """SIGINT while the target regenerates the training data into a cold cache: the run says interrupted and no
    cache entry exists half-made. The run is started the way a script's background job is (SIGINT inherited as
    ignored): Ctrl-C / kill -INT still interrupts it. Then two runs started together on that cache and one results
    root, on a file system without flock (tests/no_flock.c: the entry locks are leases): both complete in their own
    directories, the shared data is prepared once (the other run waits for it) and both train on the same data."""
    cache, results, run_dir = tmp_path / "cache", tmp_path / "results", tmp_path / "run"
    proc = cli([*SMOKE, f"hydra.run.dir={run_dir}"], cache, tmp_path, preexec_fn=ignore_sigint)
    wait_for(
        lambda: list((cache / "locks").glob("regen-*-shard-*.lock*")) if (cache / "locks").exists() else [],
        300,
        "data preparation",
        proc,
    )
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) != 0
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"
    assert not list(cache.glob("*/*/complete.json"))  # no entry is taken for whole (finished shards are kept)
    assert not [p for p in cache.rglob("shard-*.arrow") if p.stat().st_size == 0]

    procs = [cli(SMOKE, cache, results, env=no_flock) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-1500:] for o in outs]
    # The training data is one shard: one run regenerated it (and captured its states in the same pass), the other
    # waited for its lock and found it made.
    assert sum("regenerate train" in err for _, err in outs) == 1
    assert not list((cache / "locks").glob("*.lease"))  # every lease released
    run_dirs = sorted(p.parent for p in results.glob("runs/*/metrics.json"))
    assert len(run_dirs) == 2 and run_dirs[0] != run_dirs[1]
    entries = cache_entries(cache)
    assert len(entries["regen"]) == 2 and len(entries["features"]) == 2  # training data + held-out, once each
    assert all(
        (e / "shard-00000.arrow").is_file() and (e / "complete.json").is_file() for e in sum(entries.values(), [])
    )
    assert not [p for p in cache.rglob(".*.tmp-*")]
    a, b = (json.loads((d / "metrics.json").read_text()) for d in run_dirs)
    assert {k: v for k, v in a.items() if not k.startswith(("time/", "memory/", "data/shards_prepared"))} == {
        k: v for k, v in b.items() if not k.startswith(("time/", "memory/", "data/shards_prepared"))
    }


def test_a_cache_without_flock_captures_in_vllm_through_node_local_scratch(no_flock, tmp_path):
    """The cache on a file system that refuses flock (tests/no_flock.c with NO_FLOCK_UNDER: there only; the node's
    own disk keeps it), the states captured by vLLM: its hidden-states connector writes and locks its per-request
    files in paths.scratch_dir (TMPDIR), so the data stage completes and the shared file system holds only the
    finished shards. paths.scratch_dir on that file system instead is one line naming the setting, before any
    work: no cache entry, no metrics."""
    shared, local = tmp_path / "shared", tmp_path / "local"
    env = {**no_flock, "NO_FLOCK_UNDER": str(shared), "TMPDIR": str(local)}
    args = [*SMOKE, "stage=prepare", "data.capture_backend=vllm", "eval.suites.extrapolation.enabled=false"]
    bad = run_cli([*args, f"paths.scratch_dir={shared / 'scratch'}", f"hydra.run.dir={shared / 'bad'}"],
                  shared / "cache", shared, env=env)  # fmt: skip
    line = error_line(bad.returncode, bad.stderr)
    assert "does not support flock (ENOSYS)" in line and "set paths.scratch_dir (or TMPDIR)" in line, line
    assert not list(shared.rglob("complete.json")) and not list(shared.rglob("metrics.json"))
    good = run_cli([*args, f"hydra.run.dir={shared / 'good'}"], shared / "cache", shared, env=env)
    assert good.returncode == 0, good.stderr[-1500:]
    metrics = json.loads((shared / "good" / "metrics.json").read_text())
    assert metrics["data/shards_prepared"] > 0
    features = [p.parent for p in (shared / "cache" / "features").glob("*/complete.json")]
    assert len(features) == 2 and all(json.loads((f / "complete.json").read_text())["shard_bytes"] for f in features)
    assert not list(shared.rglob("eaglelab-connector-*"))
    assert not list((shared / "cache" / "logs").rglob("*.safetensors"))
    assert not list(local.glob("eaglelab-connector-*/*"))  # each request's states read into its shard and removed


# --- numerical failure ---------------------------------------------------------------------------------------------
def test_atomic_writes_are_readable_by_the_team(tmp_path):
    from eaglelab.core.io import atomic_dir, atomic_file

    old = os.umask(0o022)
    try:
        with atomic_file(tmp_path / "metrics.json") as f:
            f.write("{}")
        with atomic_dir(tmp_path / "drafter") as d:
            (d / "config.json").write_text("{}")
    finally:
        os.umask(old)
    assert (tmp_path / "metrics.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "drafter").stat().st_mode & 0o777 == 0o755


def test_a_failed_trial_does_not_leave_its_wandb_run_to_the_next(cache_dir, tmp_path, monkeypatch):
    """Trials of a sweep share a process: a trial that died with its W&B run open must not have the next
    trial log into it."""
    import wandb

    from eaglelab.results.tracking import start_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    first, second = (
        compose([*SMOKE, "logger=wandb", f"train.seed={s}"], cache_dir, tmp_path / f"t{s}") for s in (0, 1)
    )
    a = start_run(first, tmp_path / "t0")  # left open, as by a crash
    b = start_run(second, tmp_path / "t1")
    try:
        assert b.id == (tmp_path / "t1" / "wandb" / "run_id").read_text().strip() != a.id
        assert wandb.run is b and start_run(second, tmp_path / "t1") is b  # its own run is reused
    finally:
        b.finish()
        # wandb started its service for this (pytest) process and exported WANDB_SERVICE: the CLI runs of later
        # tests would inherit it and share one service (and its registry of run ids in use). Stop it.
        wandb.teardown()
        os.environ.pop("WANDB_SERVICE", None)


def test_fp16_loss_scaler_steps_are_left_to_the_scaler():
    """fp16's loss scaler makes inf gradients on purpose and skips those steps itself, so StopOnNonFinite lets them
    pass. A CPU trainer has no fp16 scaler (Lightning turns 16-mixed into bf16-mixed), hence a stand-in trainer
    here; the gradient and weight stops on eaglelab's real trainer: tests/test_training.py."""
    from types import SimpleNamespace

    from eaglelab.core.errors import TrainingError
    from eaglelab.train.ttt_module import StopOnNonFinite

    module = torch.nn.Linear(4, 4)
    module.weight.grad = torch.full_like(module.weight, float("inf"))
    scaled = SimpleNamespace(global_step=7, precision_plugin=SimpleNamespace(scaler=object()))
    stop = StopOnNonFinite(checkpoint_every_n_steps=50)
    stop.on_before_optimizer_step(scaled, module, None)  # left to the scaler: no error
    unscaled = SimpleNamespace(global_step=7, precision_plugin=SimpleNamespace(scaler=None))
    with pytest.raises(TrainingError, match="non-finite gradient at step 7"):
        stop.on_before_optimizer_step(unscaled, module, None)


def test_non_finite_loss_stops_with_a_clear_error_and_keeps_the_last_finite_checkpoint(cache_dir, tmp_path):
    """A real smoke run whose first optimizer step (lr 1e30) leaves finite but huge weights: the second step's loss
    is non-finite, and the real trainer stops the run there, before its optimizer step."""
    run_dir = tmp_path / "run"
    proc = run_cli(
        [*SMOKE, "train.lr=1e30", "train.checkpoint_every_n_steps=1", f"hydra.run.dir={run_dir}"], cache_dir, tmp_path
    )
    line = error_line(proc.returncode, proc.stderr)
    assert line == (
        "error: non-finite loss at step 1; lightning/last.ckpt keeps the last finite weights; "
        "lower train.lr or train.grad_clip"
    )
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "failed" and info["error"].startswith("TrainingError: non-finite loss at step 1")
    assert not (run_dir / "metrics.json").exists() and not (run_dir / "drafter").exists()
    state = torch.load(run_dir / "lightning" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 1  # the step before the non-finite loss, kept
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values())


# --- the vLLM engine dies, or runs out of time ---------------------------------------------------------------------
def test_vllm_engine_killed_or_timed_out_fails_the_run_keeps_training_and_the_rerun_completes(cache_dir, tmp_path):
    """The engine SIGKILLed mid-evaluation, then (the same command with eval.vllm.timeout_s=3, which is not what
    was measured and so resumes the run) stopped by its time limit: each attempt is marked failed with the reason,
    the drafter and the simulated tables stay, and the error names the rerun. The plain command then completes
    with vLLM's numbers without training again."""
    run_dir = tmp_path / "run"
    args = [
        *SMOKE,
        "eval.vllm.enabled=true",
        "eval.vllm.num_prompts=4",
        "eval.vllm.ks=[3]",  # one engine: the one killed, then the one that completes
        "eval.vllm.throughput_ks=[]",
        f"hydra.run.dir={run_dir}",
    ]
    proc = cli(args, cache_dir, tmp_path)

    def cmdline(child: psutil.Process) -> str:
        try:
            return " ".join(child.cmdline())
        except psutil.Error:  # a child that ended meanwhile (a zombie, or gone): not the engine
            return ""

    def engine():  # the evaluation's engine process (`python -m eaglelab.engine`: eaglelab.engine.process.run_engine)
        children = psutil.Process(proc.pid).children(recursive=True)
        return next((c for c in children if "-m eaglelab.engine " in cmdline(c)), None)

    victim = wait_for(engine, 600, "the vLLM engine", proc)
    wait_for(
        lambda: (run_dir / "vllm" / "vllm.log").exists() and (run_dir / "vllm" / "vllm.log").stat().st_size > 2000,
        300,
        "the engine at work",
        proc,
    )
    victim.send_signal(signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=300)
    # The console of a run that trained: eaglelab's own lines, not Lightning's (they are in run.log)
    for noise in ("INFO: ", "GPU available", "litlogger", "`srun` command", "LeafSpec"):
        assert noise not in stdout + stderr, noise
    assert "GPU available" in (run_dir / "run.log").read_text()

    def failed_keeping_training(line: str, attempt: int) -> None:
        assert f"checkpoint={run_dir}" in line, line
        info = json.loads((run_dir / "run.json").read_text())
        assert info["status"] == "failed" and info["attempt"] == attempt and not (run_dir / "metrics.json").exists()
        assert (run_dir / "drafter" / "model.safetensors").is_file() and (run_dir / "acceptance.csv").is_file()

    line = error_line(proc.returncode, stderr)
    assert "vLLM engine failed (exit -9)" in line
    failed_keeping_training(line, 1)
    steps = torch.load(run_dir / "lightning" / "last.ckpt", weights_only=False)["global_step"]
    timed_out = run_cli([*args, "eval.vllm.timeout_s=3"], cache_dir, tmp_path)
    line = error_line(timed_out.returncode, timed_out.stderr)
    assert "timed out after 3 s" in line and "raise eval.vllm.timeout_s" in line
    failed_keeping_training(line, 2)
    assert "timed out" in json.loads((run_dir / "run.json").read_text())["error"]
    done = run_cli(args, cache_dir, tmp_path)  # the same command again
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert "vllm/acceptance_length@k3" in metrics and metrics["train/steps"] == steps  # not trained again
    # It ends by saying what it found (eaglelab.results.summary), then where: τ at the trained depth from both
    # evaluators over the same prompts (each count said), the simulated one over all, and how to serve the drafter
    # where this CPU run did not
    tau, tau_vllm = metrics["acceptance_length@k3"], metrics["vllm/acceptance_length@k3"]
    same, n, n_all = (
        metrics["vllm/simulated_acceptance_length@k3"],
        metrics["vllm/prompts"],
        metrics["held_out_prompts"],
    )
    line = f"τ@3 (the trained depth): vLLM {tau_vllm:.3f}, simulated {same:.3f} over the same {n} prompts; "
    assert line + f"simulated {tau:.3f} over {n_all} prompts" in done.stdout, done.stdout
    assert f"serve it: python src/run.py checkpoint={run_dir} eval.vllm.throughput_ks=[3]" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1] == f"run_dir: {run_dir}"
    assert json.loads((run_dir / "run.json").read_text())["attempt"] == 3


# --- W&B without a network -------------------------------------------------------------------------------------
def test_wandb_online_without_network_falls_back_to_offline(cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        [*SMOKE, "logger=wandb", "logger.mode=online", "logger.init_timeout_s=5", f"hydra.run.dir={run_dir}"],
        cache_dir,
        tmp_path,
        env={"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "x" * 40},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = (run_dir / "run.log").read_text()  # the warning, in the log (and on the console)
    assert "W&B online logging unavailable" in log and "logging offline instead" in log
    logged = read_run(run_dir)  # the offline run holds the training curves and the results
    assert any("train/loss" in row for row in logged["history"])
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert float(logged["summary"]["acceptance_length@k3"]) == pytest.approx(metrics["acceptance_length@k3"])
    assert "wandb_error" not in json.loads((run_dir / "run.json").read_text())


# --- caches ---------------------------------------------------------------------------------------------------------
def test_a_changed_config_or_target_never_reuses_a_stale_cache(cache_dir, tmp_path):
    """Change what the data depends on — generation length, or the target's weights in place — and the run
    prepares new data (a new cache entry) instead of reusing the old."""
    from eaglelab.data.targets import load_target
    from eaglelab.pipeline import run as run_pipeline

    target = tmp_path / "target"
    shutil.copytree(load_target(compose(SMOKE, cache_dir, tmp_path).target, cache_dir).path, target)
    cache = tmp_path / "cache"
    # what the CLI calls, in this process; one epoch and no suites: the data, not the drafter, is under test
    base = [*SMOKE, "train.epochs=1", "eval.suites.extrapolation.enabled=false", "target=hf"]

    def run(extra: list[str], name: str) -> dict:
        run_dir = run_pipeline(compose([*base, f"target.name_or_path={target}", *extra], cache, tmp_path / name))
        return json.loads((run_dir / "metrics.json").read_text())

    first = run([], "first")
    n = len(cache_entries(cache)["regen"])
    shorter = run(["data.max_new_tokens=12"], "shorter")
    assert len(cache_entries(cache)["regen"]) == n + 1  # the training data again, with the new length
    assert shorter["data/response_tokens"] < first["data/response_tokens"]
    # the target's weights replaced in place (same folder, same config): its fingerprint changes
    from safetensors.torch import load_file, save_file

    weights = load_file(target / "model.safetensors")
    save_file(
        {k: (v * 1.5 if v.ndim == 2 else v) for k, v in weights.items()},
        target / "model.safetensors",
        metadata={"format": "pt"},
    )
    run([], "retargeted")
    assert len(cache_entries(cache)["regen"]) == n + 1 + n  # every entry of the changed target prepared anew


def test_a_damaged_cache_shard_is_named_and_prepared_again_never_read(tmp_path, caplog):
    """A shard that is not what its entry recorded (cut short, as a half-finished copy to a shared file system
    leaves it; or gone) is named in one warning and its entry prepared again: the run trains on the same data
    as before, never on the damaged bytes (which pyarrow would fail on, or read)."""
    from eaglelab.pipeline import run

    cache = tmp_path / "cache"
    first = run(compose([*SMOKE, "train.epochs=1"], cache, tmp_path / "first"))
    (states,) = cache_entries(cache)["features"][:1]
    shard = sorted(states.glob("shard-*.arrow"))[0]
    whole = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(whole // 2)
    tokens = sorted(cache_entries(cache)["regen"][0].glob("shard-*.arrow"))[0]
    tokens.unlink()
    again = run(compose([*SMOKE, "train.epochs=1"], cache, tmp_path / "again"))
    warned = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert any(f"{shard.name} holds {whole // 2} bytes, {whole} were written" in w for w in warned), warned
    assert any(f"{tokens.name} is missing" in w for w in warned), warned
    assert shard.stat().st_size == whole and tokens.is_file()  # prepared again, to the same bytes
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (first, again))
    assert {k: v for k, v in a.items() if not k.startswith(("time/", "memory/", "data/shards_prepared"))} == {
        k: v for k, v in b.items() if not k.startswith(("time/", "memory/", "data/shards_prepared"))
    }
