"""prompts -> regenerate -> capture, each stage cached once under a key that is a hash of everything that
determines it, so every trial with the same target and data shares it.

    <cache_dir>/regen/<key>/      token shards: input_ids, prompt_len, is_val, spans  (eaglelab.data.store)
    <cache_dir>/features/<key>/   state shards: aux, target_next, [final]

Prompts are sorted by length (little padding) and cut into shards of `shard_size`; each shard is regenerated,
captured and written on its own, renamed into place when whole. A killed preparation keeps its finished
shards and redoes at most the one in flight; an entry is usable once its complete.json exists. Entries are
prepared under a file lock, so concurrent trials prepare each once. Online and hybrid features stop after the
token shards (a few bytes per token instead of the states' kilobytes); hybrid training writes the state entry
itself in its first epoch (eaglelab.batches.HybridStates), and uses it at once when it already exists.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from eaglelab.config import STATES_ON_DISK
from eaglelab.data.capture import capture_batch
from eaglelab.data.prompts import Messages
from eaglelab.data.regenerate import (
    chat_turns,
    generate,
    generate_vllm,
    generate_vllm_turns,
    response_budget,
    stop_ids,
)
from eaglelab.data.render import render_prompts
from eaglelab.data.store import (
    Sequences,
    StateStore,
    StateWriter,
    TokenStore,
    damaged,
    entry_lock,
    is_complete,
    mark_complete,
    remove_entry,
    shard_lengths,
    shard_lock,
    shard_name,
    shards_done,
    state_bytes,
    state_shards_meta,
    write_token_shard,
)
from eaglelab.data.turns import (
    Conversation,
    regenerate_turns,
)
from eaglelab.errors import DataError, ResourceError
from eaglelab.io import file_lock
from eaglelab.limits import free_bytes, size_text
from eaglelab.targets import LOGITS_CHUNK

log = logging.getLogger(__name__)
# Bump when the stored layout or its meaning changes (4: sharded token and state stores; 5: per-sequence budgets,
# tails and stop ids).
CACHE_VERSION = 5
# Bytes on disk besides the values (eaglelab.data.store; measured on real shards): Arrow's framing of a sequence
# (its record batch's metadata and footer entry: ~400 bytes in a state shard), of a shard file, and vLLM's
# responses as JSON text while a regeneration runs (~6 characters per token id).
SEQUENCE_FRAMING, SHARD_FRAMING, JSON_BYTES_PER_TOKEN = 512, 4096, 7


@dataclass
class PrepareStats:
    prompts: int = 0
    skipped_too_long: int = 0
    sequences: int = 0
    tokens: int = 0
    response_tokens: int = 0
    regen_cached: bool = False
    capture_cached: bool = False
    shards: int = 0
    shards_regenerated: int = 0  # shards this call generated (a resumed preparation skips the finished ones)
    shards_captured: int = 0  # state shards this call captured apart from its regeneration
    seconds: dict = field(default_factory=dict)


def cache_key(**parts) -> str:
    """A hash of `parts` as `json.dumps(parts, sort_keys=True, default=str)` writes them, streamed: a list part
    (every prompt's token ids: ~7 characters a token) is written and hashed item by item, never as one string of
    the whole set. Token ids may be numpy arrays (written as their lists)."""
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
    if isinstance(value, list):  # (json's own separators: "[a, b]")
        digest.update(b"[")
        for i, item in enumerate(value):
            digest.update(f"{', ' if i else ''}{dumps(item)}".encode())
        digest.update(b"]")
    else:
        digest.update(dumps(value).encode())


def _jsonable(x):
    return x.tolist() if isinstance(x, np.ndarray) else str(x)


@dataclass(frozen=True)
class CaptureSettings:
    """How every prompt set of a run is regenerated and captured (the keyword arguments of `prepare_features`
    that all its prompt sets share)."""

    cache_dir: str
    aux_layer_ids: list[int]
    system_prompt: str | None
    max_length: int
    batch_size: int
    backend: str  # hf | vllm: who regenerates
    shard_size: int = 128
    capture_backend: str = "hf"  # hf | vllm: who captures the states (hf with an hf regeneration: in the same pass)
    tensor_parallel_size: int = 1  # the data engine's devices (vLLM), regeneration and capture alike
    pipeline_parallel_size: int = 1
    scratch_dir: str = "/tmp"  # node-local: vLLM's capture connector writes its per-request files there


def prepare_features(
    target,
    prompts: list[Messages],
    *,
    cache_dir: str | Path,
    name: str,
    aux_layer_ids: list[int],
    system_prompt: str | None,
    max_new_tokens: int,
    max_length: int,
    batch_size: int,
    shard_size: int = 128,
    is_val: list[bool] | None = None,
    capture_batch_size: int = 4,
    backend: str = "hf",
    capture_backend: str = "hf",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    scratch_dir: str | Path = "/tmp",
    render=None,
    features: str = "cached",
    with_final: bool = False,
    tail_tokens: int = 0,
    source: str = "",
    share: tuple[int, int] = (0, 1),
    turns: str = "last",
) -> tuple[Sequences, PrepareStats]:
    """Regenerated (and, for `features="cached"`, captured) sequences of `prompts`. `with_final` also stores the
    target's post-norm state (the KL loss's teacher; 25% more bytes with 3 aux layers). `render(tokenizer,
    messages) -> ids` replaces the native chat template (evaluation suites). `tail_tokens`: greedy tokens kept
    past each sequence's end, for simulated acceptance up to draft depth tail_tokens + 1
    (`eaglelab.acceptance.tail_tokens`). `source` names where the prompts came from (part of the cache key).
    `is_val` marks each prompt's sequence as validation (the store's `is_val` column). `share` = (rank, world):
    the ranks of a trial preparing the same set take their shares of its shards first (any process may take any
    shard: see `_take_shards`).

    Prompts that end with an assistant turn (`data.responses=original`) keep that turn as their response instead
    of a regenerated one: the target only captures its states over the source's text (EAGLE-1's fixed-data
    setting; the labels are still the target's greedy tokens, `target_next`). Such sequences have no tail.

    `turns="all"` (data.turns): a multi-turn conversation is answered turn by turn by the target (or keeps the
    source's turns, `original`) and every assistant turn is trained (eaglelab.data.turns: the store's `spans`);
    "last": its last answer only, the earlier turns context as the source wrote them."""
    cache_dir = Path(cache_dir).expanduser()
    states = features == "cached"
    stats = PrepareStats(prompts=len(prompts))
    limit = min(max_length, target.max_context)

    # 1. Prompts in the target's chat template (eaglelab.data.render); those that leave no room for a response are
    # skipped.
    rendered = render_prompts(target, prompts, is_val, system_prompt=system_prompt, render=render, turns=turns,
                              max_new_tokens=max_new_tokens, limit=limit, name=name)  # fmt: skip
    stats.skipped_too_long = rendered.skipped
    templated, is_val, originals, spans = rendered.templated, rendered.is_val, rendered.originals, rendered.spans
    conversations, multi, sizes, stops, turned = (
        rendered.conversations, rendered.multi, rendered.sizes, rendered.stops, rendered.turned
    )  # fmt: skip
    # Sorted by length (stable), then cut into shards: the store's row order.
    order = sorted(range(len(templated)), key=lambda i: sizes[i])
    shards = [order[s : s + shard_size] for s in range(0, len(order), shard_size)]
    stats.shards = len(shards)

    # 2-3. Regeneration by the target and capture of its states, each cached under its own key. A shard whose
    # tokens and states are both missing is done in one pass (states from the forward that generated them).
    # An entry that keeps more than this call asks for (longer tails, the final state) serves it too: the first
    # complete one of them is used instead of preparing another copy (eaglelab.data.stage.training_entry).
    tails = [tail_tokens] + [t for t in COVERING_TAILS if t > tail_tokens]
    regen_keys = cache_keys(
        "tail_tokens",
        tails,
        v=CACHE_VERSION,
        source=source,
        responses=originals or "regenerate",
        target=target.fingerprint,
        prompts=templated,
        is_val=is_val,
        max_new_tokens=max_new_tokens,
        limit=limit,
        batch_size=batch_size,
        shard_size=shard_size,
        backend=backend,
        stop_token_ids=stops,
        # (part of the key only where turns change the sequences: entries of one-turn prompts keep their keys)
        **({"turns": [c for c, m in zip(conversations, multi) if m]} if any(multi) else {}),
    )
    # (the capture backend is part of the key only when not HF's: entries made before it existed stay valid)
    # (hybrid's states are computed by the HF target in training, whatever captures a cached run's)
    captured_by = {"capture": capture_backend} if capture_backend != "hf" and states else {}
    feat_of = lambda regen, final: cache_key(  # noqa: E731
        v=CACHE_VERSION, regen=regen, aux=list(aux_layer_ids), final=final, **captured_by
    )
    asked = (tail_tokens, with_final)
    tail_tokens, regen_key, with_final = _covering_entry(
        cache_dir, tails, regen_keys, with_final, feat_of, features in STATES_ON_DISK
    )
    feat_key = feat_of(regen_key, with_final)
    if (tail_tokens, with_final) != asked:
        log.info("%s: the prepared entry with %d-token tails%s serves this run too", name, tail_tokens,
                 " and the final state" if with_final else "")  # fmt: skip
    parallel = {"tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size}
    regen_dir, feat_dir = cache_dir / "regen" / regen_key, cache_dir / "features" / feat_key
    per_token = state_bytes(len(aux_layer_ids), target.hidden_size, with_final)
    check_disk_space(
        cache_dir, name, sizes, shards, regen_dir, feat_dir,
        max_new_tokens=max_new_tokens + tail_tokens, limit=limit, backend=backend,
        # (hybrid writes them in its first epoch; a complete entry, e.g. one a hybrid run published: nothing to write)
        state_bytes=per_token if features in STATES_ON_DISK and not is_complete(feat_dir) else 0,
    )  # fmt: skip
    t0 = time.perf_counter()
    with contextlib.ExitStack() as locks:
        locks.enter_context(entry_lock(regen_dir))
        if states:
            locks.enter_context(entry_lock(feat_dir))
        for folder in (regen_dir, feat_dir) if states else (regen_dir,):
            if is_complete(folder) and (why := damaged(folder)):  # never read as data: prepared again
                log.warning("%s: cache entry %s is damaged (%s); preparing it again", name, folder, why)
                remove_entry(folder)
        stats.regen_cached = is_complete(regen_dir)
        stats.capture_cached = not states or is_complete(feat_dir)
    # Each shard is made by whichever process holds its lock (the ranks of this trial, other trials): the entry's
    # lock is held only to check it and to mark it complete, so no process waits for another's whole preparation.
    if not stats.regen_cached:
        fused = states and not stats.capture_cached and backend == capture_backend == "hf" and not originals
        fused = fused and turned is None  # (a multi-turn sequence's earlier answers are labelled by a second pass)
        most = [sum(min(sizes[j] + max_new_tokens + tail_tokens, limit) for j in shard) for shard in shards]
        stats.shards_regenerated = _take_shards(
            most, share, regen_dir,
            lambda todo: _regenerate(
                target, templated, is_val, shards, regen_dir, feat_dir if fused else None, aux_layer_ids, with_final,
                max_new_tokens=max_new_tokens, limit=limit, batch_size=batch_size, backend=backend,
                workdir=cache_dir / "logs" / f"regen-{regen_key}", name=name, tail_tokens=tail_tokens,
                originals=originals or None, spans=spans, conversations=turned, system_prompt=system_prompt,
                only=todo, parallel=parallel,
            ),
        )  # fmt: skip
        if share[1] > 1:
            made, rank = stats.shards_regenerated, share[0]
            log.info("%s: %d of %d shards regenerated by rank %d of %d", name, made, len(shards), rank, share[1])
        meta = {"name": name, "source": source, "target": target.fingerprint, "shards": len(shards)}
        meta["responses"] = "original" if originals else "regenerate"
        meta.update(stop_token_ids=stops, tail_tokens=tail_tokens)
        with entry_lock(regen_dir):
            if not is_complete(regen_dir):
                mark_complete(regen_dir, meta)
    t_regen = time.perf_counter() - t0
    if states and not is_complete(feat_dir):
        # New aux layers for an existing regeneration, a vLLM regeneration, or a fused pass cut short.
        tokens = TokenStore(regen_dir)
        if capture_backend == "vllm":
            workdir = cache_dir / "logs" / f"capture-{feat_key}"
            capture = lambda todo: _capture_vllm(  # noqa: E731
                target, tokens, shards, feat_dir, aux_layer_ids, with_final, name, todo, workdir=workdir,
                parallel=parallel, scratch_dir=Path(scratch_dir).expanduser(),
            )  # fmt: skip
        else:
            capture = lambda todo: _capture(  # noqa: E731
                target, tokens, shards, feat_dir, aux_layer_ids, with_final, capture_batch_size, name, only=todo
            )
        lengths = tokens.lengths()
        sizes_now = [int(lengths[rows].sum()) for _, rows in _shard_rows(shards)]
        stats.shards_captured = _take_shards(sizes_now, share, feat_dir, capture)
        meta = state_shards_meta(_shard_rows(shards), with_final, aux_layer_ids=list(aux_layer_ids), regen=regen_key)
        with entry_lock(feat_dir):
            if not is_complete(feat_dir):
                mark_complete(feat_dir, meta)
    elapsed = time.perf_counter() - t0
    stats.seconds = {"regenerate": t_regen, "capture": elapsed - t_regen}
    cached = states or (features == "hybrid" and is_complete(feat_dir))
    if cached and not states and (why := damaged(feat_dir)):  # a hybrid run's published states: its writers' entry
        raise DataError(f"{name}: cache entry {feat_dir} is damaged ({why}); remove that folder and run again")
    data = Sequences(
        TokenStore(regen_dir), StateStore(feat_dir) if cached else None, states_dir=feat_dir, keeps_final=with_final,
        tail_tokens=asked[0],  # (an entry with longer tails serves it: validation reads only what was asked)
    )  # fmt: skip
    lengths = data.tokens.lengths()
    stats.sequences = len(data)
    stats.tokens = int(lengths.sum())
    stats.response_tokens = sum(data.tokens.trained_tokens(r) for r in range(len(data.tokens)))  # every turn's
    return data, stats


# Tail lengths an entry may have been prepared with (eaglelab.acceptance.tail_tokens: powers of two from 8), looked
# for when a run asks for a shorter one.
COVERING_TAILS = (8, 16, 32, 64, 128, 256)


def _covering_entry(
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


def check_disk_space(
    cache_dir: Path, name: str, prompt_lengths: list[int], shards: list[list[int]], regen_dir: Path,
    feat_dir: Path, *, max_new_tokens: int, limit: int, backend: str, state_bytes: int,
) -> None:  # fmt: skip
    """Refuse, before any regeneration, a cache entry that cannot fit in the free space where it goes; say so when it
    may not. A sequence not yet regenerated holds at least its prompt and one token, at most min(prompt +
    max_new_tokens, limit) tokens; one regenerated already (its states still to capture) holds what its token shard
    says. A token shard stores 4 bytes per token (int32 ids), a state shard `state_bytes` per token (the aux states'
    and the final state's bf16 bits, the int32 label). Shards already on disk are not counted again."""
    tokens_done, states_done = shards_done(regen_dir), shards_done(feat_dir)
    need, states_need, least, sequences = 0, 0, 0, 0
    for i, shard in enumerate(shards):
        write_tokens, write_states = i not in tokens_done, state_bytes > 0 and i not in states_done
        if not (write_tokens or write_states):
            continue
        if write_tokens:
            tokens = sum(min(prompt_lengths[j] + max_new_tokens, limit) for j in shard)
            fewest = sum(min(prompt_lengths[j] + 1, limit) for j in shard)
        else:  # measured: the regenerated sequences' own lengths
            tokens = fewest = int(shard_lengths(regen_dir / shard_name(i)).sum())
        framing = len(shard) * SEQUENCE_FRAMING + SHARD_FRAMING
        responses_json = len(shard) * max_new_tokens * JSON_BYTES_PER_TOKEN if backend == "vllm" else 0
        sequences += len(shard)
        if write_tokens:
            need += tokens * 4 + framing + responses_json
            least += fewest * 4 + framing
        if write_states:
            states_need += tokens * state_bytes + framing
            least += fewest * state_bytes + framing
    free = free_bytes(cache_dir)
    if need + states_need <= free:
        return
    if least <= free:  # it fits if the responses stop early enough: a disk that fills up anyway is one clear line
        log.warning(
            "%s: caching this data needs %s to %s (responses that stop early to ones that use all of "
            "max_new_tokens) and %s has %s free: it may fill up", name, size_text(least), size_text(need + states_need),
            cache_dir, size_text(free),
        )  # fmt: skip
        return
    if name == "train":
        fix = "lower data.num_prompts or data.max_length"
        fix += f", or use features=online (token ids only: ~{size_text(need)})" if states_need else ""
    else:  # the held-out set and the suites' sets
        fix = "lower eval.num_prompts (or the suite's num_prompts)"
    per_token = f", {state_bytes} bytes of states per token" if states_need else ""
    raise ResourceError(
        f"caching the {name} data needs at least {size_text(least)} and up to {size_text(need + states_need)} "
        f"({sequences} sequences of at most {limit} tokens{per_token}) but {cache_dir} has {size_text(free)} free; "
        f"free space under paths.cache_dir, {fix}"
    )


# Shards one process takes in one go (one vLLM engine start; open locks stay well below ulimit), and at most this many
# tokens among them (at least one shard): an engine job's token ids are Python lists and JSON in both processes
# (~50 bytes a token), so its size is bounded by this, not by the shard size times the context length.
CLAIM_AT_ONCE, CLAIM_TOKENS = 64, 8_000_000


def _take_shards(sizes: list[int], share: tuple[int, int], folder: Path, make) -> int:
    """Shards 0..len(sizes)-1 of `folder`'s entry (`shard-NNNNN.arrow` each; `sizes`: their tokens, at most), made by
    whoever holds each shard's lock (`<cache>/locks/`), until every one is on disk or the entry is complete (another
    producer, e.g. a hybrid run, published it). This process claims, without waiting, up to CLAIM_AT_ONCE shards and
    CLAIM_TOKENS tokens that nobody holds from its own share (shards rank, rank + W, ... of `share` = (rank, W)) and
    `make`s them; with none of its own left, it takes what the others have not taken (a slow or missing rank's); when
    every missing shard is another's, it waits for one and makes it itself if that holder died without making it.
    -> shards this process made."""
    rank, world = share
    order = list(range(len(sizes)))
    lock = lambda i: shard_lock(folder, shard_name(i))  # noqa: E731
    done = lambda i: (folder / shard_name(i)).is_file()  # noqa: E731
    leases: dict = {}  # (lease locks: one per shard across the attempts below, so expired claims expire together)
    made = 0
    while not is_complete(folder) and (pending := [i for i in order if i not in shards_done(folder)]):
        with contextlib.ExitStack() as held:
            claimed = []
            # This process's own share; only when none of it is left to take, what the others have not taken yet.
            for group in ([i for i in pending if i % world == rank], [i for i in pending if i % world != rank]):
                for i in group:
                    if claimed and (
                        len(claimed) == CLAIM_AT_ONCE or sum(sizes[c] for c in claimed) + sizes[i] > CLAIM_TOKENS
                    ):
                        break
                    claim = file_lock(lock(i), wait=False, leases=leases)
                    if claim.__enter__() and not done(i):
                        held.push(claim.__exit__)
                        claimed.append(i)
                    else:  # another's, or made meanwhile: let go at once (a lock kept here would block this process)
                        claim.__exit__(None, None, None)
                if claimed:
                    break
            if not claimed and not done(pending[0]):  # every missing shard is another's: wait for the first
                held.enter_context(file_lock(lock(pending[0]), leases=leases))
                claimed = [] if done(pending[0]) else [pending[0]]
            if claimed:
                made += make(claimed)
    return made


def _shard_rows(shards: list[list[int]]) -> list[tuple[str, list[int]]]:
    """Each shard's file and store rows: shard i holds the rows after those of shards 0..i-1, in its order."""
    out, start = [], 0
    for i, shard in enumerate(shards):
        out.append((shard_name(i), list(range(start, start + len(shard)))))
        start += len(shard)
    return out


def _regenerate(
    target, templated, is_val, shards, regen_dir: Path, feat_dir: Path | None, aux_layer_ids, with_final, *,
    max_new_tokens, limit, batch_size, backend, workdir: Path, name: str, tail_tokens: int,
    originals: list[list[int]] | None = None, spans: list, conversations: list | None, system_prompt: str | None,
    only: list[int], parallel: dict,
) -> int:  # fmt: skip
    """The token shards `only` (not yet on disk; with `feat_dir`, their state shards from the same pass, too);
    `originals`: the sources' own responses, written as they are (`spans`: their earlier turns);
    `conversations`: multi-turn conversations, answered turn by turn (eaglelab.data.turns). -> shards generated."""
    todo = [i for i in only if i not in shards_done(regen_dir)]
    if len(todo) < len(shards) and shards_done(regen_dir):
        log.info("%s: %d of %d shards already regenerated, kept", name, len(shards_done(regen_dir)), len(shards))
    answered: dict[int, list[Conversation]] = {}  # per shard: its sequences, when made before the loop below
    if originals is not None:
        answered = {
            i: [Conversation(templated[j].tolist(), originals[j], [], spans[j], 0) for j in shards[i]] for i in todo
        }
    elif backend == "vllm" and conversations is not None:
        asked = {i: [conversations[j] for j in shards[i]] for i in todo}
        answered = generate_vllm_turns(target, asked, system_prompt, max_new_tokens, limit, workdir, tail_tokens,
                                       parallel)  # fmt: skip
    elif backend == "vllm":
        prompts = {i: [templated[j].tolist() for j in shards[i]] for i in todo}
        responses, _ = generate_vllm(target, prompts, max_new_tokens, limit, workdir, tail_tokens, parallel)
        answered = {i: [Conversation(p, *rt, [], 1) for p, rt in zip(prompts[i], responses[i])] for i in todo}
    bar = tqdm(desc=f"regenerate {name}", unit="tok", unit_scale=True, leave=False)
    have_states = shards_done(feat_dir) if feat_dir is not None else set()
    shard_rows = _shard_rows(shards)
    for i in todo:
        capture = feat_dir is not None and i not in have_states
        if backend == "hf" and conversations is not None and originals is None:  # turn by turn, in this process
            turns = _hf_turns(target, system_prompt, max_new_tokens, limit, batch_size, tail_tokens)
            answered[i] = regenerate_turns([conversations[j] for j in shards[i]], **turns)
        if i in answered:
            made = answered.pop(i)
            if lost := sum(max(c.rounds - 1 - len(c.spans), 0) for c in made):  # (eaglelab.data.turns.locate)
                log.warning("%s: %d earlier answers of shard %d are not where the chat template put them in the last "
                            "round's prompt (a template that renders earlier turns anew); they stay context, untrained",
                            name, lost, i)  # fmt: skip
            rows = [(c, None) for c in made]
        else:  # one turn each, by HF (its states captured in the same pass with `feat_dir`), streamed
            prompts = [templated[j].tolist() for j in shards[i]]
            layers = list(aux_layer_ids) if capture else None
            generated = generate(target, prompts, max_new_tokens, limit, batch_size, layers, tail_tokens)
            rows = _in_order(generated, prompts)
        first_row = shard_rows[i][1][0]  # the shard's first row in the store
        tokens = []
        with StateWriter(feat_dir / shard_name(i), with_final) if capture else contextlib.nullcontext() as writer:
            for k, (c, captured) in enumerate(rows):  # in the shard's (length) order
                budget = response_budget(len(c.prompt), max_new_tokens, limit)
                flat = [p for span in c.spans for p in span]
                tokens.append((c.prompt + c.response, len(c.prompt), is_val[shards[i][k]], budget, c.tail, flat))
                if writer is not None:
                    writer.write(first_row + k, captured["aux"], captured["target_next"], captured["final"])
                bar.update(len(c.prompt) + len(c.response))
        write_token_shard(regen_dir / shard_name(i), tokens)
        if backend == "vllm":  # its vLLM responses: now in the token shard
            (workdir / "shards" / f"{i}.json").unlink(missing_ok=True)
    bar.close()
    return len(todo)


def _in_order(generated, prompts: list[list[int]]):
    """HF's one-turn sequences and their states (eaglelab.data.regenerate.generate), checked to come in the shard's
    (length) order: its k-th is the store's row k of the shard."""
    for k, g in enumerate(generated):
        assert g.index == k, "rows come in the shard's order"
        yield Conversation(prompts[k], g.response, g.tail, [], 1), g.captured


def _hf_turns(target, system_prompt, max_new_tokens: int, limit: int, batch_size: int, tail_tokens: int) -> dict:
    """regenerate_turns' render, generate and decode, by the HF target in this process."""

    def answer(prompts):
        generated = generate(target, prompts, max_new_tokens, limit, batch_size, None, tail_tokens)
        return [(g.response, g.tail) for g in sorted(generated, key=lambda g: g.index)]

    return {"generate": answer, "limit": limit, **chat_turns(target.tokenizer, system_prompt, stop_ids(target))}


def _capture(
    target, tokens: TokenStore, shards, feat_dir: Path, aux_layer_ids, with_final, batch_size, name, only: list[int]
) -> int:
    """The state shards `only` not yet on disk, by one whole-sequence forward per batch of finished sequences."""
    todo = set(only) - shards_done(feat_dir)
    rows_of = _shard_rows(shards)
    total = sum(len(tokens.input_ids(r)) for i in todo for r in rows_of[i][1])
    bar = tqdm(total=total, desc=f"capture {name}", unit="tok", unit_scale=True, leave=False)
    for i, (file, rows) in enumerate(rows_of):
        if i not in todo:
            continue
        seqs = [tokens.input_ids(r).tolist() for r in rows]
        with StateWriter(feat_dir / file, with_final) as writer:
            for idx in _batches(list(range(len(rows))), [len(s) for s in seqs], batch_size):
                captured = capture_batch(
                    target, [seqs[j] for j in idx], aux_layer_ids, [tokens.trained_from(rows[j]) for j in idx]
                )
                for j, (aux, final, nxt) in zip(idx, captured):
                    writer.write(rows[j], aux, nxt, final)
                    bar.update(len(seqs[j]))
    bar.close()
    return len(todo)


def _capture_vllm(
    target, tokens: TokenStore, shards, feat_dir: Path, aux_layer_ids, with_final, name, only: list[int], *,
    workdir: Path, parallel: dict, scratch_dir: Path,
) -> int:  # fmt: skip
    """The state shards `only` not yet on disk, from a vLLM capture engine: one prefill of each finished sequence
    (prompt + response as one prompt), its states taken at the aux layers and the last layer
    (eaglelab.data.vllm_capture), written by the engine's process. The connector's per-request files go to
    `scratch_dir` (node-local), its job and log files to `workdir` (the cache's logs/, where an error names them)."""
    from eaglelab.vllm_engine import run_engine

    todo = sorted(set(only) - shards_done(feat_dir))
    if not todo:
        return 0
    rows_of = _shard_rows(shards)
    job_shards = {
        str(i): {
            "input_ids": [tokens.input_ids(r).tolist() for r in rows_of[i][1]],
            "rows": rows_of[i][1],
            "trained_from": [tokens.trained_from(r) for r in rows_of[i][1]],  # (labels from there on)
        }
        for i in todo
    }
    run_engine(
        {
            "mode": "capture",
            "target": str(target.path),
            "dtype": str(target.dtype).split(".")[-1],
            "num_layers": target.num_layers,
            "layer_ids": list(aux_layer_ids),
            "with_final": with_final,
            "storage": str(connector_dir(scratch_dir)),  # this process's engine's
            "shards": job_shards,
            "shard_paths": {str(i): str(feat_dir / rows_of[i][0]) for i in todo},
            "engines": len(todo),  # the progress bar counts shards
            # On a GPU the engine's process also holds the LM head and one chunk of logits (labels, vllm_capture)
            "beside_engine_bytes": (target.hidden_size + LOGITS_CHUNK) * target.vocab_size * target.dtype.itemsize,
            **parallel,
        },
        workdir / f"engine-{socket.gethostname()}-{os.getpid()}",  # its job and log files: this process's
        desc=f"capture {name} (vLLM)",
        module="eaglelab.data.vllm_capture",  # (its capture_job; vLLM is imported only in that process)
    )
    return len(todo)


def connector_dir(scratch_dir: Path, pid: int | None = None) -> Path:
    """The folder of one engine process's hidden-states connector files under the node-local `scratch_dir`."""
    return Path(scratch_dir) / f"eaglelab-connector-{socket.gethostname()}-{pid or os.getpid()}"


def _batches(order: list[int], lengths: list[int], batch_size: int, max_tokens: int = 8192):
    """Consecutive groups of `order` with at most `batch_size` sequences and `max_tokens` padded tokens
    (a batch of four 8k-token prompts would need ~3 GB of activations)."""
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) == batch_size or (len(batch) + 1) * max(lengths[j] for j in (*batch, i)) > max_tokens):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch
