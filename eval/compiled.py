"""A static KV cache and compiled decode steps (`eval.compile`, `python -m eval --compile`), as serving stacks run.

gpt-fast and vLLM decode with a KV cache allocated once and a decode step compiled (on a GPU captured as a
CUDA graph): a small model's step is otherwise bound by per-call overhead (kernel launches, Python, the
allocator), not by the bytes of its weights. `StaticLM` is `CachedLM` on a transformers `StaticCache` sized
once for the longest request (prompt + new tokens + a round's drafts). A rejected draft is rolled back by
position: the cache's length goes down and the next pass overwrites the stale entries, which the causal
mask hides until then. Nothing is re-allocated.

Two steps are compiled per model, once per process: one token (a draft token, a vanilla step) and a verify
pass over 2..`max_verify` tokens (one graph, dynamic in the token count; CUDA graphs record each count
once). The draft catches up on the two tokens it has not seen after a fully accepted round with two
one-token steps, as gpt-fast does. The prefill (a whole prompt) runs eagerly on the same cache.

On a CPU the steps can be compiled with inductor's `freezing` (its CPU inference recipe; `freeze=True`,
off by default, see `FREEZE_ON_CPU`): the weights are folded in as constants and the linear layers' weights
prepacked for oneDNN once, where an unfrozen step reads them as inputs and a float32 matmul lays each
weight out again on every call. Frozen steps keep copies of the weights, so a model changed in place since
is compiled again (`static_lm` checks the tensors' versions).

The numerics are those of the compiled kernels, for vanilla and speculative decoding alike, so compiled is
compared with compiled; exactness does not depend on them (the greedy equality and the sampling test run
in this mode too, tests/test_compiled.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eval.lean import LeanLM, eager_lm
from eval.packed import weights_version
from eval.settings import COMPILE_MODES
from eval.speculative import CachedLM


def compile_supported(device: torch.device) -> str | None:
    """Why torch.compile cannot run on `device` here (None: it can)."""
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        return "no C++ compiler for inductor's CPU kernels"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
    if device.type not in ("cpu", "cuda"):
        return f"compiled decoding is not set up for {device.type}"
    return None


FREEZE_ON_CPU = False
"""Compile CPU steps with inductor's `freezing` by default. Off: on the development CPU the frozen verify pass
was cheaper but whole requests were slower (`scripts/bench_decoder.py --modes compiled,compiled-frozen`;
docs/eval.md)."""


class StaticLM(CachedLM):
    """`CachedLM` with a static cache of `max_length` positions and compiled steps (`compiled=False`: the same
    cache, eager steps). `max_verify`: the longest verify pass (k + 1)."""

    def __init__(self, model, vocab_size: int, token_ids: torch.Tensor | None = None, *, max_length: int,
                 max_verify: int = 9, compiled: bool = True, freeze: bool | None = None):
        self.max_length = max_length
        self.max_verify = max_verify
        super().__init__(model, vocab_size, token_ids)
        self.compiled = compiled
        self.frozen = compiled and self.would_freeze(model, freeze)
        self.weights_version = weights_version(model)
        self.step_one, self.step_many = self._step_one, self._step_many
        self._tracing = contextlib.nullcontext
        if compiled:
            # Each checkpoint's draft is a new graph of the same code; the default of 8 would fall back to eager.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            if self.device.type == "cuda":
                how = {"mode": "reduce-overhead"}  # CUDA graphs
            else:  # inductor's CPU inference recipe: weights folded in as constants, linear weights prepacked
                how = {"options": {"freezing": True}} if self.frozen else {}
                # Dynamo reads the flag itself while tracing (it makes the parameters constants): see _call.
                self._tracing = (lambda: torch._inductor.config.patch(freezing=True)) if self.frozen else contextlib.nullcontext
            self.step_one = torch.compile(self._step_one, fullgraph=True, dynamic=False, **how)
            self.step_many = torch.compile(self._step_many, fullgraph=True, dynamic=True, **how)

    @staticmethod
    def would_freeze(model, freeze: bool | None = None) -> bool:
        """Whether compiled steps of `model` fold its weights in (`freeze`; None: `FREEZE_ON_CPU` on a CPU)."""
        on_cpu = next(model.parameters()).device.type == "cpu"
        return on_cpu and (FREEZE_ON_CPU if freeze is None else freeze)

    def new_cache(self):
        from transformers import StaticCache

        return StaticCache(config=self.model.config, max_cache_len=self.max_length)

    def reset(self) -> None:
        self.crop(0)  # the same tensors serve every request

    def _step_one(self, ids: torch.Tensor) -> torch.Tensor:
        return CachedLM.run(self, ids, 1)

    def _step_many(self, ids: torch.Tensor) -> torch.Tensor:
        return CachedLM.run(self, ids, ids.shape[1])

    def run(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        n = ids.shape[1]
        if self.length + n > self.max_length:
            raise ValueError(f"{self.length + n} tokens do not fit the static cache of {self.max_length}")
        if keep == 1 and n <= 2:
            for i in range(n):  # one-token steps (the draft catching up on at most two tokens)
                logits = self._call(self.step_one, ids[0, i].view(1, 1))  # strides (1, 1) as any one-token input: one graph
            return logits
        if keep == n and n <= self.max_verify:
            if self.compiled:
                torch._dynamo.mark_dynamic(ids, 1)  # one graph for every verify length, not one for 2 and one for the rest
            return self._call(self.step_many, ids)
        return CachedLM.run(self, ids, keep)  # the prefill, eagerly

    def _call(self, step, ids: torch.Tensor) -> torch.Tensor:
        if self.compiled and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
            return step(ids).clone()  # a CUDA graph's output is overwritten by its next replay
        with self._tracing():
            return step(ids)

    @torch.no_grad()
    def warm_up(self, prompt_ids: list[int]) -> float:
        """Compile (or load) every step on a real prompt before anything is timed, as decoding calls them (no
        gradient, one and two one-token steps, every verify length); returns the seconds it took."""
        start = time.perf_counter()
        for _ in range(2):  # a second call runs what the first compiled (CUDA graphs record on it)
            self.reset()
            self.forward(prompt_ids[:-1] or prompt_ids, keep=1)
            self.forward(prompt_ids[-1:], keep=1)
            self.forward(prompt_ids[-1:] * 2, keep=1)
            for n in range(2, self.max_verify + 1):  # every verify length, so CUDA graphs are recorded now
                self.forward(prompt_ids[-1:] * n, keep=n)
                self.crop(self.length - n)
        self.reset()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start


_LMS: "OrderedDict[object, StaticLM]" = OrderedDict()
"""The process's `StaticLM`s, most recently used last: the target, measured at every checkpoint, is compiled
once; a checkpoint's draft is dropped (with its cache and graphs) once two newer models have been used."""
_KEEP = 2


