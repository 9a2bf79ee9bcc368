"""What a run found, in a few lines: the end of every `python src/run.py` (and of a sweep).

Read from the finished run directory only (metrics.json, run.json, config.yaml), so it says exactly what the
results say: τ at the trained depth (simulated and vLLM), the served speedup with its 95% interval where it was
measured (or how to measure it), the drift headline, and the figures to open.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from eaglelab.core.ranks import is_primary


def _load(run_dir: Path) -> tuple[dict, dict, dict]:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    record = json.loads((run_dir / "run.json").read_text())
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    return metrics, record, config


# What the hint asks for where a CPU run served nothing: the trained depth at concurrency 1, enough passes a side to
# resolve a drafter's effect there (README, "Served speed on a CPU")
SERVE_ON_A_CPU = "eval.vllm.throughput_ks=[{k}] eval.vllm.concurrencies=[1] eval.vllm.repeats=10"


def has_results(run_dir: Path) -> bool:
    """A finished run that evaluated a drafter (not a `stage=prepare` run, which made data only)."""
    path = Path(run_dir) / "metrics.json"
    return path.is_file() and any(k.startswith("acceptance_length@k") for k in json.loads(path.read_text()))


def _status(run_dir: Path) -> str:
    try:
        return json.loads((run_dir / "run.json").read_text()).get("status", "?")
    except (OSError, ValueError):
        return "no readable run.json"


def handed_off(run_dir: Path) -> str | None:
    """A trained trial whose evaluation runs in a Slurm job of its own (eval.job): which, and where its log is."""
    try:
        record = json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return None
    job = record.get("evaluation_job") if record.get("status") == "trained" else None
    if job is None:
        return None
    return f"trained; evaluated by Slurm job {job['job_id']} (log: {job['log']}), metrics.json when it ends"


def _minutes(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s" if seconds >= 60 else f"{seconds:.0f} s"


def _trained_depth(config: dict, record: dict) -> int:
    """ttt_steps, from the run's config.yaml (run.json's where an older run has no config)."""
    return int((config.get("train") or {}).get("ttt_steps") or record.get("ttt_steps") or 0)


def _speedups(metrics: dict) -> list[tuple[int, int, float, float | None, float | None]]:
    """(k, c, speedup, 95% low, 95% high) of every served comparison in metrics.json, by concurrency."""
    out = []
    for key, value in metrics.items():
        if key.startswith("vllm/speedup@k"):
            k, c = key.removeprefix("vllm/speedup@k").split("@c")
            at = f"k{k}@c{c}"
            out.append((int(k), int(c), value, metrics.get(f"vllm/speedup_ci_low@{at}"),
                        metrics.get(f"vllm/speedup_ci_high@{at}")))  # fmt: skip
    return sorted(out, key=lambda r: (r[1], r[0]))


def drift_headline(metrics: dict) -> str | None:
    """How the drafter's attention on the real context moves with depth (eaglelab.evaluate.drift): the share at depth
    1 and at the deepest depth measured, and the fc input balance over the aux layers."""
    depths = sorted(int(k.split("@d")[1]) for k in metrics if k.startswith("drift/context_share@d"))
    if not depths:
        return None
    first, last = (metrics[f"drift/context_share@d{d}"] for d in (depths[0], depths[-1]))
    line = f"attention on the context {first:.2f} at depth {depths[0]} -> {last:.2f} at depth {depths[-1]}"
    shares = sorted((int(k.split("@layer")[1]), v) for k, v in metrics.items() if k.startswith("drift/fc_input_share"))
    if shares:
        line += "; fc input share by aux layer " + " / ".join(f"{layer}: {v:.2f}" for layer, v in shares)
    return line


def _prompts(n) -> str:
    return f"{int(n)} prompts" if n is not None else "the held-out prompts"


def _tau_line(metrics: dict, k: int, in_vllm: bool) -> str:
    """τ at depth k, like with like: vLLM beside the simulated evaluator on the same prompts (vLLM measures a subset:
    eval.vllm.num_prompts), each with its count; the simulated figure over every held-out prompt after them."""
    sim, vllm = metrics[f"acceptance_length@k{k}"], metrics.get(f"vllm/acceptance_length@k{k}")
    everyone = f"simulated {sim:.3f} over {_prompts(metrics.get('held_out_prompts'))}"
    if not in_vllm:
        return everyone
    if vllm is None:
        return f"{everyone} (vLLM measured other depths)"
    same = metrics.get(f"vllm/simulated_acceptance_length@k{k}")
    if same is None:  # (a run from before the like-with-like figure was kept)
        return f"{everyone}, vLLM {vllm:.3f}"
    return f"vLLM {vllm:.3f}, simulated {same:.3f} over the same {_prompts(metrics.get('vllm/prompts'))}; {everyone}"


BENCHMARK_NAMES = {"mt_bench": "MT-Bench", "humaneval": "HumanEval"}


def _benchmark_lines(metrics: dict, config: dict) -> list[str]:
    """τ per benchmark (the benchmarks suite) at each depth measured, the simulated evaluator beside vLLM on the same
    requests, and the published figures of the run's recipe for that benchmark."""
    lines = []
    published = ((config.get("recipe") or {}).get("published")) or []
    order = list(BENCHMARK_NAMES)
    keys = [k for k in metrics if k.startswith("benchmarks/prompts@")]
    for key in sorted(keys, key=lambda k: order.index(k.split("@", 1)[1]) if k.split("@", 1)[1] in order else 99):
        name = key.split("@", 1)[1]
        tau = {}
        for evaluator in ("simulated", "vllm"):
            prefix = f"benchmarks/{evaluator}/acceptance_length@{name}@k"
            tau[evaluator] = {int(k[len(prefix) :]): v for k, v in metrics.items() if k.startswith(prefix)}
        ks = sorted(tau["simulated"])
        line = f"  {BENCHMARK_NAMES.get(name, name)} ({int(metrics[key])} requests): τ@{'/'.join(map(str, ks))}"
        line += " simulated " + "/".join(f"{tau['simulated'][k]:.3f}" for k in ks)
        if tau["vllm"]:
            line += ", vLLM " + "/".join(f"{tau['vllm'][k]:.3f}" if k in tau["vllm"] else "-" for k in ks)
        line += _served_at_batch_one(metrics, name)
        refs = [f"τ@{r['k']} {r['acceptance_length']:.2f} ({r['source']})" for r in published if r["benchmark"] == name]
        lines.append(line + (f"; published for this target: {'; '.join(refs)}" if refs else ""))
    return lines


