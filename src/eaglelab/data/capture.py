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
def capture_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int], first):
    """One right-padded whole-sequence forward of the frozen target, on whatever device it lives:
    -> aux [B, T, n·H] (the aux layers' states, concatenated in `layer_ids` order), final [B, T, H]
    (post-norm), target_next [B, T] (greedy next token from position first[b] = P-1 on; -1 before it,
    where no label is ever read, and at padding). Cached capture and online features both call this."""
    with aux_hooks(model, layer_ids) as grabbed, sdpa_attention(model):
        final = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    aux = torch.cat([grabbed[k] for k in layer_ids], dim=-1)  # [B, T, n·H]
    pos = torch.arange(input_ids.shape[1], device=input_ids.device)
    labelled = (pos >= first[:, None]) & attention_mask.bool()  # [B, T]
    # lm_head only where a label is read: it is ~20% of a SmolLM2 forward, and prompts are most tokens.
    nxt = torch.full(input_ids.shape, -1, dtype=torch.long, device=input_ids.device)
    nxt[labelled] = model.get_output_embeddings()(final[labelled]).argmax(-1)
    return aux, final, nxt


def padded(sequences: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and attention mask [B, T] on `device`."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long, device="cpu")  # filled on the host
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = torch.as_tensor(s, device="cpu")
        mask[row, : len(s)] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def capture_batch(target, sequences: list[list[int]], layer_ids: list[int], trained_from: list[int]):
    """Capture of a batch of finished sequences; yields per sequence (aux [T, n·H], final [T, H], next [T]: labels
    from position trained_from - 1 on, the sequence's first assistant token's), on the CPU (where the cache writer
    needs them)."""
    device = next(target.model.parameters()).device
    ids, mask = padded(sequences, target.tokenizer.pad_token_id, device)
    first = torch.tensor(trained_from, device=device) - 1
    aux, final, nxt = capture_states(target.model, ids, mask, layer_ids, first)
    for row, s in enumerate(sequences):
        n = len(s)
        yield aux[row, :n].cpu(), final[row, :n].cpu(), nxt[row, :n].cpu()
