"""The target's side of every distillation loss, and the model plumbing both sides share: its logits from a forward pass under no_grad (online), rebuilt
from the top-k log-probs the generate stage cached, or nothing (sequence CE alone learns from the target's text).

Cached rows are proper distributions: the top-k entries keep their log-probs and the tail mass is spread
uniformly over the other tokens (`topk_to_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from train.batches import Batch
from train.draft_vocab import DraftVocab


def topk_to_logprobs(ids: torch.Tensor, lp: torch.Tensor, vocab: int, restrict: "DraftVocab | None" = None) -> torch.Tensor:
    """Full log-prob rows (n, V) from top-k ids and log-probs (n, k): the top-k entries keep their
    log-probs and the tail mass 1 - sum(top-k) is spread uniformly over the other V - k tokens.

    With `restrict`, only its columns (n, S), in its order: the same values, not renormalised (the
    losses take a log-softmax, which renormalises over the draft vocabulary).
    """
    tail = (1 - lp.exp().sum(-1)).clamp_min(1e-8) / max(vocab - ids.shape[1], 1)  # (n,)
    if restrict is None:
        return tail.log()[:, None].expand(ids.shape[0], vocab).clone().scatter_(1, ids, lp)
    size = restrict.ids.shape[0]
    cols = restrict.index.to(ids.device)[ids]
    cols = torch.where(cols >= 0, cols, size)  # top-k tokens outside the draft vocabulary land in a column dropped below
    return tail.log()[:, None].expand(ids.shape[0], size + 1).clone().scatter_(1, cols, lp)[:, :size]


def columns(x: torch.Tensor, vocab: int, restrict: DraftVocab | None) -> torch.Tensor:
    """The vocabulary columns the losses compare: the first `vocab` (padding rows dropped), or the draft vocabulary's."""
    return x[..., :vocab] if restrict is None else x.index_select(-1, restrict.ids)


def masked_topk(batch: Batch, topk_ids, topk_logprobs) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached top-k (N, k) ids and log-probs of the loss positions, in the order of
    `batch.loss_mask.nonzero()` (example by example, position by position)."""
    ids, lp = [], []
    for e in batch.examples:
        n = len(e.ids) - e.start  # completion tokens = loss positions of this example
        if len(topk_ids[e.row]) < n:
            raise ValueError(f"generated row {e.row}: {len(topk_ids[e.row])} top-k rows for {n} completion tokens")
        ids.append(torch.tensor(topk_ids[e.row][:n], dtype=torch.long))
        lp.append(torch.tensor(topk_logprobs[e.row][:n], dtype=torch.float32))
    return torch.cat(ids), torch.cat(lp)


def model_logits(model, batch: Batch, device) -> torch.Tensor:
    """Logits of positions first..L-2, (B, L-1-first, V): position t predicts token t+1.

    The prompt positions before the earliest completion never enter a loss, so the output head (the
    largest matrix of a small draft) is not run on them: `logits_to_keep` keeps the last positions.
    """
    length = batch.input_ids.shape[1]
    out = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                logits_to_keep=length - batch.first)
    return out.logits[:, :-1]


def head_rows(weight: torch.Tensor, vocab: int, restrict: DraftVocab | None) -> torch.Tensor:
    """The head rows the losses use: the first `vocab`, or the draft vocabulary's."""
    return weight[:vocab] if restrict is None else weight.index_select(0, restrict.ids)


def unwrapped(model):
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def fused_head_weight(chunk_size: int, model):
    """The head weight to run inside the chunked loss, or None where the model's own forward gives the logits:
    no chunking, no gradient, or a ZeRO-3-partitioned head (only its engine's hooks can gather it)."""
    if chunk_size <= 0 or not torch.is_grad_enabled():
        return None
    inner = unwrapped(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_decoder") else None
    if head is None or getattr(head, "bias", None) is not None or hasattr(head.weight, "ds_id"):
        return None
    return head.weight


def last_hidden(model, batch: Batch, device) -> torch.Tensor:
    """The model's final hidden states (after its last norm) at positions first..L-2, (B, L-1-first, H).

    The call goes through the wrapper (DDP, DeepSpeed) as usual, with the head run on one position only;
    a hook on the decoder picks up its output, which the head would have read.
    """
    captured = []
    hook = unwrapped(model).get_decoder().register_forward_hook(lambda module, args, out: captured.append(out[0]))
    try:
        model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device), logits_to_keep=1)
    finally:
        hook.remove()
    return captured[-1][:, batch.first:-1]


@dataclass
class TargetSignal:
    """The target's side of one micro-batch's loss, at its N loss positions."""

    rows: Callable | None
    """`rows(lo, hi, vocab, restrict) -> (1, hi - lo, V)`: logits or log-probs of loss positions lo..hi-1 over the
    first `vocab` tokens (or the draft vocabulary's); None: no target signal (sequence_ce alone)."""
    vocab: int | None = None
    """The target's head rows (online), which may differ from the draft's; None: any vocabulary (cached, none)."""


def target_rows(kind: str, *, target, batch: Batch, device, cached=None) -> TargetSignal:
    """The target signal of `kind`: "online" (a forward pass under no_grad, the model's own head), "cached"
    (`cached = (topk_ids, topk_logprobs)` of the generate stage, rebuilt chunk by chunk) or "none".

    Cached rows are log-probs at temperature 1; the losses divide them by the training temperature, which gives
    p^(1/T) renormalised, the tempered distribution.
    """
    if kind == "none":
        return TargetSignal(None)
    if kind == "cached":
        topk_ids, topk_lp = masked_topk(batch, *cached)
        return TargetSignal(lambda lo, hi, vocab, restrict: topk_to_logprobs(topk_ids[lo:hi], topk_lp[lo:hi], vocab,
                                                                             restrict)[None].to(device))
    if kind != "online":
        raise ValueError(f"target signal must be online, cached or none, got {kind!r}")
    with torch.no_grad():
        logits = model_logits(target, batch, device)[batch.positions.to(device)][None]  # (1, N, V_target)
    return TargetSignal(lambda lo, hi, vocab, restrict: columns(logits[:, lo:hi], vocab, restrict), logits.shape[-1])
