"""The engine jobs of the data stage: the target answers a set's prompts (regenerate) and its states are taken
(capture), one claimed group of shards at a time (eaglelab.data.shard_claims.take_shards), each shard written whole.

Who answers: HF in this process (one turn each, streamed, its states captured in the same forward when asked; or
turn by turn), a vLLM engine in its own process (eaglelab.data.regenerate), or nobody (the sources' own answers,
`data.responses=original`). Who captures: one HF forward per batch of finished sequences, or a vLLM capture engine
that prefills them (eaglelab.data.vllm_capture, its connector's files under the node-local scratch folder).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path

from tqdm.auto import tqdm

from eaglelab.data.cache_entry import CaptureSettings, Entry
from eaglelab.data.capture import capture_batch
from eaglelab.data.regenerate import (
    chat_turns,
    generate,
    generate_vllm,
    generate_vllm_turns,
    response_budget,
    stop_ids,
)
from eaglelab.data.shard_claims import batches, shard_rows
from eaglelab.data.store import StateWriter, TokenStore, shard_name, shards_done, write_token_shard
from eaglelab.data.targets import LOGITS_CHUNK
from eaglelab.data.turns import Conversation, regenerate_turns
from eaglelab.engine.jobs import CaptureJob
from eaglelab.engine.process import run_engine

log = logging.getLogger(__name__)


def regenerate_shards(target, rendered, entry: Entry, how: CaptureSettings, only: list[int], fused: bool) -> int:
    """The token shards `only` of `entry` not yet on disk, from `rendered` (eaglelab.data.render.Rendered); with
    `fused`, their state shards from the same HF pass too. -> shards generated."""
    done = shards_done(entry.regen_dir)
    todo = [i for i in only if i not in done]
    if len(todo) < len(entry.shards) and done:
        log.info("%s: %d of %d shards already regenerated, kept", entry.name, len(done), len(entry.shards))
    answered = _answered_before(target, rendered, entry, how, todo)  # shard -> its conversations, answered
    have_states = shards_done(entry.feat_dir) if fused else set()
    rows_of = shard_rows(entry.shards)
    bar = tqdm(desc=f"regenerate {entry.name}", unit="tok", unit_scale=True, leave=False)
    for i in todo:
        shard, first_row = entry.shards[i], rows_of[i][1][0]  # its prompts; its first row in the store
        capture = fused and i not in have_states
        if how.backend == "hf" and rendered.turned is not None:  # turn by turn, in this process
            answered[i] = regenerate_turns([rendered.turned[j] for j in shard], **_hf_turns(target, entry, how))
        if i in answered:
            rows = [(c, None) for c in _located(answered.pop(i), entry.name, i)]
        else:  # one turn each, by HF (its states captured in the same pass with `capture`), streamed
            prompts = [rendered.templated[j].tolist() for j in shard]
            layers = list(how.aux_layer_ids) if capture else None
            generated = generate(target, prompts, entry.max_new_tokens, entry.limit, how.batch_size, layers,
                                 entry.tail_tokens)  # fmt: skip
            rows = _in_order(generated, prompts)
        tokens = []
        writer = StateWriter(entry.feat_dir / shard_name(i), entry.with_final) if capture else None
        with writer or contextlib.nullcontext():
            for k, (c, captured) in enumerate(rows):  # in the shard's (length) order
                budget = response_budget(len(c.prompt), entry.max_new_tokens, entry.limit)
                flat = [p for span in c.spans for p in span]
                tokens.append((c.prompt + c.response, len(c.prompt), rendered.is_val[shard[k]], budget, c.tail, flat))
                if writer is not None:
                    writer.write(first_row + k, captured["aux"], captured["target_next"], captured["final"])
                bar.update(len(c.prompt) + len(c.response))
        write_token_shard(entry.regen_dir / shard_name(i), tokens)
        if how.backend == "vllm":  # its vLLM responses: now in the token shard
            (entry.logs("regen") / "shards" / f"{i}.json").unlink(missing_ok=True)
    bar.close()
    return len(todo)


def _answered_before(target, rendered, entry: Entry, how: CaptureSettings, todo: list[int]) -> dict:
    """The shards of `todo` whose conversations are answered before the loop over shards: the sources' own answers
    (`spans`: their earlier turns), or a vLLM engine's for every shard at once (turn by turn for multi-turn
    conversations, eaglelab.data.turns). -> shard -> [Conversation]; {} when HF answers shard by shard."""
    templated, shards = rendered.templated, entry.shards
    if rendered.originals:
        return {
            i: [Conversation(templated[j].tolist(), rendered.originals[j], [], rendered.spans[j], 0) for j in shards[i]]
            for i in todo
        }
    if how.backend != "vllm":
        return {}
    budget = (how.system_prompt, entry.max_new_tokens, entry.limit, entry.logs("regen"), entry.tail_tokens)
    if rendered.turned is not None:
        asked = {i: [rendered.turned[j] for j in shards[i]] for i in todo}
        return generate_vllm_turns(target, asked, *budget, how.parallel)
    prompts = {i: [templated[j].tolist() for j in shards[i]] for i in todo}
    responses, _ = generate_vllm(target, prompts, *budget[1:], how.parallel)
    return {i: [Conversation(p, *rt, [], 1) for p, rt in zip(prompts[i], responses[i])] for i in todo}


def _located(made: list[Conversation], name: str, shard: int) -> list[Conversation]:
    """`made`, warned about when earlier answers were not found where the template put them (eaglelab.data.turns)."""
    if lost := sum(max(c.rounds - 1 - len(c.spans), 0) for c in made):
        log.warning("%s: %d earlier answers of shard %d are not where the chat template put them in the last round's "
                    "prompt (a template that renders earlier turns anew); they stay context, untrained",
                    name, lost, shard)  # fmt: skip
    return made


def _in_order(generated, prompts: list[list[int]]):
    """HF's one-turn sequences and their states (eaglelab.data.regenerate.generate), checked to come in the shard's
    (length) order: its k-th is the store's row k of the shard."""
    for k, g in enumerate(generated):
        assert g.index == k, "rows come in the shard's order"
        yield Conversation(prompts[k], g.response, g.tail, [], 1), g.captured