def static_lm(model, vocab_size: int, token_ids: torch.Tensor | None, *, max_length: int, max_verify: int,
              freeze: bool | None = None) -> StaticLM:
    """The process's compiled `StaticLM` of `model`, built (or rebuilt where `_serves` says the kept one cannot
    serve) on demand."""
    lm = _LMS.pop(model, None)
    if lm is not None and lm.frozen and lm.weights_version != weights_version(model):
        # Frozen steps hold copies of the weights, and dynamo's guards would hand the new steps the same
        # compiled code: start every compilation afresh (the pipeline never gets here: it measures copies).
        torch._dynamo.reset()
        lm = None
    if lm is None or not _serves(lm, model, vocab_size, token_ids, max_length, max_verify, freeze):
        lm = StaticLM(model, vocab_size, token_ids, max_length=max_length, max_verify=max_verify, freeze=freeze)
    _LMS[model] = lm
    while len(_LMS) > _KEEP:
        _LMS.popitem(last=False)
    return lm


def forget_compiled() -> None:
    """Drop the process's compiled `StaticLM`s and dynamo's compiled code, so the next compiled decoding
    compiles afresh (a benchmark comparing inductor settings: nothing is served by another setting's graphs)."""
    _LMS.clear()
    torch._dynamo.reset()


def _serves(lm: StaticLM, model, vocab_size: int, token_ids: torch.Tensor | None, max_length: int, max_verify: int,
            freeze: bool | None) -> bool:
    """Whether `lm`, built earlier for `model`, serves these settings: the same head (vocabulary size and draft
    token ids), a cache and verify pass at least as long, and the same freezing."""
    same_head = lm.vocab_size == vocab_size and (lm.token_ids is None) == (token_ids is None) and (
        token_ids is None or torch.equal(lm.token_ids, token_ids))
    return (same_head and lm.max_length >= max_length and lm.max_verify >= max_verify
            and lm.frozen == StaticLM.would_freeze(model, freeze))


def no_recompiles(compiled: bool):
    """While decoding is timed, a recompilation is an error rather than seconds hidden in a request's wall time."""
    return torch.compiler.set_stance("fail_on_recompile") if compiled else contextlib.nullcontext()


def steps_of(lm) -> str:
    """How a decoder runs its steps: `compiled` (a `StaticLM`), `lean` (eval/lean.py) or `transformers` (the model's
    own forward)."""
    return "compiled" if isinstance(lm, StaticLM) else "lean" if isinstance(lm, LeanLM) else "transformers"


