"""Sweeps without a cluster: the ready grids compose, runs resume to the uninterrupted result after kills,
several processes share one Optuna study, and sweep mistakes fail before anything runs. (The same on a real
Slurm: tests/test_slurm.py; several ranks per trial, every launch path: tests/test_launch.py.)"""

import importlib.util
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import preemption  # the benchmark's kill-and-resume, the same code the closing figures come from

from conftest import ROOT, compose, error_line, run_cli

# A cheap trial: the smoke loop, one epoch, no suites.
QUICK = [
    "experiment=smoke",
    "train.epochs=1",
    "eval.suites.drift.enabled=false",
    "eval.suites.extrapolation.enabled=false",
]


def _grid(sweep: str) -> list[list[str]]:
    """The trials a sweep config expands to (Hydra's own override grammar and sweep iteration)."""
    import itertools

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    import eaglelab.core.config  # noqa: F401  registers the schema (run alone, no earlier test has imported it)

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = hydra_compose("config", overrides=[f"+sweep={sweep}"], return_hydra_config=True)
    params = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()])
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] for o in params]
    return [list(combo) for combo in itertools.product(*axes)]


ALL_VARIANTS = {"eagle3.1", "no_fc_norm", "no_norm_output", "eagle3"}
TRIAL_KEYS = {  # what tells a grid's trials apart, read from the composed config
    "seed": lambda cfg: cfg.train.seed,
    "ttt_steps": lambda cfg: cfg.train.ttt_steps,
    "num_prompts": lambda cfg: cfg.data.num_prompts,
}


@pytest.mark.parametrize(
    "sweep, trials, keys, variants",
    [
        ("ablation_grid", 12, ("seed",), ALL_VARIANTS),
        ("ttt_grid", 16, ("ttt_steps",), ALL_VARIANTS),
        ("data_scaling", 20, ("num_prompts", "seed"), {"eagle3.1", "eagle3"}),
        ("paper_pair", 6, ("seed",), {"eagle3.1", "eagle3"}),
    ],
)
def test_ready_grids_expand_to_distinct_valid_trials(sweep, trials, keys, variants, cache_dir, tmp_path):
    grid = _grid(sweep)
    assert len(grid) == trials
    seen = set()
    for overrides in grid:
        cfg = compose(overrides, cache_dir, tmp_path)
        seen.add((cfg.variant, *(TRIAL_KEYS[k](cfg) for k in keys)))
    assert len(seen) == trials  # every trial is a different (variant, seed|depth|data size ...)
    assert {v for v, *_ in seen} == variants


@pytest.mark.parametrize("sweep", ["loss_grid", "ttt_grid"])
def test_a_loss_or_ttt_grid_prepares_one_data_set_for_every_trial(sweep, cache_dir, tmp_path):
    """Every trial of the grid asks for the same training and held-out entries (eaglelab.data.stage), so the
    first prepares them and the rest read them; without the grid's data settings they would not."""
    from eaglelab.data.stage import held_out_entry, training_entry
    from eaglelab.sweeps import warn_copies

    trials = [compose([f"+sweep={sweep}", *overrides], cache_dir, tmp_path) for overrides in _grid(sweep)]
    entries = {(json.dumps(training_entry(c)), json.dumps(held_out_entry(c))) for c in trials}
    assert len(entries) == 1, entries
    unset = ["data.keep_final=false", "data.tail_for_ttt=0"]
    bare = [compose([f"+sweep={sweep}", *overrides, *unset], cache_dir, tmp_path) for overrides in _grid(sweep)]
    assert len({(json.dumps(training_entry(c)), json.dumps(held_out_entry(c))) for c in bare}) == 2
    fix = {"loss_grid": "data.keep_final=true", "ttt_grid": "data.tail_for_ttt=5"}[sweep]
    with _logged("eaglelab.sweeps") as lines:
        warn_copies(bare)
        warn_copies(trials)
    assert len(lines) == 1 and "at least 2 copies" in lines[0] and f"add {fix} to prepare one" in lines[0], lines


