"""Which cache entry a prompt set is read from or prepared into: what a run asks of a set (`SetRequest`), how
every set of the run is regenerated and captured (`CaptureSettings`), and the keys those hash to (`Entry`).

    <cache_dir>/regen/<regen_key>/     token shards (eaglelab.data.store)
    <cache_dir>/features/<feat_key>/   state shards

A key is a hash of everything that determines its entry, so every trial with the same target and data shares
it. An entry that keeps more than a request asks for (longer tails, the final state) serves it too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eaglelab.core.config import STATES_ON_DISK
from eaglelab.data.store import is_complete

# Bump when the stored layout or its meaning changes (4: sharded token and state stores; 5: per-sequence budgets,
# tails and stop ids).
CACHE_VERSION = 5
# Tail lengths an entry may have been prepared with (eaglelab.models.acceptance.tail_tokens: powers of two from 8),
# looked for when a run asks for a shorter one.
COVERING_TAILS = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class CaptureSettings:
    """How every prompt set of a run is regenerated and captured (training, held-out, the suites')."""

    cache_dir: str | Path
    aux_layer_ids: list[int]
    system_prompt: str | None
    max_length: int
    batch_size: int  # sequences per regeneration batch
    backend: str = "hf"  # hf | vllm: who regenerates
    shard_size: int = 128
    capture_backend: str = "hf"  # hf | vllm: who captures the states (hf with an hf regeneration: in the same pass)
    capture_batch_size: int = 4  # sequences per whole-sequence capture forward (HF)
    tensor_parallel_size: int = 1  # the data engine's devices (vLLM), regeneration and capture alike
    pipeline_parallel_size: int = 1
    scratch_dir: str | Path = "/tmp"  # node-local: vLLM's capture connector writes its per-request files there

    @property
    def parallel(self) -> dict:
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
        }


@dataclass(frozen=True)
class SetRequest:
    """One prompt set as a run asks for it: its name, its responses' length, and what its entry must keep."""

    name: str  # train | eval | <suite>-<condition>: in logs, errors and the entry's meta
    max_new_tokens: int
    source: str = ""  # where the prompts came from (part of the key)
    is_val: list[bool] | None = None  # per prompt: a validation prompt (the store's is_val column)
    render: object = None  # render(tokenizer, messages) -> ids instead of the native template (evaluation suites)
    features: str = "cached"  # cached: states captured into the cache; online | hybrid | stream: token ids only
    with_final: bool = False  # also the target's post-norm state (the KL loss's teacher; +25% with 3 aux layers)
    tail_tokens: int = 0  # greedy tokens kept past each end: simulated acceptance up to depth tail_tokens + 1
    share: tuple[int, int] = (0, 1)  # (rank, world) of the processes preparing this set: each takes its shards first
    turns: str = "last"  # data.turns: all = every assistant turn of a multi-turn conversation is trained


@dataclass(frozen=True)
class Entry:
    """The token and state entries of one prompt set, and the shards they are cut into."""

    name: str
    source: str  # where its prompts came from (the request's)
    cache_dir: Path
    regen_key: str
    feat_key: str
    shards: list[list[int]]  # rendered prompt indices per shard: the store's row order (sorted by length)
    max_new_tokens: int
    limit: int  # the longest a sequence may be: min(max_length, the target's window)
    tail_tokens: int  # what the entry keeps (at least what was asked)
    with_final: bool  # the entry keeps the final state (asked for, or kept anyway)
    asked_tail: int  # what the request asked for: validation reads only this much
    states: bool  # its states are captured into the cache now (features=cached)

    @property
    def regen_dir(self) -> Path:
        return self.cache_dir / "regen" / self.regen_key

    @property
    def feat_dir(self) -> Path:
        return self.cache_dir / "features" / self.feat_key

    def logs(self, job: str) -> Path:
        """Where an engine job of this entry keeps its job and log files (an error names them)."""
        key = self.regen_key if job == "regen" else self.feat_key
        return self.cache_dir / "logs" / f"{job}-{key}"


