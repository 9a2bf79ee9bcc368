"""The training data's disk and read bandwidth at the field's scale, computed (nothing runs, nothing is downloaded)
with the `data_plan` the run's preflight prints (eaglelab.plan.costs):

    python benchmarks/data_plan.py [--target llama-3.1-8b|llama-3.3-70b] [--conversations 200000]
                                   [--tokens 2048] [-- overrides]

Every conversation is taken at `--tokens` tokens (prompt and response: the upper bound the preflight uses before
anything is regenerated), the drafter on the target's shape with vLLM's default aux layers, at the run's settings
(overrides: e.g. train.loss=kl, features=online, train.tokens_per_batch=65536) on a GPU. The target shapes are
their published config.json values.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from hydra import compose, initialize_config_dir
from transformers import LlamaConfig

from eaglelab.core.config import to_run_config
from eaglelab.core.io import size_text
from eaglelab.models.drafter import Eagle3Config
from eaglelab.plan.costs import PromptSet, data_plan

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {  # config.json of each (hidden, intermediate, heads, KV heads, layers, vocabulary)
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         num_hidden_layers=32, vocab_size=128256, rms_norm_eps=1e-5),
    "llama-3.3-70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                          num_hidden_layers=80, vocab_size=128256, rms_norm_eps=1e-5),
}  # fmt: skip


def plan(target: str, conversations: int, tokens: int, overrides: list[str]):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Hydra's version_base notice: composed as `src/run.py` composes)
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            overrides = ["train.accelerator=gpu", "train.tokens_per_batch=32768", *overrides]
            cfg = to_run_config(compose("config", overrides=overrides))
    shape = LlamaConfig(**TARGETS[target])
    L = shape.num_hidden_layers
    drafter = Eagle3Config.for_target(
        cfg.drafter, shape, aux_layer_ids=[2, L // 2, L - 3], draft_vocab_size=cfg.drafter.draft_vocab_size,
        max_context=tokens,
    )  # fmt: skip
    data = PromptSet("train", 1, tokens, tokens, tokens, "", trained_on=conversations, sequences=conversations,
                     tokens_bound=conversations * tokens)  # fmt: skip
    return data_plan(cfg, drafter, data)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", choices=sorted(TARGETS), default="llama-3.1-8b")
    ap.add_argument("--conversations", type=int, default=200_000)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    p = plan(args.target, args.conversations, args.tokens, args.overrides)
    print(f"{args.target}, {args.conversations:,} conversations × {args.tokens:,} tokens, {' '.join(args.overrides)}")
    for line in p.lines():
        print(f"  data plan: {line}")
    print(f"  ({size_text(p.disk)} per copy; a sweep whose trials keep different states or tails makes one each)")


if __name__ == "__main__":
    main()