def _served_at_batch_one(metrics: dict, name: str) -> str:
    """A benchmark's served speedup at each timed depth (eval.suites.benchmarks.served), with its interval."""
    prefix, out = f"benchmarks/vllm/speedup@{name}@k", ""
    for key in sorted((m for m in metrics if m.startswith(prefix)), key=lambda m: int(m[len(prefix) :].split("@")[0])):
        at = key.removeprefix("benchmarks/vllm/speedup@")
        low, high = (metrics.get(f"benchmarks/vllm/speedup_ci_{end}@{at}") for end in ("low", "high"))
        interval = f" [{low:.2f}, {high:.2f}]" if low is not None else ""
        out += f"; served one request at a time, k={key[len(prefix) :].split('@')[0]}: {metrics[key]:.2f}x{interval}"
    return out


def run_summary(run_dir: Path) -> list[str]:
    """The lines that end a run: what it measured, where its figures are. A summary is never worth a finished run:
    results it cannot read (an older layout, a file edited by hand) make it one line saying so."""
    run_dir = Path(os.path.abspath(run_dir))  # as `run_dir:` prints it
    try:
        return _run_summary(run_dir)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"summary: not available ({type(e).__name__}: {e}); the results are in run_dir"]


def _run_summary(run_dir: Path) -> list[str]:
    metrics, record, config = _load(run_dir)
    ttt = _trained_depth(config, record)
    target = Path(str(record.get("target_path") or (config.get("target") or {}).get("name") or "?")).name
    head = f"{record.get('variant', '?')} (seed {record.get('seed', '?')}) on {target}"
    if "train/steps" in metrics:
        trained = _minutes(metrics.get("time/train_s"))
        head += f", trained {int(metrics['train/steps'])} steps at ttt_steps={ttt} in {trained}"
    else:
        head += f", evaluated from {record.get('checkpoint')}"
    lines = [f"summary: {head}; {_minutes(metrics.get('time/total_s'))} in all"]

    in_vllm = "vllm" in str(record.get("evaluator", ""))
    ks = sorted({ttt, max((int(k.split("@k")[1]) for k in metrics if k.startswith("acceptance_length@k")), default=0)})
    for k in (k for k in ks if f"acceptance_length@k{k}" in metrics):
        what = "the trained depth" if k == ttt else "deepest measured"
        lines.append(f"  τ@{k} ({what}): {_tau_line(metrics, k, in_vllm)}")
    if not in_vllm:
        lines.append(f"  vLLM: not run ({record.get('vllm_skipped') or 'eval.vllm.enabled=false, or not installed'})")

    lines += _benchmark_lines(metrics, config)
    served = _speedups(metrics)
    if served:
        for k, c, s, low, high in served:
            interval = f" [{low:.2f}, {high:.2f}] (95%, over the timed passes)" if low is not None else ""
            lines.append(f"  served speedup at k={k}, concurrency {c}: {s:.2f}x{interval}")
    elif record.get("evaluator") == "simulated+vllm":
        # (eaglelab.evaluate.held_out.served_ks: a CPU run serves nothing unless told)
        lines.append("  served speedup: not measured (by default a GPU's only: README, 'Served speed on a CPU')")
        lines.append(f"    serve it: python src/run.py checkpoint={run_dir} {SERVE_ON_A_CPU.format(k=ttt)}")
    headline = drift_headline(metrics)
    if headline:
        lines.append(f"  drift: {headline}")
    figures = [p for p in ("acceptance.png", "speedup.png") if (run_dir / p).is_file()]
    figures += sorted(str(p.relative_to(run_dir)) for p in (run_dir / "suites").glob("*.png"))
    if figures:
        lines.append(f"  figures: {', '.join(figures)} (in run_dir)")
    return lines


