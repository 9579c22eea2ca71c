"""Recipe schema: one YAML file per run, parsed into typed dataclasses; `load_recipe(path, overrides)`.

Every section is a dataclass whose fields carry their docstrings; ranges are checked in
`__post_init__`. An unknown key, a wrong type or a value out of range raises `UserError`
naming the dotted key (`distill.lr`), which the commands print as one line with exit status 2.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from eval.errors import UserError
from eval.models import DEFAULT_TARGET
from eval.settings import EvalSettings, FieldError, check, check_temperatures

LOSS_NAMES = ("forward_kl", "reverse_kl", "jsd", "tvd", "sequence_ce")
STAGES = ("generate", "distill", "eval", "export")
_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


@dataclass
class ModelSection:
    """The target model."""

    model: str = DEFAULT_TARGET
    """Hub id, local directory, a .gguf file, or `smollm2-135m-instruct` (the embedded default)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """`auto`: bfloat16 on a GPU that supports it, float32 on CPU."""
    trust_remote_code: bool = False
    """Run model code shipped with a hub repository. Off unless you trust the repository."""
    revision: Optional[str] = None
    """Hub revision (branch, tag or commit)."""


@dataclass
class DraftSection:
    """How the draft is initialised."""

    init: Literal["pretrained", "layers", "config"] = "layers"
    """`pretrained`: load `model`; `layers`: copy `layers` of the target plus its embeddings,
    final norm and head; `config`: fresh weights, the target's config with `config` overrides."""
    model: Optional[str] = None
    """For `init: pretrained`: hub id, local directory or .gguf file (same tokenizer as the target)."""
    layers: list[int] = field(default_factory=lambda: [0, -1])
    """For `init: layers`: indices of the target's decoder layers to keep (negative counts from the end)."""
    config: dict[str, Any] = field(default_factory=dict)
    """For `init: config`: config fields overriding the target's (num_hidden_layers, hidden_size, ...)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The draft's serving dtype (eval, export); `auto`: the target's. Training keeps float32 master weights."""
    trust_remote_code: bool = False
    revision: Optional[str] = None
    vocab_size: int = 0
    """A reduced draft vocabulary (EAGLE-3 style): the draft's head scores only the `vocab_size` tokens with the
    most target probability in the generated data (plus EOS), in training and decoding; 0: every token. The
    ids are saved as `draft_vocab.json` beside each checkpoint and the export, whose weights keep the full head."""

    def __post_init__(self):
        check(self.vocab_size >= 0, "vocab_size", "expected 0 (the full vocabulary) or a token count")
        check(self.init != "pretrained" or bool(self.model), "model", "required when init is 'pretrained'")
        check(self.init != "layers" or len(self.layers) > 0, "layers", "expected at least one layer index")
        check(len(set(self.layers)) == len(self.layers), "layers", "layer indices must be distinct")


DEFAULT_SELF_HINTS = {
    "code": "The user is a programmer and asks for help with code: a function to write, a bug to fix, a concept, "
            "a command or a library to explain.",
    "math": "The user asks a math question: arithmetic, algebra, geometry, probability or a word problem, and "
            "wants the working shown.",
    "json": "The user asks for structured data as JSON: information to convert, a config file, an API payload or "
            "an example record.",
    "prose": "The user asks for a piece of writing: a story, a poem, a description, a summary, a letter or a "
             "product text.",
    "chat": "The user chats about everyday life and asks for advice, ideas, recommendations or an opinion.",
}


@dataclass
class SelfWrittenSection:
    """Self-written prompts (Magpie): the target writes user requests from its chat template, one system hint
    per domain; exact and near-duplicates (of each other and of the evaluation sets) are dropped."""

    num_prompts: int = 1000
    """Requests to keep, split evenly over the domains."""
    domains: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_SELF_HINTS))
    """Domain -> the system hint that steers the requests (an empty hint: no system message)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 96
    """The longest request, in tokens; longer ones are cut and dropped (unless keep_unfinished)."""
    min_words: int = 3
    near_duplicate: float = 0.6
    """Character 5-gram Jaccard similarity at or above which a request is a near-duplicate."""
    max_attempts: float = 4.0
    """Stop after generating this many times a domain's quota in candidates, kept or not."""
    keep_unfinished: bool = False
    with_builtin: bool = False
    """Also use the built-in train prompts (a mixture of templated and self-written prompts)."""

    def __post_init__(self):
        check(self.num_prompts > 0, "num_prompts", "must be > 0")
        check(len(self.domains) > 0, "domains", "expected at least one domain")
        check(self.temperature > 0, "temperature", "must be > 0 (greedy would write one request per domain)")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.max_tokens > 0, "max_tokens", "must be > 0")
        check(self.min_words >= 1, "min_words", "must be >= 1")
        check(0 < self.near_duplicate <= 1, "near_duplicate", "must be in (0, 1]")
        check(self.max_attempts >= 1, "max_attempts", "must be >= 1")


