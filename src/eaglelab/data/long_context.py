"""Long-context prompts from real text that ships with Python: standard-library source files.

Prompt i at every length is a prefix of the same module (so lengths differ only in how much context
comes before the request), wrapped as a chat turn with a question or continuation request at the
end, in the target's native template. None of these modules feed the training prompts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from eaglelab.data.prompts import Messages
from eaglelab.errors import DataError

# Long (>= 50 kB) pure-Python modules; none is in eaglelab.data.prompts.STDLIB_MODULES.
MODULES = [
    "argparse",
    "subprocess",
    "configparser",
    "threading",
    "dataclasses",
    "optparse",
    "enum",
    "pickle",
    "mailbox",
    "smtplib",
    "ftplib",
    "imaplib",
]
REQUESTS = [
    "Continue the code above from where it stops.",
    "Explain what the code above does, one short paragraph per class or function.",
    "Summarize the module above in five bullet points.",
    "Write two unit tests for the last function defined above.",
]


def module_source(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise DataError(f"standard-library module {name} has no Python source on this machine")
    return Path(spec.origin).read_text(encoding="utf-8")


def _messages(name: str, source: str, request: str) -> Messages:
    return [
        {
            "role": "user",
            "content": f"Here is the beginning of the Python module `{name}`:\n\n```python\n{source}\n```\n\n{request}",
        }
    ]


def long_context_prompts(tokenizer, render, length: int, num_prompts: int) -> list[Messages]:
    """`num_prompts` conversations whose rendered prompt is `length` tokens (within a few)."""
    if num_prompts > len(MODULES):
        raise DataError(
            f"eval.suites.long_context.num_prompts={num_prompts}: at most {len(MODULES)} "
            "distinct source modules are available"
        )
    out = []
    for i, name in enumerate(MODULES[:num_prompts]):
        request = REQUESTS[i % len(REQUESTS)]
        ids = tokenizer(module_source(name), add_special_tokens=False)["input_ids"]
        overhead = len(render(tokenizer, _messages(name, "", request)))
        budget = length - overhead
        if budget < 16:
            raise DataError(
                f"long-context length {length} leaves no room for text after the template "
                f"({overhead} tokens); use lengths >= {overhead + 16}"
            )
        if budget > len(ids):
            raise DataError(
                f"module {name} has only {len(ids)} tokens of source; lower the longest "
                "eval.suites.long_context.lengths"
            )
        for _ in range(4):  # decode/re-encode can shift the count by a few tokens: converge on `length`
            messages = _messages(name, tokenizer.decode(ids[:budget]), request)
            excess = len(render(tokenizer, messages)) - length
            if excess <= 0:
                break
            budget -= excess
        out.append(messages)
    return out
