"""Streamed states (features=stream): what the engine and the trainers do, who waits, and what the store holds.

    python -m benchmarks.stream [--target smollm2|tiny] [--prompts 64] [--epochs 2] [--devices 2] [--repeats 3]
                                [--window-gb 0.05] [--sweep] [--json results/benchmarks/stream.json]

Every run is `python src/run.py features=stream` (the real loop, its own process): one vLLM capture engine beside
`--devices` DDP trainer ranks on this machine, the store a `mooncake_master` the run starts. The token shards are
prepared once before timing (`stage=prepare`). Reported per repeat, then the median: the engine's tokens/s (its
prefill and the samples it publishes), the trainers' positions/s (logs/metrics.csv `time/positions_per_s`, per
rank, epochs after the first), the trainers' input-wait share (`time/input_wait_s` / `time/epoch_s`) against the
engine's wait for room in the window (`stream/engine_wait_s`), the store's peak allocation (the master's
`master_allocated_bytes`, sampled) against its capacity and the window, each rank's peak RSS, and bytes written to
disk: the cache before and after (states: none) and the run folder, per training token.

`--sweep`: a 2-variant × 2-seed sweep (train.data_seed=0, hydra/launcher=local: concurrent trials) fed by one stream
(features.stream.share=true) against the same sweep with a stream per trial: target forward passes (samples the
engines published), the sweep's wall time, and each trial's τ@3 (identical where the data are identical).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def du(folder: Path) -> int:
    return (
        sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) if folder.exists() else 0
    )


def cli(args: list[str], cache: Path, results: Path) -> None:
    env = {
        **os.environ,
        "EAGLELAB_CACHE_DIR": str(cache),
        "EAGLELAB_RESULTS_DIR": str(results),
        "HYDRA_FULL_ERROR": "1",
    }
    proc = subprocess.run([sys.executable, "src/run.py", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: run failed ({' '.join(args)}): {proc.stderr.strip().splitlines()[-1:]}")


def epochs_of(run_dir: Path) -> list[dict]:
    with open(run_dir / "logs" / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("time/epoch_s")]


def one_stream(common: list[str], devices: int, epochs: int, window_gb: float, cache: Path, work: Path, i: int) -> dict:
    run_dir = work / f"stream{i}"
    cache_before = du(cache)
    cli([*common, "features=stream", f"train.devices={devices}", f"features.stream.window_gb={window_gb}",
         f"hydra.run.dir={run_dir}"], cache, work)  # fmt: skip
    m = json.loads((run_dir / "metrics.json").read_text())
    later = epochs_of(run_dir)[1:] or epochs_of(run_dir)  # (the first epoch carries the engine's start)
    trained = m["data/train_tokens"] * epochs
    return {
        "engine_tokens_per_s": m["stream/engine_tokens_per_s"],
        "trainer_positions_per_s": statistics.median(float(r["time/positions_per_s"]) for r in later),
        "input_wait_share": statistics.median(float(r["time/input_wait_s"]) / float(r["time/epoch_s"]) for r in later),
        "engine_wait_s": m["stream/engine_wait_s"],
        "samples_streamed": m["stream/samples_streamed"],
        "window_samples": m["stream/window_samples"],
        "store_bytes": m["stream/store_bytes"],
        "store_peak_bytes": m["stream/store_peak_bytes"],
        "rank_peak_rss_gb": [v for k, v in sorted(m.items()) if k.startswith("memory/rank") and k.endswith("rss_gb")],
        "cache_bytes_written": du(cache) - cache_before,
        "run_dir_bytes_per_token": du(run_dir) / max(trained, 1),
        "tau@3": m["acceptance_length@k3"],
    }


def sweep(common: list[str], share: bool, cache: Path, work: Path) -> dict:
    folder = work / ("shared" if share else "separate")
    t0 = time.perf_counter()
    cli(["-m", *common, "features=stream", f"features.stream.share={str(share).lower()}", "train.data_seed=0",
         "+ablation=eagle3_1,eagle3", "train.seed=0,1", "hydra/launcher=local", "hydra.launcher.cpus_per_task=1",
         f"hydra.sweep.dir={folder}"], cache, work)  # fmt: skip
    wall = time.perf_counter() - t0
    trials = {p.parent.name: json.loads(p.read_text()) for p in sorted(folder.glob("*/metrics.json"))}
    return {
        "wall_s": wall,
        "target_passes": sum(m.get("stream/samples_streamed", 0) for m in trials.values()),
        "tau@3": {name: m["acceptance_length@k3"] for name, m in trials.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window-gb", type=float, default=0.05)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--work", type=Path, help="keep the work folder (and its prepared cache) here")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="eaglelab-stream-"))
    cache = work / "cache"
    common = [f"target={a.target}", f"data.num_prompts={a.prompts}", f"train.epochs={a.epochs}",
              "eval.vllm.enabled=false", "eval.num_prompts=8", "eval.suites.extrapolation.enabled=false",
              "eval.suites.drift.enabled=false"]  # fmt: skip
    if a.target == "tiny":
        common += ["experiment=smoke", f"data.num_prompts={a.prompts}"]
    cli([*common, "stage=prepare", "features=stream", f"hydra.run.dir={work / 'prepare'}"], cache, work)
    rows = [one_stream(common, a.devices, a.epochs, a.window_gb, cache, work, i) for i in range(a.repeats)]
    keys = [k for k in rows[0] if isinstance(rows[0][k], (int, float))]
    median = {k: statistics.median(r[k] for r in rows) for k in keys}
    m = median
    bottleneck = "trainers (the engine waited for room)" if m["engine_wait_s"] > 1.0 else "engine (it never waited)"
    lines = [
        f"features=stream, {a.target}, {a.prompts} prompts, {a.epochs} epochs: 1 engine + {a.devices} trainer ranks, "
        f"median of {a.repeats}",
        f"  engine: {m['engine_tokens_per_s']:.0f} tokens/s; trainers: {m['trainer_positions_per_s']:.0f} positions/s "
        f"a rank ({a.devices * m['trainer_positions_per_s']:.0f} in all)",
        f"  trainers waiting for input: {100 * m['input_wait_share']:.0f} % of an epoch; the engine waiting for room "
        f"in the window: {m['engine_wait_s']:.1f} s -> bottleneck: {bottleneck}",
        f"  store: peak {m['store_peak_bytes'] / 1e6:.1f} MB allocated of {m['store_bytes'] / 1e6:.1f} MB mounted "
        f"(window {m['window_samples']:.0f} samples); ranks' peak RSS {rows[0]['rank_peak_rss_gb']} GB",
        f"  written to disk: cache +{m['cache_bytes_written']:.0f} bytes (states: none); run folder "
        f"{m['run_dir_bytes_per_token']:.1f} bytes per training token (checkpoints, logs); τ@3 {m['tau@3']:.3f}",
    ]
    print("\n".join(lines))
    out = {"rows": rows, "median": median}
    if a.sweep:
        out["sweep"] = {kind: sweep(common, kind == "shared", cache, work) for kind in ("shared", "separate")}
        for kind, s in out["sweep"].items():
            print(
                f"  sweep ({kind}): {s['target_passes']} target forward passes, {s['wall_s']:.0f} s; τ@3 {s['tau@3']}"
            )
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
