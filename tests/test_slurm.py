"""Against a real Slurm that this module starts and stops (slurm/dev-cluster/, NODES=2: this machine's node, and
n1, n2 each in network and UTS namespaces of its own): a grid through `hydra/launcher=slurm`, a trial on two Slurm
tasks of one node (DDP), an Optuna sweep with 2 trials at a time, a DDP trial across two nodes preempted (USR2, as
Slurm signals it) that submitit requeues and that resumes to the uninterrupted 2-node result, and a wrong partition
refused before anything is queued. Needs root (the daemons) and the Debian packages
scripts/setup.sh installs."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from benchmarks import faults, preemption

from conftest import ROOT, compose, run_cli

CLUSTER = ROOT / "slurm" / "dev-cluster"
# Jobs on the test node: no GPUs, one CPU each (two run side by side on 2 cores).
SLURM = [
    "hydra/launcher=slurm",
    "hydra.launcher.gpus_per_node=null",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=2",
    "hydra.launcher.timeout_min=30",
]
QUICK = [
    "experiment=smoke",
    "train.epochs=1",
    "eval.suites.drift.enabled=false",
    "eval.suites.extrapolation.enabled=false",
    "train.num_threads=1",
]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("slurmctld") is None,
    reason="the throw-away Slurm needs root and the Slurm packages (scripts/setup.sh)",
)


@pytest.fixture(scope="module")
def slurm():
    # munged wants every folder above its socket world-searchable: not pytest's 700 tmp folders.
    root = Path(tempfile.mkdtemp(prefix="eaglelab-slurm-"))
    root.chmod(0o755)
    env = {**os.environ, "SLURM_TEST_ROOT": str(root), "SMOKE": "0", "NODES": "2"}
    started = subprocess.run(["bash", str(CLUSTER / "start.sh")], env=env, capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(root / "slurm.conf")
    yield root
    subprocess.run(["bash", str(CLUSTER / "stop.sh"), "--purge"], env=env, capture_output=True, timeout=120)
    shutil.rmtree(root, ignore_errors=True)
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old


def _sacct(*fields: str) -> list[list[str]]:
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", ",".join(fields)], capture_output=True, text=True, check=True
    ).stdout
    return [line.split("|") for line in out.splitlines() if line]


def test_grid_through_the_slurm_launcher_after_its_prepare_job(slurm, tmp_path):
    """The documented cluster route on a cold cache: the sweep's command with `stage=prepare` as one Slurm job (its
    GPUs: train.devices or the data engine's size; none here), then the grid's two trials as a Slurm array, which
    prepare nothing (the 2-task DDP trial below and the Optuna sweep add more jobs)."""
    cache, sweep = tmp_path / "cache", tmp_path / "grid"
    prepare = run_cli(["-m", *QUICK, *SLURM, "stage=prepare", f"hydra.sweep.dir={tmp_path / 'prepare'}"], cache,
                      tmp_path, timeout=900)  # fmt: skip
    assert prepare.returncode == 0, prepare.stderr[-3000:]
    (made,) = [json.loads(p.read_text()) for p in (tmp_path / "prepare").glob("*/metrics.json")]
    assert made["data/shards_prepared"] > 0 and not any((tmp_path / "prepare").glob("*/drafter"))
    proc = run_cli(
        ["-m", *QUICK, *SLURM, "+ablation=eagle3_1,eagle3", f"hydra.sweep.dir={sweep}"], cache, tmp_path, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(sweep.glob("*/metrics.json"))
    assert len(runs) == 2
    assert [json.loads(r.read_text())["data/shards_prepared"] for r in runs] == [0, 0]
    assert "0_eagle3.1_s0: eagle3.1 seed 0" in proc.stdout and not re.search(r"; \d+ data shards prepared", proc.stdout)
    assert re.search(r"0_eagle3.1_s0: \d+ data shards prepared in ", prepare.stdout), prepare.stdout[-2000:]
    labels = {
        (
            json.loads((r.parent / "run.json").read_text())["variant"],
            json.loads((r.parent / "run.json").read_text())["seed"],
        )
        for r in runs
    }
    assert labels == {("eagle3.1", 0), ("eagle3", 0)}
    ours = {p.name.split("_")[0] for p in (sweep / ".submitit").iterdir()}  # this sweep's array job(s)
    for _ in range(150):  # submitit returns as soon as the results are written; accounting follows shortly
        tasks = [state for job_id, state in _sacct("JobID", "State") if job_id.split("_")[0] in ours]
        if tasks.count("COMPLETED") == 2:
            break
        time.sleep(0.2)
    assert tasks == ["COMPLETED"] * 2, tasks


EXACT = [*QUICK, "train.precision=32-true"]


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory) -> Path:
    """The trial in this process, in float32 with batches of 4: what a DDP trial and a handed-off evaluation repeat."""
    from eaglelab.pipeline import run

    return run(compose([*EXACT, "train.batch_size=4"], cache_dir, tmp_path_factory.mktemp("reference")))


def test_a_trial_on_two_slurm_tasks_is_one_ddp_run(slurm, reference, cache_dir, tmp_path):
    """`tasks_per_node: ${train.devices}`: Slurm starts the 2 ranks (one task each, one CPU each); one run
    directory, rank 0 alone exports, the weights and metrics of one process with the same global batch."""
    sweep = tmp_path / "ddp"
    ddp = ["train.devices=2", "train.strategy=ddp", "train.batch_size=2"]
    proc = run_cli(["-m", *EXACT, *SLURM, *ddp, f"hydra.sweep.dir={sweep}"], cache_dir, tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (trial,) = [p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")]
    logs = [p.read_text() for p in (sweep / ".submitit").rglob("*_log.*")]
    assert len([p for p in (sweep / ".submitit").rglob("*_log.out")]) == 2  # two tasks
    assert sum(log.count("stage: export") for log in logs) == 1 and sum(log.count("stage: train") for log in logs) == 2
    a, b = (load_file(d / "drafter" / "model.safetensors") for d in (reference, trial))
    assert max(float((a[k].float() - b[k].float()).abs().max()) for k in a) < 1e-4
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (reference, trial))
    assert ma["train/steps"] == mb["train/steps"]
    for key in ("val/acceptance_length@k3", "acceptance_length@k3"):
        assert mb[key] == pytest.approx(ma[key], abs=1e-6), key


def test_a_trial_hands_its_evaluation_to_a_slurm_job_of_its_own(slurm, reference, cache_dir, tmp_path):
    """eval.job.enabled=true: the trial trains and exports in this process, then its evaluation is a Slurm job with
    eval.job's time limit and memory, which completes the same run directory with the numbers of the trial that
    evaluated itself, and keeps what the training attempt measured. A partition Slurm lacks, or a job it would not
    take (GPUs on a node without any), is refused before any work."""
    from eaglelab.core.errors import ConfigError
    from eaglelab.pipeline import run
    from eaglelab.results.summary import sweep_summary

    handed = ["eval.job.enabled=true", "eval.job.cpus_per_task=1", "eval.job.mem_gb=2", "eval.job.timeout_min=17"]
    with pytest.raises(ConfigError, match=r"^Slurm partition 'nope' does not exist; set eval.job.partition to one of"):
        run(compose([*EXACT, *handed, "eval.job.partition=nope"], cache_dir, tmp_path / "refused"))
    with pytest.raises(ConfigError, match=r"^Slurm would refuse the evaluation job \(sbatch --test-only: .+\)"):
        run(compose([*EXACT, *handed, "eval.job.gpus_per_node=4"], cache_dir, tmp_path / "refused"))  # no GPUs here
    assert not (tmp_path / "refused" / "drafter").exists()
    run_dir = run(compose([*EXACT, *handed], cache_dir, tmp_path / "trial"))
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "trained" and (run_dir / "drafter" / "model.safetensors").is_file()
    trained = json.loads((run_dir / "trained.json").read_text())
    job_id = record["evaluation_job"]["job_id"]
    assert f"evaluated by Slurm job {job_id}" in sweep_summary([run_dir])[0]
    for _ in range(600):  # the job's engine-free evaluation: seconds, after Slurm starts it
        rows = [r for r in _sacct("JobID", "Timelimit", "ReqMem", "State") if r[0] == job_id]
        if rows and rows[0][3] not in ("PENDING", "RUNNING"):
            break
        time.sleep(0.5)
    assert rows == [[job_id, "00:17:00", "2G", "COMPLETED"]], rows
    record = json.loads((run_dir / "run.json").read_text())
    (earlier,) = record["earlier"]  # the training job's attempt
    assert record["status"] == "complete" and earlier["status"] == "trained"
    assert earlier["evaluation_job"]["job_id"] == job_id
    log = Path(earlier["evaluation_job"]["log"])  # submitit's <job>_0_log.out, its stderr beside it
    assert "training finished in an earlier attempt" in log.with_suffix(".err").read_text()
    metrics, ref = (json.loads((d / "metrics.json").read_text()) for d in (run_dir, reference))
    for key in ("val/acceptance_length@k3", "acceptance_length@k3", "acceptance_length@k1", "train/steps"):
        assert metrics[key] == pytest.approx(ref[key], abs=1e-6), key
    assert {k: metrics[k] for k in trained} == trained  # the training job's own figures (data made, time, memory)
    assert metrics["time/total_s"] > trained["time/training_job_s"]
    # Relaunched while its evaluation job is queued (held here), the trial is left alone; once that job is gone,
    # the relaunch is the run's next attempt (which hands the evaluation over again).
    from eaglelab.core.rundir import begin_attempt

    (run_dir / "metrics.json").unlink()
    held = subprocess.run(["sbatch", "--hold", "--parsable", "--wrap", "true"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    (run_dir / "run.json").write_text(json.dumps({**earlier, "evaluation_job": {"job_id": held, "log": "?"}}))
    cfg = compose([*EXACT, *handed], cache_dir, run_dir)
    assert begin_attempt(cfg, run_dir) is None
    subprocess.run(["scancel", held], check=True)
    assert begin_attempt(cfg, run_dir).attempt == 2


def test_optuna_sweep_with_two_parallel_jobs(slurm, cache_dir, tmp_path):
    db = tmp_path / "study.db"
    proc = run_cli(
        [
            "-m",
            "+sweep=optuna_search",
            *QUICK,
            *SLURM,
            f"hydra.sweeper.storage=sqlite:///{db}",
            "hydra.sweeper.study_name=slurm",
            "hydra.sweeper.n_trials=4",
            "hydra.sweeper.n_jobs=2",
            f"hydra.sweep.dir={tmp_path / 'study'}",
        ],
        cache_dir,
        tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import optuna

    study = optuna.load_study(study_name="slurm", storage=f"sqlite:///{db}")
    assert [t.state.name for t in study.trials].count("COMPLETE") == 4
    # Two trials at a time: each batch was one Slurm job array of 2 tasks, and the two ran side by side.
    arrays = {}
    for job_id, start, end in _sacct("JobID", "Start", "End"):
        if "_" in job_id:
            arrays.setdefault(job_id.split("_")[0], []).append((start, end))
    pairs = [v for v in arrays.values() if len(v) == 2]
    assert len(pairs) >= 2
    assert any(max(s for s, _ in p) < min(e for _, e in p) for p in pairs)  # overlapping in time


def _processes_catching_usr2(name: str, count: int, sweeper: subprocess.Popen, timeout: float = 300) -> list[int]:
    """The pids of the `count` Python processes running the file `name` (one per Slurm task), once each catches
    SIGUSR2 (bit 12 of /proc/PID/status's SigCgt). srun's command line names the file too: only a python's
    counts. (Every node's processes are in this machine's /proc: the nodes differ in network and hostname only.)"""
    deadline = time.time() + timeout
    while time.time() < deadline and sweeper.poll() is None:
        caught = []
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
                if (
                    len(argv) > 2
                    and Path(argv[0].decode()).name.startswith("python")
                    and argv[2].endswith(name.encode())
                ):
                    status = (proc / "status").read_text().splitlines()
                    mask = int(next(line for line in status if line.startswith("SigCgt")).split()[1], 16)
                    if mask & (1 << (signal.SIGUSR2 - 1)):
                        caught.append(int(proc.name))
            except (OSError, StopIteration):
                continue
        if len(caught) >= count:
            return caught
        time.sleep(0.002)
    raise AssertionError(f"fewer than {count} Python processes running {name} caught SIGUSR2")


# One DDP trial across the two namespace nodes (start.sh's NODES=2): a task on each, gloo between them.
TWO_NODES = [
    *SLURM,
    "hydra.launcher.partition=nodes",
    "train.num_nodes=2",
    "train.devices=1",
    "train.strategy=ddp",
    "train.batch_size=2",  # per rank: the global batch of preemption.BASE's one process
    "train.num_threads=1",
    "train.epochs=2",  # 10 steps, a checkpoint after each
]


def _sweep(sweep: Path, cache_dir: Path, extra: list[str] = ()) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "src" / "run.py"), "-m", *preemption.BASE, *TWO_NODES, *extra]
    env = {**os.environ, "EAGLELAB_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [*cmd, f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_two_node_trial_preempted_requeued_resumes_to_the_uninterrupted_result(slurm, cache_dir, tmp_path):
    """A trial with `nodes=2` through `hydra/launcher=slurm`: DDP across two Slurm nodes (their own addresses and
    hostnames), once uninterrupted and once preempted. USR2 mid-training: rank 0's submitit checkpoints and
    requeues the job, the job starts again on both nodes in the same run directory and resumes from
    lightning/last.ckpt. USR2 again at the requeued job's first instant, before submitit's handler exists in
    either task: kept, delivered, requeued once more. The result is the uninterrupted run's, bit for bit."""
    t0 = time.time()
    reference = _sweep(tmp_path / "reference", cache_dir)
    out, err = reference.communicate(timeout=900)
    assert reference.returncode == 0, err[-3000:]
    uninterrupted_s = time.time() - t0
    (ref_dir,) = [p for p in (tmp_path / "reference").iterdir() if p.is_dir() and not p.name.startswith(".")]
    logs = "".join(p.read_text() for p in (tmp_path / "reference").glob(".submitit/**/*_log.*"))
    # One task on each node, each its own host: global ranks 0 and 1, rank 0 alone writes results.
    hosts = subprocess.run(["sacct", "-n", "-P", "-o", "JobName,NodeList"], capture_output=True, text=True).stdout
    assert "n[1-2]" in hosts, hosts
    assert logs.count("stage: train") == 2 and logs.count("stage: export") == 1, logs[-3000:]

    sweep = tmp_path / "preempted"
    sweeper = _sweep(sweep, cache_dir)
    deadline, ckpt = time.time() + 600, None
    while time.time() < deadline and sweeper.poll() is None:
        found = list(sweep.glob("*/lightning/last.ckpt"))
        if found and preemption.checkpoint_step(found[0]) >= 3:  # mid-epoch 1 (of 5 steps)
            ckpt = found[0]
            break
        time.sleep(0.1)
    assert ckpt is not None, "the trial never reached step 3"
    job_id = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout.split()[0]
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    faults.start_requeued_now(job_id, sweeper)  # (Slurm would hold the requeued job ~2 min first)
    # The requeued job is signalled again at its very start: both tasks' interpreters already run
    # eaglelab/slurm_entry.py (USR2 caught) but submitit has not installed its handler yet.
    entries = _processes_catching_usr2("slurm_entry.py", 2, sweeper)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    faults.start_requeued_now(job_id, sweeper)
    out, err = sweeper.communicate(timeout=900)
    assert sweeper.returncode == 0, err[-3000:]
    print(f"\n2-node trial: uninterrupted {uninterrupted_s:.0f} s; preempted twice, requeued and resumed "
          f"{time.time() - t0 - uninterrupted_s:.0f} s")  # fmt: skip
    run_dir = ckpt.parent.parent
    logs = "".join(p.read_text() for p in sweep.glob(".submitit/**/*_log.*"))  # (.out and .err)
    assert logs.count("SIGUSR2 before submitit's handler") >= 2, (entries, logs[-3000:])  # (one per task)
    assert "SIGUSR2 arrived before submitit's handler was installed: delivering it now" in logs
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "complete" and info["attempt"] == 2  # (the early USR2 came before any attempt began)
    # The first attempt acted on the USR2 itself, in training (outside any write, or right after it)
    assert info["earlier"][0]["status"] == "interrupted"
    assert info["earlier"][0]["signal"]["name"] == "SIGUSR2" and info["earlier"][0]["signal"]["stage"] == "train"
    restarts = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    assert "Restarts=2" in restarts and "NodeList=n[1-2]" in restarts, restarts  # the same job, on both nodes
    a, b = load_file(run_dir / "drafter" / "model.safetensors"), load_file(ref_dir / "drafter" / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)
    weights, metrics, differ = preemption.compare(run_dir, ref_dir)
    assert weights and metrics, differ


def test_unknown_partition_is_refused_before_submission(slurm, cache_dir, tmp_path):
    before = len(_sacct("JobID"))
    proc = run_cli(
        [
            "-m",
            *QUICK,
            *SLURM,
            "hydra.launcher.partition=nope",
            "train.seed=0,1",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cache_dir,
        tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: Slurm partition 'nope' does not exist; set hydra.launcher.partition to one of: debug, nodes"
    )
    assert len(_sacct("JobID")) == before and not (tmp_path / "sweep" / ".submitit").exists()


def test_stream_engine_on_one_node_trainer_on_the_other(slurm, cache_dir, tmp_path):
    """features=stream split over two namespace nodes: the trial's trainer a Slurm job on n2, the stream's engine a
    Slurm job of its own on n1 (features.stream.engine_launcher=srun ...), the states crossing the bridge through the
    Mooncake store the trial started on n2 (no file system in their path)."""
    sweep = tmp_path / "split"
    split = ["hydra.launcher.partition=nodes", "+hydra.launcher.additional_parameters.nodelist=n2",
             "hydra.launcher.mem_gb=3", "features=stream", "features.stream.window_gb=0.05",
             "features.stream.engine_launcher='srun -p nodes -w n1 -N1 -n1 -c1 --mem=3G'"]  # fmt: skip
    proc = run_cli(["-m", *QUICK, *SLURM, *split, f"hydra.sweep.dir={sweep}"], cache_dir, tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (trial,) = [p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")]
    metrics = json.loads((trial / "metrics.json").read_text())
    engine_log = (trial / "stream" / "vllm.log").read_text()
    assert "engine on n1, from sample 0" in engine_log
    assert re.search(
        r"streaming states: \d+ samples to 1 trial\(s\) through the Mooncake store at n2:",
        (trial / "run.log").read_text(),
    )
    assert metrics["stream/samples_streamed"] > 0 and metrics["stream/engine_restarts"] == 0
    jobs = {name: node for _, name, node in _sacct("JobID", "JobName", "NodeList")[-2:]}
    assert set(jobs.values()) == {"n1", "n2"}, jobs  # the trial's job and the engine's
