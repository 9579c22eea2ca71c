"""Measure a draft against a target: `python -m eval --target T --draft D [--prompts FILE] [--k 4] ...`."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from eval.draft_vocab import FILENAME, load_draft_vocab
from eval.report import EvalSettings, evaluate_pair, summary_text
from train.errors import UserError, cli_main
from train.models import check_model_vocab, check_same_tokenizer, load_model, load_tokenizer, pick_device
from train.prompts import eval_prompt_set, spread
from train.recipe import DEFAULT_TARGET


def _temperatures(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(t < 0 for t in values):
        raise argparse.ArgumentTypeError("temperatures must be >= 0 (0 means greedy)")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def _confidence(text: str) -> float:
    value = _fraction(text)
    if value == 1:
        raise argparse.ArgumentTypeError("must be below 1 (1 would stop after every token)")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m eval", description=__doc__)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="hub id, local directory, .gguf file or the default name")
    parser.add_argument("--draft", required=True, help="hub id, local directory, .gguf file or an exported checkpoint")
    parser.add_argument("--prompts", default="independent",
                        help="`independent` (the hand-written evaluation set, default), `held_out` (built-in template "
                             "families training never sees), or JSON lines with `prompt` and optional `id`, `domain`")
    parser.add_argument("--num-prompts", type=_positive, default=None, help="use at most N prompts (spread over domains)")
    parser.add_argument("--k", type=_positive, default=4, help="draft tokens per round (the cap with --draft-confidence)")
    parser.add_argument("--draft-confidence", type=_confidence, default=0.0,
                        help="dynamic draft length: stop a round's drafting after a token of draft probability below this "
                             "(transformers' assistant_confidence_threshold; default 0: always k)")
    parser.add_argument("--temperatures", type=_temperatures, default=[0.0, 0.7, 1.0], help="comma-separated; 0 = greedy")
    parser.add_argument("--max-new-tokens", type=_positive, default=128)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--fallback-window", type=_positive, default=100)
    parser.add_argument("--fallback-threshold", type=_fraction, default=0.4)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--draft-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                        help="the draft's dtype when it differs from the target's (default: --dtype)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                        help="decode with a static KV cache and compiled steps (on), eagerly (off), or whichever "
                             "measured faster on this device (auto, default)")
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
    prompts = spread(eval_prompt_set(args.prompts), args.num_prompts)
    device = pick_device(args.device)
    target_tok = load_tokenizer(args.target, trust_remote_code=args.trust_remote_code)
    draft_tok = load_tokenizer(args.draft, trust_remote_code=args.trust_remote_code)
    check_same_tokenizer(target_tok, draft_tok, args.target, args.draft)
    target = load_model(args.target, dtype=args.dtype, device=device, trust_remote_code=args.trust_remote_code)
    draft = load_model(args.draft, dtype=args.draft_dtype or args.dtype, device=device, trust_remote_code=args.trust_remote_code)
    check_model_vocab(target, target_tok, args.target)
    check_model_vocab(draft, target_tok, args.draft)
    if args.top_p <= 0 or args.top_p > 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    settings = EvalSettings(k=args.k, temperatures=tuple(args.temperatures), max_new_tokens=args.max_new_tokens,
                            top_k=args.top_k, top_p=args.top_p, fallback_window=args.fallback_window,
                            fallback_threshold=args.fallback_threshold, draft_confidence=args.draft_confidence,
                            seed=args.seed, compile=args.compile)
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
                           out_dir=out, progress=not args.quiet, plots=not args.no_plots, draft_vocab=draft_vocab)
    print(summary_text(report))
    print(f"\nwrote {out}/report.json, {out}/requests.jsonl and plots")


if __name__ == "__main__":
    main()
