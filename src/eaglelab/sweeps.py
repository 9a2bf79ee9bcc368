"""Sweeps: what a trial returns, checks before anything is submitted, and an Optuna study shared by processes.

- `objective(cfg, run_dir)`: the `objective` metrics of a finished run, returned by `python src/run.py`
  to Hydra's sweeper (one float, or a list for a multi-objective study).
- `Preflight`: a Hydra callback (`hydra.callbacks.preflight` in conf/config.yaml) run once in the sweeping
  process, before a launcher submits anything: unknown sweep parameters or values, a Slurm partition that
  does not exist, an Optuna storage directory that does not exist fail there, in one line, exit 2.
- `run_study`: the body of the `study` sweeper (conf/hydra/sweeper/study.yaml). Hydra's Optuna sweeper asks
  and tells with no heartbeat, so a trial whose process died stays RUNNING forever and `n_trials` counts per
  invocation. Here `n_trials` is the study's total of finished trials, however many processes share it:
  every process records heartbeats for its trials, any process marks a trial whose heartbeats stopped FAIL
  and enqueues it again (Optuna's RetryFailedTrialCallback), and a trial asked when the budget is already
  taken is PRUNED before it runs. Re-running the command continues the study to its budget.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import sys
import threading
import time
import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from eaglelab.core.config import to_run_config
from eaglelab.core.errors import ConfigError, EaglelabError
from eaglelab.core.io import file_lock, writable_folder
from eaglelab.data.stage import held_out_entry, training_entry
from eaglelab.evaluate.suites import check_suites
from eaglelab.handoff import slurm_partitions

log = logging.getLogger("eaglelab.sweeps")


# --- what a trial returns ------------------------------------------------------------------------------
def objective(cfg, run_dir: Path) -> float | list[float]:

    metrics = json.loads((Path(run_dir) / "metrics.json").read_text())
    missing = [k for k in cfg.objective if k not in metrics]
    if missing:
        raise EaglelabError(
            f"objective {missing[0]!r} is not in {run_dir}/metrics.json (e.g. val/ metrics need "
            "data.val_prompts > 0); name metrics.json keys in objective=[...]"
        )
    values = [float(metrics[k]) for k in cfg.objective]
    return values[0] if len(values) == 1 else values


# --- checks before submission ----------------------------------------------------------------------------
def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)  # SystemExit passes Hydra's error reporting: one line, nothing submitted


def _values(override) -> list[str]:
    """The values a sweep parameter takes that a check should try: every choice or range item (at most 64),
    both ends of an interval; a plain override's own value."""
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

    value = override.value()
    if isinstance(value, (ChoiceSweep, RangeSweep)):
        return list(override.sweep_string_iterator())[:64]
    if isinstance(value, IntervalSweep):
        ints = isinstance(value.start, int) and isinstance(value.end, int)
        return [str(int(v) if ints else v) for v in (value.start, value.end)]
    return [override.input_line.split("=", 1)[1]]


