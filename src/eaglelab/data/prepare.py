"""prompts -> regenerate -> capture, each stage cached once (Arrow, via `datasets`) under a key that is
a hash of everything that determines it, so every trial with the same target and data shares it.

    <cache_dir>/regen/<key>/data.arrow      prompt_ids, response_ids, is_val
    <cache_dir>/features/<key>/data.arrow   input_ids, prompt_len, is_val, aux, final, target_next

Entries are written to a temporary folder and renamed into place (never half-visible) under a file
lock, so concurrent trials prepare each entry once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import torch
from tqdm.auto import tqdm

from eaglelab.data.capture import capture_batch
from eaglelab.data.prompts import Messages, is_validation
from eaglelab.data.regenerate import generate, generate_vllm
from eaglelab.data.templates import template_prompt
from eaglelab.errors import DataError
from eaglelab.io import atomic_dir, atomic_write_json, file_lock

log = logging.getLogger(__name__)
CACHE_VERSION = 3  # bump when the stored layout or its meaning changes (3: SDPA capture, labels from P-1)


@dataclass
class PrepareStats:
    prompts: int = 0
    skipped_too_long: int = 0
    sequences: int = 0
    tokens: int = 0
    response_tokens: int = 0
    regen_cached: bool = False
    capture_cached: bool = False
    seconds: dict = field(default_factory=dict)


def cache_key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    """bf16 values stored losslessly as uint16 bits (Arrow has no bf16; fp16 overflows: SmolLM2's
    residual stream reaches ~2e4 on sink tokens)."""
    return x.to(torch.bfloat16).contiguous().view(torch.uint16).numpy()


def from_bits(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a).astype(np.uint16)).view(torch.bfloat16)


def _write(path: Path, features: datasets.Features, rows, meta: dict) -> None:
    from datasets.arrow_writer import ArrowWriter

    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # we hold the entry's lock: a killed writer's leftover
        shutil.rmtree(stale, ignore_errors=True)
    with atomic_dir(path) as tmp:
        with ArrowWriter(features=features, path=str(tmp / "data.arrow")) as writer:
            for row in rows:
                writer.write(row)
            writer.finalize()
        atomic_write_json(tmp / "meta.json", meta)


def _load(path: Path) -> datasets.Dataset:
    return datasets.Dataset.from_file(str(path / "data.arrow"))


@dataclass(frozen=True)
class CaptureSettings:
    """How every prompt set of a run is regenerated and captured (the keyword arguments of `prepare_features`
    that all its prompt sets share)."""

    cache_dir: str
    aux_layer_ids: list[int]
    system_prompt: str | None
    max_length: int
    batch_size: int
    backend: str  # hf | vllm


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
    val_fraction: float = 0.0,
    capture_batch_size: int = 4,
    backend: str = "hf",
    render=None,
) -> tuple[datasets.Dataset, PrepareStats]:
    """`render(tokenizer, messages) -> ids` replaces the native chat template (evaluation suites)."""
    cache_dir = Path(cache_dir).expanduser()
    stats = PrepareStats(prompts=len(prompts))
    limit = min(max_length, target.max_context)

    # 1. Prompts in the target's chat template; those that leave no room for a response are skipped.
    templated, is_val = [], []
    for messages in prompts:
        ids = (
            render(target.tokenizer, messages) if render else template_prompt(target.tokenizer, messages, system_prompt)
        )
        if len(ids) + 8 > limit:
            stats.skipped_too_long += 1
            continue
        templated.append(ids)
        is_val.append(is_validation(messages, val_fraction))
    if stats.skipped_too_long:
        log.warning(
            "%s: skipped %d of %d prompts longer than the context (%d tokens)",
            name,
            stats.skipped_too_long,
            len(prompts),
            limit,
        )
    if not templated:
        raise DataError(
            f"{name}: the dataset is empty after filtering ({len(prompts)} prompts, "
            f"{stats.skipped_too_long} longer than {limit} tokens); raise data.max_length "
            "or give more/shorter prompts"
        )

    # 2-3. Regeneration by the target and capture of its states, each cached under its own key. When
    # neither entry exists, one pass does both (states come from the forward that generated them).
    regen_key = cache_key(
        v=CACHE_VERSION,
        target=target.fingerprint,
        prompts=templated,
        is_val=is_val,
        max_new_tokens=max_new_tokens,
        limit=limit,
        batch_size=batch_size,
        backend=backend,
    )
    feat_key = cache_key(v=CACHE_VERSION, regen=regen_key, aux=list(aux_layer_ids))
    regen_dir, feat_dir = cache_dir / "regen" / regen_key, cache_dir / "features" / feat_key
    H = target.hidden_size
    regen_features = datasets.Features(
        {
            "prompt_ids": datasets.Sequence(datasets.Value("int32")),
            "response_ids": datasets.Sequence(datasets.Value("int32")),
            "is_val": datasets.Value("bool"),
        }
    )
    capture_features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "prompt_len": datasets.Value("int32"),
            "is_val": datasets.Value("bool"),
            "aux": datasets.Array2D((None, H * len(aux_layer_ids)), "uint16"),
            "final": datasets.Array2D((None, H), "uint16"),
            "target_next": datasets.Sequence(datasets.Value("int32")),
        }
    )
    feat_meta = {"name": name, "regen": regen_key, "aux_layer_ids": list(aux_layer_ids)}
    t0 = time.perf_counter()
    with (
        file_lock(cache_dir / "locks" / f"regen-{regen_key}.lock"),
        file_lock(cache_dir / "locks" / f"features-{feat_key}.lock"),
    ):
        stats.regen_cached = (regen_dir / "data.arrow").exists()
        stats.capture_cached = (feat_dir / "data.arrow").exists()
        if not stats.regen_cached and backend == "vllm":  # vLLM generates; a capture pass follows
            responses, _ = generate_vllm(
                target, templated, max_new_tokens, limit, cache_dir / "logs" / f"regen-{regen_key}"
            )
            _write(
                regen_dir,
                regen_features,
                ({"prompt_ids": p, "response_ids": r, "is_val": v} for p, r, v in zip(templated, responses, is_val)),
                {"name": name, "target": target.fingerprint, "n": len(templated), "backend": backend},
            )
            stats.seconds["regenerate"] = time.perf_counter() - t0
        if not stats.regen_cached and backend == "hf":
            rows = list(
                generate(
                    target,
                    templated,
                    max_new_tokens,
                    limit,
                    batch_size,
                    capture_layers=None if stats.capture_cached else list(aux_layer_ids),
                    desc=f"regenerate+capture {name}",
                )
            )
            _write(
                regen_dir,
                regen_features,
                ({"prompt_ids": templated[i], "response_ids": resp, "is_val": is_val[i]} for i, resp, _ in rows),
                {"name": name, "target": target.fingerprint, "n": len(templated)},
            )
            if not stats.capture_cached:
                _write(
                    feat_dir,
                    capture_features,
                    (_feature_row(templated[i] + resp, len(templated[i]), is_val[i], cap) for i, resp, cap in rows),
                    feat_meta,
                )
            del rows
        if not stats.capture_cached and not (feat_dir / "data.arrow").exists():
            # New aux layers for an existing regeneration, or vLLM's regeneration: a capture pass.
            _write(
                feat_dir,
                capture_features,
                _capture_rows(target, _load(regen_dir), aux_layer_ids, capture_batch_size, name),
                feat_meta,
            )
    # A fused pass counts as "regenerate" (capture inside it); a separate capture pass as "capture".
    elapsed = time.perf_counter() - t0
    if backend == "vllm" and not stats.regen_cached:
        stats.seconds["capture"] = elapsed - stats.seconds["regenerate"]
    else:
        stats.seconds = {
            "regenerate": 0.0 if stats.regen_cached else elapsed,
            "capture": elapsed if stats.regen_cached else 0.0,
        }
    regen = _load(regen_dir)
    features = _load(feat_dir)
    stats.sequences = len(features)
    lengths = [len(p) + len(r) for p, r in zip(regen["prompt_ids"], regen["response_ids"])]
    stats.tokens = int(sum(lengths))
    stats.response_tokens = int(sum(len(r) for r in regen["response_ids"]))
    return features, stats


def _capture_rows(target, regen: datasets.Dataset, aux_layer_ids, batch_size: int, name: str):
    seqs = [p + r for p, r in zip(regen["prompt_ids"], regen["response_ids"])]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths: little padding
    prompt_lens = [len(p) for p in regen["prompt_ids"]]
    is_val = regen["is_val"]
    bar = tqdm(total=sum(len(s) for s in seqs), desc=f"capture {name}", unit="tok", leave=False)
    for idx in _batches(order, [len(s) for s in seqs], batch_size):
        captured = capture_batch(target, [seqs[i] for i in idx], aux_layer_ids, [prompt_lens[i] for i in idx])
        for i, (aux, final, nxt) in zip(idx, captured):
            yield _feature_row(seqs[i], prompt_lens[i], is_val[i], {"aux": aux, "final": final, "target_next": nxt})
            bar.update(len(seqs[i]))
    bar.close()


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


def _feature_row(input_ids: list[int], prompt_len: int, is_val: bool, captured: dict) -> dict:
    assert len(captured["aux"]) == len(input_ids), "captured states must cover every position"
    return {
        "input_ids": input_ids,
        "prompt_len": prompt_len,
        "is_val": is_val,
        "aux": bf16_bits(captured["aux"]),
        "final": bf16_bits(captured["final"]),
        "target_next": captured["target_next"].tolist(),
    }
