"""Long-context prompts from real text that ships with Python: standard-library source files.

Prompt i at every length is a prefix of the same text (so lengths differ only in how much context comes before the
request), wrapped as a chat turn with a question or continuation request at the end, in the target's native
template. The text is module MODULES[i]'s source; where a length needs more than that module holds (~3k-20k tokens),
the source of further standard-library modules follows, each after a `# file: NAME.py` line, in a fixed order (the
other MODULES, then every public top-level module of the standard library by name): 655k SmolLM2 tokens in all on
Python 3.11, so a 128k-window target is tested to its window. None of these modules feed the training prompts
(STDLIB_MODULES).
"""

from __future__ import annotations

import sysconfig
from functools import cache
from pathlib import Path

from eaglelab.core.errors import DataError
from eaglelab.data.prompts import STDLIB_MODULES, Messages

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


def stdlib_folder() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_source(name: str) -> str:
    """The source file of standard-library module `name`, read from the standard library's folder (not through
    the import system, which would skip frozen modules by how Python was started, or find a same-named file)."""
    path = stdlib_folder() / f"{name}.py"
    if not path.is_file():
        raise DataError(f"standard-library module {name} has no Python source on this machine ({path})")
    return path.read_text(encoding="utf-8")


@cache
def further_modules() -> tuple[str, ...]:
    """The top-level modules of this Python's standard library that may follow a prompt's own module, by name:
    public ones, none that training prompts come from."""
    stdlib = stdlib_folder()
    excluded = set(MODULES) | set(STDLIB_MODULES)
    return tuple(p.stem for p in sorted(stdlib.glob("*.py")) if not p.stem.startswith("_") and p.stem not in excluded)


def _chain(i: int):
    """(name, source) of prompt i's text, in order: MODULES[i] (which must be there: the prompt names it), the other
    MODULES after it, then further_modules()."""
    yield MODULES[i], module_source(MODULES[i])
    for name in (*MODULES[i + 1 :], *MODULES[:i], *further_modules()):
        try:
            yield name, module_source(name)
        except (DataError, UnicodeDecodeError):  # (a module without readable source here: the next one)
            continue


def _messages(name: str, source: str, request: str, several: bool) -> Messages:
    what = (
        f"Python modules of the standard library, `{name}` first and then others, each after a `# file:` line"
        if several
        else f"the Python module `{name}`"
    )
    return [{"role": "user", "content": f"Here is the beginning of {what}:\n\n```python\n{source}\n```\n\n{request}"}]


def _source_ids(tokenizer, i: int, budget: int) -> tuple[list[int], bool]:
    """At least `budget` token ids of prompt i's text (or all of it), and whether it took more than one module."""
    ids: list[int] = []
    for n, (name, source) in enumerate(_chain(i)):
        text = source if n == 0 else f"\n\n# file: {name}.py\n{source}"
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= budget:
            return ids, n > 0
    return ids, True


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
        overhead = len(render(tokenizer, _messages(name, "", request, several=False)))
        if length - overhead < 16:
            raise DataError(
                f"long-context length {length} leaves no room for text after the template "
                f"({overhead} tokens); use lengths >= {overhead + 16}"
            )
        ids, several = _source_ids(tokenizer, i, length - overhead)
        if several:  # (the wording that names several modules is longer: less room for text)
            overhead = len(render(tokenizer, _messages(name, "", request, several=True)))
        budget = length - overhead
        if budget > len(ids):
            raise DataError(
                f"the standard library here has only {len(ids)} tokens of source to build a {length}-token prompt "
                "from; lower the longest eval.suites.long_context.lengths"
            )
        for _ in range(4):  # decode/re-encode can shift the count by a few tokens: converge on `length`
            messages = _messages(name, tokenizer.decode(ids[:budget]), request, several)
            excess = len(render(tokenizer, messages)) - length
            if excess <= 0:
                break
            budget -= excess
        out.append(messages)
    return out