def sweep_overrides(config: DictConfig) -> list:
    """Command-line overrides and `hydra.sweeper.params`, parsed by Hydra's own override grammar."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = list(config.hydra.overrides.task)
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    lines += [f"{key}={value}" for key, value in params.items()]
    return OverridesParser.create().parse_overrides(lines)


def check_sweep_params(config: DictConfig) -> None:
    """Compose and validate the config a trial would get for every value of every sweep parameter (the
    others at their first value): an unknown key or a bad value fails here, not in N submitted jobs."""
    from hydra import compose
    from hydra.errors import HydraException

    overrides = sweep_overrides(config)
    first = [
        o.input_line if o.is_delete() or not o.is_sweep_override() else f"{o.get_key_element()}={_values(o)[0]}"
        for o in overrides
    ]
    probes = [first] + [
        first[:i] + [f"{o.get_key_element()}={v}"] + first[i + 1 :]
        for i, o in enumerate(overrides)
        if o.is_sweep_override()
        for v in _values(o)[1:]
    ]
    trials = []  # each probe's config, for what its cache entries keep
    for probe in probes:
        try:
            cfg = compose(config.hydra.job.config_name, overrides=probe)
        except HydraException as e:
            line = str(e).splitlines()[0]
            bad = next((o.get_key_element() for o in overrides if o.get_key_element().lstrip("+~") in line), None)
            _fail(
                f"{'sweep parameter ' + repr(bad) + ': ' if bad else ''}{line} — list the keys with "
                "`python src/run.py --cfg job` (a new key needs a leading +)"
            )
        try:
            run_cfg = to_run_config(cfg)
            check_suites(run_cfg)
        except EaglelabError as e:
            _fail(f"a trial of this sweep would fail: {e}")
        trials.append(run_cfg)
    warn_copies(trials)
    warn_unshared(trials, OmegaConf.select(config, "hydra.launcher._target_") or "")


def warn_copies(trials: list) -> None:
    """One line when the trials of a sweep would prepare several copies of one data set (their losses or TTT
    lengths keep different states or tails), naming the settings that make them share the widest."""

    finals = {training_entry(c)["with_final"] for c in trials}
    tails = {(training_entry(c)["tail_tokens"], held_out_entry(c)["tail_tokens"]) for c in trials}
    copies = {(json.dumps(training_entry(c)), held_out_entry(c)["tail_tokens"]) for c in trials}
    if len(copies) < 2:
        return
    fix = ["data.keep_final=true"] if len(finals) > 1 else []
    if len(tails) > 1:
        fix.append(f"data.tail_for_ttt={max(max(c.train.ttt_steps, c.data.tail_for_ttt) for c in trials)}")
    log.warning(
        "the trials of this sweep would prepare at least %d copies of their training data (their train.loss or "
        "train.ttt_steps keep different states or tails); add %s to prepare one that serves them all",
        len(copies),
        " ".join(fix),
    )


def warn_unshared(trials: list, launcher: str) -> None:
    """One line when trials that ask to share a stream (features.stream.share) cannot: a launcher that runs them one
    after another (each would wait features.stream.join_s for nobody), or seeds that give each its own data order."""
    sharing = [c for c in trials if c.features.kind == "stream" and c.features.stream.share]
    if len(sharing) < 2:
        return
    if launcher.endswith("BasicLauncher"):
        log.warning(
            "features.stream.share: this sweep's launcher runs its trials one after another, so none can share a "
            "stream (each waits features.stream.join_s for others); use hydra/launcher=local or slurm"
        )
    elif len({c.train.seed for c in sharing}) > 1 and any(c.train.data_seed is None for c in sharing):
        log.warning(
            "features.stream.share: trials of different train.seed read in different orders, so each seed gets a "
            "stream of its own; set train.data_seed to give them one order and one stream"
        )


def check_slurm(config: DictConfig) -> None:
    launcher = OmegaConf.select(config, "hydra.launcher._target_") or ""
    if not launcher.endswith("SlurmLauncher"):
        return
    try:
        partitions = slurm_partitions("hydra/launcher=slurm", "use hydra/launcher=local")
    except ConfigError as e:
        _fail(str(e))
    wanted = OmegaConf.select(config, "hydra.launcher.partition")
    if wanted and wanted not in partitions:
        _fail(
            f"Slurm partition {wanted!r} does not exist; set hydra.launcher.partition to one of: "
            f"{', '.join(partitions) or '(none)'}"
        )


def check_eval_job(config: DictConfig) -> None:
    """eval.job.enabled ends a trial before its evaluation: an optimising sweeper needs the objective then."""
    optimising = not str(OmegaConf.select(config, "hydra.sweeper._target_") or "").endswith("BasicSweeper")
    if OmegaConf.select(config, "eval.job.enabled") and optimising:
        _fail(
            "eval.job.enabled=true ends each trial before its evaluation, and an Optuna sweep reads every trial's "
            "objective when the trial ends; evaluate inside the trials (eval.job.enabled=false)"
        )


def check_storage(config: DictConfig) -> None:
    url = OmegaConf.select(config, "hydra.sweeper.storage")
    if not url:
        return
    if not str(url).startswith("sqlite:///"):
        check_database_driver(str(url))
        return  # another RDB: its server answers when the study opens (before any trial is asked)
    path = Path(str(url)[len("sqlite:///") :]).expanduser()
    results = Path(str(config.paths.results_dir)).expanduser()
    if path.parent.resolve() == results.resolve():
        results.mkdir(parents=True, exist_ok=True)  # the default location: the results folder is ours to create
    elif not path.parent.is_dir():
        _fail(
            f"Optuna storage directory {path.parent} does not exist; create it or set "
            f"hydra.sweeper.storage=sqlite:///PATH/study.db (or any RDB URL)"
        )


# SQLAlchemy's driver names whose PyPI package is named otherwise (psycopg: the `postgres` extra).
DRIVER_PACKAGES = {"psycopg2": "psycopg2-binary", "mysqldb": "mysqlclient", "pymysql": "PyMySQL", "asyncpg": "asyncpg"}


def check_database_driver(url: str) -> None:
    """An RDB storage's Python driver (SQLAlchemy's dialect names it: psycopg for postgresql:// in SQLAlchemy 2.1) is
    installed here;
    otherwise Optuna would fail with an ImportError traceback when the study opens."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
        dialect = parsed.get_dialect()
    except Exception as e:  # (ArgumentError, NoSuchModuleError: an unknown scheme)
        _fail(
            f"hydra.sweeper.storage is not a database URL SQLAlchemy knows ({str(e).splitlines()[0]}); use "
            "sqlite:///PATH/study.db or an RDB URL such as postgresql://USER@HOST/DB"
        )
    try:
        dialect.import_dbapi()
    except ImportError:
        package = DRIVER_PACKAGES.get(dialect.driver, dialect.driver)
        extra = "pip install 'eaglelab[postgres]'" if dialect.driver == "psycopg" else f"pip install {package}"
        _fail(
            f"hydra.sweeper.storage={parsed.render_as_string(hide_password=True)} needs the database driver "
            f"{dialect.driver}, which is not installed here; {extra}"
        )


def check_writable(directory: Path) -> None:
    """Results go there: a folder that cannot be created or written to fails now, not after training."""
    try:
        writable_folder(directory, "paths.results_dir (or EAGLELAB_RESULTS_DIR)")
    except ConfigError as e:
        _fail(str(e))


def check_cache_dir(config: DictConfig) -> None:
    """The cache is a folder, or nothing yet (a sweep's cache may live where only its jobs create it)."""
    cache = Path(os.path.expanduser(str(config.paths.cache_dir)))
    if cache.exists() and not cache.is_dir():
        _fail(
            f"paths.cache_dir {cache} is a file, not a folder; set paths.cache_dir (or EAGLELAB_CACHE_DIR) to a folder"
        )


try:  # Hydra instantiates the callback named in conf/config.yaml
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object


class Preflight(Callback):
    """Everything a run or a sweep can get wrong that is knowable before a job starts or is submitted."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        check_writable(Path(str(config.hydra.run.dir)).expanduser())
        check_cache_dir(config)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        check_writable(Path(str(config.hydra.sweep.dir)).expanduser())
        check_cache_dir(config)
        check_slurm(config)
        check_eval_job(config)
        check_storage(config)
        check_sweep_params(config)


# --- an Optuna study shared by several sweep processes -----------------------------------------------------
def open_storage(url: str, heartbeat_interval: int, grace_period: int, max_retry: int):
    import optuna
    from optuna.storages import RDBStorage, RetryFailedTrialCallback

    class Storage(RDBStorage):
        """Optuna counts a RUNNING trial as stale only once it has a heartbeat; a process killed between
        asking a trial and its first heartbeat would leave it RUNNING forever (every other process then waits
        for it). Here such a trial is stale too, once it started more than `grace_period` seconds ago."""

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            import sqlalchemy
            from optuna.storages._rdb import models

            stale = super()._get_stale_trial_ids(study_id)
            utc_now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)  # stored as naive UTC
            cutoff = utc_now - datetime.timedelta(seconds=grace_period)
            with sqlalchemy.orm.Session(self.engine) as session:
                silent = (
                    session.query(models.TrialModel.trial_id)
                    .filter(
                        models.TrialModel.study_id == study_id,
                        models.TrialModel.state == optuna.trial.TrialState.RUNNING,
                        models.TrialModel._datetime_start_utc < cutoff,
                        ~models.TrialModel.heartbeats.any(),
                    )
                    .all()
                )
            return stale + [trial_id for (trial_id,) in silent]

    engine = {"connect_args": {"timeout": 120}} if url.startswith("sqlite") else {}  # writers wait their turn
    lock = (
        file_lock(Path(url[len("sqlite:///") :] + ".lock"))
        if url.startswith("sqlite:///")
        else contextlib.nullcontext()
    )
    with lock:  # several processes creating the schema at once would race
        return Storage(
            url,
            engine_kwargs=engine,
            heartbeat_interval=heartbeat_interval,
            grace_period=grace_period,
            heartbeat_stale_trial_callback=RetryFailedTrialCallback(max_retry=max_retry),
        ), optuna


@contextlib.contextmanager
def heartbeats(storage, trials, interval: float):
    """Record a heartbeat for each running trial every `interval` s while the launcher runs them."""
    stop = threading.Event()

    def beat():
        while not stop.wait(interval):
            for t in trials:
                try:
                    storage.record_heartbeat(t._trial_id)
                except Exception as e:  # a busy storage: say so, keep beating
                    log.warning("heartbeat of trial %d not recorded (%s)", t.number, type(e).__name__)

    thread = threading.Thread(target=beat, daemon=True, name="optuna-heartbeat")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def budget_taken(study, trial, n_trials: int) -> bool:
    """True if `n_trials` trials that started before `trial` are running or complete. Trials are ordered by
    start time (then number), so of any processes asking at once exactly the first free places run."""
    from optuna.trial import TrialState

    active = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
    order = sorted(active, key=lambda t: (t.datetime_start, t.number))
    rank = next(i for i, t in enumerate(order) if t.number == trial.number)
    return rank >= n_trials


def run_study(impl, arguments: list[str], heartbeat_interval: int, grace_period: int, max_retry: int) -> None:
    """`impl`: Hydra's OptunaSweeperImpl (its search-space parsing and trial overrides are reused)."""
    search = search_space(impl, arguments)
    directions = impl._get_directions()
    storage, optuna = open_storage(impl.storage, heartbeat_interval, grace_period, max_retry)
    State = optuna.trial.TrialState
    study = open_study(impl, storage, optuna, directions)
    failures, launched = 0, 0
    while True:
        optuna.storages.fail_stale_trials(study)  # dead processes' trials: FAIL, and enqueued again
        states = [t.state for t in study.get_trials(deepcopy=False)]
        complete, running = states.count(State.COMPLETE), states.count(State.RUNNING)
        if complete >= impl.n_trials:
            break
        free = impl.n_trials - complete - running
        if free <= 0:  # others' trials fill the budget, but one may still die and need a redo
            time.sleep(min(heartbeat_interval, 5))
            continue
        batch = ask_trials(study, storage, min(impl.n_jobs, free), impl.n_trials, State)
        if not batch:
            continue
        returns = launch_trials(impl, batch, search, storage, heartbeat_interval)
        launched += len(returns)
        failures += tell_results(study, batch, returns, len(directions), optuna)
        if launched and failures / launched > impl.max_failure_rate:
            raise RuntimeError(
                f"{failures} of {launched} trials failed (hydra.sweeper.max_failure_rate="
                f"{impl.max_failure_rate}); see the trials' run.json and logs"
            )
    save_results(impl, study, len(directions), State)


