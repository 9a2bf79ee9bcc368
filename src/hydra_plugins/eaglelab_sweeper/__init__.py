"""Hydra plugin: the `study` sweeper (conf/hydra/sweeper/study.yaml) — Hydra's Optuna sweeper with heartbeats,
a study-wide trial budget and retries of trials whose process died (eaglelab.sweeps.run_study).
Hydra finds it through the `hydra.plugins` entry point in pyproject.toml; this module stays import-light."""

from typing import Any

from hydra.plugins.sweeper import Sweeper


class StudySweeper(Sweeper):
    def __init__(
        self,
        sampler: Any,
        direction: Any,
        storage: str,
        study_name: str,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        custom_search_space: Any,
        params: Any,
        heartbeat_interval: int = 30,
        grace_period: int = 120,
        max_retry: int = 1,
    ) -> None:
        from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper

        # Hydra's own sweeper parses the search space and instantiates the sampler; only the loop differs.
        self.optuna = OptunaSweeper(
            sampler, direction, storage, study_name, n_trials, n_jobs, max_failure_rate, custom_search_space, params
        )
        self.heartbeat_interval, self.grace_period, self.max_retry = heartbeat_interval, grace_period, max_retry

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.optuna.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        from eaglelab.sweeps import run_study

        run_study(self.optuna.sweeper, arguments, self.heartbeat_interval, self.grace_period, self.max_retry)
