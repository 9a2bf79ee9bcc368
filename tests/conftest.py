"""Tests compose the same Hydra configs the CLI does and call the same `eaglelab.pipeline.run`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# `make test-fast` runs `-m "not slow"`: the tests that start no real run, engine, cluster or CLI process (about a
# minute). These modules start them in every test; elsewhere such tests carry @pytest.mark.slow themselves.
SLOW_MODULES = {
    "test_bad_input",
    "test_benchmarks",
    "test_faults",
    "test_launch",
    "test_pipeline",
    "test_results",
    "test_slurm",
    "test_smollm2",
    "test_stream",
    "test_sweeps",
    "test_vllm",
}


# `make test` runs two pytest-xdist workers, each taking whole files in the order collected: the longest first
# (seconds per file, measured with --durations=0 on the 2-core AMX Xeon box, 2026-12-06, less what that stop cut),
# so the last file a worker starts is short. Stale figures cost wall time: the workers finish apart.
FILE_SECONDS = {
    "test_vllm": 400,
    "test_launch": 138,
    "test_slurm": 175,
    "test_faults": 128,
    "test_sweeps": 93,
    "test_stream": 175,
    "test_results": 60,
    "test_smollm2": 57,
    "test_benchmarks": 52,
    "test_bad_input": 52,
    "test_pipeline": 51,
    "test_gpu_check": 46,  # (the tiny loop on a pretend bare GPU box, a vLLM engine beside held memory)
    "test_data": 46,
    "test_limits": 36,
    "test_ranks": 12,
    "test_suites": 10,
    "test_locks": 10,
    "test_formats": 10,
}


def pytest_collection_modifyitems(items):
    module = lambda item: item.module.__name__.rsplit(".", 1)[-1]  # noqa: E731
    for item in items:
        if module(item) in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: -FILE_SECONDS.get(module(item), 0))  # stable: a file's own order is kept


def _one_share_of_the_cores_per_worker() -> None:
    """Under pytest-xdist, each worker (and every process it starts: CLI runs, vLLM engines, Slurm daemons) runs on
    its own share of the cores. Without it two workers' torch and vLLM OpenMP pools, each sized and bound to every
    core, oversubscribe them (measured on the 2-core box: see Makefile)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= count:
        os.sched_setaffinity(0, cpus[int(worker.removeprefix("gw")) :: count])


_one_share_of_the_cores_per_worker()  # before torch is imported: its thread pool is sized from the affinity


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One cache per test session: cold at the start (the real conversion and capture paths run), then
    shared by every test, as trials of a sweep share it."""
    return tmp_path_factory.mktemp("eaglelab-cache")


def compose(overrides: list[str], cache_dir: Path, run_dir: Path):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from eaglelab.core.config import to_run_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = hydra_compose("config", overrides=[*overrides, f"paths.cache_dir={cache_dir}"])
    run_cfg = to_run_config(cfg)
    run_cfg.run_dir = str(run_dir)
    return run_cfg


def cli_env(cache_dir: Path, results_dir: Path, env: dict | None = None) -> dict:
    """The environment of a CLI run in the tests: its own cache and results folders (`env`: extra variables)."""
    return {
        **os.environ,
        "EAGLELAB_CACHE_DIR": str(cache_dir),
        "EAGLELAB_RESULTS_DIR": str(results_dir),
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }


def error_line(returncode: int, stderr: str) -> str:
    """Bad input's contract: exit status 2 and exactly one `error: ...` line; returns that line."""
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert returncode == 2 and len(lines) == 1, stderr[-2000:]
    return lines[0]


def run_cli(args: list[str], cache_dir: Path, results_dir: Path, timeout: int = 600, env: dict | None = None):
    """`python src/run.py ARGS` in a subprocess, as a user types it (`env`: extra environment variables)."""
    env = cli_env(cache_dir, results_dir, env)
    return subprocess.run(
        [sys.executable, str(ROOT / "src" / "run.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def no_flock(tmp_path_factory) -> dict:
    """The environment of a process on a file system without flock: tests/no_flock.c, built here and LD_PRELOADed,
    makes flock() fail with ENOSYS (what Lustre without its `flock` mount option answers): everywhere, or with
    NO_FLOCK_UNDER=PATH in the environment too, under PATH only."""
    lib = tmp_path_factory.mktemp("no_flock") / "libnoflock.so"
    source = str(ROOT / "tests" / "no_flock.c")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(lib), source, "-ldl"], check=True)
    return {"LD_PRELOAD": str(lib)}
