"""Who makes which shard of an entry, and whether it fits: the shard locks any process may take (a trial's ranks,
other trials, a Slurm array's tasks), the rows each shard holds, the disk check before any engine starts, and the
capture's padded batches."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from eaglelab.core.errors import ResourceError
from eaglelab.core.io import file_lock, free_bytes, size_text
from eaglelab.data.cache_entry import Entry
from eaglelab.data.store import is_complete, shard_lengths, shard_lock, shard_name, shards_done

log = logging.getLogger(__name__)
# Bytes on disk besides the values (eaglelab.data.store; measured on real shards): Arrow's framing of a sequence
# (its record batch's metadata and footer entry: ~400 bytes in a state shard), of a shard file, and vLLM's
# responses as JSON text while a regeneration runs (~6 characters per token id).
SEQUENCE_FRAMING, SHARD_FRAMING, JSON_BYTES_PER_TOKEN = 512, 4096, 7


def check_disk_space(entry: Entry, prompt_lengths: list[int], backend: str, state_bytes: int) -> None:
    """Refuse, before any regeneration, a cache entry that cannot fit in the free space where it goes; say so when it
    may not. A sequence not yet regenerated holds at least its prompt and one token, at most min(prompt +
    max_new_tokens + tail, limit) tokens; one regenerated already (its states still to capture) holds what its token
    shard says. A token shard stores 4 bytes per token (int32 ids), a state shard `state_bytes` per token (the aux
    states' and the final state's bf16 bits, the int32 label; 0: no states to write). Shards already on disk are not
    counted again."""
    cache_dir, name, shards, limit = entry.cache_dir, entry.name, entry.shards, entry.limit
    regen_dir, max_new_tokens = entry.regen_dir, entry.max_new_tokens + entry.tail_tokens
    tokens_done, states_done = shards_done(regen_dir), shards_done(entry.feat_dir)
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


def take_shards(sizes: list[int], share: tuple[int, int], folder: Path, make) -> int:
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


def shard_rows(shards: list[list[int]]) -> list[tuple[str, list[int]]]:
    """Each shard's file and store rows: shard i holds the rows after those of shards 0..i-1, in its order."""
    out, start = [], 0
    for i, shard in enumerate(shards):
        out.append((shard_name(i), list(range(start, start + len(shard)))))
        start += len(shard)
    return out


def batches(order: list[int], lengths: list[int], batch_size: int, max_tokens: int = 8192):
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
