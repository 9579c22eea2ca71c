"""Distillation losses: pure functions on position-aligned (B, T, V) logits, float32 inside.

Every loss takes `mask` (B, T) of 0/1 (None = all positions) and `reduction`: "mean" over unmasked
positions (0 for an all-masked batch, never NaN) or "sum" (the distill loop divides by the global
token count, so gradient accumulation and data parallelism give the same loss). `chunk_size` > 0
computes the loss over T in chunks, each with its gradient in closed form in the same pass, so
float32 copies of both models' full-vocabulary logits exist for one chunk at a time; value and
gradient are the same. `fused_head_loss` goes one step further for the distill loop: it runs the
draft's output head chunk by chunk too, so the draft's (B, T, V) logits never exist at all.

Notation, as in the decoder: p = softmax(target_logits / temperature) is the target's distribution,
q = softmax(draft_logits / temperature) the draft's; each divergence is one class below (`ForwardKL`, ...)
holding its per-position value and its gradient side by side.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F


def _xlogy_diff(a: torch.Tensor, log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """sum_x a (log a - log b) with 0 log 0 = 0; (..., V) -> (...)."""
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def _log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """log m, m = beta p + (1 - beta) q, in log space (beta = 0 or 1 leave one side out)."""
    return torch.logaddexp(log_p + math.log(beta) if beta > 0 else torch.full_like(log_p, -math.inf),
                           log_q + math.log(1 - beta) if beta < 1 else torch.full_like(log_q, -math.inf))


# Each divergence D(p, q) between the target's p and the draft's q at one position, (..., V) -> (...), beside its
# gradient with respect to the draft's logits z (q = softmax(z / T)), times T. Where D is written through a
# "score" g, that gradient is q (g - sum_x q g): the chain rule through the softmax.


class ForwardKL:
    """KL(p || q) = sum_x p log(p / q): mean-seeking, sequence-level KD's token-level twin (Hinton et al. 2015)."""

    @staticmethod
    def value(log_p, log_q, p, q, **_):
        return (log_p - log_q).mul_(p).masked_fill_(p == 0, 0.0).sum(-1)

    @staticmethod
    def grad(log_p, log_q, p, q, **_):
        return q - p  # d/dz sum_x p (log p - log q) = q - p


class ReverseKL:
    """KL(q || p) = sum_x q log(q / p): mode-seeking (GKD, Agarwal et al. 2024; MiniLLM, Gu et al. 2024)."""

    @staticmethod
    def value(log_p, log_q, p, q, **_):
        return _xlogy_diff(q, log_q, log_p)

    @staticmethod
    def score(log_p, log_q, p, q, **_):
        return log_q - log_p  # d/dq_x: log(q_x / p_x) + 1, the constant cancels against sum_x q


class JSD:
    """Generalised JSD (GKD, Agarwal et al. 2024, eq. 3): beta KL(p || m) + (1 - beta) KL(q || m),
    m = beta p + (1 - beta) q. beta = 0.5 is the symmetric Jensen-Shannon divergence."""

    @staticmethod
    def value(log_p, log_q, p, q, beta=0.5, **_):
        log_m = _log_mixture(log_p, log_q, beta)
        return beta * _xlogy_diff(p, log_p, log_m) + (1 - beta) * _xlogy_diff(q, log_q, log_m)

    @staticmethod
    def score(log_p, log_q, p, q, beta=0.5, **_):
        return (1 - beta) * (log_q - _log_mixture(log_p, log_q, beta))  # the other terms of d/dq_x cancel


class TVD:
    """Total variation 1/2 sum_x |p - q| = 1 - beta, the acceptance probability's complement (Leviathan et al. 2023,
    section 3: beta = 1 - D_LK(p, q)): minimising it maximises acceptance directly."""

    @staticmethod
    def value(log_p, log_q, p, q, **_):
        return 0.5 * (p - q).abs().sum(-1)

    @staticmethod
    def score(log_p, log_q, p, q, **_):
        return 0.5 * torch.sign(q - p)


DIVERGENCE_MATH = {"forward_kl": ForwardKL, "reverse_kl": ReverseKL, "jsd": JSD, "tvd": TVD}


