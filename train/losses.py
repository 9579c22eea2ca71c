"""Distillation losses: pure functions on position-aligned (B, T, V) logits, float32 inside.

Every loss takes `mask` (B, T) of 0/1 (None = all positions) and `reduction`: "mean" over unmasked
positions (0 for an all-masked batch, never NaN) or "sum" (the distill loop divides by the global
token count, so gradient accumulation and data parallelism give the same loss). `chunk_size` > 0
computes the loss over T in chunks, each under activation checkpointing, so float32 copies of
both models' full-vocabulary logits exist for one chunk at a time; value and gradient are the same.

p_target = softmax(target_logits / temperature), p_draft = softmax(draft_logits / temperature).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _xlogy_diff(p: torch.Tensor, log_p: torch.Tensor, log_other: torch.Tensor) -> torch.Tensor:
    """sum_x p (log p - log other) with 0 log 0 = 0; (..., V) -> (...)."""
    return torch.where(p > 0, p * (log_p - log_other), torch.zeros_like(p)).sum(-1)


def _forward_kl(log_p_draft, log_p_target, **_):
    # KL(p_target || p_draft) = sum_x p_target (log p_target - log p_draft)
    return _xlogy_diff(log_p_target.exp(), log_p_target, log_p_draft)


def _reverse_kl(log_p_draft, log_p_target, **_):
    # KL(p_draft || p_target): mode-seeking (GKD, Agarwal et al. 2024; MiniLLM, Gu et al. 2024)
    return _xlogy_diff(log_p_draft.exp(), log_p_draft, log_p_target)


def _jsd(log_p_draft, log_p_target, beta: float = 0.5, **_):
    # Generalised JSD (GKD eq. 3): beta KL(p_target || m) + (1 - beta) KL(p_draft || m),
    # m = beta p_target + (1 - beta) p_draft, computed in log space.
    beta_t = torch.tensor(beta, dtype=log_p_target.dtype, device=log_p_target.device)
    log_m = torch.logsumexp(torch.stack([log_p_target + beta_t.log(), log_p_draft + (1 - beta_t).log()]), dim=0)
    return beta * _xlogy_diff(log_p_target.exp(), log_p_target, log_m) + (1 - beta) * _xlogy_diff(
        log_p_draft.exp(), log_p_draft, log_m
    )


def _tvd(log_p_draft, log_p_target, **_):
    # TV = 1/2 sum_x |p_target - p_draft| = 1 - alpha: minimising it maximises the acceptance rate directly
    return 0.5 * (log_p_target.exp() - log_p_draft.exp()).abs().sum(-1)


def _reduce(per_position_sum: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "sum":
        return per_position_sum
    if reduction == "mean":
        return per_position_sum / count.clamp_min(1)
    raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


def _chunked_sum(chunk_sum: Callable, tensors: tuple, chunk_size: int) -> torch.Tensor:
    """sum of chunk_sum over slices [:, lo:hi] of `tensors` (first one: the draft's logits).

    With chunk_size > 0 and gradients on, each chunk runs under activation checkpointing: its float32
    log-softmaxes are recomputed in backward instead of kept, so only one chunk's exist at a time.
    """
    draft_logits = tensors[0]
    length = draft_logits.shape[1]
    step = chunk_size if chunk_size > 0 else max(length, 1)
    use_ckpt = chunk_size > 0 and torch.is_grad_enabled() and draft_logits.requires_grad
    total = draft_logits.new_zeros((), dtype=torch.float32)
    for lo in range(0, length, step):
        args = tuple(x[:, lo : lo + step] for x in tensors)
        total = total + (checkpoint(chunk_sum, *args, use_reentrant=False) if use_ckpt else chunk_sum(*args))
    return total


def _divergence(per_token: Callable, draft_logits, target_logits, mask, temperature, reduction, chunk_size, **kw):
    if draft_logits.shape != target_logits.shape:
        raise ValueError(f"draft logits {tuple(draft_logits.shape)} and target logits {tuple(target_logits.shape)} differ")
    if mask is None:
        mask = torch.ones(draft_logits.shape[:2], device=draft_logits.device)

    def chunk_sum(d, t, m):  # (B, C, V), (B, C, V), (B, C) -> ()
        log_q = F.log_softmax(d.float() / temperature, dim=-1)
        log_p = F.log_softmax(t.float() / temperature, dim=-1)
        return (per_token(log_q, log_p, **kw) * m.float()).sum()

    total = _chunked_sum(chunk_sum, (draft_logits, target_logits.detach(), mask), chunk_size)
    return _reduce(total, mask.float().sum(), reduction)


def forward_kl(draft_logits, target_logits, mask=None, *, temperature=1.0, reduction="mean", chunk_size=0):
    """KL(p_target || p_draft) = sum_x p_target(x) log(p_target(x) / p_draft(x)), per position."""
    return _divergence(_forward_kl, draft_logits, target_logits, mask, temperature, reduction, chunk_size)


def reverse_kl(draft_logits, target_logits, mask=None, *, temperature=1.0, reduction="mean", chunk_size=0):
    """KL(p_draft || p_target) = sum_x p_draft(x) log(p_draft(x) / p_target(x)), per position."""
    return _divergence(_reverse_kl, draft_logits, target_logits, mask, temperature, reduction, chunk_size)


def jsd(draft_logits, target_logits, mask=None, *, beta=0.5, temperature=1.0, reduction="mean", chunk_size=0):
    """beta KL(p_target || m) + (1 - beta) KL(p_draft || m), m = beta p_target + (1 - beta) p_draft (GKD)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return _divergence(_jsd, draft_logits, target_logits, mask, temperature, reduction, chunk_size, beta=beta)


def tvd(draft_logits, target_logits, mask=None, *, temperature=1.0, reduction="mean", chunk_size=0):
    """1/2 sum_x |p_target(x) - p_draft(x)| = 1 - alpha (the per-position acceptance probability)."""
    return _divergence(_tvd, draft_logits, target_logits, mask, temperature, reduction, chunk_size)


def sequence_ce(draft_logits, labels, mask=None, *, reduction="mean", chunk_size=0):
    """Cross-entropy of the draft on target-written tokens (sequence-level KD, Kim & Rush 2016).

    `draft_logits[:, t]` predicts `labels[:, t]`; `labels` (B, T) int64.
    """
    if mask is None:
        mask = torch.ones(labels.shape, device=draft_logits.device)

    def chunk_sum(d, y, m):
        ce = F.cross_entropy(d.float().flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
        return (ce * m.float()).sum()

    total = _chunked_sum(chunk_sum, (draft_logits, labels, mask), chunk_size)
    return _reduce(total, mask.float().sum(), reduction)


DIVERGENCES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": jsd, "tvd": tvd}
