"""Benchmark the generate stage: python scripts/bench_generate.py [--prompts 32] [--batch-size 16] [--max-new-tokens 64]

Tokens/s of our batched generation (left padding, one `generate` call per batch, packed linear weights
on a CPU: as the generate stage runs it) against one-prompt-at-a-time `generate()`, same target,
prompts and settings (greedy), in one run (`--plain-linears`: without the packing of eval/packed.py). Prints a table and writes JSON (default runs/bench/bench_generate.json). Goal (issue 4): >= 4x on
a 2-core CPU with the default target.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.packed import packed_linears  # noqa: E402
from eval.report import format_table  # noqa: E402
from eval.fsutil import atomic_write_json  # noqa: E402
from train.completions import Row, generate_batch  # noqa: E402
from eval.models import load_model, load_tokenizer  # noqa: E402
from eval.prompts import builtin_prompts, encode_prompt, spread  # noqa: E402
from train.recipe import DEFAULT_TARGET, GenerateSection  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--plain-linears", action="store_true", help="PyTorch's own linear layers, unpacked")
    parser.add_argument("--out", default="runs/bench/bench_generate.json")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.target)
    target = load_model(args.target)
    prompts = spread(builtin_prompts("train"), args.prompts)
    rows = [Row(p, encode_prompt(tokenizer, p), 0.0, 0) for p in prompts]
    settings = GenerateSection(temperatures=[0.0], max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)

    with packed_linears(target, enabled=not args.plain_linears):
        generate_batch(target, tokenizer, rows[:2], settings, seed=0)  # warm-up
        start = time.perf_counter()
        single_tokens = sum(len(generate_batch(target, tokenizer, [row], settings, seed=0)[0][0]) for row in rows)
        t_single = time.perf_counter() - start
        start = time.perf_counter()
        batched_tokens = 0
        for i in range(0, len(rows), args.batch_size):
            batched_tokens += sum(len(r[0]) for r in generate_batch(target, tokenizer, rows[i:i + args.batch_size], settings, seed=0))
        t_batched = time.perf_counter() - start

    result = {
        "prompts": len(rows), "batch_size": args.batch_size, "packed_linears": not args.plain_linears, "max_new_tokens": args.max_new_tokens,
        "device": str(target.device), "threads": torch.get_num_threads(),
        "tokens_single": single_tokens, "seconds_single": t_single, "tokens_per_s_single": single_tokens / t_single,
        "tokens_batched": batched_tokens, "seconds_batched": t_batched, "tokens_per_s_batched": batched_tokens / t_batched,
    }
    result["ratio"] = result["tokens_per_s_batched"] / result["tokens_per_s_single"]
    result["goal_ratio_ge_4"] = result["ratio"] >= 4
    print(f"{args.target}, greedy, {len(rows)} prompts, {args.max_new_tokens} new tokens, device {target.device}, "
          f"{torch.get_num_threads()} threads, {'plain' if args.plain_linears else 'packed'} linears")
    print(format_table(["mode", "tokens", "seconds", "tokens/s"], [
        ["one prompt at a time", single_tokens, t_single, result["tokens_per_s_single"]],
        [f"batched ({args.batch_size})", batched_tokens, t_batched, result["tokens_per_s_batched"]],
    ]))
    print(f"ratio batched / single: {result['ratio']:.2f}x (goal >= 4x)")
    print(f"wrote {atomic_write_json(args.out, result)}")


if __name__ == "__main__":
    main()
