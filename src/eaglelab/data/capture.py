"""Capture the target's aux hidden states (vLLM's layer-id convention) with forward hooks.

vLLM's id k is "the residual stream after k decoder layers" = HF `output_hidden_states[k]`
(0 = embeddings). A hook on layer k-1's output (or on the embedding for k = 0) grabs exactly that
tensor without keeping all L+1 states alive. We also keep the target's post-norm last state (for the
KL loss, whose target distribution is lm_head of it restricted to the draft vocab) and its greedy
next token (the label; -1 inside the prompt, where no label is ever read).
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


@contextlib.contextmanager
def sdpa_attention(model):
    """Whole-sequence forwards run SDPA (2-3x eager at 2k tokens on CPU, more at 8k: no T x T score
    tensor per layer); the target otherwise keeps eager attention, faster for batched decoding here."""
    before = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@torch.no_grad()
def capture_batch(target, sequences: list[list[int]], layer_ids: list[int], prompt_lens: list[int]):
    """Right-padded forward of a batch; yields per sequence (aux [T, n·H], final [T, H], next [T])."""
    pad = target.tokenizer.pad_token_id
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
    with aux_hooks(target.model, layer_ids) as grabbed, sdpa_attention(target.model):
        final = target.model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    aux = torch.cat([grabbed[k] for k in layer_ids], dim=-1)  # [B, T, n·H]
    head = target.model.get_output_embeddings()
    for row, s in enumerate(sequences):
        n, first = len(s), prompt_lens[row] - 1
        # Labels only from the last prompt position on (-1 before, as in the fused path): lm_head is
        # ~20% of a SmolLM2 forward and prompts are most of the tokens (all but ~1% at long context).
        nxt = torch.full((n,), -1, dtype=torch.long)
        nxt[first:] = head(final[row, first:n]).argmax(-1)
        yield aux[row, :n], final[row, :n], nxt
