"""Entry point: `python src/run.py [+ablation=NAME] [experiment=NAME] [key=value ...]`, and with `-m` a sweep
(`python src/run.py -m +sweep=ablation_grid`, sweeps/README.md).

Composes conf/ with Hydra, runs eaglelab.pipeline.run, prints what the run found (eaglelab.results.summary) and
`run_dir: <path>` last, and returns the `objective` metrics (what Hydra's Optuna sweeper optimises).
"""

import logging
import os
import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig

import eaglelab.core.config  # noqa: F401  registers the schema and the ablation configs with Hydra's ConfigStore
from eaglelab.core.errors import EaglelabError
from eaglelab.results.summary import handed_off, has_results, run_summary

# Hydra 1.4 warns on every callback it instantiates without a whitelist; both callbacks are ours.
warnings.filterwarnings("ignore", message=r".*_target_='eaglelab\.(sweeps\.Preflight|summary\.SweepSummary)'")


@hydra.main(config_path="../conf", config_name="config")
def main(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from eaglelab.core import preemption
    from eaglelab.core.config import to_run_config
    from eaglelab.core.ranks import is_primary
    from eaglelab.pipeline import run
    from eaglelab.sweeps import objective

    # Signals are recorded when they arrive and acted on outside writes (eaglelab.core.preemption); in a submitit job
    # submitit's own handlers (checkpoint and requeue) are what acting calls.
    preemption.install()
    try:
        run_cfg = to_run_config(cfg)
        hc = HydraConfig.get()
        run_cfg.run_dir = hc.runtime.output_dir
        if hc.mode == RunMode.MULTIRUN and run_cfg.logger.group is None:  # W&B: a sweep's runs side by side
            run_cfg.logger.group = Path(hc.sweep.dir).name
        run_dir = run(run_cfg)
        # an optimising sweeper (not a grid) gets the objective metrics back
        optimising = hc.mode == RunMode.MULTIRUN and not hc.sweeper._target_.endswith("BasicSweeper")
        value = objective(run_cfg, run_dir) if optimising and is_primary() else None
    except EaglelabError as e:
        logging.getLogger("eaglelab").debug("error", exc_info=True)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # one trial failed: Hydra records it (the sweep reports it), the other trials go on
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if is_primary():
        if has_results(run_dir):
            print("\n".join(run_summary(run_dir)), flush=True)
        elif handed_off(run_dir):
            print(f"summary: {handed_off(run_dir)}", flush=True)
        print(f"run_dir: {os.path.abspath(run_dir)}", flush=True)
    return value


if __name__ == "__main__":
    main()
