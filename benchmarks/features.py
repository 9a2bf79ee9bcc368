"""Training features side by side: cached vs online vs hybrid on the same data and seed, and the bytes each
leaves on disk; optionally the peak RSS of a cached run with 4x the data against 1x.

    python -m benchmarks.features [--prompts 96] [--epochs 3] [--repeats 2] [--device cpu|cuda]
                                  [--rss] [--out results/benchmarks/features.json]

Every run is `python src/run.py` (the real loop, its own process) on the embedded SmolLM2 with vLLM's
acceptance stage and the suites off. The three modes are interleaved within each repeat. They share one token
cache; the cached mode's state entry is prepared once before timing. Hybrid runs get a fresh copy of the
cache without the training states (symlinks), so their first epoch really is online. Reported per mode:
training positions/s per epoch (from `time/epoch_s` in logs/metrics.csv: epoch 1, and the later epochs), τ@k3
on the held-out prompts (simulated) and validation τ, and bytes on disk per token. Bytes per token are
projected to Llama-3.1-8B (hidden 4096, 3 aux layers, bf16) at 10^7 and 10^8 training tokens.

`--rss`: peak RSS of the train stage (`eaglelab.train.fit.train_drafter`, what the loop calls, one epoch, in a
fresh process after the target is loaded and freed as the loop does) on cached training data the size of the
default run's (192 prompts) and 4x that: the training set's real stores, replicated; and 1x for 4 epochs, the
steps of 4x for one, which separates what the data costs (read one sequence at a time: nothing held) from what
more steps cost.

`--work DIR` keeps the work folder (and its prepared cache) for a later call.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("cached", "online", "hybrid")
TRAIN_ONLY = """
import json, resource, sys
from pathlib import Path
from hydra import compose, initialize_config_dir
from eaglelab.core.config import to_run_config
from eaglelab.data.store import Sequences, StateStore, TokenStore
from eaglelab.pipeline import build_model_config
from eaglelab.data.targets import load_target
from eaglelab.train.fit import train_drafter

root, data, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
with initialize_config_dir(config_dir=str(root / "conf"), version_base=None):
    cfg = to_run_config(compose("config", overrides=["train.epochs=1", f"paths.cache_dir={sys.argv[4]}"]))
target = load_target(cfg.target, cfg.paths.cache_dir)
model_cfg, weights = build_model_config(cfg, target), target.weights()
del target
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
seqs = Sequences(TokenStore(data / "tokens"), StateStore(data / "states"))
train_drafter(cfg, out, model_cfg, weights, seqs)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"sequences": len(seqs), "peak_before_train_mb": before / 1024, "peak_mb": peak / 1024}))
"""


def run(overrides: list[str], cache: Path, run_dir: Path) -> dict:
    env = {**os.environ, "EAGLELAB_CACHE_DIR": str(cache), "HYDRA_FULL_ERROR": "1"}
    cmd = [sys.executable, "src/run.py", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: run failed ({' '.join(overrides)}): {proc.stderr.strip().splitlines()[-1:]}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    with open(run_dir / "logs" / "metrics.csv") as f:
        metrics["epoch_s"] = [float(r["time/epoch_s"]) for r in csv.DictReader(f) if r.get("time/epoch_s")]
    return metrics


def without_training_states(cache: Path, into: Path) -> None:
    """A cache where everything but the training set's states is a symlink into `cache`."""
    into.mkdir(parents=True)
    for name in ("targets", "regen", "logs"):
        if (cache / name).exists():
            (into / name).symlink_to(cache / name)
    (into / "features").mkdir()
    for entry in (cache / "features").iterdir():
        meta = json.loads((entry / "complete.json").read_text()) if (entry / "complete.json").is_file() else {}
        regen = cache / "regen" / str(meta.get("regen")) / "complete.json"
        if regen.is_file() and json.loads(regen.read_text()).get("name") != "train":
            (into / "features" / entry.name).symlink_to(entry)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def disk_per_token(cache: Path) -> dict[str, float]:
    """Bytes per token of the training set's token store and of its state store."""
    from eaglelab.data.store import TokenStore

    for entry in (cache / "regen").iterdir():
        if json.loads((entry / "complete.json").read_text()).get("name") != "train":
            continue
        tokens = int(TokenStore(entry).lengths().sum())
        states = [
            p
            for p in (cache / "features").iterdir()
            if json.loads((p / "complete.json").read_text()).get("regen") == entry.name
        ]
        return {"tokens": folder_bytes(entry) / tokens, "states": folder_bytes(states[0]) / tokens}
    raise SystemExit("error: no training entry in the cache")


