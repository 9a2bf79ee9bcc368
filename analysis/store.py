"""The results store as data: every finished run directory under the given roots, grouped into setups.

A *setup* is everything a run's config.yaml says except its seed (and where it was written): the runs of
one setup are the seeds of one experiment, which the tables and figures aggregate (mean ± 95% CI or ± SE).
A setup is labelled by its variant plus whatever else differs between the setups found (`eagle3 ttt_steps=2`).
Runs that differ only in the training data size (data.num_prompts) are distinct setups; `data_sizes` regroups
them into one *line* per setup-without-its-size for the data-scaling figure and table.
Reads only what docs/results_layout.md lists; a directory that is not a readable finished run is named
(with the reason) and skipped, never half-used.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import yaml
from scipy import stats

from eaglelab.models.variants import VARIANT_FLAGS

# Config keys that do not change what was measured (where results went, how they were logged).
NOT_SETUP = ("train.seed", "run_dir", "paths.", "logger.", "checkpoint", "hydra.", "objective", "plan.", "recipe.")
# The data-scaling axis (sweeps/data_scaling.yaml): a setup's label without it is one line of the scaling figure.
DATA_SIZE = "data.num_prompts"
# The flags a variant fixes (eaglelab.models.variants): implied by the variant's name, not shown in labels.
ABLATION_FLAGS = tuple(f"drafter.{flag}" for flag in VARIANT_FLAGS)
RESULT_TABLES = [
    "acceptance.csv",
    "per_position.csv",
    "depth_accuracy.csv",
    "per_prompt.csv",
    "per_prompt_depth.csv",
    "throughput.csv",
    "sampling.csv",
    "suites/extrapolation.csv",
    "suites/long_context.csv",
    "suites/templates.csv",
    "suites/benchmarks.csv",
    "suites/drift.csv",
    "suites/drift_per_prompt.csv",
    "suites/fc_balance.csv",
    "suites/long_context_throughput.csv",
    "suites/benchmarks_throughput.csv",
    "suites/per_prompt.csv",
    "suites/per_prompt_depth.csv",
]


class StoreError(Exception):
    """The store holds nothing usable (the message names what to pass instead)."""


@dataclass
class Run:
    dir: Path
    variant: str
    seed: int
    ttt: int
    config: dict  # flattened config.yaml ("train.ttt_steps": 3, ...), without `resolved`
    metrics: dict
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)  # "acceptance", "suites/drift", ...
    setup: str = ""  # label, set by `load`
    line: str = ""  # the setup's label without its data size (DATA_SIZE), set by `load`


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = tuple(v) if isinstance(v, list) else v
    return out


def read_run(run_dir: Path) -> Run:
    """One finished run directory; raises ValueError naming what is wrong with it."""
    if not (run_dir / "metrics.json").is_file():
        try:
            info = json.loads((run_dir / "run.json").read_text())
        except (OSError, ValueError):
            info = {}
        status = info.get("status", "unknown")
        why = f" ({info['error'].splitlines()[0]})" if info.get("error") else ""
        raise ValueError(f"no metrics.json: not a finished run (run.json status: {status}{why})")
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    except FileNotFoundError as e:
        raise ValueError(f"{Path(e.filename).name} is missing") from None
    except (ValueError, yaml.YAMLError) as e:
        raise ValueError(f"unreadable result file ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if not isinstance(metrics, dict) or not isinstance(config, dict):
        raise ValueError("metrics.json or config.yaml does not hold a mapping")
    if "suites" not in (config.get("eval") or {}):
        raise ValueError(
            "written by an older eaglelab (config.yaml has no eval.suites): re-evaluate it with "
            f"`python src/run.py checkpoint={run_dir}`"
        )
    config.pop("resolved", None)
    flat = flatten(config)
    try:
        ttt, seed = int(flat["train.ttt_steps"]), int(flat["train.seed"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("config.yaml has no integer train.ttt_steps / train.seed") from None
    if f"acceptance_length@k{ttt}" not in metrics:
        raise ValueError(f"metrics.json has no acceptance_length@k{ttt}")
    tables = {}
    for name in RESULT_TABLES:
        if (run_dir / name).is_file():
            try:
                tables[name.removesuffix(".csv")] = pd.read_csv(run_dir / name)
            except (ValueError, pd.errors.ParserError) as e:
                raise ValueError(f"{name} is unreadable ({str(e).splitlines()[0]})") from None
    return Run(run_dir, str(flat.get("variant")), seed, ttt, flat, metrics, tables)


def find_run_dirs(roots: list[Path]) -> list[Path]:
    """Run directories (those holding a run.json or metrics.json) under each root, or the roots themselves."""
    found = []
    for root in roots:
        if not root.exists():
            raise StoreError(f"{root} does not exist; pass a results directory (e.g. results/) or run directories")
        marks = [p.parent for name in ("run.json", "metrics.json") for p in root.rglob(name)]
        inside = lambda d: {"wandb", "drafter"} & set(d.relative_to(root).parts)  # (W&B's own files)
        found += sorted({d for d in marks if not inside(d)})
    return list(dict.fromkeys(found))


def _finished(run: Run) -> float:
    """When the run completed (run.json), else its metrics.json's time: copies need not keep file times."""
    try:
        return float(json.loads((run.dir / "run.json").read_text())["finished"])
    except (OSError, ValueError, KeyError, TypeError):
        return (run.dir / "metrics.json").stat().st_mtime


