"""Self-written prompts (`data.source: self`): the target writes the user requests it then answers.

Magpie (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing"): an aligned chat model given its chat template up to the start of a user turn writes a
plausible user request. A short system hint per domain steers what the requests are about. Requests
cut at the length limit, too short, exact duplicates (after normalising case, spacing and
punctuation) and near-duplicates (character 5-gram Jaccard similarity at or above
`near_duplicate`) of a kept request or of any evaluation prompt are dropped.

Candidates are written in rounds, each with a seed of its own, to RUN/generate/self_written/round-*.jsonl
(atomic), and filtered in round order, so a killed run resumes with the same command and the kept
set is the same as an uninterrupted run's. RUN/generate/prompts.jsonl (written last) holds the kept
prompts with their domain; the generate stage then answers them as any prompt set.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from tqdm.auto import tqdm

from eval.fsutil import atomic_write_text
from train.completions import Row, generate_batch
from eval.models import log
from eval.prompts import Prompt, builtin_prompts, read_jsonl_prompts

SENTINEL = "\uE000specdistill-user-turn\uE000"
SHINGLE = 5


def request_prefix(tokenizer, hint: str) -> list[int]:
    """Token ids of the chat template up to where a user message's text begins (system hint first)."""
    messages = [{"role": "user", "content": SENTINEL}]
    if hint:
        messages.insert(0, {"role": "system", "content": hint})
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template without a system role: put the hint nowhere rather than fail
        text = tokenizer.apply_chat_template(messages[-1:], tokenize=False)
    return tokenizer(text[: text.index(SENTINEL)], add_special_tokens=False)["input_ids"]


def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def shingles(text: str) -> set[str]:
    norm = normalize(text)
    return {norm[i:i + SHINGLE] for i in range(max(1, len(norm) - SHINGLE + 1))}


class NearDuplicates:
    """Texts seen so far; `seen(text)` is true for an exact or near duplicate (Jaccard >= threshold)."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.exact: set[str] = set()
        self.sets: list[set[str]] = []
        self.index: dict[str, list[int]] = {}

    def seen(self, text: str) -> bool:
        if normalize(text) in self.exact:
            return True
        mine = shingles(text)
        shared = Counter(i for s in mine for i in self.index.get(s, ()))
        return any(n / (len(mine) + len(self.sets[i]) - n) >= self.threshold for i, n in shared.items())

    def add(self, text: str) -> None:
        self.exact.add(normalize(text))
        self.sets.append(shingles(text))
        for s in self.sets[-1]:
            self.index.setdefault(s, []).append(len(self.sets) - 1)


def accept(text: str, finish: str, cfg) -> str | None:
    """The request as kept, or None: cut at the length limit (unless allowed) or shorter than min_words."""
    text = text.strip()
    if finish != "eos" and not cfg.keep_unfinished:
        return None
    if len(text.split()) < cfg.min_words:
        return None
    return text


def write_self_prompts(recipe, target, tokenizer, out_dir: Path) -> list[Prompt]:
    """Write (or resume writing) the self-written prompts into OUT/prompts.jsonl and return them.
    Main process only: the other processes read the file once it exists."""
    cfg = recipe.data.self_written
    final = Path(out_dir) / "prompts.jsonl"
    if final.is_file():
        return read_jsonl_prompts(final)
    rounds_dir = Path(out_dir) / "self_written"
    domains = list(cfg.domains)
    quota = math.ceil(cfg.num_prompts / len(domains))
    per_round = recipe.generate.batch_size
    max_rounds = math.ceil(cfg.max_attempts * quota / per_round)  # per domain
    prefixes = {d: request_prefix(tokenizer, cfg.domains[d]) for d in domains}
    # Evaluation prompts are seen from the start: a request close to one of them is never trained on.
    dedup = NearDuplicates(cfg.near_duplicate)
    for p in builtin_prompts("independent") + builtin_prompts("held_out"):
        dedup.add(p.prompt)
    kept: dict[str, list[str]] = {d: [] for d in domains}
    sampling = SimpleNamespace(max_new_tokens=cfg.max_tokens, top_p=cfg.top_p, top_k=0, topk_logprobs=0)
    bar = tqdm(total=quota * len(domains), desc="self-written prompts", unit="prompt")
    for r in range(max_rounds):
        short = [d for d in domains if len(kept[d]) < quota]
        if not short:
            break
        path = rounds_dir / f"round-{r:05d}.jsonl"
        if path.is_file():  # written before a kill: the same candidates, filtered the same way
            candidates = [json.loads(line) for line in path.read_text().splitlines()]
        else:
            candidates = []
            for domain in short:
                rows = [Row(None, prefixes[domain], cfg.temperature, s) for s in range(per_round)]
                seed = recipe.seed * 1_000_003 + r * 7_919 + domains.index(domain)
                for ids, finish, _ in generate_batch(target, tokenizer, rows, sampling, seed=seed, steps=recipe.generate.steps):
                    text = tokenizer.decode(ids, skip_special_tokens=True)
                    candidates.append({"domain": domain, "text": text, "finish": finish})
            atomic_write_text(path, "".join(json.dumps(c) + "\n" for c in candidates))
        for c in candidates:
            text = accept(c["text"], c["finish"], cfg)
            if text is None or len(kept[c["domain"]]) >= quota or dedup.seen(text):
                continue
            dedup.add(text)
            kept[c["domain"]].append(text)
            bar.update(1)
    bar.close()
    prompts = [Prompt(id=f"self-{d}-{i:05d}", domain=d, prompt=text, family=f"self-{d}")
               for d in domains for i, text in enumerate(kept[d])]
    short = {d: len(kept[d]) for d in domains if len(kept[d]) < quota}
    if short:
        log(f"generate: self-written prompts: after {max_rounds} rounds some domains are short of {quota}: {short}")
    atomic_write_text(final, "".join(json.dumps({"id": p.id, "domain": p.domain, "family": p.family, "prompt": p.prompt})
                                     + "\n" for p in prompts))
    log(f"generate: {len(prompts)} self-written prompts ({', '.join(f'{d} {len(kept[d])}' for d in domains)}) in {final}")
    return prompts