def replicated(cache: Path, copies: int, into: Path) -> Path:
    """The training set's token and state stores, `copies` times over (real states, shard files copied)."""
    from eaglelab.data.store import mark_complete, shard_name, state_shards_meta

    def meta(entry):
        return json.loads((entry / "complete.json").read_text())

    regen = next(e for e in (cache / "regen").iterdir() if meta(e)["name"] == "train")
    states = next(e for e in (cache / "features").iterdir() if meta(e).get("regen") == regen.name)
    state_meta = meta(states)
    n_shards, n_rows = meta(regen)["shards"], sum(len(s["rows"]) for s in state_meta["shards"])
    (into / "tokens").mkdir(parents=True)
    (into / "states").mkdir(parents=True)
    shards = []
    for c in range(copies):
        for i in range(n_shards):
            j = c * n_shards + i
            shutil.copy(regen / shard_name(i), into / "tokens" / shard_name(j))
            shutil.copy(states / shard_name(i), into / "states" / shard_name(j))
            shards.append((shard_name(j), [c * n_rows + r for r in state_meta["shards"][i]["rows"]]))
    mark_complete(into / "tokens", {"shards": copies * n_shards})
    mark_complete(into / "states", state_shards_meta(shards, state_meta["with_final"]))
    return into


def train_peak_rss(cache: Path, copies: int, work: Path, epochs: int = 1) -> dict:
    name = f"x{copies}-e{epochs}"
    for stale in (work / name, work / f"{name}-run"):
        shutil.rmtree(stale, ignore_errors=True)
    data = replicated(cache, copies, work / name)
    args = [str(ROOT), str(data), str(work / f"{name}-run"), str(cache)]
    script = TRAIN_ONLY.replace('"train.epochs=1"', f'"train.epochs={epochs}"')
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: training on {copies} copies failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--rss", action="store_true", help="also peak RSS of cached runs with 1x and 4x the default data")
    ap.add_argument("--work", type=Path, help="keep the work folder here (reused when it holds a prepared cache)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "benchmarks" / "features.json")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="eaglelab-features-"))
    cache = work / "cache"
    common = [
        f"train.accelerator={'gpu' if args.device == 'cuda' else 'cpu'}",
        "eval.num_prompts=32",
        "eval.vllm.enabled=false",
        "eval.suites.drift.enabled=false",
        "logger=csv",
    ]
    sized = [*common, f"data.num_prompts={args.prompts}"]
    if not (work / "warm" / "metrics.json").is_file():
        print(f"preparing the shared cache in {cache} (regeneration and capture, once)", flush=True)
        shutil.rmtree(work / "warm", ignore_errors=True)
        run([*sized, "train.epochs=1", "features=cached"], cache, work / "warm")
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES:
            where = cache
            if mode == "hybrid":
                where = work / f"hybrid-cache-{r}"
                shutil.rmtree(where, ignore_errors=True)
                without_training_states(cache, where)
            shutil.rmtree(work / f"{mode}-{r}", ignore_errors=True)
            m = run([*sized, f"train.epochs={args.epochs}", f"features={mode}"], where, work / f"{mode}-{r}")
            per_epoch = [m["data/train_tokens"] / s for s in m["epoch_s"]]
            results[mode].append(
                {
                    "positions_per_s": per_epoch,
                    "tau@k3": m["acceptance_length@k3"],
                    "val_tau@k3": m["val/acceptance_length@k3"],
                    "train_s": m["time/train_s"],
                }
            )
            print(
                f"repeat {r} {mode:7s} epochs {[f'{p:.0f}' for p in per_epoch]} positions/s, "
                f"τ@k3 {m['acceptance_length@k3']:.3f}",
                flush=True,
            )
    report = {"prompts": args.prompts, "epochs": args.epochs, "repeats": args.repeats, "device": args.device}

    def med(mode, which):
        vals = [
            x["positions_per_s"][0] if which == "first" else statistics.mean(x["positions_per_s"][1:])
            for x in results[mode]
        ]
        return statistics.median(vals)

    table = {}
    for mode in MODES:
        table[mode] = {
            "epoch1_positions_per_s": med(mode, "first"),
            "later_positions_per_s": med(mode, "later"),
            "tau@k3": statistics.median(x["tau@k3"] for x in results[mode]),
            "val_tau@k3": statistics.median(x["val_tau@k3"] for x in results[mode]),
        }
    for mode in MODES:
        table[mode]["epoch1_vs_cached"] = (
            table[mode]["epoch1_positions_per_s"] / table["cached"]["epoch1_positions_per_s"]
        )
        table[mode]["later_vs_cached"] = table[mode]["later_positions_per_s"] / table["cached"]["later_positions_per_s"]
        table[mode]["tau_vs_cached"] = table[mode]["tau@k3"] / table["cached"]["tau@k3"]
    report["modes"], report["runs"] = table, results

    disk = disk_per_token(cache)
    hidden, aux, smol_hidden = 4096, 3, 576
    state_overhead = disk["states"] / (2 * aux * smol_hidden + 4)  # measured / (bf16 aux + int32 label) bytes
    per_token_8b = {"cached": disk["tokens"] + state_overhead * (2 * aux * hidden + 4), "online": disk["tokens"]}
    per_token_8b["hybrid"] = per_token_8b["cached"]  # hybrid writes cached's entry during its first epoch
    report["bytes_per_token"] = {
        "smollm2": {
            "cached": disk["tokens"] + disk["states"],
            "online": disk["tokens"],
            "hybrid": disk["tokens"] + disk["states"],
        },
        "llama3.1-8b": per_token_8b,
        "llama3.1-8b_GB@1e7": {k: v * 1e7 / 1e9 for k, v in per_token_8b.items()},
        "llama3.1-8b_GB@1e8": {k: v * 1e8 / 1e9 for k, v in per_token_8b.items()},
        "online_share_of_cached": disk["tokens"] / (disk["tokens"] + disk["states"]),
    }
    if args.rss:
        one = max(1, round(192 / args.prompts))  # copies of this training set that make the default run's 192 prompts
        rss = {scale: train_peak_rss(cache, one * scale, work) for scale in (1, 4)}
        for scale, r in rss.items():
            print(
                f"train stage, {scale}x the default data ({r['sequences']} sequences): peak RSS {r['peak_mb']:.0f} MB "
                f"(before training {r['peak_before_train_mb']:.0f} MB)"
            )
        report["peak_rss_mb"] = {"1x": rss[1], "4x": rss[4], "ratio": rss[4]["peak_mb"] / rss[1]["peak_mb"]}

    print(
        f"\n{'mode':8s} {'epoch 1 pos/s':>14s} {'x cached':>9s} {'later pos/s':>12s} {'x cached':>9s} "
        f"{'τ@k3':>7s} {'x cached':>9s} {'B/token':>9s} {'8B GB@1e8':>10s}"
    )
    for mode in MODES:
        t, b = table[mode], report["bytes_per_token"]
        print(
            f"{mode:8s} {t['epoch1_positions_per_s']:14.0f} {t['epoch1_vs_cached']:9.2f} "
            f"{t['later_positions_per_s']:12.0f} {t['later_vs_cached']:9.2f} {t['tau@k3']:7.3f} "
            f"{t['tau_vs_cached']:9.3f} {b['smollm2'][mode]:9.1f} {b['llama3.1-8b_GB@1e8'][mode]:10.1f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
