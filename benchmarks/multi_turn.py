"""Multi-turn training data: assistant tokens trained per conversation with data.turns=last against data.turns=all.

    python -m benchmarks.multi_turn [--target smollm2|tiny] [--conversations 12] [--turns 3] [--max-new-tokens 48]

Writes a multi-turn JSONL (OpenAI `messages`): each conversation asks for one standard-library function (eaglelab's
`stdlib_docstrings` requests), then follows up (`FOLLOW_UPS`), each user turn answered by a placeholder "source"
answer. Prepares it twice with the HF backend (cached features, a fresh cache each): `turns=last` (the answer to the
last user turn trained, the earlier turns context in the source's words: what eaglelab did before turns existed)
and `turns=all` (every turn answered by the target, each answer a trained span). Prints the sequences, their tokens,
the assistant tokens trained per conversation and the preparation's seconds for each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

FOLLOW_UPS = [
    "Now add type hints and a docstring to it.",
    "Write two unit tests for it with pytest.",
    "Explain in three sentences when this would be slower than a built-in alternative.",
    "Rewrite it without any imports.",
]


def conversations(count: int, turns: int) -> list[dict]:
    from eaglelab.data.prompts import stdlib_docstring_prompts

    asks = stdlib_docstring_prompts()
    rows = []
    for c in range(count):
        users = [asks[c][0]["content"], *FOLLOW_UPS][:turns]
        messages = []
        for t, text in enumerate(users):
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": f"(source answer {t})"}]
        rows.append({"messages": messages})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3, help=f"user turns per conversation (1..{1 + len(FOLLOW_UPS)})")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "eaglelab", help="where targets are")
    args = ap.parse_args(argv)
    from eaglelab.core.config import TargetConfig
    from eaglelab.data.cache_entry import CaptureSettings, SetRequest
    from eaglelab.data.prepare_set import prepare_features
    from eaglelab.data.prompts import jsonl_prompts
    from eaglelab.data.targets import load_target

    target = load_target(TargetConfig(kind=args.target, dtype="float32"), args.cache)
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "chats.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in conversations(args.conversations, args.turns)))
        prompts = jsonl_prompts(str(path))
        rows = []
        for turns in ("last", "all"):
            t0 = time.perf_counter()
            how = CaptureSettings(Path(work) / turns, target.default_aux_layer_ids(), None, 2048, batch_size=16)
            data, stats = prepare_features(target, prompts, SetRequest("train", args.max_new_tokens, turns=turns), how)
            trained = [data.tokens.trained_tokens(r) for r in range(len(data))]
            spans = [len(data.tokens.spans(r)) + 1 for r in range(len(data))]
            rows.append((turns, stats, trained, spans, time.perf_counter() - t0))
    print(f"{args.target}, {args.conversations} conversations of {args.turns} user turns, "
          f"max_new_tokens={args.max_new_tokens}")  # fmt: skip
    print(f"{'data.turns':<11}{'sequences':>10}{'tokens':>8}{'trained/conv':>14}{'(median)':>9}{'turns/conv':>11}"
          f"{'seconds':>9}")  # fmt: skip
    for turns, stats, trained, spans, seconds in rows:
        print(f"{turns:<11}{stats.sequences:>10}{stats.tokens:>8}{sum(trained) / len(trained):>14.1f}"
              f"{statistics.median(trained):>9.0f}{sum(spans) / len(spans):>11.2f}{seconds:>9.1f}")  # fmt: skip
    (_, _, before, _, _), (_, _, after, _, _) = rows
    print(f"assistant tokens trained: {sum(after) / max(sum(before), 1):.2f}x with turns=all")


if __name__ == "__main__":
    main()