def sweep_summary(run_dirs: list[Path]) -> list[str]:
    """One line per trial of a sweep: variant, seed, τ at the trained depth (simulated, vLLM), the speedup at c = 1,
    and the data shards it prepared itself (0: it read what an earlier trial or stage=prepare made); a trial of
    `stage=prepare` says what it prepared only."""
    lines = []
    for run_dir in run_dirs:
        try:
            metrics, record, config = _load(run_dir)
        except (OSError, ValueError):
            lines.append(f"  {run_dir.name}: {handed_off(run_dir) or f'not finished ({_status(run_dir)})'}")
            continue
        ttt = _trained_depth(config, record)
        made = metrics.get("data/shards_prepared")
        prepared = f"{int(made)} data shards prepared in {_minutes(metrics.get('time/prepare_s'))}" if made else ""
        if not has_results(run_dir):  # stage=prepare
            lines.append(f"  {run_dir.name}: {prepared or 'data found prepared'}")
            continue
        sim, vllm = metrics.get(f"acceptance_length@k{ttt}"), metrics.get(f"vllm/acceptance_length@k{ttt}")
        line = f"  {run_dir.name}: {record.get('variant', '?')} seed {record.get('seed', '?')}, τ@{ttt}"
        line += f" simulated {sim:.3f}" if sim is not None else " simulated -"
        if vllm is not None:  # beside the simulated evaluator on vLLM's own prompts (like with like)
            same, n = metrics.get(f"vllm/simulated_acceptance_length@k{ttt}"), metrics.get("vllm/prompts")
            line += f", vLLM {vllm:.3f}" + (f" (simulated {same:.3f} on its {_prompts(n)})" if same is not None else "")
        at_one = [r for r in _speedups(metrics) if r[1] == 1]
        if at_one:
            k, _, s, low, high = at_one[0]
            line += f", speedup {s:.2f}x" + (f" [{low:.2f}, {high:.2f}]" if low is not None else "")
        lines.append(line + (f"; {prepared}" if prepared else ""))
    return lines


def trial_dirs(sweep_dir: Path) -> list[Path]:
    """A sweep's trial directories (`<job number>_<variant>_s<seed>`), in job order."""
    number = lambda p: int(p.name.split("_")[0]) if p.name.split("_")[0].isdigit() else 1 << 30  # noqa: E731
    return sorted((p for p in sweep_dir.iterdir() if (p / "run.json").is_file()), key=lambda p: (number(p), p.name))


class SweepSummary(Callback):
    """A sweep ends as a run does: one line per trial of what it found (rank 0 of the sweep's process only)."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:

        sweep_dir = Path(str(config.hydra.sweep.dir)).expanduser()
        if not is_primary() or not sweep_dir.is_dir():
            return
        trials = trial_dirs(sweep_dir)
        if trials:
            print("\n".join([f"summary: {len(trials)} trials", *sweep_summary(trials)]), flush=True)
            print(f"sweep_dir: {sweep_dir.resolve()}", flush=True)