def search_space(impl, arguments: list[str]) -> tuple:
    """The sweeper's parameters and the command line's, parsed as Hydra's Optuna sweeper parses them -> (the
    distributions sampled, the fixed parameters, the fixed overrides): what `impl._configure_trials` takes."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    impl._process_searchspace_config()
    params_conf = impl._parse_sweeper_params_config() + list(arguments)
    space, fixed_params, fixed_overrides = create_params_from_overrides(params_conf)
    for name in fixed_params:
        space.pop(name, None)
    return space, fixed_params, fixed_overrides


def open_study(impl, storage, optuna, directions: list):
    """The study every process of the sweep shares (created by the first, loaded by the others)."""
    # Heartbeats with ask/tell (not Study.optimize) are what this loop is for; Optuna warns about both.
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    study = optuna.create_study(
        study_name=impl.study_name, storage=storage, sampler=impl.sampler, directions=directions, load_if_exists=True
    )
    log.info(
        "study %s in %s: %d finished trials wanted, %d jobs at a time",
        study.study_name,
        impl.storage,
        impl.n_trials,
        impl.n_jobs,
    )
    return study


def ask_trials(study, storage, count: int, n_trials: int, State) -> list:
    """Up to `count` new trials to run, each with a heartbeat at once; one asked when other processes have already
    taken the budget is PRUNED, not run."""
    batch = []
    for _ in range(count):
        trial = study.ask()
        storage.record_heartbeat(trial._trial_id)  # at once: a process dying from here on leaves a stale trial
        if budget_taken(study, trial, n_trials):
            trial.set_user_attr("eaglelab", "not run: the study's budget was taken by other processes")
            study.tell(trial, state=State.PRUNED)
        else:
            batch.append(trial)
    return batch


def launch_trials(impl, batch: list, search: tuple, storage, heartbeat_interval: int) -> list:
    """The batch's trials run by Hydra's launcher, their heartbeats recorded while they run -> the launcher's
    returns, one per trial."""
    overrides = impl._configure_trials(batch, *search)
    # A trial's run directory is named by its study-wide number: unique across processes and re-runs.
    overrides = [[*o, f"hydra.sweep.subdir=trial{t.number:04d}"] for o, t in zip(overrides, batch)]
    with heartbeats(storage, batch, heartbeat_interval):
        returns = impl.launcher.launch(overrides, initial_job_idx=impl.job_idx)
    impl.job_idx += len(returns)
    return returns


def tell_results(study, batch: list, returns: list, n_directions: int, optuna) -> int:
    """Each trial's objective values told to the study, or its failure -> how many of the trials failed."""
    failures = 0
    for trial, ret in zip(batch, returns):
        try:
            study.tell(trial, values=objective_values(ret, n_directions))
        except optuna.exceptions.UpdateFinishedTrialError:  # heartbeats came too late (a storage stall):
            log.warning(
                "trial %d was marked failed by another process while it ran; its retry stands in "
                "for it (raise hydra.sweeper.grace_period)",
                trial.number,
            )
        except Exception as e:  # any trial error is the trial's failure, recorded
            failures += 1
            log.warning("trial %d failed: %s", trial.number, str(e).splitlines()[0] if str(e) else repr(e))
            with contextlib.suppress(RuntimeError):  # already failed by a heartbeat check
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return failures


