"""How a pair is measured: one dataclass, `EvalSettings`, is the recipe's `eval:` section, the source of
`python -m eval`'s options and defaults, and the `settings` of every report. `FieldError` and `check` are the
validation every recipe section shares: the recipe parser prefixes the section ("recipe key 'eval.k': ..."),
the command line names the option ("--k: ...")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Union


COMPILE_MODES = ("auto", "on", "off", "draft")
"""`eval.compile`: per model whichever measured faster here; both compiled; both eager; the draft compiled."""

EAGER_STEPS = ("lean", "transformers")
"""`eval.eager_steps`: how a model that is not compiled runs its steps (eval/lean.py, or the model's own forward)."""


class FieldError(ValueError):
    """Raised inside a settings dataclass; the caller says where the key came from."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise FieldError(key, message)


def check_temperatures(values: list[float], key: str) -> None:
    check(len(values) > 0, key, "expected at least one temperature")
    for t in values:
        check(t >= 0, key, f"temperatures must be >= 0 (0 means greedy), got {t}")


@dataclass
class EvalSettings:
    """How a (target, draft) pair is measured with the built-in speculative decoder: the recipe's `eval:` section,
    `python -m eval`'s options (--k, --draft-confidence, ...) and every report's `settings`."""

    k: int = 4
    """Draft tokens per round (the most per round when draft_confidence > 0)."""
    draft_confidence: float = 0.0
    """Dynamic draft length: a round stops drafting after a token the draft gives a probability below this
    (transformers' assistant_confidence_threshold; exact either way). 0: always k tokens."""
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7, 1.0])
    max_new_tokens: int = 128
    num_prompts: int = 16
    """Evaluation prompts per measurement, taken round-robin over domains (all of a smaller set)."""
    prompts: str = "independent"
    """`independent`: the hand-written evaluation set (160 prompts, no template shared with training);
    `held_out`: the built-in prompts of template families training never sees; or a JSON lines file."""
    top_p: float = 1.0
    top_k: int = 0
    fallback_window: int = 100
    """Acceptance outcomes in the guardrail's rolling window."""
    fallback_threshold: float = 0.4
    """Below this rolling acceptance a request finishes with vanilla decoding (0 disables)."""
    compile: Union[Literal["auto", "on", "off", "draft"], bool] = "auto"
    """`on`: a static KV cache and compiled decode steps (CUDA graphs on a GPU; eval/compiled.py); `off`: eager;
    `draft`: the draft's steps compiled, the target eager; `auto`: compile, time a draft token and the target's
    passes both ways, and keep for each model the faster (eager where compiling cannot run).
    YAML reads a bare on/off as true/false: both spellings mean the same."""
    eager_steps: Literal["lean", "transformers"] = "lean"
    """How a model decoded eagerly runs its steps. `lean`: a Llama-family model (Llama, Qwen2) on a CPU runs its
    forward pass written out over a KV cache of plain tensors (eval/lean.py: the same maths in fewer calls, both
    models' tokens cheaper; docs/eval.md measures them); any other model, or one on a GPU, runs transformers'
    forward. `transformers`: every model runs its own forward with a `DynamicCache`."""
    reuse_vanilla: bool = False
    """A run measuring several checkpoints against one target: decode each request vanilla once and give later
    checkpoints its tokens and wall time (eval/report.py, `VanillaCache`), which halves a later checkpoint's
    measurement. Off by default: a speedup then divides times taken minutes apart, and on a shared CPU the
    machine's speed drifted by a third between two checkpoints of one run (docs/eval.md); paired, each
    request's vanilla and speculative decodes run back to back."""

    def __post_init__(self):
        if isinstance(self.compile, bool):
            self.compile = "on" if self.compile else "off"
        check(self.compile in COMPILE_MODES, "compile", f"must be auto, on, off or draft, got {self.compile!r}")
        check(self.eager_steps in EAGER_STEPS, "eager_steps", f"must be lean or transformers, got {self.eager_steps!r}")
        check(self.k >= 1, "k", f"must be >= 1, got {self.k}")
        check_temperatures(self.temperatures, "temperatures")
        for key in ("max_new_tokens", "num_prompts", "fallback_window"):
            check(getattr(self, key) > 0, key, "must be > 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.top_k >= 0, "top_k", "must be >= 0 (0 disables)")
        check(0 <= self.fallback_threshold <= 1, "fallback_threshold", "must be in [0, 1]")
        check(0 <= self.draft_confidence < 1, "draft_confidence", f"must be in [0, 1), got {self.draft_confidence}")
        check(isinstance(self.reuse_vanilla, bool), "reuse_vanilla", f"must be true or false, got {self.reuse_vanilla!r}")


    @property
    def fixed_k(self) -> int | None:
        """The draft length of every round, or None when it is dynamic."""
        return None if self.draft_confidence > 0 else self.k

    @classmethod
    def of_report(cls, report: dict) -> "EvalSettings":
        """The settings a report was measured with (a key an older report lacks takes its default)."""
        stored = report["settings"]
        return cls(**{f.name: stored[f.name] for f in dataclasses.fields(cls) if f.name in stored})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