def test_a_sweep_that_cannot_share_its_stream_is_told(cache_dir, tmp_path):
    """features.stream.share asks trials to subscribe to one stream: a launcher that runs them one after another, or
    seeds with their own data orders, cannot; one line says which, and nothing when they can."""
    from eaglelab.sweeps import warn_unshared

    share = ["features=stream", "features.stream.share=true"]
    seeds = [compose([*share, f"train.seed={s}"], cache_dir, tmp_path) for s in (0, 1)]
    ordered = [compose([*share, f"train.seed={s}", "train.data_seed=0"], cache_dir, tmp_path) for s in (0, 1)]
    local = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
    with _logged("eaglelab.sweeps") as lines:
        warn_unshared(ordered, "hydra._internal.core_plugins.basic_launcher.BasicLauncher")
        warn_unshared(seeds, local)
        warn_unshared(ordered, local)
    assert len(lines) == 2, lines
    assert "runs its trials one after another" in lines[0] and "set train.data_seed" in lines[1]


def _logged(name: str):
    """The lines logger `name` writes inside the block."""
    import contextlib
    import logging

    @contextlib.contextmanager
    def catch():
        lines, handler = [], logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        try:
            yield lines
        finally:
            logger.removeHandler(handler)

    return catch()


def test_data_scaling_sizes_are_distinct_training_sets(cache_dir, tmp_path):
    """Each data size of the data-scaling grid gets that many distinct training prompts from the default sources: a
    size beyond what they hold would silently repeat the largest set. The self_chat source is the target writing
    its share (tested on SmolLM2 in test_smollm2.py); here numbered requests stand in for it, so the grid's largest
    size is checked in a second rather than generated."""
    from eaglelab.data.prompts import mix_sources

    sizes = sorted({int(o.split("=")[1]) for trial in _grid("data_scaling") for o in trial if "num_prompts" in o})
    assert len(sizes) >= 4
    data = compose([f"data.num_prompts={sizes[-1]}"], cache_dir, tmp_path).data
    assert "self_chat" in data.sources
    written = lambda count: [[{"role": "user", "content": f"request {i}"}] for i in range(count)]  # noqa: E731
    prompts = mix_sources(data.sources, data.num_prompts + data.val_prompts, data.seed, self_chat=written)
    assert len({json.dumps(p) for p in prompts}) == sizes[-1] + data.val_prompts


def test_a_run_killed_again_and_again_resumes_to_the_uninterrupted_result(cache_dir, tmp_path, monkeypatch):
    """One run, logged to W&B (offline), killed at four points in turn, each resume killed at the next: SIGINT
    while the target loads, SIGTERM mid-epoch 2 (the scheduler's TERM), SIGKILL mid-epoch 3 (resumes from the
    step checkpoint at the mid-epoch sampler position; nothing got to clean up), SIGTERM during evaluation
    (training is not redone). The fifth attempt ends with weights bitwise and metrics equal to the uninterrupted
    run, the interrupted attempts' logs kept and merged with no step twice, and one W&B run id throughout.
    (Each point in a run of its own: `python benchmarks/preemption.py`; a cold-cache Ctrl-C during data
    preparation: test_faults.py.)"""
    import csv

    monkeypatch.setenv("WANDB_MODE", "offline")
    assert preemption.CHAIN == ["data_sigint", "train_sigterm", "mid_epoch3", "evaluate"]
    # (with DataLoader workers, which read ahead of the step: the sampler position resumed is the step's)
    overrides = ["logger=wandb", "train.num_workers=2"]
    result = preemption.chain(preemption.CHAIN, tmp_path, cache_dir, overrides)
    kills = {k["point"]: k for k in result["kills"]}
    assert result["attempts"] == 5 and result["weights_identical"] and result["metrics_identical"], result
    # a signal (not SIGKILL) is recorded as interrupted, cleanly; SIGKILL leaves the attempt as it was, running
    assert [k["status"] for k in result["kills"]] == ["interrupted", "interrupted", "running", "interrupted"], kills
    assert kills["data_sigint"]["killed_at_step"] is None
    assert kills["train_sigterm"]["killed_at_step"] >= preemption.STEPS_PER_EPOCH + 2
    steps = preemption.STEPS_PER_EPOCH
    assert 2 * steps + 3 <= kills["mid_epoch3"]["killed_at_step"] < 4 * steps  # a resumed attempt, killed again
    run_dir = tmp_path / "chain"
    kept = sorted(p.name for p in (run_dir / "logs").glob("metrics.attempt*.csv"))
    assert kept == ["metrics.attempt1.csv", "metrics.attempt2.csv"]  # the two attempts stopped while training
    with open(run_dir / "logs" / "metrics.csv") as f:
        logged = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert logged and logged == sorted(set(logged))  # replayed steps are not doubled
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) >= 4 and all(r.name.endswith(run_id) for r in runs)  # every attempt that logged: one id
    # A finished run started again is returned as it is, not re-run.
    before = (run_dir / "metrics.json").stat().st_mtime_ns
    preemption.run_to_end(run_dir, cache_dir, overrides)
    assert (run_dir / "metrics.json").stat().st_mtime_ns == before