def _reduce(per_position_sum: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "sum":
        return per_position_sum
    if reduction == "mean":
        return per_position_sum / count.clamp_min(1)
    raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


def _chunked_sum(chunk_sum: Callable, tensors: tuple, chunk_size: int) -> torch.Tensor:
    """sum of chunk_sum over slices [:, lo:hi] of `tensors` (first one: the draft's logits); used without a
    gradient to the logits (with one, `_FusedChunkedLoss` computes it in closed form, chunk by chunk)."""
    length = tensors[0].shape[1]
    step = chunk_size if chunk_size > 0 else max(length, 1)
    total = tensors[0].new_zeros((), dtype=torch.float32)
    for lo in range(0, length, step):
        total = total + chunk_sum(*(x[:, lo : lo + step] for x in tensors))
    return total


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits / temperature, without a copy when there is nothing to change."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


@torch.no_grad()
def divergence_value_and_grad(name: str, d, t, m, *, temperature: float = 1.0, **kw):
    """Sum over positions of divergence `name` and its gradient with respect to the draft logits `d`.

    `d`, `t` (B, C, V) draft and target logits, `m` (B, C) mask -> (value (), gradient (B, C, V) float32).
    """
    math_ = DIVERGENCE_MATH[name]
    log_q = F.log_softmax(_tempered(d, temperature), dim=-1)
    log_p = F.log_softmax(_tempered(t, temperature), dim=-1)
    p, q = log_p.exp(), log_q.exp()
    m = m.float()
    value = (math_.value(log_p, log_q, p, q, **kw) * m).sum()
    if hasattr(math_, "grad"):
        g = math_.grad(log_p, log_q, p, q, **kw)
    else:
        score = math_.score(log_p, log_q, p, q, **kw)
        g = q.mul_(score.sub_((q * score).sum(-1, keepdim=True)))
    return value, g.mul_(m[..., None] / temperature)


@torch.no_grad()
def ce_value_and_grad(d, y, m):
    """Sum over positions of the cross-entropy of logits `d` (B, C, V) on labels `y` (B, C), masked by
    `m`, and its gradient: d CE / d z = softmax(z) - onehot(y)."""
    log_q = F.log_softmax(d.float(), dim=-1)
    m = m.float()
    value = -(log_q.gather(-1, y[..., None]).squeeze(-1) * m).sum()
    g = log_q.exp_()
    g.scatter_add_(-1, y[..., None], -torch.ones_like(g[..., :1]))
    return value, g.mul_(m[..., None])


class _FusedChunkedLoss(torch.autograd.Function):
    """sum over positions of a loss, computed chunk by chunk over T; the gradient with respect to the
    draft's logits is computed in the same pass and kept (in the logits' dtype) for backward."""

    @staticmethod
    def forward(ctx, draft_logits, chunk_loss_and_grad, tensors, chunk_size):
        grad = torch.empty_like(draft_logits)
        total = draft_logits.new_zeros((), dtype=torch.float32)
        for lo in range(0, draft_logits.shape[1], chunk_size):
            value, g = chunk_loss_and_grad(draft_logits[:, lo:lo + chunk_size], *(x[:, lo:lo + chunk_size] for x in tensors))
            total += value
            grad[:, lo:lo + chunk_size] = g.to(grad.dtype)
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        # In place: the buffer is used once (a second backward through the same graph is not supported).
        return grad.mul_(grad_output.to(grad.dtype)), None, None, None


class _FusedHeadLoss(torch.autograd.Function):
    """The summed loss of logits = hidden @ weight.T, over T in chunks: one chunk's (B, C, V) logits exist
    at a time, and the gradients with respect to `hidden` (and `weight`) are computed in the same pass,
    as in fused linear cross-entropy (Liger-Kernel; Wijmans et al. 2025, "Cut Your Losses"), here for
    any loss whose logit gradient is known in closed form."""

    @staticmethod
    def forward(ctx, hidden, weight, chunk_value_and_grad, chunk_size):
        w = weight.to(hidden.dtype)  # (V, H); a bf16 copy under autocast
        want_weight = ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        total = hidden.new_zeros((), dtype=torch.float32)
        for lo in range(0, hidden.shape[1], chunk_size):
            h = hidden[:, lo:lo + chunk_size]  # (B, C, H)
            value, g = chunk_value_and_grad(lo, lo + h.shape[1], h @ w.T)  # (), (B, C, V)
            total += value
            g = g.to(w.dtype)
            grad_hidden[:, lo:lo + chunk_size] = g @ w
            if want_weight:
                grad_weight.addmm_(g.flatten(0, 1).T.float(), h.flatten(0, 1).float())
        ctx.save_for_backward(grad_hidden, *([grad_weight] if want_weight else []))
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, *rest = ctx.saved_tensors
        grad_weight = rest[0].mul_(grad_output).to(ctx.weight_dtype) if rest else None
        return grad_hidden.mul_(grad_output.to(grad_hidden.dtype)), grad_weight, None, None


def fused_head_loss(hidden, weight, chunk_value_and_grad: Callable, chunk_size: int) -> torch.Tensor:
    """sum over chunks [lo, hi) of T of `chunk_value_and_grad(lo, hi, logits)`, logits = hidden @ weight.T.

    `hidden` (B, T, H) the draft's last hidden states, `weight` (V, H) its output head;
    `chunk_value_and_grad(lo, hi, logits (B, C, V)) -> (value (), d value / d logits (B, C, V))`, for
    instance a weighted sum of `divergence_value_and_grad` and `ce_value_and_grad`. The draft's
    full-vocabulary logits never exist: memory holds one chunk of them, and the gradients of `hidden`
    (B, T, H) and of `weight` when it is trained.
    """
    return _FusedHeadLoss.apply(hidden, weight, chunk_value_and_grad, max(chunk_size, 1))


def _divergence(name: str, draft_logits, target_logits, mask, temperature, reduction, chunk_size, **kw):
    if draft_logits.shape != target_logits.shape:
        raise ValueError(f"draft logits {tuple(draft_logits.shape)} and target logits {tuple(target_logits.shape)} differ")
    if mask is None:
        mask = torch.ones(draft_logits.shape[:2], device=draft_logits.device)
    count = mask.float().sum()

    def chunk_sum(d, t, m):  # (B, C, V), (B, C, V), (B, C) -> ()
        log_q = F.log_softmax(d.float() / temperature, dim=-1)
        log_p = F.log_softmax(t.float() / temperature, dim=-1)
        return (DIVERGENCE_MATH[name].value(log_p, log_q, log_p.exp(), log_q.exp(), **kw) * m.float()).sum()

    if chunk_size > 0 and torch.is_grad_enabled() and draft_logits.requires_grad:
        loss_and_grad = functools.partial(divergence_value_and_grad, name, temperature=temperature, **kw)
        total = _FusedChunkedLoss.apply(draft_logits, loss_and_grad, (target_logits.detach(), mask), chunk_size)
        return _reduce(total, count, reduction)
    total = _chunked_sum(chunk_sum, (draft_logits, target_logits.detach(), mask), 0 if chunk_size <= 0 else chunk_size)
    return _reduce(total, count, reduction)


def forward_kl(draft_logits, target_logits, mask=None, *, temperature=1.0, reduction="mean", chunk_size=0):
    """`ForwardKL` per position, KL(p || q), masked and reduced."""
    return _divergence("forward_kl", draft_logits, target_logits, mask, temperature, reduction, chunk_size)


def reverse_kl(draft_logits, target_logits, mask=None, *, temperature=1.0, reduction="mean", chunk_size=0):
    """`ReverseKL` per position, KL(q || p), masked and reduced."""
    return _divergence("reverse_kl", draft_logits, target_logits, mask, temperature, reduction, chunk_size)


def jsd(draft_logits, target_logits, mask=None, *, beta=0.5, temperature=1.0, reduction="mean", chunk_size=0):
    """`JSD` per position, beta KL(p || m) + (1 - beta) KL(q || m), masked and reduced."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return _divergence("jsd", draft_logits, target_logits, mask, temperature, reduction, chunk_size, beta=beta)


def tvd(draft_logits, target_logits, mask=None, *, temperature=1.0, reduction="mean", chunk_size=0):
    """`TVD` per position, 1/2 sum_x |p - q| = 1 - alpha, masked and reduced."""
    return _divergence("tvd", draft_logits, target_logits, mask, temperature, reduction, chunk_size)


def sequence_ce(draft_logits, labels, mask=None, *, reduction="mean", chunk_size=0):
    """Cross-entropy of the draft on target-written tokens (sequence-level KD, Kim & Rush 2016).

    `draft_logits[:, t]` predicts `labels[:, t]`; `labels` (B, T) int64.
    """
    if mask is None:
        mask = torch.ones(labels.shape, device=draft_logits.device)

    def chunk_sum(d, y, m):
        ce = F.cross_entropy(d.float().flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
        return (ce * m.float()).sum()

    if chunk_size > 0 and torch.is_grad_enabled() and draft_logits.requires_grad:
        loss_and_grad = ce_value_and_grad
        total = _FusedChunkedLoss.apply(draft_logits, loss_and_grad, (labels, mask), chunk_size)
    else:
        total = _chunked_sum(chunk_sum, (draft_logits, labels, mask), 0)
    return _reduce(total, mask.float().sum(), reduction)


DIVERGENCES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": jsd, "tvd": tvd}