def plan_entry(target, rendered, request: SetRequest, how: CaptureSettings, limit: int) -> Entry:
    """The entry `rendered` (eaglelab.data.render.Rendered) is read from or prepared into. Prompts are sorted by
    length (stable), then cut into shards of `how.shard_size`. The first complete entry that keeps at least what
    `request` asks for is used instead of preparing another copy (eaglelab.data.stage.training_entry)."""
    order = sorted(range(len(rendered.templated)), key=lambda i: rendered.sizes[i])
    shards = [order[s : s + how.shard_size] for s in range(0, len(order), how.shard_size)]
    tails = [request.tail_tokens] + [t for t in COVERING_TAILS if t > request.tail_tokens]
    multi = rendered.multi
    regen_keys = cache_keys(
        "tail_tokens",
        tails,
        v=CACHE_VERSION,
        source=request.source,
        responses=rendered.originals or "regenerate",
        target=target.fingerprint,
        prompts=rendered.templated,
        is_val=rendered.is_val,
        max_new_tokens=request.max_new_tokens,
        limit=limit,
        batch_size=how.batch_size,
        shard_size=how.shard_size,
        backend=how.backend,
        stop_token_ids=rendered.stops,
        # (part of the key only where turns change the sequences: entries of one-turn prompts keep their keys)
        **({"turns": rendered.conversations_where(multi)} if any(multi) else {}),
    )
    states = request.features == "cached"
    # (the capture backend is part of the key only when not HF's: entries made before it existed stay valid)
    # (hybrid's states are computed by the HF target in training, whatever captures a cached run's)
    captured_by = {"capture": how.capture_backend} if how.capture_backend != "hf" and states else {}
    feat_of = lambda regen, final: cache_key(  # noqa: E731
        v=CACHE_VERSION, regen=regen, aux=list(how.aux_layer_ids), final=final, **captured_by
    )
    cache_dir = Path(how.cache_dir).expanduser()
    on_disk = request.features in STATES_ON_DISK
    tail, regen_key, final = _covering(cache_dir, tails, regen_keys, request.with_final, feat_of, on_disk)
    return Entry(request.name, request.source, cache_dir, regen_key, feat_of(regen_key, final), shards,
                 request.max_new_tokens, limit, tail, final, request.tail_tokens, states)  # fmt: skip


def _covering(
    cache_dir: Path, tails: list[int], regen_keys: list[str], with_final: bool, feat_of, states: bool
) -> tuple[int, str, bool]:
    """(tails, regen key, with_final) of the entry to read or prepare for a request of `tails[0]` and `with_final`:
    the first complete entry that holds at least that (its states complete too when `states`), else the first
    whose tokens are complete (only states to capture), else the one asked for. `regen_keys[i]`: tails[i]'s key."""
    complete = lambda kind, key: is_complete(cache_dir / kind / key)  # noqa: E731
    for tail, key in zip(tails, regen_keys):
        for final in [True] if with_final else [False, True]:
            if complete("regen", key) and (not states or complete("features", feat_of(key, final))):
                return tail, key, final
    for tail, key in zip(tails, regen_keys):
        if complete("regen", key):
            return tail, key, with_final
    return tails[0], regen_keys[0], with_final


def cache_key(**parts) -> str:
    """A hash of `parts` as `json.dumps(parts, sort_keys=True, default=str)` writes them, streamed: a list part
    (every prompt's token ids: ~7 characters a token), or any sequence (conversations read from their source), is
    written and hashed item by item, never as one string of the whole set. Token ids may be numpy arrays (written as
    their lists)."""
    return cache_keys("", [None], **parts)[0]


def cache_keys(vary: str, values: list, **parts) -> list[str]:
    """`cache_key(**parts, vary=value)` for each of `values` (`vary=""`: of `parts` alone), the parts that come before
    `vary` in key order (the prompts among them) hashed once."""
    names = sorted([*parts, vary] if vary else parts)
    at = names.index(vary) if vary else len(names)
    head = hashlib.sha256()
    for n, name in enumerate(names[:at]):
        _hash_part(head, n, name, parts[name])
    keys = []
    for value in values:
        digest = head.copy()
        for n, name in enumerate(names[at:], start=at):
            _hash_part(digest, n, name, value if name == vary else parts[name])
        digest.update(b"}")
        keys.append(digest.hexdigest()[:20])
    return keys


def _hash_part(digest, n: int, name: str, value) -> None:
    dumps = lambda x: json.dumps(x, sort_keys=True, default=_jsonable)  # noqa: E731
    digest.update(f"{', ' if n else '{'}{dumps(name)}: ".encode())
    if isinstance(value, Sequence) and not isinstance(value, str):  # (a list, or one read item by item; "[a, b]")
        digest.update(b"[")
        for i, item in enumerate(value):
            digest.update(f"{', ' if i else ''}{dumps(item)}".encode())
        digest.update(b"]")
    else:
        digest.update(dumps(value).encode())


def _jsonable(x):
    return x.tolist() if isinstance(x, np.ndarray) else str(x)
