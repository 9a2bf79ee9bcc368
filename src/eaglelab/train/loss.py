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
run twice (a checkpointed loss would run the head again in the backward pass). Off the matmuls the work is
memory-bound, so a chunk's is done in one float32 buffer, in place: the logits, shifted by their maximum (which
also gives the drafts), exponentiated, summed, then turned into the gradient, with no host wait. Where chunks keep
more, not less (fewer rows than about the hidden size: `chunks_cost_more`), the plain expression is used; without
gradients, chunks always. The numbers are those of the plain expression: logits in the autocast dtype, softmax in
float32, gradients cast back to the logits' dtype before their matmuls, as autograd does (tests/test_training.py
compares both, forward and backward).

The other objectives of the field (`train.loss`: reverse KL, Jensen-Shannon, total variation, negative
log-acceptance, speculators' KL/TV blend) read the same teacher y and have no such short form, but each is a sum over
rows of a function f of the row's distribution q, so its gradient through the softmax is still closed:

    ∂f/∂z_v = q_v · ( ∂f/∂q_v - Σ_u q_u ∂f/∂q_u )

`row_divergence` writes each f once (autograd differentiates it in the plain expression) and `_dloss_dz` its
gradient, which the chunks use; tests/test_training.py holds the two against each other.

KL's teacher is the same at every draft step, one position later: where its log-probabilities over a batch are small
(`keeps_teacher`) they are computed once (`teacher_log_probs`) and each step reads its rows from them; otherwise each
chunk computes its rows' teacher logits again from the target's states (memory bounded by the model, not the head).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F

# Rows per chunk. Each chunk's elementwise work is memory-bound (a float32 [rows, V_d] buffer read and written a few
# times), and each also pays the head's [V_d, H] gradient accumulation, so a chunk takes at least H rows; past that,
# as few as keep the float32 buffer at 16 MB (below glibc's 32 MB mmap ceiling, so on the CPU it comes back from the
# heap instead of being faulted in afresh: 8x faster to fill), and never more than 64 MB.
CHUNK_ELEMENTS, MAX_CHUNK_ELEMENTS = 1 << 22, 1 << 24
# The KL teacher's float32 log-probabilities over a batch are kept (not recomputed at every draft step) up to this
# size: at SmolLM2's 8k draft vocabulary 8,192 positions, at an 8B drafter's 32k 2,048.
KEEP_TEACHER_BYTES = 1 << 28


# The objectives that distill the target's next-token distribution y (all but CE, which reads its greedy token):
#   kl   forward KL(y ‖ q)                      the mode-covering default of EAGLE's KL recipes
#   rkl  reverse KL(q ‖ y)                      mode-seeking: q's mass where y has it
#   jsd  Jensen-Shannon, ½KL(y ‖ m) + ½KL(q ‖ m), m = (y + q)/2
#   tv   total variation ½Σ|y - q| = 1 - α      α = Σ min(y, q), the chance a sampled draft is accepted
#   nla  -log α                                 the acceptance itself, in log space
#   lk_hybrid  λ·KL + (1 - λ)·TV, λ = exp(-3α) held constant: KL where q and y barely overlap (TV's gradient
#        vanishes there), TV as they come to agree (speculators' lk_hybrid)
DIVERGENCES = ("kl", "rkl", "jsd", "tv", "nla", "lk_hybrid")


def chunk_rows(draft_vocab_size: int, hidden_size: int) -> int:
    V = draft_vocab_size
    return max(1, CHUNK_ELEMENTS // V, min(hidden_size, MAX_CHUNK_ELEMENTS // V))


def keeps_teacher(positions: int, draft_vocab_size: int) -> bool:
    """Whether KL's teacher log-probabilities over `positions` are kept once for every draft step."""
    return positions * draft_vocab_size * 4 <= KEEP_TEACHER_BYTES


def teacher_log_probs(states: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """states [M, H_t] (the target's post-norm states), head [V_d, H_t] -> log softmax(states · headᵀ) [M, V_d]
    float32: the logits in the autocast dtype where one is active, as each chunk would compute them."""
    return F.log_softmax(states.to(head.dtype) @ head.T, dim=-1, dtype=torch.float32)  # (cast inside: no copy)


class _DraftHeadLoss(torch.autograd.Function):
    """(hidden [N, H], weight [V_d, H], index [N] | None, teacher_states [N, H_t] | None, teacher_head [V_d, H_t] |
    None, kept [M, V_d] | None, kept_rows [N] | None, rows, with_grad, divergence) -> (loss summed over rows [],
    argmax of the logits [N]). `index`: CE's draft-vocabulary index of each row's label (-1: outside the vocabulary,
    weight 0); else `divergence` from softmax(teacher_states · teacher_headᵀ), or from the kept log-probabilities'
    rows `kept_rows`."""

    @staticmethod
    def forward(ctx, hidden, weight, index, teacher_states, teacher_head, kept, kept_rows, rows, with_grad, divergence):
        need_hidden, need_weight = with_grad and ctx.needs_input_grad[0], with_grad and ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = product = None  # float32 [V_d, H], and the buffer each chunk's share is made in
        total = hidden.new_zeros((), dtype=torch.float32)
        drafts = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            part = slice(start, start + rows)
            # Under autocast both matmuls with lm_head's weight take autocast's cached low-precision copy (a leaf
            # parameter): it is cast once per training step, not per chunk, matmul or draft step.
            logits = F.linear(hidden[part], weight)  # [n, V_d], in the autocast dtype where one is active
            if index is not None:
                summed, g = _ce_rows(logits, index[part], drafts[part], need_hidden or need_weight)
            else:  # the teacher's log-probabilities [n, V_d] float32: kept, or from the target's states
                log_y = (
                    kept.index_select(0, kept_rows[part])
                    if kept is not None
                    else teacher_log_probs(teacher_states[part], teacher_head)
                )
                rows_of = _kl_rows if divergence == "kl" else partial(_divergence_rows, divergence)
                summed, g = rows_of(logits, log_y, drafts[part], need_hidden or need_weight)
            total += summed
            if g is None:
                continue
            g = g.to(logits.dtype)  # as autograd hands lm_head's backward its output's dtype
            if need_hidden:
                grad_hidden[part] = g @ weight  # [n, H]
            if need_weight:  # accumulated in float32 across chunks, each chunk's share made in one product buffer
                h = hidden[part].to(g.dtype)
                if grad_weight is None:
                    grad_weight = (g.T @ h).float()
                else:
                    product = torch.mm(g.T, h, out=product) if product is not None else g.T @ h
                    grad_weight.add_(product)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype, ctx.spent = weight.dtype, False
        ctx.mark_non_differentiable(drafts)
        return total, drafts

    @staticmethod
    def backward(ctx, grad_total, _grad_drafts):
        # The saved gradients are scaled in place (no second [V_d, H] buffer), so they serve one backward pass
        if ctx.spent:
            raise RuntimeError("draft_head_loss's gradients serve one backward pass: retain_graph is not supported")
        ctx.spent = True
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden.mul_(grad_total.to(grad_hidden.dtype)) if grad_hidden is not None else None,
            grad_weight.mul_(grad_total).to(ctx.weight_dtype) if grad_weight is not None else None,
            None, None, None, None, None, None, None, None,
        )  # fmt: skip


def _ce_rows(logits, index, drafts, gradient):
    """CE over some rows, in one float32 buffer -> (Σ_r w_r·(-log q_r,label) [], ∂loss/∂z = w·(q - onehot) [n, V_d]
    float32, or None without `gradient`). Writes each row's draft (the logits' argmax) into `drafts` [n]."""
    valid, label = index >= 0, index.clamp(min=0)[:, None]
    z = logits.float()  # [n, V_d]: the one float32 buffer (the logits themselves in float32), worked in place
    z_label = z.gather(-1, label)[:, 0]
    m, top = z.max(-1, keepdim=True)  # (the first of equal maxima, as argmax)
    drafts.copy_(top[:, 0])
    z -= m
    z.exp_()
    s = z.sum(-1, keepdim=True)  # [n, 1]: log q_v = z_v - m - log s
    summed = ((m[:, 0] + s[:, 0].log() - z_label) * valid).sum()
    if not gradient:
        return summed, None
    w = valid[:, None].to(z.dtype)  # [n, 1]: a label outside the draft vocabulary weighs 0
    z *= w / s  # w·q, normalised and weighted in one pass
    return summed, z.scatter_add_(-1, label, -w)  # w·(q - onehot(label))


def _kl_rows(logits, log_y, drafts, gradient):
    """Forward KL(y ‖ q) over some rows -> (Σ_r Σ_v y·(log y - log q) [], ∂loss/∂z = q - y [n, V_d] float32, or
    None without `gradient`). Writes each row's draft into `drafts` [n]. log_y: the teacher's log-probabilities
    [n, V_d] float32, a buffer worked in place. With b the drafter's logits less their maxima and s = Σ_v exp(b),
    log q = b - log s, so Σ_v y·(log y - log q) = Σ_v y·(log y - b) + log s (a row dot, no [n, V_d] product kept)."""
    y = log_y.exp()  # [n, V_d]
    z = logits.float()  # [n, V_d]
    m, top = z.max(-1, keepdim=True)  # (the first of equal maxima, as argmax)
    drafts.copy_(top[:, 0])
    z -= m  # b
    with torch.autocast(y.device.type, enabled=False):  # (autocast would take the row dot to 16 bits)
        cross = torch.linalg.vecdot(y, log_y.sub_(z))  # [n]: Σ_v y·(log y - b), float32
    z.exp_()
    s = z.sum(-1, keepdim=True)  # [n, 1]
    summed = (cross + s[:, 0].log()).sum()
    if not gradient:
        return summed, None
    return summed, z.mul_(s.reciprocal()).sub_(y)  # q - y


def row_divergence(divergence: str, log_q: torch.Tensor, log_y: torch.Tensor) -> torch.Tensor:
    """Each row's objective f(q; y) [n] from the drafter's and the teacher's log-probabilities [n, V_d] float32: the
    definition, which autograd differentiates in the plain expression and `_dloss_dz` in the chunks."""
    with torch.autocast(log_q.device.type, enabled=False):  # (autocast would take the row dots to 16 bits)
        return _row_divergence(divergence, log_q, log_y)


def _row_divergence(divergence, log_q, log_y):
    q, y = log_q.exp(), log_y.exp()
    if divergence == "kl":
        return torch.linalg.vecdot(y, log_y - log_q)
    if divergence == "rkl":
        return torch.linalg.vecdot(q, log_q - log_y)
    if divergence == "jsd":
        log_m = torch.logaddexp(log_q, log_y) - math.log(2.0)
        return 0.5 * (torch.linalg.vecdot(y, log_y - log_m) + torch.linalg.vecdot(q, log_q - log_m))
    if divergence == "tv":
        return 0.5 * (q - y).abs().sum(-1)
    if divergence == "nla":
        return -_acceptance(q, y).log()
    if divergence == "lk_hybrid":
        lam = _hybrid_weight(q, y)
        return lam * torch.linalg.vecdot(y, log_y - log_q) + (1 - lam) * 0.5 * (q - y).abs().sum(-1)
    raise ValueError(f"unknown divergence {divergence!r}: one of {DIVERGENCES}")


def _acceptance(q, y):
    """α = Σ_v min(q_v, y_v) [n]: the chance that a draft sampled from q is accepted against y (kept above 0, where
    two float32 distributions share no mass, so that -log α stays finite)."""
    return torch.minimum(q, y).sum(-1).clamp(min=torch.finfo(torch.float32).tiny)


def _dloss_dz(divergence, log_q, log_y):
    """∂f/∂z [n, V_d] of `row_divergence`'s f through the softmax: q·(∂f/∂q - Σ_u q_u ∂f/∂q_u), ∂f/∂q taken up to a
    constant per row (which that difference cancels)."""
    q, y = log_q.exp(), log_y.exp()
    if divergence == "rkl":  # f = Σ q (log q - log y): ∂f/∂q = log q - log y + 1
        return _through_softmax(q, log_q - log_y)
    if divergence == "jsd":  # the y/m and q/m terms of ∂f/∂q add up to 1: ½ (log q - log m)
        return _through_softmax(q, 0.5 * (log_q - (torch.logaddexp(log_q, log_y) - math.log(2.0))))
    if divergence == "tv":
        return _through_softmax(q, 0.5 * torch.sign(q - y))
    if divergence == "nla":  # f = -log Σ min(q, y): only the entries where q is the smaller count
        return _through_softmax(q, -(q < y).to(q.dtype) / _acceptance(q, y)[:, None])
    if divergence == "lk_hybrid":  # λ held constant (detached): λ·(q - y), KL's, plus (1 - λ) TV's
        lam = _hybrid_weight(q, y)[:, None]
        return (q - y).mul_(lam).add_(_through_softmax(q, 0.5 * torch.sign(q - y)).mul_(1 - lam))
    raise ValueError(f"no chunked gradient for {divergence!r}")


def _through_softmax(q, d):
    """q·(d - Σ_u q_u d_u) [n, V_d]: a gradient d with respect to q taken to the logits."""
    return d.sub_(torch.linalg.vecdot(q, d)[:, None]).mul_(q)


def _hybrid_weight(q, y):
    """speculators' λ = exp(-3α) of lk_hybrid, a constant of the gradient: KL's where q and y barely overlap (where
    TV's gradient vanishes), TV's as they come to agree."""
    return torch.exp(-3.0 * _acceptance(q, y)).detach()


def _divergence_rows(divergence, logits, log_y, drafts, gradient):
    """`divergence` over some rows -> (Σ_r f_r [], ∂loss/∂z [n, V_d] float32, or None without `gradient`). Writes
    each row's draft into `drafts` [n]."""
    z = logits.float()  # [n, V_d]
    m, top = z.max(-1, keepdim=True)  # (the first of equal maxima, as argmax)
    drafts.copy_(top[:, 0])
    z -= m
    log_q = z.sub_(torch.logsumexp(z, -1, keepdim=True))  # in place: log q
    summed = row_divergence(divergence, log_q, log_y).sum()
    if not gradient:
        return summed, None
    with torch.autocast(z.device.type, enabled=False):  # (autocast would take the row dots to 16 bits)
        return summed, _dloss_dz(divergence, log_q, log_y)


def draft_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    index: torch.Tensor | None = None,
    teacher_states: torch.Tensor | None = None,
    teacher_head: torch.Tensor | None = None,
    teacher: torch.Tensor | None = None,
    teacher_rows: torch.Tensor | None = None,
    rows: int | None = None,
    divergence: str = "kl",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft step's summed loss over its labelled rows and each row's draft (argmax, a draft-vocabulary index).
    hidden: [N, H] the rows' norm(o); weight: [V_d, H] lm_head's. CE: `index` [N], the label's draft-vocabulary
    index (-1 outside it). KL: `teacher_states` [N, H_t] (the target's post-norm state one token later) and
    `teacher_head` [V_d, H_t]; or `teacher` [M, V_d], the teacher's log-probabilities kept (`teacher_log_probs`), and
    `teacher_rows` [N], each row's in them; `divergence` (one of DIVERGENCES) says which objective reads that teacher.
    `rows`: rows per chunk (default: `chunk_rows`)."""
    if sum(x is not None for x in (index, teacher_states, teacher)) != 1 or (teacher is None) != (teacher_rows is None):
        raise ValueError("draft_head_loss takes index (CE), or teacher_states and teacher_head, or teacher and "
                         "teacher_rows (KL)")  # fmt: skip
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    N, H, V = hidden.shape[0], hidden.shape[1], weight.shape[0]
    if with_grad and rows is None and chunks_cost_more(N, V, H, kl=index is None):
        if teacher is not None:
            teacher = teacher.index_select(0, teacher_rows)
        elif teacher_states is not None:
            teacher = teacher_log_probs(teacher_states, teacher_head)
        return _plain(hidden, weight, index, teacher, divergence)
    rows = rows or chunk_rows(V, H)
    return _DraftHeadLoss.apply(
        hidden, weight, index, teacher_states, teacher_head, teacher, teacher_rows, rows, with_grad, divergence
    )


def chunks_cost_more(rows: int, draft_vocab_size: int, hidden_size: int, kl: bool) -> bool:
    """Whether taking the gradient in the forward pass would keep more than autograd does: it keeps [rows, H] and the
    head's [V_d, H] gradient per step; autograd keeps [rows, V_d] log-probabilities (and KL's teacher distribution).
    With few rows (short sequences under a large head: an 8B drafter's 32k × 4,096 head at T = 2,048) the plain
    expression holds less."""
    return rows * draft_vocab_size * (2 if kl else 1) <= (rows + draft_vocab_size) * hidden_size


def _plain(hidden, weight, index, teacher, divergence) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss as autograd differentiates it (what the chunks compute, held whole): log q [N, V_d] float32 kept.
    teacher: the distilled objectives' log-probabilities [N, V_d] float32 (CE: None)."""
    logq = F.log_softmax(F.linear(hidden, weight).float(), dim=-1)
    if index is not None:
        total = -(logq.gather(-1, index.clamp(min=0)[:, None])[:, 0] * (index >= 0)).sum()
    else:
        total = row_divergence(divergence, logq, teacher).sum()
    return total, logq.argmax(-1).detach()
