"""The TTT loss over the draft vocabulary, without holding the logits.

A draft step's loss reads the drafter's distribution q = softmax(lm_head(h)) over the draft vocabulary V_d at each
labelled position. Written plainly, autograd keeps [N, V_d] float32 log-probabilities per step (and KL the
teacher's [N, V_d] distribution beside them): at long context that, not the model, is what a step holds. Here the
rows go through the head in chunks and each chunk's gradient is taken on the spot, since the loss is a sum over
rows whose gradient has a closed form. With y_r the target distribution of row r (CE: one-hot on the target's
greedy token; KL: the teacher's softmax) and w_r its weight (CE: 0 for a token outside the draft vocabulary):

    loss       = Σ_r w_r · ( Σ_v y_rv·log y_rv  -  Σ_v y_rv·log q_rv )        (CE: the first term is 0)
    ∂loss/∂z_r = w_r · (q_r - y_r)                                            (z = h Wᵀ, the logits; Σ_v y_rv = 1)
    ∂loss/∂h   = (∂loss/∂z) W,        ∂loss/∂W = (∂loss/∂z)ᵀ h

So the step keeps [N, H] and [V_d, H] (the sizes of its input and of the head) instead of [N, V_d], and no matmul is
run twice (a checkpointed loss would run the head again in the backward pass). Where that keeps more, not less
(fewer rows than about the hidden size: `chunks_cost_more`), the plain expression is used; without gradients, chunks
always. The numbers are those of the plain expression: logits in the autocast dtype, softmax in float32, gradients
cast back to the logits' dtype before their matmuls, as autograd does (tests/test_training.py compares both, forward
and backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows per chunk: a chunk's float32 [rows, V_d] tensors (logits, q, y, the gradient) stay near 4 × 64 MB.
CHUNK_ELEMENTS = 1 << 24


def chunk_rows(draft_vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // draft_vocab_size)


class _DraftHeadLoss(torch.autograd.Function):
    """(hidden [N, H], weight [V_d, H], index [N] | None, teacher_states [N, H_t] | None, teacher_head [V_d, H_t] |
    None, rows, with_grad) -> (loss summed over rows [], argmax of the logits [N]). `index`: CE's draft-vocabulary
    index of each row's label (-1: outside the vocabulary, weight 0); else KL from softmax(teacher_states ·
    teacher_headᵀ)."""

    @staticmethod
    def forward(ctx, hidden, weight, index, teacher_states, teacher_head, rows, with_grad):
        grad_hidden = torch.empty_like(hidden) if with_grad and ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if with_grad and ctx.needs_input_grad[1] else None
        total = hidden.new_zeros((), dtype=torch.float32)
        argmax = []
        for start in range(0, hidden.shape[0], rows):
            part = slice(start, start + rows)
            h = hidden[part]
            teacher = teacher_states[part] if teacher_states is not None else None
            summed, logq, y, dtype = _rows_loss(
                h, weight, index[part] if index is not None else None, teacher, teacher_head
            )
            total += summed
            argmax.append(logq.argmax(-1))
            if grad_hidden is None and grad_weight is None:
                continue
            g = logq.exp_()  # [n, V_d] q, in place over what is no longer read; then q - y
            if index is not None:  # y one-hot on the label; a label outside the draft vocabulary weighs 0
                label = index[part].clamp(min=0)[:, None]
                g = g.scatter_add_(-1, label, torch.full_like(label, -1, dtype=g.dtype)) * (index[part] >= 0)[:, None]
            else:
                g -= y
            g = g.to(dtype)  # as autograd hands lm_head's backward its output's dtype
            if grad_hidden is not None:
                grad_hidden[part] = (g @ weight.to(g.dtype)).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (g.T @ h.to(g.dtype)).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        argmax = torch.cat(argmax) if argmax else hidden.new_zeros(0, dtype=torch.long)
        ctx.mark_non_differentiable(argmax)
        return total, argmax

    @staticmethod
    def backward(ctx, grad_total, _grad_argmax):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_total.to(grad_hidden.dtype) if grad_hidden is not None else None,
            (grad_weight * grad_total).to(ctx.weight_dtype) if grad_weight is not None else None,
            None, None, None, None, None,
        )  # fmt: skip


def draft_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    index: torch.Tensor | None = None,
    teacher_states: torch.Tensor | None = None,
    teacher_head: torch.Tensor | None = None,
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft step's summed loss over its labelled rows and each row's draft (argmax, a draft-vocabulary index).
    hidden: [N, H] the rows' norm(o); weight: [V_d, H] lm_head's. CE: `index` [N], the label's draft-vocabulary
    index (-1 outside it). KL: `teacher_states` [N, H_t] (the target's post-norm state one token later) and
    `teacher_head` [V_d, H_t]. `rows`: rows per chunk (default: `chunk_rows`)."""
    if (index is None) == (teacher_states is None):
        raise ValueError("draft_head_loss takes either index (CE) or teacher_states and teacher_head (KL)")
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    N, H, V = hidden.shape[0], hidden.shape[1], weight.shape[0]
    if with_grad and rows is None and chunks_cost_more(N, V, H, kl=index is None):
        return _plain(hidden, weight, index, teacher_states, teacher_head)
    return _DraftHeadLoss.apply(
        hidden, weight, index, teacher_states, teacher_head, rows or chunk_rows(weight.shape[0]), with_grad
    )


def chunks_cost_more(rows: int, draft_vocab_size: int, hidden_size: int, kl: bool) -> bool:
    """Whether taking the gradient in the forward pass would keep more than autograd does: it keeps [rows, H] and the
    head's [V_d, H] gradient per step; autograd keeps [rows, V_d] log-probabilities (and KL's teacher distribution).
    With few rows (short sequences under a large head: an 8B drafter's 32k × 4,096 head at T = 2,048) the plain
    expression holds less."""
    return rows * draft_vocab_size * (2 if kl else 1) <= (rows + draft_vocab_size) * hidden_size


def _rows_loss(hidden, weight, index, teacher_states, teacher_head):
    """The summed loss of some rows -> (loss [], log q [n, V_d] float32, y [n, V_d] (KL; None for CE), the logits'
    dtype). CE: y one-hot on the label, a label outside the draft vocabulary (-1) weighs 0; KL: y the teacher's
    distribution over the draft vocabulary."""
    logits = F.linear(hidden, weight)  # [n, V_d], in the autocast dtype where one is active
    logq = F.log_softmax(logits.float(), dim=-1)
    if index is not None:
        return -(logq.gather(-1, index.clamp(min=0)[:, None])[:, 0] * (index >= 0)).sum(), logq, None, logits.dtype
    y = F.softmax((teacher_states.to(teacher_head.dtype) @ teacher_head.T).float(), dim=-1)
    return (y * (torch.log(y.clamp_min(1e-20)) - logq)).sum(), logq, y, logits.dtype


def _plain(hidden, weight, index, teacher_states, teacher_head) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss as autograd differentiates it (what the chunks compute, held whole)."""
    total, logq, _, _ = _rows_loss(hidden, weight, index, teacher_states, teacher_head)
    return total, logq.argmax(-1).detach()
