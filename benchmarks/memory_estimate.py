"""The memory estimate (`eaglelab.plan.costs`) against the measured peak, on the embedded SmolLM2.

    python -m benchmarks.memory_estimate [--cache DIR] [--out DIR] [--only NAME ...]

Each setting is one `python src/run.py` (the real loop, its own process, one at a time): a short default run, two
larger ones, and the short one trained for 8 epochs (where oneDNN's per-shape memory levels off). metrics.json
holds `memory/estimate_gb` (the estimate, made before any work) and `memory/peak_rss_gb` (the process's peak
resident memory, read at the end); the table prints both and their ratio, then what each estimate is made of
(run.log's `memory estimate:` line). The target is converted once into the cache (`EAGLELAB_CACHE_DIR`, default
/tmp/eaglelab-cache-mem) and the data is regenerated once per distinct data setting.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHORT = [
    "data.num_prompts=48",
    "train.epochs=1",
    "eval.num_prompts=8",
    "eval.vllm.enabled=false",
    "eval.suites.drift.enabled=false",
    "eval.suites.extrapolation.enabled=false",
]
SETTINGS = {
    "default (short)": SHORT,
    "train.batch_size=8": [*SHORT, "train.batch_size=8"],
    "train.ttt_steps=8 data.max_length=512": [*SHORT, "train.ttt_steps=8", "data.max_length=512"],
    # 8 epochs of the same sequences: oneDNN's per-shape memory levels off once batch lengths repeat
    "train.epochs=8": [*SHORT, "train.epochs=8"],
}


def run(overrides: list[str], cache: Path, run_dir: Path) -> dict:
    env = {**os.environ, "EAGLELAB_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "src/run.py", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: run failed ({' '.join(overrides)}): {proc.stderr.strip().splitlines()[-1:]}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    logged = re.search(r"memory estimate: (.*)", (run_dir / "run.log").read_text())
    return {
        "estimate_gb": metrics["memory/estimate_gb"],
        "peak_rss_gb": metrics["memory/peak_rss_gb"],
        "train_steps": metrics.get("train/steps"),
        "estimate": logged.group(1) if logged else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cache", type=Path, default=Path(os.environ.get("EAGLELAB_CACHE_DIR", "/tmp/eaglelab-cache-mem"))
    )
    parser.add_argument("--out", type=Path, default=None, help="keep the run directories here (default: a temp dir)")
    parser.add_argument("--only", nargs="*", default=None, help="setting names to run (default: all)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="memory-estimate-"))
    rows = []
    for i, (name, overrides) in enumerate(SETTINGS.items()):
        if args.only and name not in args.only:
            continue
        result = run(overrides, args.cache, out / f"run{i}")
        rows.append({"setting": name, **result})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'setting':<42} {'estimate GB':>11} {'peak RSS GB':>11} {'ratio':>6} {'train steps':>11}")
    for r in rows:
        ratio = r["estimate_gb"] / r["peak_rss_gb"]
        numbers = f"{r['estimate_gb']:>11.2f} {r['peak_rss_gb']:>11.2f} {ratio:>6.2f} {r['train_steps']:>11}"
        print(f"{r['setting']:<42} {numbers}")
    for r in rows:
        print(f"{r['setting']}: {r['estimate']}")


if __name__ == "__main__":
    main()
