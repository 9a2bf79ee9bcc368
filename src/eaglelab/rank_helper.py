"""A rank that eaglelab.ranks started (`python -m eaglelab.rank_helper CONFIG`): the trial's resolved config,
run as rank LOCAL_RANK of this node, through the same `pipeline.run` as rank 0."""

import logging
import os
import pickle
import sys

from eaglelab import preemption
from eaglelab.errors import EaglelabError
from eaglelab.pipeline import run


def main(config_file: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[rank {os.environ.get('LOCAL_RANK')}] %(levelname)s %(message)s")
    preemption.install()
    with open(config_file, "rb") as f:
        cfg = pickle.load(f)
    try:
        run(cfg)
    except EaglelabError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1])
