"""Benchmark the generate stage: python scripts/bench_generate.py [--prompts 32] [--batched float32:16,bfloat16:64]

Tokens/s of our batched generation (left padding, one `generate` call per batch, packed linear weights
on a CPU: as the generate stage runs it) at each DTYPE:BATCH_SIZE of `--batched` (`generate.dtype`,
`generate.batch_size`) against one-prompt-at-a-time float32 `generate()`, same target, prompts and
settings (greedy), in one run; for a dtype other than the target's, also the share of its tokens the
target as loaded picks greedily in the same context (`--plain-linears`: without the packing of eval/packed.py). Prints a table and writes JSON (default runs/bench/bench_generate.json). Goal (issue 4): >= 4x on
a 2-core CPU with the default target.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.packed import packed_linears  # noqa: E402
from eval.report import format_table  # noqa: E402
from eval.fsutil import atomic_write_json  # noqa: E402
from train.completions import Row, generate_batch  # noqa: E402
from eval.models import describe_processor, dtype_name, load_model, load_tokenizer, resolve_dtype  # noqa: E402
from eval.prompts import builtin_prompts, encode_prompt, spread  # noqa: E402
from train.models import cast_weights  # noqa: E402
from train.recipe import DEFAULT_TARGET, GenerateSection  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batched", default="float32:16",
                        help="comma-separated DTYPE:BATCH_SIZE settings to time batched (generate.dtype, generate.batch_size)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--topk-logprobs", type=int, default=0,
                        help="top-k log-probs recorded per token, as the generate stage does (the default recipe: 20)")
    parser.add_argument("--plain-linears", action="store_true", help="PyTorch's own linear layers, unpacked")
    parser.add_argument("--out", default="runs/bench/bench_generate.json")
    args = parser.parse_args()
    try:
        batched = [(dtype, int(size)) for dtype, size in (item.split(":") for item in args.batched.split(","))]
    except ValueError:
        sys.exit(f"--batched: expected DTYPE:BATCH_SIZE[,...], got '{args.batched}'")
    tokenizer = load_tokenizer(args.target)
    target = load_model(args.target)
    prompts = spread(builtin_prompts("train"), args.prompts)
    rows = [Row(p, encode_prompt(tokenizer, p), 0.0, 0) for p in prompts]

    def timed(model, batch_size):
        """Completions and seconds of greedy generation for every row, `batch_size` rows a `generate` call."""
        settings = GenerateSection(temperatures=[0.0], max_new_tokens=args.max_new_tokens, batch_size=batch_size,
                                     topk_logprobs=args.topk_logprobs)
        with packed_linears(model, enabled=not args.plain_linears):
            generate_batch(model, tokenizer, rows[:2], settings, seed=0)  # warm-up
            start, completions = time.perf_counter(), []
            for i in range(0, len(rows), batch_size):
                completions += [r[0] for r in generate_batch(model, tokenizer, rows[i:i + batch_size], settings, seed=0)]
        return completions, time.perf_counter() - start

    @torch.no_grad()
    def target_agreement(completions) -> float:
        """The share of the completions' tokens that the target as loaded also picks greedily in their context."""
        same = total = 0
        for row, ids in zip(rows, completions):
            logits = target(torch.tensor([row.prompt_ids + ids], device=target.device)).logits[0, len(row.prompt_ids) - 1:-1]
            same += (logits.argmax(-1).cpu() == torch.tensor(ids)).sum().item()
            total += len(ids)
        return same / total

    single, t_single = timed(target, 1)
    single_tokens = sum(map(len, single))
    table = [[f"one prompt at a time ({dtype_name(target.dtype)})", single_tokens, t_single, single_tokens / t_single, 1.0, "-"]]
    settings = []
    for setting, batch_size in batched:
        dtype = resolve_dtype(setting, target.device)
        model = target if dtype == target.dtype else cast_weights(copy.deepcopy(target), dtype)
        completions, seconds = timed(model, batch_size)
        tokens = sum(map(len, completions))
        rate = tokens / seconds
        # Another dtype writes slightly other text: how much of it is still the loaded target's own greedy choice.
        agreement = target_agreement(completions) if dtype != target.dtype else None
        settings.append({"dtype": setting, "batch_size": batch_size, "tokens": tokens, "seconds": seconds,
                         "tokens_per_s": rate, "ratio": rate / (single_tokens / t_single),
                         "target_agreement": agreement})
        table.append([f"batched ({batch_size}, {setting})", tokens, seconds, rate, settings[-1]["ratio"],
                      "-" if agreement is None else f"{agreement:.3f}"])
    result = {
        "prompts": len(rows), "packed_linears": not args.plain_linears, "max_new_tokens": args.max_new_tokens,
        "topk_logprobs": args.topk_logprobs, "device": str(target.device), "processor": describe_processor(),
        "threads": torch.get_num_threads(),
        "tokens_single": single_tokens, "seconds_single": t_single, "tokens_per_s_single": single_tokens / t_single,
        "batched": settings,
    }
    result["ratio"] = settings[0]["ratio"]
    result["goal_ratio_ge_4"] = result["ratio"] >= 4
    print(f"{args.target}, greedy, {len(rows)} prompts, {args.max_new_tokens} new tokens, device {target.device}, "
          f"{result['processor']}, {'plain' if args.plain_linears else 'packed'} linears, top-{args.topk_logprobs} log-probs")
    print(format_table(["mode", "tokens", "seconds", "tokens/s", "x single", "target's greedy token"], table))
    print(f"ratio batched ({batched[0][1]}, {batched[0][0]}) / single: {result['ratio']:.2f}x (goal >= 4x)")
    print(f"wrote {atomic_write_json(args.out, result)}")


if __name__ == "__main__":
    main()
