"""The target writing completions: a row is (prompt, temperature, sample), and one batched `generate` call answers
rows of one temperature with their top-k log-probs. The generate stage (train/generate.py) shards rows over
processes and files; self-written prompts (train/self_written.py) use the same call to write requests."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from eval.prompts import Prompt, encode_prompt


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
def generate_batch(target, tokenizer, rows: list[Row], generate, seed: int):
    """Left-padded batched `generate` at one temperature; returns per row (completion ids, finish reason, top-k)."""
    pad = tokenizer.pad_token_id
    width = max(len(r.prompt_ids) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        attention[i, width - len(r.prompt_ids):] = 1
    device = next(target.parameters()).device
    temperature = rows[0].temperature
    eos = tokenizer.eos_token_id
    kwargs = dict(do_sample=False) if temperature == 0 else dict(
        do_sample=True, temperature=temperature, top_p=generate.top_p, top_k=generate.top_k or None)
    torch.manual_seed(seed)
    steps = []  # per generate step, the top-k log-probs of every row (the full logits are never kept)
    with _topk_per_step(target, generate.topk_logprobs, steps):
        out = target.generate(
            input_ids=input_ids.to(device), attention_mask=attention.to(device), max_new_tokens=generate.max_new_tokens,
            eos_token_id=eos, pad_token_id=pad, return_dict_in_generate=True, **kwargs,
        )
    completions = out.sequences[:, width:].tolist()
    if steps:
        values = torch.stack([v for v, _ in steps], dim=1).half().tolist()  # (rows, steps, k)
        indices = torch.stack([i for _, i in steps], dim=1).tolist()
    results = []
    for i, ids in enumerate(completions):
        finish = "length"
        if eos in ids:
            ids = ids[: ids.index(eos) + 1]
            finish = "eos"
        topk = (indices[i][: len(ids)], values[i][: len(ids)]) if steps else None
        results.append((ids, finish, topk))
    return results


@contextlib.contextmanager
def _topk_per_step(target, k: int, steps: list):
    """While `generate` runs, each pass's top-`k` log-probs of the raw logits (temperature 1, float32, the
    last position of every row) go to `steps` as (values, indices): what `output_logits=True` would give
    after a log-softmax and top-k, without holding every step's logits over the whole vocabulary."""
    if k <= 0:
        yield
        return

    def record(_module, _inputs, output):
        values, indices = output.logits[:, -1].float().log_softmax(-1).topk(k, dim=-1)
        steps.append((values, indices))

    handle = target.register_forward_hook(record)
    try:
        yield
    finally:
        handle.remove()
