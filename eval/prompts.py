"""Prompt sets: the built-in set (train / held-out split by template family), the independent
evaluation set, JSON lines, CSV, parquet, hub datasets.

A prompt is a user message (the chat template is applied when the tokenizer has one) or a list of
chat messages, with an `id` and a `domain` used to break metrics down.

Two evaluation sets ship with specdistill:
- `held_out`: built-in prompts of template families the train split never uses (scripts/make_prompts.py);
  still template siblings of the training prompts in style and topic;
- `independent`: 160 prompts written by hand over the five domains, of varied length, style and task,
  not from any template and never used for training. The default eval measures on it, since a user's
  prompts look like it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eval.errors import UserError

BUILTIN_PATH = Path(__file__).parent / "data" / "prompts.jsonl"
INDEPENDENT_PATH = Path(__file__).parent / "data" / "independent.jsonl"
EVAL_SETS = ("independent", "held_out")


@dataclass
class Prompt:
    id: str
    domain: str
    prompt: str | None = None
    messages: list[dict] | None = None
    """Chat messages [{role, content}, ...]; when set, used instead of `prompt`."""
    family: str | None = None
    """The template a built-in prompt was written from (held-out families never appear in training)."""
    split: str | None = None

    def as_messages(self) -> list[dict]:
        return self.messages if self.messages is not None else [{"role": "user", "content": self.prompt}]


def row_to_prompt(row: dict, index: int, where: str, *, prompt_column="prompt", id_column="id",
                   domain_column="domain", chat_column=None) -> Prompt:
    messages = None
    if chat_column:
        messages = row.get(chat_column)
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
            raise UserError(f"{where}: column '{chat_column}' must hold a list of {{role, content}} messages")
        # The conversation up to its last user turn: the target writes the reply (chat datasets such as
        # UltraChat also hold the reference replies, which must not be part of the prompt).
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            raise UserError(f"{where}: column '{chat_column}' holds no user message")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages[: users[-1] + 1]]
        text = None
    else:
        text = row.get(prompt_column)
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"{where}: expected a non-empty string in '{prompt_column}'")
    pid = row.get(id_column) if id_column else None
    domain = row.get(domain_column) if domain_column else None
    return Prompt(id=str(pid) if pid is not None else str(index), domain=str(domain or "general"),
                  prompt=text, messages=messages, family=row.get("family"), split=row.get("split"))


def read_jsonl_prompts(path: str | Path, **columns) -> list[Prompt]:
    """JSON lines with `prompt` (or a chat column) and optional `id`, `domain`; errors name file and line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompt file '{path}' not found")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"prompt file '{path}' line {number}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise UserError(f"prompt file '{path}' line {number}: expected a JSON object")
        prompts.append(row_to_prompt(row, len(prompts), f"prompt file '{path}' line {number}", **columns))
    if not prompts:
        raise UserError(f"prompt file '{path}' holds no prompts")
    return prompts


def builtin_prompts(split: str = "train") -> list[Prompt]:
    """The prompt sets shipped with specdistill; `split` is `train`, `held_out`, `all` or `independent`."""
    if split == "independent":
        return read_jsonl_prompts(INDEPENDENT_PATH)
    prompts = read_jsonl_prompts(BUILTIN_PATH)
    return prompts if split == "all" else [p for p in prompts if p.split == split]


def eval_prompt_set(name: str) -> list[Prompt]:
    """An evaluation set by name (`independent`, `held_out`) or a JSON lines file of prompts."""
    return builtin_prompts(name) if name in EVAL_SETS else read_jsonl_prompts(name)


def spread(prompts: list[Prompt], n: int | None) -> list[Prompt]:
    """At most `n` prompts, taken round-robin over domains so a short eval still covers each one."""
    if n is None or n >= len(prompts):
        return prompts
    by_domain: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_domain.setdefault(p.domain, []).append(p)
    out, i = [], 0
    while len(out) < n:
        for group in by_domain.values():
            if i < len(group) and len(out) < n:
                out.append(group[i])
        i += 1
    return out


def encode_prompt(tokenizer, prompt: Prompt, max_tokens: int | None = None) -> list[int]:
    """Token ids of the prompt, through the chat template when the tokenizer has one (left-truncated)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(prompt.as_messages(), add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    else:
        text = "\n".join(m["content"] for m in prompt.as_messages())
        ids = tokenizer(text)["input_ids"]
    ids = list(ids)
    return ids[-max_tokens:] if max_tokens else ids
