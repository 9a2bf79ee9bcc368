"""The launch matrix: every way a trial's ranks are started × features {cached, online, hybrid}, 2 ranks on gloo.

Each cell checks what issue 29 asks of every path: one run directory per trial, one process that wrote results
(only rank 0 runs the export stage), and the metrics and weights of one process with the same global batch
(2 ranks × batch 2 against 1 × batch 4; the loss is normalised by the global count, validation counts are summed
over the ranks' shares). Hybrid cells run on a cache without states, so epoch 1 really computes and publishes
them: the published entry holds each sequence once.

| path                                   | who starts the ranks                | cells                   |
|----------------------------------------|-------------------------------------|-------------------------|
| `python src/run.py train.devices=2`    | eaglelab (`eaglelab.core.ranks`)         | hybrid, killed, resumed |
| `-m` basic launcher, 2 trials in turn  | eaglelab, once per trial            | online, cached          |
| `-m hydra/launcher=local` (submitit)   | eaglelab, inside each submitit job  | hybrid                  |
| `torchrun --nproc-per-node 2 -m`       | torchrun                            | hybrid, online          |
| torchrun inside a Slurm allocation     | torchrun (not Slurm: Lightning's order) | cached              |
| two "nodes", NODE_RANK=0/1             | the user, one command per node      | cached                  |
(Slurm tasks, `tasks_per_node: ${train.devices}`, are the Slurm launcher's path: tests/test_slurm.py.)
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import ROOT, cli_env, compose, run_cli

COMMON = [
    "experiment=smoke",
    "train.epochs=2",  # hybrid: epoch 2 reads what epoch 1 published
    "train.precision=32-true",
    "train.num_threads=1",
    "eval.suites.drift.enabled=false",
    "eval.suites.extrapolation.enabled=false",
]
TWO_RANKS = [*COMMON, "train.batch_size=2", "train.devices=2", "train.strategy=ddp"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process, batch 4, per features mode, on the module's cache: hybrid first (it publishes the states the
    later runs of this cache read), as the cells' caches are filled."""
    from eaglelab.pipeline import run

    root = tmp_path_factory.mktemp("launch")
    out = {"cache": root / "cache"}
    for kind in ("hybrid", "online", "cached"):
        run_dir = run(compose([*COMMON, "train.batch_size=4", f"features={kind}"], out["cache"], root / kind))
        out[kind] = run_dir
    return out


def same_as_one_process(run_dir: Path, reference: Path) -> None:
    a, b = (load_file(d / "drafter" / "model.safetensors") for d in (reference, run_dir))
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst < 1e-4, (run_dir, worst)
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (reference, run_dir))
    assert ma["train/steps"] == mb["train/steps"]
    assert mb["train/loss"] == pytest.approx(ma["train/loss"], abs=1e-4)
    for key in ("val/acceptance_length@k3", "val/acc@d1", "acceptance_length@k3", "acc@d2"):
        assert mb[key] == pytest.approx(ma[key], abs=1e-6), (run_dir, key)
    assert mb["data/val_sequences"] == ma["data/val_sequences"]


def written_once(output: str, trials: int = 1) -> None:
    """Only rank 0 of each trial ran the stages that write results (every rank logs its stages)."""
    assert output.count("stage: export") == trials, output[-3000:]
    assert output.count("stage: train") == 2 * trials  # both ranks trained


