"""Entry point: `python src/run.py [+ablation=NAME] [experiment=NAME] [key=value ...]`.

Composes conf/ with Hydra, runs eaglelab.pipeline.run, prints `run_dir: <path>` last.
"""

import logging
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `eaglelab` without installing (src layout)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from eaglelab.errors import EaglelabError  # noqa: E402


@hydra.main(config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from eaglelab.config import to_run_config
    from eaglelab.pipeline import run

    def interrupt(signum, _frame):  # SIGTERM (kill, a scheduler) ends the run like Ctrl-C: cleanly
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    try:
        run_cfg = to_run_config(cfg)
        run_cfg.run_dir = HydraConfig.get().runtime.output_dir
        run_dir = run(run_cfg)
    except EaglelabError as e:
        logging.getLogger("eaglelab").debug("error", exc_info=True)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"run_dir: {os.path.abspath(run_dir)}", flush=True)


if __name__ == "__main__":
    main()