def test_a_run_dir_is_resumed_across_logging_and_newer_settings_but_not_across_what_was_measured(cache_dir, tmp_path):
    """The run identity is what was measured: W&B on, another results path, a setting added since (at its
    default) resume the run; another learning rate does not."""
    from dataclasses import asdict

    import yaml

    from eaglelab.core.errors import EaglelabError
    from eaglelab.core.rundir import previous_attempt

    cfg = compose(QUICK, cache_dir, tmp_path)
    stored = asdict(cfg)
    del stored["data"]["skip_empty"]  # written by an eaglelab before that setting existed
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**stored, "resolved": {"max_k": 8}}))
    (tmp_path / "run.json").write_text(json.dumps({"status": "interrupted", "attempt": 1}))
    cfg.logger.kind, cfg.logger.group, cfg.paths.results_dir = "wandb", "ablation_grid_x", "/elsewhere"
    assert previous_attempt(cfg, tmp_path)["status"] == "interrupted"
    cfg.train.lr *= 2
    with pytest.raises(EaglelabError, match=r"another configuration \(differs in train.lr\)"):
        previous_attempt(cfg, tmp_path)


def test_same_run_dir_with_another_config_is_refused(cache_dir, tmp_path):
    run_dir = tmp_path / "trial"
    first = run_cli([*QUICK, f"hydra.run.dir={run_dir}"], cache_dir, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    other = run_cli([*QUICK, "train.seed=7", f"hydra.run.dir={run_dir}"], cache_dir, tmp_path)
    assert other.returncode == 2
    assert "another configuration" in other.stderr and "train" in other.stderr.strip().splitlines()[-1]


def _study(db: Path, name: str):
    """The study's (number, state) rows; none while Optuna is still creating its tables."""
    con = sqlite3.connect(db)
    try:
        return con.execute(
            "SELECT t.number, t.state FROM trials t JOIN studies s ON t.study_id = s.study_id "
            "WHERE s.study_name = ? ORDER BY t.number",
            (name,),
        ).fetchall()
    except sqlite3.OperationalError as e:  # the schema is being written, or a writer holds the lock
        if "no such table" not in str(e) and "locked" not in str(e):
            raise
        return []
    finally:
        con.close()


def test_processes_share_one_study_and_a_killed_trial_is_redone(cache_dir, tmp_path):
    """One study of 4 trials in sqlite: a sweep process is killed in its first trial; a second process, started
    after the kill, notices the stopped heartbeat, marks that trial FAIL, runs it again, and the study ends with
    exactly 4 finished trials. Running the command again finds the budget met and runs nothing. (Processes
    running side by side: benchmarks/study_concurrency.py, 4 × 8 trials.)"""
    db = tmp_path / "study.db"
    cmd = [
        sys.executable,
        str(ROOT / "src" / "run.py"),
        "-m",
        "+sweep=optuna_search",
        *QUICK,
        f"hydra.sweeper.storage=sqlite:///{db}",
        "hydra.sweeper.study_name=shared",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.heartbeat_interval=1",
        "hydra.sweeper.grace_period=4",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    env = {**os.environ, "EAGLELAB_CACHE_DIR": str(cache_dir), "EAGLELAB_RESULTS_DIR": str(tmp_path)}
    victim = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not (db.exists() and any(s == "RUNNING" for _, s in _study(db, "shared"))):
        time.sleep(0.2)
    time.sleep(2)  # well inside its first trial
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    survivor = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert survivor.returncode == 0, survivor.stderr[-3000:]
    states = [s for _, s in _study(db, "shared")]
    assert states.count("COMPLETE") == 4
    assert states[0] == "FAIL" and states.count("FAIL") == 1  # the killed trial, marked by the survivor
    assert "RUNNING" not in states and "WAITING" not in states
    runs = sorted((tmp_path / "sweep").glob("trial*/metrics.json"))
    assert len(runs) == 4  # one run directory per finished trial, none shared
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and [s for _, s in _study(db, "shared")] == states  # nothing re-run


@pytest.mark.parametrize(
    "args, message",
    [
        (["hydra/launcher=nowhere"], "hydra/launcher"),
        (
            ["+sweep=optuna_search", "hydra.sweeper.storage=sqlite:////nonexistent/dir/study.db"],
            "storage directory /nonexistent/dir does not exist",
        ),
        (["train.sed=0,1"], "train.sed"),
        (["drafter.fc_nrom=true,false"], "fc_nrom"),
        # every value of the grid is checked, not only the first
        (["train.loss=ce,mse"], "sweep parameter 'train.loss': Error merging override train.loss=mse"),
        (["train.seed=0,1", "eval.suites.templates.conditions=[native,klingon]"], "klingon"),  # the suites' checks
        (["train.seed=0,1", "drafter.aux_layer_ids=[5,2]"], "must be sorted and unique"),
        (["+sweep=optuna_search", "eval.job.enabled=true"], "an Optuna sweep reads every trial's objective"),
    ],
)
def test_sweep_mistakes_fail_before_anything_runs(args, message, cache_dir, tmp_path):
    proc = run_cli(["-m", *QUICK, f"hydra.sweep.dir={tmp_path / 'sweep'}", *args], cache_dir, tmp_path, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-1500:]
    assert not any((tmp_path / "sweep").glob("*/run.json"))  # no trial started


@pytest.mark.skipif(importlib.util.find_spec("psycopg") is not None, reason="PostgreSQL's driver is installed here")
def test_a_postgresql_study_without_its_driver_is_one_line_naming_the_extra(cache_dir, tmp_path):
    """The README's cluster line on a machine without psycopg: one line naming the extra (Optuna's ImportError
    traceback before), the password not echoed, no trial started."""
    storage = "hydra.sweeper.storage=postgresql://user:secret@db/eaglelab"
    args = ["-m", *QUICK, f"hydra.sweep.dir={tmp_path / 'sweep'}", "+sweep=optuna_search", storage]
    line = error_line(*(lambda p: (p.returncode, p.stderr))(run_cli(args, cache_dir, tmp_path, timeout=120)))
    assert "needs the database driver psycopg" in line and "pip install 'eaglelab[postgres]'" in line, line
    assert "secret" not in line and "user:***@db" in line
    assert not any((tmp_path / "sweep").glob("*/run.json"))


def test_interrupted_attempts_logs_merge_with_every_step_once(tmp_path):
    """A SIGTERM flushes log rows past the last checkpoint; the resumed attempt logs those steps again. The
    merged metrics.csv keeps each attempt's rows only before the step the next attempt resumed from."""
    from eaglelab.core.io import write_csv
    from eaglelab.core.rundir import merge_logs

    write_csv(tmp_path / "metrics.attempt1.csv", [{"step": s, "train/loss": 10 - s} for s in (4, 9, 14)])
    write_csv(tmp_path / "metrics.attempt2.csv", [{"step": s, "train/loss": 20 - s} for s in (9, 14, 19)])
    write_csv(tmp_path / "metrics.csv", [{"step": s, "train/loss": 30 - s} for s in (14, 19, 24)])
    merge_logs(tmp_path)
    import csv

    with open(tmp_path / "metrics.csv") as f:
        rows = [(int(r["step"]), float(r["train/loss"])) for r in csv.DictReader(f)]
    assert rows == [(4, 6.0), (9, 11.0), (14, 16.0), (19, 11.0), (24, 6.0)]
