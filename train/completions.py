"""The target writing completions: a row is (prompt, temperature, sample), and one `generate_batch` call answers
rows of one temperature with their top-k log-probs. The generate stage (train/generate.py) shards rows over
processes and files; self-written prompts (train/self_written.py) use the same call to write requests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from eval.lean import LeanBatch, runs_lean
from eval.prompts import Prompt, encode_prompt
from eval.speculative import Sampling, cache_kwarg, probs_from_logits, sample


@dataclass
class Row:
    prompt: Prompt
    prompt_ids: list[int]
    temperature: float
    sample: int


def build_rows(prompts: list[Prompt], tokenizer, generate, max_prompt_tokens: int) -> list[Row]:
    rows = []
    for temperature in generate.temperatures:
        samples = 1 if temperature == 0 else generate.num_samples  # greedy has one answer
        for prompt in prompts:
            ids = encode_prompt(tokenizer, prompt, max_prompt_tokens)
            rows.extend(Row(prompt, ids, temperature, s) for s in range(samples))
    return rows


@torch.no_grad()
def generate_batch(target, tokenizer, rows: list[Row], generate, seed: int, steps: str = "lean"):
    """Left-padded batched decoding at one temperature; returns per row (completion ids, finish reason, top-k).

    Our own loop rather than transformers' `generate()`: one float32 log-softmax a step serves the stored
    top-k log-probs (temperature 1, the full logits never kept), and a sampled token is drawn by inverting
    the cumulative distribution (`eval.speculative.sample`), where `generate()`'s `torch.multinomial` draws
    an exponential variate for every vocabulary entry of every row, most of a sampled step's time on a CPU.
    Greedy rows are the argmax of the same logits, as `generate()` would pick them. `steps` (`generate.steps`):
    lean steps (`eval.lean.LeanBatch`) where the target allows them, else the target's own forward."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    device = next(target.parameters()).device
    input_ids, attention = (t.to(device) for t in left_padded([r.prompt_ids for r in rows], pad))
    positions = (attention.cumsum(-1) - 1).clamp_min(0)  # left padding: each row counts from its first token
    sampling = Sampling(rows[0].temperature, top_k=generate.top_k, top_p=generate.top_p)
    generator = torch.Generator(device=device).manual_seed(seed)
    batch = batch_steps(target, attention, positions, generate.max_new_tokens, steps)
    k = generate.topk_logprobs
    tokens = torch.full((len(rows), generate.max_new_tokens), pad, dtype=torch.long, device=device)
    top_values = torch.zeros((len(rows), generate.max_new_tokens, k), device=device)
    top_indices = torch.zeros((len(rows), generate.max_new_tokens, k), dtype=torch.long, device=device)
    alive = torch.arange(len(rows), device=device)  # the rows still writing, in batch order
    for step in range(generate.max_new_tokens):
        logits = batch(input_ids).float()
        if k > 0:
            top_values[alive, step], top_indices[alive, step] = logits.log_softmax(-1).topk(k, dim=-1)
        chosen = logits.argmax(-1) if sampling.greedy else sample(probs_from_logits(logits, sampling), generator)
        tokens[alive, step] = chosen
        writing = chosen != eos
        if not bool(writing.all()):  # a row that wrote EOS leaves the batch: no more passes over it
            if not bool(writing.any()):
                break
            kept = writing.nonzero().squeeze(-1)
            alive, chosen = alive[kept], chosen[kept]
            batch.select(kept)
        input_ids = chosen[:, None]
    completions = tokens.tolist()
    if k > 0:
        values = top_values.half().tolist()  # (rows, steps, k)
        indices = top_indices.tolist()
    results = []
    for i, ids in enumerate(completions):
        ids = cut_at_eos(ids, eos)
        finish = "eos" if eos in ids else "length"
        topk = (indices[i][: len(ids)], values[i][: len(ids)]) if k > 0 else None
        results.append((ids, finish, topk))
    return results


def batch_steps(target, attention: torch.Tensor, positions: torch.Tensor, max_new_tokens: int, steps: str):
    """The steps a batch is written with (`generate.steps`): `eval.lean.LeanBatch` where `steps` is lean and the
    target allows it (`eval.lean.runs_lean`), else `TransformersBatch`; both called as `batch(ids)`."""
    if runs_lean(target, steps):
        return LeanBatch(target, attention, positions, max_new_tokens)
    return TransformersBatch(target, attention, positions)


class TransformersBatch:
    """Rows of one left-padded batch decoded together by the target's own forward pass and a `DynamicCache`:
    `batch(ids)` feeds every row's next tokens and returns the logits of their last position, (rows, V);
    `select(rows)` keeps only those rows."""

    def __init__(self, model, attention: torch.Tensor, positions: torch.Tensor):
        self.model, self.attention, self.positions = model, attention, positions
        self.cache, self.cache_arg = DynamicCache(config=model.config), cache_kwarg(model)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=self.attention, position_ids=self.positions, use_cache=True,
                         logits_to_keep=1, **{self.cache_arg: self.cache})
        self.attention = torch.cat([self.attention, self.attention.new_ones((len(ids), 1))], dim=-1)
        self.positions = self.positions[:, -1:] + 1
        return out.logits[:, -1]

    def select(self, rows: torch.Tensor) -> None:
        self.attention, self.positions = self.attention[rows], self.positions[rows]
        self.cache.batch_select_indices(rows)


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as one left-padded batch: (input_ids, attention_mask), both (rows, longest)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    return input_ids, attention


def cut_at_eos(ids: list[int], eos: int) -> list[int]:
    """A completion up to and including its first EOS (all of it when it has none)."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids
