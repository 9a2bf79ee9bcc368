"""The target's states captured by vLLM (data.capture_backend=vllm) against HF's capture, on the same sequences.

    python -m benchmarks.capture_backends [--target smollm2] [--dtypes bfloat16 float32] [--prompts 64]

The prompts are regenerated once per dtype (HF), then captured twice through eaglelab's own path
(`prepare_features`): by one HF forward per batch of finished sequences, and by a vLLM capture engine that prefills
each prompt + response (extract_hidden_states; on a CPU eaglelab's connector). Reported per captured layer (the aux
layers in the run's order, then norm(h_L), the KL teacher's input): max and mean |Δ| between the two and the mean
|value| beside them, and in a 16-bit dtype each backend against the float32 target's states of the same tokens (the
noise that dtype brings by itself); the share of greedy labels (target_next) that agree; each capture's wall seconds
and tokens/s (the vLLM engine's start included, as a run pays it). Both captures are stored as bf16 bits, as
training reads them. `--json PATH` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def compare(target_kind: str, dtype: str, prompts: int, max_new_tokens: int, cache_dir: str, work: Path) -> dict:
    from dataclasses import replace

    import torch

    from eaglelab.core.config import TargetConfig
    from eaglelab.data.cache_entry import CaptureSettings, SetRequest
    from eaglelab.data.prepare_set import prepare_features
    from eaglelab.data.prompts import mix_sources
    from eaglelab.data.targets import load_target

    target = load_target(TargetConfig(kind=target_kind, dtype=dtype), cache_dir)
    aux = target.default_aux_layer_ids()
    chats = mix_sources(["stdlib_docstrings", "pydoc_topics"], prompts, seed=0)
    ask = SetRequest("bench", max_new_tokens, with_final=True)
    how = CaptureSettings(work, aux, None, max_length=1024, batch_size=16, backend="hf", shard_size=32)
    # One regeneration (HF: the faster here), tokens only; then each backend's capture into its own cache entry,
    # `seconds["capture"]` the capture alone.
    _, regen = prepare_features(target, chats, replace(ask, features="online"), how)
    hf, hf_stats = prepare_features(target, chats, ask, replace(how, capture_backend="hf"))
    assert hf_stats.regen_cached and not hf_stats.capture_cached
    engine, engine_stats = prepare_features(target, chats, ask, replace(how, capture_backend="vllm"))
    assert engine_stats.regen_cached and not engine_stats.capture_cached
    seconds = {"hf": hf_stats.seconds["capture"], "vllm": engine_stats.seconds["capture"]}
    tokens = int(hf.tokens.lengths().sum())
    items = {"hf": [hf.item(i, with_final=True) for i in range(len(hf))]}
    items["vllm"] = [engine.item(i, with_final=True) for i in range(len(engine))]
    for a, b in zip(items["hf"], items["vllm"], strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])
    pairs = {"vllm vs hf": ("vllm", "hf")}
    if dtype != "float32":  # the bf16 noise itself: each backend against the float32 target on the same tokens
        items["float32"] = reference_states(target_kind, cache_dir, aux, items["hf"])
        pairs.update({"hf vs float32": ("hf", "float32"), "vllm vs float32": ("vllm", "float32")})
    return {
        "target": target_kind,
        "dtype": dtype,
        "sequences": len(hf),
        "tokens": tokens,
        "comparisons": {n: differences(items[x], items[y], aux, target.hidden_size) for n, (x, y) in pairs.items()},
        "capture_seconds": seconds,
        "capture_tokens_per_s": {k: tokens / s for k, s in seconds.items()},
        "regenerate_seconds": regen.seconds["regenerate"],
        "torch_threads": torch.get_num_threads(),
    }  # fmt: skip


def reference_states(target_kind: str, cache_dir: str, aux: list[int], items: list[dict]) -> list[dict]:
    """The float32 target's states of the same sequences (HF capture, not rounded to bf16)."""
    from eaglelab.core.config import TargetConfig
    from eaglelab.data.capture import capture_batch
    from eaglelab.data.targets import load_target

    target = load_target(TargetConfig(kind=target_kind, dtype="float32"), cache_dir)
    out = []
    for it in items:
        seq, prompt_len = it["input_ids"].tolist(), int(it["prompt_len"])
        ((aux_states, final, nxt),) = capture_batch(target, [seq], aux, [prompt_len])
        out.append({"aux": aux_states, "final": final, "target_next": nxt})
    return out


def differences(xs: list[dict], ys: list[dict], aux: list[int], H: int) -> dict:
    """Per captured layer: max and mean |x − y| and mean |y|; the share of greedy labels that agree."""

    names = [f"aux {k}" for k in aux] + ["final (norm h_L)"]
    acc = {n: {"max": 0.0, "sum": 0.0, "abs": 0.0} for n in names}
    count = agree = labels = 0
    for a, b in zip(xs, ys, strict=True):
        count += len(a["target_next"]) * H
        for j, n in enumerate(names):
            x, y = (
                (a["final"], b["final"])
                if j == len(aux)
                else (a["aux"][:, j * H : (j + 1) * H], b["aux"][:, j * H : (j + 1) * H])
            )
            d = (x.float() - y.float()).abs()
            acc[n]["max"] = max(acc[n]["max"], d.max().item())
            acc[n]["sum"] += d.sum().item()
            acc[n]["abs"] += y.float().abs().sum().item()
        labelled = b["target_next"] >= 0
        agree += int((a["target_next"][labelled] == b["target_next"][labelled]).sum())
        labels += int(labelled.sum())
    layers = {n: {"max_abs_diff": v["max"], "mean_abs_diff": v["sum"] / count, "mean_abs": v["abs"] / count}
              for n, v in acc.items()}  # fmt: skip
    return {"layers": layers, "labels_agree": agree / max(labels, 1), "labels": labels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--cache-dir", default="~/.cache/eaglelab", help="where the target is (converted once)")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for dtype in args.dtypes:
        with tempfile.TemporaryDirectory() as work:
            rows.append(compare(args.target, dtype, args.prompts, args.max_new_tokens, args.cache_dir, Path(work)))
    for r in rows:
        print(f"\n{r['target']} {r['dtype']}: {r['sequences']} sequences, {r['tokens']} tokens")
        for name, c in r["comparisons"].items():
            print(f"  {name}: greedy labels agree {c['labels_agree']:.2%} of {c['labels']}")
            print(f"    {'layer':<18} {'max |Δ|':>10} {'mean |Δ|':>10} {'mean |x|':>10} {'mean rel':>9}")
            for layer, v in c["layers"].items():
                rel = v["mean_abs_diff"] / v["mean_abs"]
                figures = f"{v['max_abs_diff']:>10.4g} {v['mean_abs_diff']:>10.4g} {v['mean_abs']:>10.4g}"
                print(f"    {layer:<18} {figures} {rel:>9.3%}")
        for backend, s in r["capture_seconds"].items():
            print(f"  capture {backend:<5} {s:7.1f} s  {r['capture_tokens_per_s'][backend]:8.0f} tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
