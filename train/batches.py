"""Training examples and batches: generated rows as examples, the seeded order of optimizer steps, padding into a
batch, and on-policy batches the draft completes itself.

Data order is fixed by the seed: optimizer step s takes examples [s*G, (s+1)*G) of a per-epoch permutation,
G = batch_size * grad_accum * processes; process r, micro-batch a takes slice a*P + r (`micro_batches`).
With `group_by_length` the permutation is regrouped so that each step's examples have alike lengths (less
padding, the same examples each epoch; `grouped_order`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from eval.errors import UserError
from eval.models import log
from train.completions import cut_at_eos, left_padded


@dataclass
class Example:
    ids: list[int]
    """prompt + completion token ids, truncated to max_seq_len."""
    start: int
    """index of the first completion token in `ids`."""
    row: int
    """row of the generated dataset (for the cached top-k log-probs)."""


def build_examples(dataset, max_seq_len: int) -> list[Example]:
    """Generated rows as training examples; rows whose prompt leaves no room for a completion are dropped."""
    examples, dropped = [], 0
    for i, (prompt, completion) in enumerate(zip(dataset["prompt_ids"], dataset["completion_ids"])):
        if not completion or len(prompt) >= max_seq_len:
            dropped += 1
            continue
        examples.append(Example(ids=(list(prompt) + list(completion))[:max_seq_len], start=len(prompt), row=i))
    if dropped:
        log(f"distill: {dropped} of {len(dataset)} generated rows dropped (empty completion or prompt >= max_seq_len)")
    if not examples:
        raise UserError("distill: no usable training rows (every prompt is longer than distill.max_seq_len?)")
    return examples


def epoch_order(n: int, epoch: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


GROUP_SPAN = 50
"""Steps whose examples `grouped_order` sorts by length together (HF Trainer's `group_by_length` uses 50 too)."""


@lru_cache(maxsize=4)
def grouped_order(lengths: tuple[int, ...], epoch: int, seed: int, global_batch: int) -> list[int]:
    """The epoch's permutation regrouped by length: each span of GROUP_SPAN steps' examples is sorted by length
    and cut into steps of `global_batch`, and the whole steps are shuffled over the epoch (so a step's examples
    are alike in length but long and short steps do not come in a fixed cycle). Steps run on over epochs: the
    examples that fill the step the previous epoch left short come first, and a step this epoch leaves short
    comes last, so that every whole step in between is one group."""
    n = len(lengths)
    order = epoch_order(n, epoch, seed)
    head = (-epoch * n) % global_batch  # the previous epoch's short step takes these
    span = global_batch * GROUP_SPAN
    steps = []
    for lo in range(head, n, span):
        ranked = sorted(order[lo:lo + span], key=lambda i: lengths[i])
        steps += [ranked[i:i + global_batch] for i in range(0, len(ranked), global_batch)]
    short = steps.pop() if steps and len(steps[-1]) < global_batch else []
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch + 7_777)
    return order[:head] + [i for k in torch.randperm(len(steps), generator=g).tolist() for i in steps[k]] + short


def step_indices(n: int, step: int, global_batch: int, seed: int, lengths: tuple[int, ...] | None = None) -> list[int]:
    """The example indices of optimizer step `step` (0-based), continuing over epochs; with `lengths` (one per
    example) each epoch's order is `grouped_order`."""
    out, position = [], step * global_batch
    while len(out) < global_batch:
        epoch, offset = divmod(position, n)
        take = min(global_batch - len(out), n - offset)
        order = epoch_order(n, epoch, seed) if lengths is None else grouped_order(lengths, epoch, seed, global_batch)
        out.extend(order[offset:offset + take])
        position += take
    return out


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, L) right-padded
    attention_mask: torch.Tensor  # (B, L)
    loss_mask: torch.Tensor  # (B, L-1): position t predicts input_ids[:, t+1], a completion token
    examples: list[Example]

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def positions(self) -> torch.Tensor:
        """(B, L-1-first) bool: the loss positions among those from `first` on (what every loss keeps)."""
        return self.loss_mask[:, self.first:].bool()

    @property
    def first(self) -> int:
        """The first position that predicts a completion token: logits before it are never computed."""
        return min(e.start for e in self.examples) - 1


def collate(examples: list[Example], pad_id: int) -> Batch:
    width = max(len(e.ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width - 1), dtype=torch.float32)
    for i, e in enumerate(examples):
        input_ids[i, :len(e.ids)] = torch.tensor(e.ids)
        attention[i, :len(e.ids)] = 1
        loss_mask[i, e.start - 1:len(e.ids) - 1] = 1
    return Batch(input_ids, attention, loss_mask, examples)


def micro_batches(examples: list[Example], step: int, *, batch_size: int, grad_accum: int, world: int, rank: int,
                  seed: int, pad_id: int, group_by_length: bool = False) -> list[Batch]:
    """This process's `grad_accum` micro-batches of optimizer step `step`."""
    lengths = tuple(len(e.ids) for e in examples) if group_by_length else None
    indices = step_indices(len(examples), step, batch_size * grad_accum * world, seed, lengths)
    batches = []
    for a in range(grad_accum):
        lo = (a * world + rank) * batch_size
        batches.append(collate([examples[i] for i in indices[lo:lo + batch_size]], pad_id))
    return batches


@torch.no_grad()
def on_policy_batch(draft, batch: Batch, tokenizer, max_new_tokens: int, temperature: float, seed: int,
                    synced_gpus: bool) -> Batch:
    """The same prompts, completed by the current draft (sampled at the training temperature)."""
    pad = tokenizer.pad_token_id
    prompts = [e.ids[:e.start] for e in batch.examples]
    input_ids, attention = left_padded(prompts, pad)
    width = input_ids.shape[1]
    device = next(draft.parameters()).device
    was_training = draft.training
    draft.eval()
    torch.manual_seed(seed)
    out = draft.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device), do_sample=True,
                         temperature=temperature, top_k=None, top_p=None, max_new_tokens=max_new_tokens,
                         pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, synced_gpus=synced_gpus)
    draft.train(was_training)
    examples = []
    for i, e in enumerate(batch.examples):
        completion = cut_at_eos(out[i, width:].tolist(), tokenizer.eos_token_id) or [tokenizer.eos_token_id]
        examples.append(Example(ids=prompts[i] + completion, start=e.start, row=e.row))
    return collate(examples, pad)