@dataclass
class DataSection:
    """Where prompts come from."""

    source: Literal["builtin", "files", "hub", "self"] = "builtin"
    """`builtin`: the prompt set shipped with specdistill; `files`: local JSON lines / CSV / parquet;
    `hub`: a Hugging Face dataset id; `self`: the target writes the prompts (`self_written`)."""
    path: Optional[str] = None
    """For `files`: a file or glob; for `hub`: the dataset id."""
    split: str = "train"
    prompt_column: str = "prompt"
    id_column: Optional[str] = "id"
    domain_column: Optional[str] = "domain"
    chat_column: Optional[str] = None
    """A column holding a list of chat messages ({role, content}); used instead of `prompt_column`."""
    max_prompts: Optional[int] = None
    """Use at most this many prompts (None: all), taken round-robin over domains."""
    max_prompt_tokens: int = 512
    self_written: SelfWrittenSection = field(default_factory=SelfWrittenSection)
    """For `self`: how the target writes its prompts."""

    def __post_init__(self):
        check(self.source in ("builtin", "self") or bool(self.path), "path", f"required when source is '{self.source}'")
        check(self.max_prompts is None or self.max_prompts > 0, "max_prompts", "must be > 0")
        check(self.max_prompt_tokens > 0, "max_prompt_tokens", "must be > 0")


