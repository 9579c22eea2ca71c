"""A reduced draft vocabulary (as in EAGLE-3): the draft's head scores only the N tokens the target uses most.

On a CPU a small draft's output head is most of its cost: for four SmolLM2 layers the 49152 x 576 head
reads more bytes per token than the layers do; scoring 8192 tokens instead makes a draft token much
cheaper (`python -m eval --draft RUN/export` against the same with `--full-draft-vocab` measures both;
docs/default-draft.md has the numbers). The tokens are chosen
from the generate stage's data: the N with the most target probability in its top-k log-probs, plus
EOS. Training then fits the draft to the target's distribution restricted to them, and decoding
drafts from them only.

Exactness does not depend on the choice: the draft's distribution q is zero outside the set, the
target verifies every token as usual, and a token the draft cannot propose comes from the residual
max(0, p - q) or the bonus position. The exported model keeps its full head (a plain Hugging Face model,
usable as `assistant_model=`); the ids travel beside it in `draft_vocab.json`, which this project's
decoder reads.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch

FILENAME = "draft_vocab.json"


def build_draft_vocab(topk_ids_rows, topk_logprobs_rows, size: int, vocab: int, always=()) -> list[int]:
    """The `size` token ids with the most summed target probability over every position's top-k.

    `topk_*_rows`: per generated row, a (positions, k) list of ids and log-probs. The `always` ids (EOS) are
    kept first; when the data names fewer tokens than `size`, the lowest unused ids fill the rest (BPE
    vocabularies number their tokens roughly by frequency). Sorted ascending.
    """
    size = min(size, vocab)
    mass = torch.zeros(vocab, dtype=torch.float64)
    for ids, lps in zip(topk_ids_rows, topk_logprobs_rows):
        if len(ids):
            ids_t = torch.as_tensor(ids, dtype=torch.long).flatten()
            keep = ids_t < vocab
            mass.index_add_(0, ids_t[keep], torch.as_tensor(lps, dtype=torch.float64).flatten()[keep].exp())
    mass[[i for i in always if 0 <= i < vocab]] = math.inf
    # Ties (all zero-mass tokens) go to the lower id: a stable sort on -mass keeps id order.
    order = torch.sort(-mass, stable=True).indices[:size]
    return sorted(order.tolist())


def save_draft_vocab(directory: str | Path, ids: list[int], **meta) -> Path:
    from eval.fsutil import atomic_write_json

    path = Path(directory) / FILENAME
    atomic_write_json(path, {"size": len(ids), **meta, "ids": ids})
    return path


def load_draft_vocab(directory: str | Path) -> list[int] | None:
    """The ids saved beside a model (None when it has none: the full vocabulary)."""
    path = Path(directory) / FILENAME
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    ids = data.get("ids") if isinstance(data, dict) else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"{path}: expected a JSON object with a non-empty list 'ids' of token ids")
    return ids


def subset_index(ids: list[int] | torch.Tensor, vocab: int, device=None) -> torch.Tensor:
    """(vocab,) int64: the position of each token id in `ids`, or -1 for ids outside it."""
    ids = torch.as_tensor(ids, dtype=torch.long, device=device)
    index = torch.full((vocab,), -1, dtype=torch.long, device=device)
    index[ids] = torch.arange(len(ids), device=device)
    return index


@contextlib.contextmanager
def restricted_head(model: torch.nn.Module, ids: list[int] | None):
    """While the block runs, the model's output head scores only `ids` (logits (..., len(ids)), in that order).

    The head is swapped for a linear layer holding the chosen rows (a copy: tied embeddings are untouched)
    and put back on exit. `ids=None` changes nothing.
    """
    if ids is None:
        yield model
        return
    head = model.get_output_embeddings()
    index = torch.as_tensor(ids, dtype=torch.long, device=head.weight.device)
    sub = torch.nn.Linear(head.weight.shape[1], len(ids), bias=head.bias is not None,
                          device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        sub.weight.copy_(head.weight[index])
        if head.bias is not None:
            sub.bias.copy_(head.bias[index])
    sub.requires_grad_(False)
    model.set_output_embeddings(sub)
    try:
        yield model
    finally:
        model.set_output_embeddings(head)