@dataclass
class Decoders:
    """What the eval decodes with: each model's eager decoder (its lean steps, or the model itself with a fresh
    DynamicCache per request: `eval.lean.eager_lm`) or its compiled `StaticLM`, and how that was decided."""

    target: object
    draft: object
    target_compiled: bool
    draft_compiled: bool
    requested: str
    compile_seconds: float = 0.0
    note: str = ""
    costs: dict = field(default_factory=dict)
    """auto: the measured costs (ms) of each mode, {"eager": ..., "compiled": ...}."""

    @property
    def compiled(self) -> bool:
        """Whether any step is compiled."""
        return self.target_compiled or self.draft_compiled

    @property
    def mode(self) -> str:
        return {(True, True): "compiled", (False, False): "eager", (False, True): "compiled draft",
                (True, False): "compiled target"}[(self.target_compiled, self.draft_compiled)]

    @contextlib.contextmanager
    def running(self, target, draft, packed: bool = True):
        """While decoding with these decoders: a model run by transformers' eager forward reads packed linear
        weights (`packed`, eval/packed.py; lean steps pack their own), and a recompilation is an error rather than
        seconds hidden in a request's wall time."""
        from eval.packed import packed_linears

        with (packed_linears(target, enabled=packed and self.target_steps == "transformers"),
              packed_linears(draft, enabled=packed and self.draft_steps == "transformers"), no_recompiles(self.compiled)):
            yield

    @property
    def target_steps(self) -> str:
        return steps_of(self.target)

    @property
    def draft_steps(self) -> str:
        return steps_of(self.draft)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "target_compiled": self.target_compiled, "draft_compiled": self.draft_compiled,
                "target_steps": self.target_steps, "draft_steps": self.draft_steps,
                "requested": self.requested, "compile_seconds": self.compile_seconds, "note": self.note,
                "costs": self.costs}


_AUTO: "weakref.WeakKeyDictionary[object, tuple[bool, bool, str]]" = weakref.WeakKeyDictionary()
"""auto's decision per target (target compiled, draft compiled, why) for the rest of the process: every checkpoint
of a run is decoded the same way, so checkpoints are compared by their drafts, not by which mode a noisy
measurement picked for each."""


def decisions_path():
    """Where auto's decisions are remembered between processes: `SPECDISTILL_AUTO_DECISIONS` (empty: nowhere),
    default compile_auto.json in the cache (`SPECDISTILL_CACHE`)."""
    from eval.models import cache_dir

    value = os.environ.get("SPECDISTILL_AUTO_DECISIONS")
    if value is not None:
        return Path(value) if value else None
    return cache_dir() / "compile_auto.json"


def decision_key(target, draft, draft_vocab: torch.Tensor | None, k_max: int, eager_steps: str = "lean") -> str:
    """What auto's measurement depends on: the processor, the torch version, both models' sizes and dtypes, the
    draft's head, the longest verify pass and how eager steps run (what compiled steps are measured against)."""
    from eval.models import describe_processor, dtype_name

    def shape(model) -> str:
        first = next(model.parameters())
        return f"{type(model).__name__} {sum(p.numel() for p in model.parameters())} {dtype_name(first.dtype)}"

    device = next(target.parameters()).device
    head = "full head" if draft_vocab is None else f"head of {len(draft_vocab)}"
    return (f"{describe_processor(device)} | torch {torch.__version__} | target {shape(target)} | "
            f"draft {shape(draft)}, {head} | k<={k_max} | eager steps {eager_steps}")


def remembered(key: str) -> dict | None:
    """The decision remembered for `key`; None where there is none, or only one taken before auto decided per
    model (a single `compiled` for both), which is measured again."""
    path = decisions_path()
    if path is None or not path.is_file():
        return None
    try:
        decision = json.loads(path.read_text()).get(key)
    except (ValueError, OSError):  # unreadable: measured again, and rewritten
        return None
    return decision if isinstance(decision, dict) and {"target", "draft", "note", "decided"} <= set(decision) else None


def remember(key: str, target_compiled: bool, draft_compiled: bool, note: str) -> None:
    from eval.fsutil import atomic_write_json

    path = decisions_path()
    if path is None:
        return
    try:
        decisions = json.loads(path.read_text()) if path.is_file() else {}
    except (ValueError, OSError):
        decisions = {}
    decisions[key] = {"target": target_compiled, "draft": draft_compiled, "note": note,
                      "decided": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, decisions)


def mean_target_pass(costs) -> float:
    """A target pass averaged over every length a round can verify (1 to k + 1 tokens; 1 is also vanilla
    decoding's step). The one-token cost alone hides a verify pass that costs twice as much compiled as
    eagerly, as on a CPU without AVX-512 (docs/eval.md)."""
    return sum(costs.t_target.values()) / len(costs.t_target)