@dataclass
class GenerateSection:
    """The target writes training data."""

    temperatures: list[float] = field(default_factory=lambda: [0.0])
    """Sampling temperatures; 0 means greedy."""
    num_samples: int = 1
    """Completions per prompt and temperature (greedy always writes one)."""
    max_new_tokens: int = 128
    """The longest completion, in tokens (a cut one is kept, with finish reason `length`)."""
    batch_size: int = 8
    """Rows per batched `generate` call."""
    top_p: float = 1.0
    """Nucleus sampling at T > 0 (1: off)."""
    top_k: int = 0
    """Top-k sampling at T > 0 (0: off)."""
    topk_logprobs: int = 0
    """If > 0, also store the target's top-k log-probs at every completion position."""
    dtype: Literal["target", "auto", "float32", "bfloat16", "float16"] = "target"
    """The dtype the target generates in (a copy of it for the stage when it differs from `target.dtype`).
    `target`: the target's own; `auto`: bfloat16 on a GPU that supports it and on a CPU that multiplies bf16
    natively (avx512_bf16, AMX), else the target's own."""
    shard_size: int = 256
    """Rows per shard on disk."""
    steps: Literal["lean", "transformers"] = "lean"
    """How the target's forward passes run: `lean`, a Llama-family target on a CPU runs lean steps (eval/lean.py:
    its forward pass written out over a plain KV cache, the same maths in fewer calls); `transformers`, or any
    other target or device, runs its own forward with a `DynamicCache`."""

    def __post_init__(self):
        check_temperatures(self.temperatures, "temperatures")
        for key in ("num_samples", "max_new_tokens", "batch_size", "shard_size"):
            check(getattr(self, key) > 0, key, "must be > 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.top_k >= 0, "top_k", "must be >= 0 (0 disables)")
        check(self.topk_logprobs >= 0, "topk_logprobs", "must be >= 0")


@dataclass
class DistillSection:
    """The draft learns from the target."""

    losses: dict[str, float] = field(default_factory=lambda: {"reverse_kl": 1.0})
    """Loss name -> weight. Names: forward_kl, reverse_kl, jsd, tvd, sequence_ce."""
    jsd_beta: float = 0.5
    temperature: float = 1.0
    """Temperature of both distributions in the loss: train at the temperature you serve at."""
    target_signal: Literal["online", "cached"] = "online"
    """`online`: the target's forward pass in the loop; `cached`: top-k log-probs from generate."""
    on_policy_lambda: float = 0.0
    """Probability that a batch's completions are sampled by the current draft (GKD's lambda)."""
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 10
    max_steps: int = 100
    batch_size: int = 8
    """Per-process micro-batch size (sequences)."""
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    max_seq_len: int = 512
    group_by_length: bool = False
    """Batch examples of alike length together (each span of 50 steps sorted by length, the steps then shuffled):
    less padding in the draft's forward, the same examples each epoch in another order (as HF Trainer's)."""
    loss_chunk_size: int = 64
    """Loss positions per chunk: the draft's head runs inside the loss, one chunk of logits at a time (0: full logits)."""
    checkpoint_every: int = 50
    keep_checkpoints: int = 0
    """Keep the newest N checkpoints, plus the best measured one (0: keep all)."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """`auto`: bf16 autocast on a GPU with bf16 and on a CPU with native bf16 (avx512_bf16, AMX), else none."""
    seed: Optional[int] = None
    """The training run's seed (data order, on-policy draws, a `config` draft's initial weights); null: the
    recipe's `seed`. Another value on the same generated data repeats the training run alone, which is how a
    study measures the run-to-run spread."""
    freeze_embeddings: bool = False
    """Keep the draft's input embeddings and output head fixed (with `init: layers` they are the target's own;
    training only the layers between them is cheaper and keeps the head aligned with the target's)."""

    def __post_init__(self):
        check(len(self.losses) > 0, "losses", "expected at least one loss")
        for name, weight in self.losses.items():
            check(name in LOSS_NAMES, f"losses.{name}", f"unknown loss; expected one of {', '.join(LOSS_NAMES)}")
            check(weight >= 0, f"losses.{name}", f"weight must be >= 0, got {weight}")
        check(0 <= self.jsd_beta <= 1, "jsd_beta", "must be in [0, 1]")
        check(self.temperature > 0, "temperature", "must be > 0")
        check(0 <= self.on_policy_lambda <= 1, "on_policy_lambda", "must be in [0, 1]")
        check(self.on_policy_lambda == 0 or any(name != "sequence_ce" for name in self.losses), "on_policy_lambda",
               "on-policy batches learn from a divergence (draft-written text is no target); add one to 'losses'")
        check(self.lr > 0, "lr", "must be > 0")
        check(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        check(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        for key in ("max_steps", "batch_size", "grad_accum", "max_seq_len", "checkpoint_every"):
            check(getattr(self, key) > 0, key, "must be > 0")
        check(self.max_grad_norm > 0, "max_grad_norm", "must be > 0")
        check(self.loss_chunk_size >= 0, "loss_chunk_size", "must be >= 0")
        check(self.keep_checkpoints >= 0, "keep_checkpoints", "must be >= 0")


@dataclass
class ExportSection:
    """The best checkpoint, by measured speedup, as a plain Hugging Face model."""

    push_to_hub: bool = False
    hub_model_id: Optional[str] = None
    wandb_artifact: bool = False

    def __post_init__(self):
        check(not self.push_to_hub or bool(self.hub_model_id), "hub_model_id", "required when push_to_hub is true")


@dataclass
class TrackingSection:
    report_to: Literal["wandb", "none"] = "wandb"
    """`wandb` runs offline when no API key is set; `none` turns tracking off."""
    project: str = "specdistill"
    run_name: Optional[str] = None


@dataclass
class Recipe:
    """One run: target, draft, data and the four stages."""

    name: str = "run"
    """Run name; the run directory is `runs/<name>/` unless `output_dir` is set."""
    output_dir: Optional[str] = None
    seed: int = 0
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    """Stages to run, in pipeline order."""
    target: ModelSection = field(default_factory=ModelSection)
    draft: DraftSection = field(default_factory=DraftSection)
    data: DataSection = field(default_factory=DataSection)
    generate: GenerateSection = field(default_factory=GenerateSection)
    distill: DistillSection = field(default_factory=DistillSection)
    eval: EvalSettings = field(default_factory=EvalSettings)
    export: ExportSection = field(default_factory=ExportSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)

    def __post_init__(self):
        check(bool(self.name) and "/" not in self.name, "name", "expected a non-empty name without '/'")
        for stage in self.stages:
            check(stage in STAGES, "stages", f"unknown stage '{stage}'; expected some of {', '.join(STAGES)}")

    @property
    def train_seed(self) -> int:
        """The seed of the distill stage (`distill.seed`, else `seed`)."""
        return self.seed if self.distill.seed is None else self.distill.seed

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------- parsing


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp, key: str) -> Any:
    """Check `value` against the annotation `tp`; returns the value (ints widened to float)."""
    bad = UserError(f"recipe key '{key}': expected {_type_name(tp)}, got {value!r}")
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise bad
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except UserError:
                pass
        raise bad
    if origin is list:
        if not isinstance(value, list):
            raise bad
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        _, val_tp = typing.get_args(tp)
        return {str(k): _coerce(v, val_tp, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_RE.match(value):
            return float(value)  # YAML 1.1 reads `1e-4` as a string; every user means the number
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    raise TypeError(f"unsupported annotation {tp} for {key}")


def _build(cls, data: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise UserError(f"unknown recipe key '{dotted}'; expected one of: {', '.join(sorted(names))}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    try:
        return cls(**kwargs)
    except FieldError as err:
        dotted = f"{prefix}.{err.key}" if prefix else err.key
        raise UserError(f"recipe key '{dotted}': {err.message}") from None


def apply_override(data: dict, override: str) -> None:
    """Apply `a.b.c=value` to the raw recipe mapping; the value is parsed as YAML (`1e-4`, `[0, 0.7]`)."""
    if "=" not in override:
        raise UserError(f"override '{override}': expected key.sub=value")
    dotted, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    parts = dotted.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"override '{override}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_recipe(data: dict) -> Recipe:
    if not isinstance(data, dict):
        raise UserError("a recipe must be a YAML mapping of sections (target, draft, data, ...)")
    return _build(Recipe, data, "")


def read_recipe_file(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"recipe file '{path}' not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"recipe file '{path}'{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    return data if data is not None else {}


def load_recipe(path: str | os.PathLike, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe, apply dotted overrides, and validate everything."""
    data = read_recipe_file(path)
    if not isinstance(data, dict):
        raise UserError(f"recipe file '{path}': expected a mapping of sections")
    data.setdefault("name", Path(path).stem)
    for override in overrides:
        apply_override(data, override)
    return parse_recipe(data)


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)
