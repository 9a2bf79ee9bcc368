"""The jobs a vLLM engine process runs, one typed class per kind: what the parent sends (as JSON) and the engine reads.

A job is checked when it is built, in the parent: an unknown or missing field, or a value of the wrong type, fails
there (TypeError, naming the field) instead of minutes later in an engine process on a GPU. Each kind names the
handler that runs it in the engine process (`handler`, "module:function"), beside its stage's own code; the one
entry point (`python -m eaglelab.engine JOB.json OUT.json`, eaglelab.engine.__main__) imports it by that name, so
this module, below every stage, imports none of them.

    kind             handler (module:function)                      the engine
    GenerateJob      eaglelab.data.regenerate:answer_prompts        answers prompts greedily, shard by shard
    ConversationJob  eaglelab.data.regenerate:answer_conversations  answers conversations turn by turn
    SelfChatJob      eaglelab.data.self_chat:sample_requests        samples the requests a user would ask
    CaptureJob       eaglelab.data.vllm_capture:capture_shards      captures states into state shards
    StreamJob        eaglelab.data.vllm_capture:stream_samples      captures states into a Mooncake store
    EvaluateJob      eaglelab.evaluate.in_vllm:evaluate             drafts (acceptance), then serves (speed)
"""

from __future__ import annotations

import dataclasses
import reprlib
import types
import typing
from dataclasses import asdict, dataclass, field
from typing import ClassVar

DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass(frozen=True, kw_only=True)
class EngineJob:
    """What every engine needs: the target, served at a dtype and a context length, over tensor x pipeline devices
    (vLLM's own workers). `gpu_memory_utilization`: the engine's share of its device (None: sized where it starts,
    eaglelab.core.devices.engine_placement); `enforce_eager` None: eager on a CPU, CUDA graphs on a GPU."""

    handler: ClassVar[str]
    target: str
    dtype: str
    max_model_len: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enforce_eager: bool | None = None
    gpu_memory_utilization: float | None = None

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _is(value, hints[f.name]):
                raise TypeError(f"{type(self).__name__}.{f.name}: {reprlib.repr(value)} is not {hints[f.name]}")
        if self.dtype not in DTYPES:
            raise TypeError(f"{type(self).__name__}.dtype: {self.dtype!r} is not one of {DTYPES}")
        if min(self.tensor_parallel_size, self.pipeline_parallel_size) < 1 or self.max_model_len < 0:
            raise TypeError(f"{type(self).__name__}: parallel sizes must be >= 1 and max_model_len >= 0")

    @property
    def devices(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def kv_requests(self) -> list[tuple[int, int]]:
        """(prompt tokens, tokens generated) of every request the job has in flight at once: a CPU engine's KV cache
        is sized from them (eaglelab.engine.llm.cpu_kv_cache_bytes)."""
        raise NotImplementedError

    def to_json(self) -> dict:
        return {"kind": type(self).__name__, **asdict(self)}

    @staticmethod
    def from_json(data: dict) -> EngineJob:
        fields = dict(data)
        kind = fields.pop("kind", None)
        if kind not in KINDS:
            raise TypeError(f"unknown engine job kind {kind!r}: one of {sorted(KINDS)}")
        return KINDS[kind](**fields)


def _is(value, hint) -> bool:
    """Whether `value` (as JSON holds it) is of the annotated type: the outer type, a dict's items', and a list's first
    item's (a capture job's lists hold millions of token ids: what one is, all are)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and (not args or all(_is(v, args[0]) for v in value[:1]))
    if origin is dict:
        return isinstance(value, dict) and all(_is(k, args[0]) and _is(v, args[1]) for k, v in value.items())
    if hint is typing.Any:
        return True
    return isinstance(value, origin or hint)


Ids = list[int]
# {prompts, max_tokens: one per prompt, or one for all}; a timed group may add its own concurrencies and waves
PromptGroup = dict[str, list[Ids] | Ids | int]


@dataclass(frozen=True, kw_only=True)
class GenerateJob(EngineJob):
    """Regenerate: each shard's prompts answered greedily within their budgets (`max_tokens`, per prompt), each
    response's `tail_tokens` greedy ids past its end kept besides; a shard's rows written to `shard_dir/<shard>.json`
    as soon as it is done."""

    handler: ClassVar[str] = "eaglelab.data.regenerate:answer_prompts"
    shards: dict[str, list[Ids]]
    max_tokens: dict[str, Ids]
    shard_dir: str
    stop_token_ids: Ids | None = None
    tail_tokens: int = 0

    def kv_requests(self):
        return [(len(p), b + self.tail_tokens) for s, ps in self.shards.items() for p, b in zip(ps, self.max_tokens[s])]


@dataclass(frozen=True, kw_only=True)
class ConversationJob(EngineJob):
    """Regenerate multi-turn conversations (`shards`: {shard: [messages]}): every assistant turn answered by the
    target in turn, after its own earlier answers (eaglelab.data.turns)."""

    handler: ClassVar[str] = "eaglelab.data.regenerate:answer_conversations"
    shards: dict[str, list[list[dict[str, typing.Any]]]]
    shard_dir: str
    stop_token_ids: Ids
    system_prompt: str | None
    max_new_tokens: int
    tail_tokens: int = 0

    def kv_requests(self):  # a conversation's prompt grows towards the window
        return [(self.max_model_len, 0) for conversations in self.shards.values() for _ in conversations]


@dataclass(frozen=True, kw_only=True)
class SelfChatJob(EngineJob):
    """Self-chat prompts: `batch_size` requests sampled after the template's user-turn `prefix`, one batch per seed
    (`batches`: {batch: seed}), each batch written to `folder` as it is done."""

    handler: ClassVar[str] = "eaglelab.data.self_chat:sample_requests"
    prefix: Ids
    stop_token_ids: Ids
    temperature: float
    top_p: float
    max_new_tokens: int
    batch_size: int
    batches: dict[str, int]
    folder: str

    def kv_requests(self):
        return [(len(self.prefix), self.max_new_tokens)] * self.batch_size


@dataclass(frozen=True, kw_only=True)
class CaptureJob(EngineJob):
    """Capture: the target's states at `layer_ids` (and its final state with `with_final`) over each shard's
    sequences (`shards`: {shard: {input_ids, rows, trained_from}}), written to `shard_paths`; `storage`: the hidden-
    states connector's folder. `max_model_len` 0: the longest sequence's."""

    handler: ClassVar[str] = "eaglelab.data.vllm_capture:capture_shards"
    layer_ids: Ids
    with_final: bool
    storage: str
    shards: dict[str, dict[str, list[Ids] | Ids]]
    shard_paths: dict[str, str]
    num_layers: int | None = None
    max_model_len: int = 0

    def kv_requests(self):
        return [(len(s), 1) for shard in self.shards.values() for s in shard["input_ids"]]


@dataclass(frozen=True, kw_only=True)
class StreamJob(EngineJob):
    """Streamed states: the samples of a stream's plan (`plan`, a .npy of token-store rows; `tokens`, that store)
    captured and put into the Mooncake store at `address` under the stream's `name`, at most `window` ahead of its
    readers; `attempt`: the engine's restarts so far (its raw objects' names)."""

    handler: ClassVar[str] = "eaglelab.data.vllm_capture:stream_samples"
    layer_ids: Ids
    with_final: bool
    tokens: str
    plan: str
    name: str
    address: dict[str, typing.Any]
    window: int
    stall_s: float
    num_layers: int | None = None
    attempt: int = 0
    max_model_len: int = 0

    def kv_requests(self):  # sized by its capture engine from the sequences it holds (eaglelab.data.vllm_capture)
        return []


@dataclass(frozen=True, kw_only=True)
class EvaluateJob(EngineJob):
    """Evaluate in vLLM: one engine per depth in `ks` drafting with `drafter` over each prompt group (`groups`:
    {name: {prompts, max_tokens}}), greedy, then at each sampled `temperatures`; vLLM's counters per group. With
    `along_vllm` ({layer_ids, scratch_dir, folder}), the states along vLLM's greedy outputs are captured after (their
    `with_tails`: k greedy ids past each end). Served speed besides, when `throughput_ks` and `concurrencies` are
    both set: vLLM's OpenAI server without and with the drafter at each, over `timed_groups` (None: `groups`),
    `waves` waves of c requests, `repeats` passes, sampled at `temperature`, logs in `log_dir`."""

    handler: ClassVar[str] = "eaglelab.evaluate.in_vllm:evaluate"
    drafter: str
    ks: Ids
    groups: dict[str, PromptGroup]
    stop_token_ids: Ids | None = None
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    with_tails: bool = False
    along_vllm: dict[str, typing.Any] | None = None
    throughput_ks: Ids = field(default_factory=list)
    concurrencies: Ids = field(default_factory=list)
    timed_groups: dict[str, PromptGroup] | None = None
    waves: int = 1
    repeats: int = 1
    temperature: float = 0.0
    log_dir: str | None = None

    @property
    def served(self) -> bool:
        return bool(self.throughput_ks and self.concurrencies)

    def kv_requests(self):
        return [(len(p), b) for g in self.groups.values() for p, b in zip(g["prompts"], budgets(g))]


def request_budgets(max_tokens, n: int) -> list[int]:
    """Per-prompt budgets: one for all, or each sequence's own (the budget it was regenerated with)."""
    return list(max_tokens) if isinstance(max_tokens, list) else [max_tokens] * n


def budgets(group: dict) -> list[int]:
    """A prompt group's budgets, one per prompt."""
    return request_budgets(group["max_tokens"], len(group["prompts"]))


KINDS = {k.__name__: k for k in (GenerateJob, ConversationJob, SelfChatJob, CaptureJob, StreamJob, EvaluateJob)}
