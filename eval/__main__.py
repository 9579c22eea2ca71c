"""Measure a draft against a target: `python -m eval --target T --draft D [--prompts FILE] [--k 4] ...`."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from eval.draft_vocab import FILENAME, load_draft_vocab
from eval.report import evaluate_pair, summary_text
from eval.settings import COMPILE_MODES, EAGER_STEPS, EvalSettings, FieldError
from eval.errors import UserError, cli_main
from eval.models import check_model_vocab, check_same_tokenizer, load_model, load_tokenizer, pick_device
from eval.prompts import eval_prompt_set, spread
from eval.models import DEFAULT_TARGET


def _temperatures(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


DEFAULTS = EvalSettings()
SETTING_OPTIONS = ("k", "draft_confidence", "temperatures", "max_new_tokens", "num_prompts", "prompts", "top_k", "top_p",
                   "fallback_window", "fallback_threshold", "compile", "eager_steps")
"""Options that are `EvalSettings` fields: their defaults and their checks are the recipe's `eval:` section's."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m eval", description=__doc__)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="hub id, local directory, .gguf file or the default name")
    parser.add_argument("--draft", required=True, help="hub id, local directory, .gguf file or an exported checkpoint")
    parser.add_argument("--prompts", default=DEFAULTS.prompts,
                        help="`independent` (the hand-written evaluation set, default), `held_out` (built-in template "
                             "families training never sees), or JSON lines with `prompt` and optional `id`, `domain`")
    parser.add_argument("--num-prompts", type=int, default=DEFAULTS.num_prompts,
                        help=f"use at most N prompts, spread over domains (default {DEFAULTS.num_prompts}, as eval.num_prompts)")
    parser.add_argument("--k", type=int, default=DEFAULTS.k, help="draft tokens per round (the cap with --draft-confidence)")
    parser.add_argument("--draft-confidence", type=float, default=DEFAULTS.draft_confidence,
                        help="dynamic draft length: stop a round's drafting after a token of draft probability below this "
                             "(transformers' assistant_confidence_threshold; default 0: always k)")
    parser.add_argument("--temperatures", type=_temperatures, default=DEFAULTS.temperatures, help="comma-separated; 0 = greedy")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    parser.add_argument("--top-k", type=int, default=DEFAULTS.top_k)
    parser.add_argument("--top-p", type=float, default=DEFAULTS.top_p)
    parser.add_argument("--fallback-window", type=int, default=DEFAULTS.fallback_window)
    parser.add_argument("--fallback-threshold", type=float, default=DEFAULTS.fallback_threshold)
    parser.add_argument("--compile", default=DEFAULTS.compile, choices=COMPILE_MODES,
                        help="decode with a static KV cache and compiled steps (on), eagerly (off), with the draft "
                             "alone compiled (draft), or each model as it measured faster on this device (auto, default)")
    parser.add_argument("--eager-steps", default=DEFAULTS.eager_steps, choices=EAGER_STEPS,
                        help="how a model decoded eagerly runs its steps: written out over plain tensors where it is a "
                             "Llama-family model on a CPU (lean, default: eval/lean.py), or transformers' own forward")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--draft-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                        help="the draft's dtype when it differs from the target's (default: --dtype)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--out", default=None, help="output directory (default: runs/eval/<draft name>)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--full-draft-vocab", action="store_true",
                        help="ignore the draft's draft_vocab.json (a reduced head from training) and score every token")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


@cli_main
def main(argv=None):
    args = parse_args(argv)
    try:
        settings = EvalSettings(**{key: getattr(args, key) for key in SETTING_OPTIONS})
    except FieldError as err:
        raise UserError(f"--{err.key.replace('_', '-')}: {err.message}") from None
    prompts = spread(eval_prompt_set(args.prompts), args.num_prompts)
    device = pick_device(args.device)
    target_tok = load_tokenizer(args.target, trust_remote_code=args.trust_remote_code)
    draft_tok = load_tokenizer(args.draft, trust_remote_code=args.trust_remote_code)
    check_same_tokenizer(target_tok, draft_tok, args.target, args.draft)
    target = load_model(args.target, dtype=args.dtype, device=device, trust_remote_code=args.trust_remote_code)
    draft = load_model(args.draft, dtype=args.draft_dtype or args.dtype, device=device, trust_remote_code=args.trust_remote_code)
    check_model_vocab(target, target_tok, args.target)
    check_model_vocab(draft, target_tok, args.draft)
    draft_vocab = None
    if not args.full_draft_vocab and Path(args.draft).is_dir():
        try:
            draft_vocab = load_draft_vocab(args.draft)
        except ValueError as exc:
            raise UserError(f"{exc} (or pass --full-draft-vocab)") from None
        if draft_vocab is not None and max(draft_vocab) >= len(target_tok):
            raise UserError(f"{Path(args.draft) / FILENAME}: token id {max(draft_vocab)} is outside the target's "
                            f"vocabulary of {len(target_tok)}")
    out = Path(args.out) if args.out else Path("runs") / "eval" / Path(args.draft.rstrip("/")).name
    torch.manual_seed(args.seed)
    report = evaluate_pair(target, draft, target_tok, prompts, settings, target_name=args.target, draft_name=args.draft,
                           out_dir=out, progress=not args.quiet, plots=not args.no_plots, draft_vocab=draft_vocab, seed=args.seed)
    print(summary_text(report))
    print(f"\nwrote {out}/report.json, {out}/requests.jsonl and plots")


if __name__ == "__main__":
    main()
