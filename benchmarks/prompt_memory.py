"""Host memory of the data stage's prompt side, per process: N training prompts in the target's chat template,
kept for sharding and hashed into the regeneration's cache key — eaglelab before against now.

    python -m benchmarks.prompt_memory [--prompts 10000 100000] [--target smollm2|tiny]

  before   each prompt's token ids a Python list (~36 bytes a token), the key `json.dumps` of every id at once
  now      each prompt's ids an int32 array (4 bytes a token, eaglelab.data.prepare_set), the key hashed part by part
           (eaglelab.data.cache_entry.cache_key: the same hash)

Each case runs in a fresh process that renders the prompts with eaglelab's `template_prompt` (the target's own
tokenizer), keeps them as the case does and makes the key: measured is the peak RSS (ru_maxrss) less the RSS once
the prompts' messages are built (held in both cases). Prompts: the `python_docstrings` requests, cycled with a
numbered suffix up to N. Every process of a trial and every task of a `stage=prepare` array holds this once.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MEASURE = """
import hashlib, json, resource, sys
import numpy as np
from eaglelab.core.config import TargetConfig
from eaglelab.data.cache_entry import cache_key
from eaglelab.data.prompts import python_docstring_prompts
from eaglelab.data.templates import template_prompt
from eaglelab.data.targets import load_target

case, n, kind, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
tokenizer = load_target(TargetConfig(kind=kind, dtype="float32"), cache).tokenizer
pool = python_docstring_prompts()
prompts = [[{"role": "user", "content": f"{pool[i % len(pool)][0]['content']} ({i})"}] for i in range(n)]
rss = lambda: int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
base = rss()
templated = []
for messages in prompts:
    ids = template_prompt(tokenizer, messages, None)
    templated.append(ids if case == "before" else np.asarray(ids, np.int32))
if case == "before":
    key = hashlib.sha256(json.dumps({"prompts": templated, "v": 5}, sort_keys=True).encode()).hexdigest()[:20]
else:
    key = cache_key(prompts=templated, v=5)
tokens = sum(len(t) for t in templated)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"case": case, "prompts": n, "tokens": tokens, "held_gb": (peak - base) / 2**30, "key": key}))
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[10000, 100000])
    ap.add_argument("--target", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "eaglelab"), help="where targets are")
    args = ap.parse_args(argv)
    rows = []
    for n in args.prompts:
        for case in ("before", "now"):
            out = subprocess.run([sys.executable, "-c", MEASURE, case, str(n), args.target, args.cache], cwd=ROOT,
                                 capture_output=True, text=True, check=True)  # fmt: skip
            rows.append(json.loads(out.stdout.splitlines()[-1]))
    print(f"{'prompts':>8}{'tokens':>12}  {'before (GiB)':>13}{'now (GiB)':>11}{'ratio':>7}  same key")
    for before, now in zip(rows[::2], rows[1::2]):
        ratio = before["held_gb"] / max(now["held_gb"], 1e-9)
        print(f"{before['prompts']:>8}{before['tokens']:>12,}  {before['held_gb']:>13.3f}{now['held_gb']:>11.3f}"
              f"{ratio:>7.1f}  {before['key'] == now['key']}")  # fmt: skip


if __name__ == "__main__":
    main()