def load(roots: list[Path], warn=lambda msg: print(msg, file=sys.stderr), duplicate=None) -> list[Run]:
    """Every finished run under `roots`, with its setup label; each skipped directory is named with its reason
    (`warn`; a second run of the same setup and seed goes to `duplicate`, by default `warn` too)."""
    duplicate = duplicate or warn
    runs = []
    for run_dir in find_run_dirs([Path(r) for r in roots]):
        try:
            runs.append(read_run(run_dir))
        except ValueError as e:
            warn(f"skipped {run_dir}: {e}")
    if not runs:
        raise StoreError(
            f"no finished run under {', '.join(map(str, roots))}; a run is finished when its "
            "directory holds metrics.json (`python src/run.py ...` writes one)"
        )

    def by_variant(k):  # an ablation flag the variant fixes (its preset) says nothing the variant does not
        return k in ABLATION_FLAGS and all(
            len({repr(r.config.get(k)) for r in runs if r.variant == v}) == 1 for v in {r.variant for r in runs}
        )

    # A setting a run's config.yaml predates reads as the schema's default (runs of a store span schema changes)
    defaults = schema_defaults()
    value = lambda r, k: r.config[k] if k in r.config else defaults.get(k)  # noqa: E731
    differing = sorted(
        k
        for k in set().union(*(r.config for r in runs))
        if not k.startswith(NOT_SETUP)
        and k != "variant"
        and len({repr(value(r, k)) for r in runs}) > 1
        and not by_variant(k)
    )
    last = [k.split(".")[-1] for k in differing]
    names = {k: (k.split(".")[-1] if last.count(k.split(".")[-1]) == 1 else k) for k in differing}
    for r in runs:
        extras = {k: f"{names[k]}={_short(value(r, k))}" for k in differing}
        r.setup = " ".join([r.variant, *extras.values()])
        r.line = " ".join([r.variant, *(token for k, token in extras.items() if k != DATA_SIZE)])
    # One run per setup and seed: a re-evaluation (checkpoint=RUN) or a repeated launch is not another seed.
    kept: dict[tuple[str, int], Run] = {}
    for r in sorted(runs, key=_finished):
        if (r.setup, r.seed) in kept:
            duplicate(
                f"skipped {kept[(r.setup, r.seed)].dir}: the same setup and seed as {r.dir} (the later one is kept)"
            )
        kept[(r.setup, r.seed)] = r
    return sorted(kept.values(), key=lambda r: (r.setup, r.seed))


def schema_defaults() -> dict:
    """eaglelab's run configuration at its defaults, flattened as a run's config.yaml is."""
    from dataclasses import asdict

    from eaglelab.core.config import RunConfig

    return flatten(asdict(RunConfig()))


def _short(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def setups(runs: list[Run]) -> dict[str, list[Run]]:
    """setup label -> its runs (seeds), in a stable order: EAGLE-3.1 first, plain EAGLE-3 last."""
    order = {"eagle3.1": 0, "no_fc_norm": 1, "no_norm_output": 2, "norm_before_fc": 3, "eagle3": 9}
    out: dict[str, list[Run]] = {}
    for r in sorted(runs, key=lambda r: (order.get(r.variant, 5), r.setup, r.seed)):
        out.setdefault(r.setup, []).append(r)
    return out


def data_sizes(runs: list[Run]) -> dict[str, dict[int, list[Run]]]:
    """line (setup label without its data size) -> data.num_prompts -> its runs (seeds), sizes ascending, lines in
    `setups` order. Only runs that trained here: an evaluation-only run (checkpoint=...) has no training data."""
    out: dict[str, dict[int, list[Run]]] = {}
    for members in setups(runs).values():
        for r in members:
            if "data/response_tokens" in r.metrics:
                out.setdefault(r.line, {}).setdefault(int(r.config[DATA_SIZE]), []).append(r)
    return {line: dict(sorted(sizes.items())) for line, sizes in out.items()}


def mean_ci(values: list[float], level: float = 0.95) -> tuple[float, float, float, int]:
    """(mean, half-width of the Student-t confidence interval, standard error, n) over seeds; NaNs dropped."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    mean = sum(xs) / n
    if n == 1:
        return mean, math.nan, math.nan, 1
    se = stats.sem(xs)
    return mean, float(se * stats.t.ppf((1 + level) / 2, n - 1)), float(se), n


def add_seed_stats(row: dict, per_run: list[dict], keys) -> dict:
    """`row` with each key's mean, 95% CI half-width, standard error and n over the runs' values (`per_run`)."""
    for key in keys:
        mean, ci, se, n = mean_ci([p[key] for p in per_run])
        row.update({key: mean, f"{key}_ci95": ci, f"{key}_se": se, f"{key}_n": n})
    return row


def aggregate(frames: list[pd.DataFrame], by: list[str], value: str) -> pd.DataFrame:
    """One row per `by` value: mean, standard error and n of `value` over the runs (one frame per seed)."""
    df = pd.concat(frames, ignore_index=True)
    g = df.groupby(by, sort=True)[value]
    out = g.agg(mean="mean", n="count").reset_index()
    out["se"] = g.sem().fillna(0.0).values  # one seed: no spread to show
    return out
