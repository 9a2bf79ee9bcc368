"""Host memory of a trial process's prompt side at N conversations from a JSONL source: the sources read and mixed,
the held-out overlap dropped, validation held out, the sizes checked (eaglelab.plan.costs), the training set rendered
in the target's template and keyed (the data stage's first two steps) — everything a process holds of its prompts
before the engines start, on every rank and every task of a `stage=prepare` array.

    python -m benchmarks.source_memory [--conversations 10000 100000] [--select 1.0] [--src PATH]

The JSONL is synthetic, ShareGPT-like: 2 rounds, ~1.5 KB of text a conversation (the regenerated set keeps the
first user turn, its answer and the second user turn). `--select` is the share of the file a run draws
(`data.num_prompts`). Each case runs in a fresh process on the tiny target (its tokenizer is SmolLM2's); measured
are the peak RSS (VmHWM) less the RSS after imports and the target's load, and the process's whole peak. `--src`
measures another checkout's eaglelab (e.g. a worktree of an earlier commit) with the same script.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the function returns a list of values sorted by key when the input holds several entries and each item "
         "is compared with its neighbour before the result is written back to the caller").split()  # fmt: skip

MEASURE = """
import json, sys
from hydra import compose, initialize_config_dir
from eaglelab.core.config import to_run_config
from eaglelab.data.cache_entry import SetRequest, plan_entry
from eaglelab.data.render import render_prompts
from eaglelab.data.stage import capture_settings, select_prompts, training_entry
from eaglelab.plan.preflight import check_limits
from eaglelab.pipeline import build_model_config
from eaglelab.data.targets import load_target

conf, jsonl, n, cache = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
status = lambda key: int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
with initialize_config_dir(config_dir=conf, version_base=None):
    cfg = to_run_config(compose("config", overrides=[
        "target=tiny", f"data.sources=[jsonl:{jsonl}]", f"data.num_prompts={n}", "data.val_prompts=64",
        "eval.num_prompts=8", "data.max_length=1024", f"paths.cache_dir={cache}", "eval.vllm.enabled=false"]))
target = load_target(cfg.target, cache)
model_cfg = build_model_config(cfg, target)
base = status("VmRSS")
prompts = select_prompts(cfg, target)
check_limits(cfg, target, model_cfg, prompts.train, prompts.held_out, prompts.validation)
how = capture_settings(cfg, model_cfg)
is_val = [False] * len(prompts.train) + [True] * len(prompts.validation)
request = SetRequest("train", cfg.data.max_new_tokens, source="bench", is_val=is_val, features=cfg.features.kind,
                     turns=cfg.data.turns, **training_entry(cfg))
limit = min(how.max_length, target.max_context)
rendered = render_prompts(target, prompts.training_set, request, how, limit)
entry = plan_entry(target, rendered, request, how, limit)
tokens = int(sum(len(t) for t in rendered.templated))
print(json.dumps({"conversations": n, "tokens": tokens, "held_gb": (status("VmHWM") - base) / 2**30,
                  "peak_gb": status("VmHWM") / 2**30, "key": entry.regen_dir.name}))
"""


def write_jsonl(path: Path, count: int) -> None:
    rng = random.Random(0)
    text = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    with open(path, "w") as f:
        for i in range(count):
            turns = [("user", 50), ("assistant", 100), ("user", 50), ("assistant", 100)]
            messages = [{"role": role, "content": f"{i}: {text(n)}"} for role, n in turns]
            f.write(json.dumps({"messages": messages}) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, nargs="+", default=[10000, 100000])
    ap.add_argument("--select", type=float, default=1.0, help="the share of the file a run draws")
    ap.add_argument("--src", default=str(ROOT / "src"), help="the eaglelab checkout's src/ to measure")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "eaglelab"), help="where targets are")
    args = ap.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": args.src}
    conf = str(Path(args.src).parent / "conf")
    print(f"{'conversations':>13}{'drawn':>9}{'tokens':>13}  {'held (GiB)':>10}  {'process peak':>12}  key")
    folder = Path(tempfile.gettempdir()) / "eaglelab-source-memory"  # (one path: it seeds the source's shuffle)
    folder.mkdir(exist_ok=True)
    try:
        for n in args.conversations:
            path = folder / f"{n}.jsonl"
            write_jsonl(path, n)
            drawn = int(n * args.select) - 64 - 8
            out = subprocess.run([sys.executable, "-c", MEASURE, conf, str(path), str(drawn), args.cache], env=env,
                                 capture_output=True, text=True, check=True)  # fmt: skip
            row = json.loads(out.stdout.splitlines()[-1])
            print(f"{n:>13,}{drawn:>9,}{row['tokens']:>13,}  {row['held_gb']:>10.3f}  {row['peak_gb']:>12.3f}  "
                  f"{row['key']}", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
