"""General-chat prompts the target writes itself (Magpie, Xu et al. 2024): no hub, no data set.

Given only its chat template up to where a user's text begins (the *user-turn prefix*), an instruction-tuned
model continues with something a user would type: sampled, that is a stream of varied requests in the
target's own notion of conversation. Each candidate ends where the target closes the user turn (a stop id);
candidates that run out of tokens, are too short or too long, or repeat an earlier one are dropped.

Candidates are generated in seeded batches and cached as they come (`<cache_dir>/prompts/self_chat/<key>/`,
one JSONL file per batch, renamed into place when whole), so asking for more prompts later extends the same
stream and a killed generation keeps its finished batches. The key holds everything that decides the text:
the target, the prefix, the sampling settings and the seed (and the sampler: HF's `generate` here, or a vLLM engine
in its own process where vLLM regenerates, `sample_requests`: then the target's weights never load in this process, as
the data stage's other engines keep them out of it). Filtering runs on read.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eaglelab.core.config import SelfChatSettings
from eaglelab.core.errors import DataError
from eaglelab.core.io import atomic_write_text, file_lock
from eaglelab.data.cache_entry import cache_key
from eaglelab.data.prompts import Messages
from eaglelab.data.regenerate import stop_ids
from eaglelab.engine.jobs import SelfChatJob
from eaglelab.engine.llm import make_engine
from eaglelab.engine.process import progress, run_engine

log = logging.getLogger("eaglelab")

_SENTINEL = "\u2063EAGLELAB_USER_TEXT\u2063"  # an invisible separator: no template writes it


SELF_CHAT_VERSION = 1  # bump when generation or filtering changes meaning
SAMPLES_PER_SEED = 4096  # vLLM's seeds of a batch's samples: batch seed × this + i (data.self_chat.batch_size at most)


def user_turn_prefix(tokenizer, system_prompt: str | None) -> list[int]:
    """The chat template rendered up to the first character of a user's text (system turn included)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("data source self_chat needs a target with a chat template; remove self_chat from data.sources")
    messages = [{"role": "user", "content": _SENTINEL}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    prefix = text[: text.index(_SENTINEL)]
    return list(tokenizer(prefix, add_special_tokens=False)["input_ids"])


def _normalized(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def keep(candidates: list[dict], count: int, settings: SelfChatSettings) -> list[str]:
    """The first `count` candidates that closed their turn, have a sensible length and are new: exact repeats
    and near-repeats (same first 48 normalized characters, how a sampled stream usually repeats) are dropped."""
    out, seen = [], set()
    for c in candidates:
        text = c["text"].strip()
        if not c["closed"] or not settings.min_chars <= len(text) <= settings.max_chars or len(text.split()) < 3:
            continue
        norm = _normalized(text)
        if not norm or norm in seen or norm[:48] in seen:
            continue
        seen.update((norm, norm[:48]))
        out.append(text)
        if len(out) == count:
            break
    return out


@torch.no_grad()
def _sample_batch(target, prefix: list[int], stops: set[int], settings: SelfChatSettings, seed: int) -> list[dict]:
    """One batch of candidates from the same prefix: the rows differ only by their sampled tokens."""
    model = target.model
    device = next(model.parameters()).device
    ids = torch.tensor([prefix] * settings.batch_size, device=device)
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        torch.manual_seed(seed)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=0,
            max_new_tokens=settings.max_new_tokens,
            eos_token_id=sorted(stops),
            pad_token_id=sorted(stops)[0],
        )
    rows = []
    for row in out[:, len(prefix) :].tolist():
        end = next((i for i, t in enumerate(row) if t in stops), None)
        text = target.tokenizer.decode(row if end is None else row[:end], skip_special_tokens=True)
        rows.append({"text": text, "closed": end is not None})
    return rows


def _batch_path(folder: Path, b: int) -> Path:
    return folder / f"batch-{b:05d}.jsonl"


def _write_batch(folder: Path, b: int, rows: list[dict]) -> None:
    """Batch b's candidates, one JSON object a line, renamed into place when whole."""
    atomic_write_text(_batch_path(folder, b), "".join(json.dumps(r) + "\n" for r in rows))


def _sample_with_vllm(target, prefix: list[int], stops: set[int], settings: SelfChatSettings, engine: dict,
                      folder: Path, batches: dict[int, int], workdir: Path) -> None:  # fmt: skip
    """Batches {b: seed} sampled by a vLLM engine in its own process (`sample_requests`), each written to `folder` as
    `batch-<b>.jsonl` as it finishes."""
    job = SelfChatJob(
        target=str(target.path),
        dtype=str(target.dtype).split(".")[-1],
        max_model_len=len(prefix) + settings.max_new_tokens + 1,
        prefix=prefix,
        stop_token_ids=sorted(stops),
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_new_tokens=settings.max_new_tokens,
        batch_size=settings.batch_size,
        batches={str(b): s for b, s in batches.items()},
        folder=str(folder),
        **engine,  # tensor_parallel_size, pipeline_parallel_size
    )
    run_engine(job, workdir, desc="self_chat (vLLM)", engines=len(batches), unit="batch")


def sample_requests(job: SelfChatJob) -> dict:
    """In the engine's process: each batch is `batch_size` samples from the user-turn prefix, seeded with its own
    seed (a batch's text does not depend on which others share its engine), a candidate closed where the target
    ended its turn (a stop id)."""
    from vllm import SamplingParams

    llm = make_engine(job)
    for b, seed in job.batches.items():
        # A request per sample, each seeded (batch_size <= SAMPLES_PER_SEED: batch b's seeds never meet batch b + 1's):
        # one request of n samples draws the same n for every seed (vLLM 0.32)
        params = [SamplingParams(temperature=job.temperature, top_p=job.top_p, seed=seed * SAMPLES_PER_SEED + i,
                                 max_tokens=job.max_new_tokens, stop_token_ids=job.stop_token_ids)
                  for i in range(job.batch_size)]  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": job.prefix}] * len(params), params, use_tqdm=False)
        rows = [{"text": o.outputs[0].text, "closed": o.outputs[0].finish_reason == "stop"} for o in outs]
        _write_batch(Path(job.folder), int(b), rows)
        progress(f"batch {b}")
    return {}


def self_chat_prompts(
    target,
    count: int,
    *,
    cache_dir: str | Path,
    system_prompt: str | None,
    seed: int,
    settings: SelfChatSettings | None = None,
    engine: dict | None = None,
) -> list[Messages]:
    """`count` distinct user requests the target wrote, as single-turn conversations (fewer, with a warning, if
    the target keeps repeating itself). `engine`: sampled by a vLLM engine with these settings (its
    tensor_parallel_size, pipeline_parallel_size) instead of the HF model in this process."""

    settings = settings or SelfChatSettings()
    prefix = user_turn_prefix(target.tokenizer, system_prompt)
    stops = stop_ids(target)
    sampler = {"sampler": "vllm"} if engine is not None else {}  # (HF's streams keep their keys)
    key = cache_key(source="self_chat", v=SELF_CHAT_VERSION, target=target.fingerprint, prefix=prefix,
                    stops=sorted(stops), seed=seed, settings=asdict(settings), **sampler)  # fmt: skip
    folder = Path(cache_dir).expanduser() / "prompts" / "self_chat" / key
    folder.mkdir(parents=True, exist_ok=True)
    candidates: list[dict] = []
    # Duplicates grow as the stream goes on; past this many batches the target has little new to say.
    max_batches = 4 + 4 * -(-count // settings.batch_size)
    bar = None
    # Under the entry's lock: concurrent trials and the processes of a DDP run write each batch once, the others
    # wait and read it.
    with file_lock(Path(cache_dir).expanduser() / "locks" / f"self_chat-{key}.lock"):
        for b in range(max_batches):
            kept = len(keep(candidates, count, settings))
            if bar is not None:
                bar.n = min(kept, count)
                bar.refresh()
            if kept >= count:
                break
            if b >= 2 and kept * max_batches < count * b:  # at this rate the stream cannot make `count`: stop early
                break
            path = _batch_path(folder, b)
            if not path.exists():
                if bar is None:
                    bar = tqdm(
                        total=count, initial=min(kept, count), desc="self_chat prompts", unit="prompt", leave=False
                    )
                if engine is None:
                    _write_batch(folder, b, _sample_batch(target, prefix, stops, settings, seed=seed * 1_000_003 + b))
                else:  # one engine start for the batches this stream likely still needs (each seeded as here)
                    rate = kept / b if b else settings.batch_size / 2
                    more = min(max_batches - b, 1 + math.ceil(1.25 * (count - kept) / max(rate, 1.0)))
                    _sample_with_vllm(target, prefix, stops, settings, engine, folder,
                                      {b + i: seed * 1_000_003 + b + i for i in range(more)},
                                      Path(cache_dir).expanduser() / "logs" / f"self_chat-{key}")  # fmt: skip
            candidates += [json.loads(line) for line in path.read_text().splitlines()]
    if bar is not None:
        bar.close()
    texts = keep(candidates, count, settings)
    if len(texts) < count:
        log.warning(
            "self_chat: the target wrote %d distinct requests in %d candidates, %d were asked for",
            len(texts),
            len(candidates),
            count,
        )
    return [[{"role": "user", "content": t}] for t in texts]
