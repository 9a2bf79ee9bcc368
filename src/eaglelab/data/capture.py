"""Capture the target's aux hidden states (vLLM's layer-id convention) with forward hooks.

vLLM's id k is "the residual stream after k decoder layers" = HF `output_hidden_states[k]`
(0 = embeddings). A hook on layer k-1's output (or on the embedding for k = 0) grabs exactly that
tensor without keeping all L+1 states alive. We also keep the target's post-norm last state (for the
KL loss, whose target distribution is lm_head of it restricted to the draft vocab) and its greedy
next token (the label; the fused path stores -1 inside the prompt, where no label is ever read).
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def aux_hooks(model, layer_ids: list[int]):
    """Yield a dict filled, on each forward, with {k: [B, T, H]} and {"final": [B, T, H]}."""
    grabbed: dict = {}
    inner = model.model
    handles = []

    def keep(key):
        def hook(_module, _inputs, output):
            grabbed[key] = output[0] if isinstance(output, tuple) else output
        return hook

    for k in layer_ids:
        module = inner.embed_tokens if k == 0 else inner.layers[k - 1]
        handles.append(module.register_forward_hook(keep(k)))
    handles.append(inner.norm.register_forward_hook(keep("final")))
    try:
        yield grabbed
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def capture_batch(target, sequences: list[list[int]], layer_ids: list[int]):
    """Right-padded forward of a batch; yields per sequence (aux [T, n·H], final [T, H], next [T])."""
    pad = target.tokenizer.pad_token_id
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
    with aux_hooks(target.model, layer_ids) as grabbed:
        logits = target.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    aux = torch.cat([grabbed[k] for k in layer_ids], dim=-1)  # [B, T, n·H]
    nxt = logits.argmax(-1)  # [B, T] the target's greedy token after each position
    for row, s in enumerate(sequences):
        n = len(s)
        yield aux[row, :n], grabbed["final"][row, :n], nxt[row, :n]