def objective_values(ret, n_directions: int) -> list[float]:
    """A finished trial's objective values, one per direction of the study (raises the trial's own exception if it
    failed)."""
    value = ret.return_value  # raises the trial's exception if it failed
    values = [float(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    if len(values) != n_directions:
        raise ValueError(
            f"the trial returned {len(values)} values for {n_directions} directions; "
            "objective=[...] must name one metric per direction"
        )
    return values


def save_results(impl, study, n_directions: int, State) -> None:
    """The study's best trial (or, with several objectives, its Pareto front) in the sweep folder's
    optimization_results.yaml, as Hydra's Optuna sweeper writes it."""
    finished = study.get_trials(deepcopy=False, states=(State.COMPLETE,))
    summary = (
        {"best_params": study.best_trial.params, "best_value": study.best_trial.value}
        if n_directions == 1
        else {"solutions": [{"params": t.params, "values": t.values} for t in study.best_trials]}
    )
    Path(str(impl.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    OmegaConf.save(
        OmegaConf.create(
            {
                "name": "optuna",
                "study": study.study_name,
                "storage": impl.storage,
                "finished_trials": len(finished),
                **summary,
            }
        ),
        Path(str(impl.config.hydra.sweep.dir)) / "optimization_results.yaml",
    )
    log.info("study %s: %d finished trials; %s", study.study_name, len(finished), summary)