def _hf_turns(target, entry: Entry, how: CaptureSettings) -> dict:
    """regenerate_turns' render, generate and decode, by the HF target in this process."""

    def answer(prompts):
        generated = generate(
            target, prompts, entry.max_new_tokens, entry.limit, how.batch_size, None, entry.tail_tokens
        )
        return [(g.response, g.tail) for g in sorted(generated, key=lambda g: g.index)]

    turns = chat_turns(target.tokenizer, how.system_prompt, stop_ids(target))
    return {"generate": answer, "limit": entry.limit, **turns}


def capture_shards(target, entry: Entry, how: CaptureSettings, only: list[int]) -> int:
    """The state shards `only` of `entry` not yet on disk, by one whole-sequence HF forward per batch of finished
    sequences. -> shards captured."""
    tokens = TokenStore(entry.regen_dir)
    todo = set(only) - shards_done(entry.feat_dir)
    rows_of = shard_rows(entry.shards)
    total = sum(len(tokens.input_ids(r)) for i in todo for r in rows_of[i][1])
    bar = tqdm(total=total, desc=f"capture {entry.name}", unit="tok", unit_scale=True, leave=False)
    for i, (file, rows) in enumerate(rows_of):
        if i not in todo:
            continue
        seqs = [tokens.input_ids(r).tolist() for r in rows]
        with StateWriter(entry.feat_dir / file, entry.with_final) as writer:
            for idx in batches(list(range(len(rows))), [len(s) for s in seqs], how.capture_batch_size):
                captured = capture_batch(
                    target, [seqs[j] for j in idx], how.aux_layer_ids, [tokens.trained_from(rows[j]) for j in idx]
                )
                for j, (aux, final, nxt) in zip(idx, captured):
                    writer.write(rows[j], aux, nxt, final)
                    bar.update(len(seqs[j]))
    bar.close()
    return len(todo)


def capture_shards_vllm(target, entry: Entry, how: CaptureSettings, only: list[int]) -> int:
    """The state shards `only` of `entry` not yet on disk, from a vLLM capture engine: one prefill of each finished
    sequence (prompt + response as one prompt), its states taken at the aux layers and the last layer
    (eaglelab.data.vllm_capture), written by the engine's process. The connector's per-request files go to the
    node-local scratch folder, its job and log files to the cache's logs/ (where an error names them)."""
    todo = sorted(set(only) - shards_done(entry.feat_dir))
    if not todo:
        return 0
    tokens, rows_of = TokenStore(entry.regen_dir), shard_rows(entry.shards)
    job_shards = {
        str(i): {
            "input_ids": [tokens.input_ids(r).tolist() for r in rows_of[i][1]],
            "rows": rows_of[i][1],
            "trained_from": [tokens.trained_from(r) for r in rows_of[i][1]],  # (labels from there on)
        }
        for i in todo
    }
    job = CaptureJob(
        target=str(target.path),
        dtype=str(target.dtype).split(".")[-1],
        num_layers=target.num_layers,
        layer_ids=list(how.aux_layer_ids),
        with_final=entry.with_final,
        storage=str(connector_dir(Path(how.scratch_dir).expanduser())),  # this process's engine's
        shards=job_shards,
        shard_paths={str(i): str(entry.feat_dir / rows_of[i][0]) for i in todo},
        **how.parallel,
    )
    run_engine(
        job,
        entry.logs("capture") / f"engine-{socket.gethostname()}-{os.getpid()}",  # its job and log files: this process's
        desc=f"capture {entry.name} (vLLM)",
        engines=len(todo),  # the progress bar counts shards
        # On a GPU the engine's process also holds the LM head and one chunk of logits (labels, vllm_capture)
        beside_engine_bytes=(target.hidden_size + LOGITS_CHUNK) * target.vocab_size * target.dtype.itemsize,
    )
    return len(todo)


def connector_dir(scratch_dir: Path, pid: int | None = None) -> Path:
    """The folder of one engine process's hidden-states connector files under the node-local `scratch_dir`."""
    return Path(scratch_dir) / f"eaglelab-connector-{socket.gethostname()}-{pid or os.getpid()}"