def published_once(cache: Path, run_dir: Path) -> None:
    """Hybrid under 2 ranks: the entry its first epoch published holds every sequence once (each rank wrote the
    rows it trained and validated; validation is sharded, not repeated on every rank)."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    entries = [json.loads(p.read_text()) for p in (cache / "features").glob("*/complete.json")]
    online = [e for e in entries if e.get("shards") and not e["shards"][0]["file"].startswith("shard")]
    assert len(online) == 1, entries
    rows = [r for shard in online[0]["shards"] for r in shard["rows"]]
    assert sorted(rows) == list(range(metrics["data/train_sequences"] + metrics["data/val_sequences"]))


def run_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def test_a_basic_launcher_sweep_runs_each_trial_once_on_two_ranks(references, tmp_path):
    """Lightning's launcher would re-run sys.argv (the whole sweep) in each child; each trial here starts its own
    rank, in turn, in the sweep's one process."""
    sweep = tmp_path / "sweep"
    out = run_cli(
        ["-m", *TWO_RANKS, "features=online,cached", f"hydra.sweep.dir={sweep}"], references["cache"], tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    written_once(out.stdout + out.stderr, trials=2)
    trials = run_dirs(sweep)
    assert [p.name.split("_")[0] for p in trials] == ["0", "1"]
    for trial, kind in zip(trials, ("online", "cached")):
        same_as_one_process(trial, references[kind])
        assert (trial / "logs" / "metrics.csv").read_text().count("\n") > 2  # rank 0 logged
    # Lightning's info lines and its sync_dist hint stay out of the console, the ranks eaglelab started included
    for noise in ("INFO: ", "It is recommended to use `self.log("):
        assert noise not in out.stdout + out.stderr, (noise, out.stderr[-3000:])
    # The sweep ends by saying what each trial found (eaglelab.results.summary.SweepSummary), once: rank 0's process
    assert out.stdout.count("summary: 2 trials") == 1, out.stdout[-3000:]
    for trial in trials:
        tau = json.loads((trial / "metrics.json").read_text())["acceptance_length@k3"]
        assert f"{trial.name}: eagle3.1 seed 0, τ@3 simulated {tau:.3f}" in out.stdout


def test_submitit_local_jobs_start_their_ranks(references, tmp_path):
    """submitit's job process runs `python -m submitit.core._submit FOLDER`: a rank started from that argv would
    fail in submitit's parser (hydra/launcher=local did, before eaglelab started its ranks itself)."""
    cache, sweep = tmp_path / "cache", tmp_path / "sweep"
    args = ["-m", "hydra/launcher=local", *TWO_RANKS, "features=hybrid", f"hydra.sweep.dir={sweep}"]
    out = run_cli(args, cache, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (trial,) = run_dirs(sweep)
    same_as_one_process(trial, references["hybrid"])
    logs = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*.err")) + (trial / "run.log").read_text()
    assert "unrecognized arguments" not in logs
    published_once(cache, trial)
    assert json.loads((trial / "run.json").read_text())["status"] == "complete"


def torchrun(args: list[str], cache: Path, results: Path, env: dict | None = None):
    return subprocess.run(
        [*TORCHRUN, str(ROOT / "src" / "run.py"), *args],
        cwd=ROOT,
        env=cli_env(cache, results, env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_torchrun_with_each_features_mode(references, tmp_path):
    cache, sweep = tmp_path / "cache", tmp_path / "sweep"
    out = torchrun(["-m", *TWO_RANKS, "features=hybrid,online", f"hydra.sweep.dir={sweep}"], cache, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    written_once(out.stdout + out.stderr, trials=2)
    trials = run_dirs(sweep)
    for trial, kind in zip(trials, ("hybrid", "online")):
        same_as_one_process(trial, references[kind])
    published_once(cache, trials[0])


def test_torchrun_inside_a_slurm_allocation_is_torchrun(references, tmp_path):
    """Slurm's variables are set (salloc, then torchrun), but torchrun started the ranks: its environment is the
    one Lightning picks first, so a 1-task allocation does not make a world of 1. Each rank resolves its run
    directory's time stamp itself: they take rank 0's (${eaglelab.launch_stamp:...}), one run directory. (Without
    Slurm's variables: test_torchrun_with_each_features_mode.)"""
    slurm = {"SLURM_NTASKS": "1", "SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    slurm |= {"SLURM_NODEID": "0", "SLURM_NODELIST": "localhost", "SLURM_JOB_NAME": "train"}
    out = torchrun(TWO_RANKS, references["cache"], tmp_path, env=slurm)
    assert out.returncode == 0, out.stderr[-3000:]
    written_once(out.stdout + out.stderr)
    (run_dir,) = run_dirs(tmp_path / "runs")  # one, not one per rank
    same_as_one_process(run_dir, references["cached"])


def test_two_nodes_without_a_scheduler(references, tmp_path):
    """One command per node with NODE_RANK set (here both on this machine): node 1's rank 0 is global rank 1 and
    writes nothing. Without a shared hydra.run.dir, each node names its own: one clear error on both."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [*COMMON, "train.batch_size=2", "train.num_nodes=2", "train.strategy=ddp"]

    def nodes(extra: list[str]) -> list[subprocess.CompletedProcess]:
        procs = [
            subprocess.Popen(
                [sys.executable, str(ROOT / "src" / "run.py"), *args, *extra],
                cwd=ROOT,
                env=cli_env(
                    references["cache"],
                    tmp_path,
                    {"NODE_RANK": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for n in (0, 1)
        ]
        done = [(p, *p.communicate(timeout=600)) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, out, err in done]

    node0, node1 = nodes([f"hydra.run.dir={tmp_path / 'run'}"])
    assert node0.returncode == node1.returncode == 0, (node0.stderr[-2000:], node1.stderr[-2000:])
    assert "stage: export" in node0.stdout + node0.stderr and "stage: export" not in node1.stdout + node1.stderr
    assert node0.stdout.count("run_dir:") == 1 and "run_dir:" not in node1.stdout
    same_as_one_process(tmp_path / "run", references["cached"])
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)

    for node in nodes([]):
        lines = [line for line in node.stderr.splitlines() if line.startswith("error: ")]
        assert node.returncode == 2 and len(lines) == 1, node.stderr[-2000:]
        assert "disagree on the run directory" in lines[0] and "hydra.run.dir" in lines[0]


def test_a_rank_that_dies_ends_the_trial_and_the_same_command_resumes_it(references, tmp_path):
    """Hybrid features, 2 ranks, shards of 2 sequences: a rank eaglelab started is SIGKILLed inside epoch 1, once
    shards were closed. Rank 0 (waiting for it in a collective) is told, records the attempt and exits, instead of
    waiting out the collective's 30-minute timeout. The same command resumes: the published entry holds every
    sequence once, and what was computed again at publishing is at most the shard each rank had in flight."""
    import signal
    import threading
    import time

    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    cell = [*TWO_RANKS, "features=hybrid", "data.shard_size=2", "train.checkpoint_every_n_steps=2"]
    args = [sys.executable, str(ROOT / "src" / "run.py"), *cell, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(args, cwd=ROOT, env=cli_env(cache, tmp_path), stderr=subprocess.STDOUT,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout))
    reader.start()
    deadline = time.monotonic() + 300
    while len(list(cache.glob("features/.*partial*/*.rows.json"))) < 2:  # a closed shard on each rank, or two
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
        time.sleep(0.02)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    (helper,) = [c for c in children if b"eaglelab.rank_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    os.kill(int(helper), signal.SIGKILL)
    proc.wait(timeout=300)  # not the 30 minutes of a collective's timeout
    reader.join()
    output = "".join(lines)
    assert proc.returncode != 0, output[-3000:]
    assert f"local rank 1 (pid {helper}) ended with exit code -9" in output
    # The training data (shards of 2 prompts) was regenerated by both ranks, each its own share.
    made = re.findall(r"train: (\d+) of (\d+) shards regenerated by rank \d", output)
    assert len(made) == 2 and sum(int(m) for m, _ in made) == int(made[0][1]), output[-3000:]
    assert min(int(m) for m, _ in made) > 0, made
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] in ("interrupted", "failed") and not (run_dir / "metrics.json").exists()
    assert not [p for p in cache.glob("features/*/complete.json") if "shard-" not in p.read_text()]  # unpublished

    again = run_cli([*cell, f"hydra.run.dir={run_dir}"], cache, tmp_path)
    helper_lines = "\n".join(line for line in again.stderr.splitlines() if "rank 1" in line)
    assert again.returncode == 0, helper_lines[-3000:] + again.stderr[-2000:]
    assert again.stdout.count("run_dir:") == 1 and not (tmp_path / "runs").exists()  # one writer, one directory
    assert json.loads((run_dir / "run.json").read_text())["attempt"] == 2
    published_once(cache, run_dir)
    (entry,) = [
        json.loads(p.read_text()) for p in cache.glob("features/*/complete.json") if "shard-" not in p.read_text()
    ]
    print(f"hybrid, 2 ranks, killed in epoch 1: {entry['recomputed']} sequences computed again at publishing")
    assert entry["recomputed"] <= 2 * 2, entry["recomputed"]  # at most one shard of 2 per rank
    same_as_one_process(run_dir, references["hybrid"])
