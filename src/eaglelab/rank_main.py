"""A rank that eaglelab.core.ranks started (`python -m eaglelab.rank_main CONFIG`): the trial's resolved config,
run as rank LOCAL_RANK of this node, through the same `pipeline.run` as rank 0."""

import logging
import os
import pickle
import sys

import torch.distributed as dist

from eaglelab.core import preemption
from eaglelab.core.errors import EaglelabError
from eaglelab.pipeline import run


def main(config_file: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[rank {os.environ.get('LOCAL_RANK')}] %(levelname)s %(message)s")
    # Lightning's own console handler (added when `lightning` is imported) and its info lines, rank 0's to tell: this
    # rank's console carries eaglelab's lines and Lightning's warnings only, once each
    import lightning.pytorch  # noqa: F401  (imported now: `lightning` adds its handler on import)

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.setLevel(logging.WARNING)
        logger.propagate = True
    preemption.install()
    with open(config_file, "rb") as f:
        cfg = pickle.load(f)
    try:
        run(cfg)
    except EaglelabError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    # Done: leave the trial's group before the interpreter's teardown does it, while rank 0 may still be evaluating.
    # (Not after an error: a group whose peer is gone may not shut down cleanly; the process just exits.)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