def prepare_decoders(target, draft, mode: str, *, vocab_size: int, draft_vocab: torch.Tensor | None,
                     probe_ids: list[int], max_length: int, k: int, freeze: bool | None = None,
                     eager_steps: str = "lean") -> Decoders:
    """Pick eager or compiled decoding of each model for `mode` (`eval.compile`), compiling (outside any timing)
    what is needed.

    `auto` compiles both, then times a draft token and target passes over 1..k+1 tokens both ways
    (`measure_costs`, eager with packed linears as the eager eval runs) and keeps for each model the cheaper:
    the draft by its token, the target by `mean_target_pass` (their sum is a round's cost, so the pair is the
    cheapest of the four). Either way vanilla and speculative decoding run the same target, so compiled is
    compared with compiled. The decision holds for that target for the rest of the process (a later
    checkpoint's draft is compiled only if drafts were), and is remembered on disk (`decisions_path`, keyed
    by `decision_key`) for later processes with the same processor, torch and model shapes, which then
    compile only what was kept: a study's variants, a rerun. Where compiling cannot run (`compile_supported`)
    it decodes eagerly and says why. `max_length`: the longest request (prompt + new tokens); `k`: the most
    draft tokens a round; `freeze`: `StaticLM`'s; `eager_steps`: how a model that is not compiled runs
    (`eval.eager_steps`, `eval.lean.eager_lm`), in the decoding and in auto's measurement alike."""
    from eval.metrics import measure_costs

    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")

    def eager_target():
        return eager_lm(target, vocab_size, None, eager_steps)

    def eager_draft():
        return eager_lm(draft, vocab_size, draft_vocab, eager_steps)

    if mode == "off":
        return Decoders(eager_target(), eager_draft(), False, False, requested=mode)
    device = next(target.parameters()).device
    reason = compile_supported(device)
    if reason is not None:
        if mode != "auto":
            raise RuntimeError(f"compiled decoding cannot run on {device}: {reason}")
        return Decoders(eager_target(), eager_draft(), False, False, requested=mode, note=f"eager: {reason}")
    k_max = max(8, k)
    decided = _AUTO.get(target) if mode == "auto" else None
    key = decision_key(target, draft, draft_vocab, k_max, eager_steps) if mode == "auto" else None
    if mode == "auto" and decided is None and (earlier := remembered(key)) is not None:
        decided = (earlier["target"], earlier["draft"],
                   f"{earlier['note']} (measured {earlier['decided']} by an earlier process on this machine and "
                   f"remembered in {decisions_path()}; delete it to measure again)")
        _AUTO[target] = decided
    wanted = {"on": (True, True), "draft": (False, True)}.get(mode) or (decided[:2] if decided else (True, True))
    sizes = dict(max_length=max_length + k_max + 2, max_verify=k_max + 1, freeze=freeze)
    target_lm = static_lm(target, vocab_size, None, **sizes) if wanted[0] else eager_target()
    draft_lm = static_lm(draft, vocab_size, draft_vocab, **sizes) if wanted[1] else eager_draft()
    seconds = sum(lm.warm_up(probe_ids) for lm in (target_lm, draft_lm) if isinstance(lm, StaticLM))
    decoders = Decoders(target_lm, draft_lm, *wanted, requested=mode, compile_seconds=seconds)
    if decided is not None:
        decoders.note = decided[2]
    elif mode == "auto":
        compiled = measure_costs(target_lm, draft_lm, probe_ids, k_max=k_max)
        eager_target_lm, eager_draft_lm = eager_target(), eager_draft()
        with Decoders(eager_target_lm, eager_draft_lm, False, False, requested=mode).running(target, draft):  # as eager decoding runs
            eager = measure_costs(eager_target_lm, eager_draft_lm, probe_ids, k_max=k_max, draft_vocab=draft_vocab)
        decoders.costs = {"eager": eager.to_dict(), "compiled": compiled.to_dict()}
        if mean_target_pass(eager) <= mean_target_pass(compiled):
            decoders.target, decoders.target_compiled = eager_target_lm, False
        if eager.t_draft <= compiled.t_draft:
            decoders.draft, decoders.draft_compiled = eager_draft_lm, False
        decoders.note = (f"auto: a draft token took {1e3 * compiled.t_draft:.1f} ms compiled, {1e3 * eager.t_draft:.1f} ms "
                         f"eager; a target pass over 1..{k_max + 1} tokens (mean) {1e3 * mean_target_pass(compiled):.1f} "
                         f"ms compiled, {1e3 * mean_target_pass(eager):.1f} ms eager; {decoders.mode} for this target "
                         f"from here on")
        _AUTO[target] = (decoders.target_compiled, decoders.draft_compiled, decoders.note)
        remember(key, decoders.target_compiled, decoders.draft_compiled, decoders.note)
    return decoders
