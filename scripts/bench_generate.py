"""Benchmark the generate stage: python scripts/bench_generate.py [--prompts 32] [--batched float32:16,bfloat16:64]

Tokens/s of our batched generation (left padding, one `train.completions.generate_batch` call per batch,
packed linear weights on a CPU: as the generate stage runs it) at each DTYPE:BATCH_SIZE of `--batched`
(`generate.dtype`, `generate.batch_size`) against one prompt at a time in the target's dtype, same target,
prompts and settings, in one run; for a dtype other than the target's, also the share of its tokens the
target as loaded picks greedily in the same context (`--plain-linears`: without the packing of
eval/packed.py; lean steps pack their own products). `--steps lean,transformers` times each batched setting
with both `generate.steps` (the default: lean only) and prints their speed ratio per repeat and, greedy, how
many rows they write alike; `--batching sorted,given` likewise compares batches of rows sorted by prompt length
(as the stage batches a shard) with the prompts' own order. `--prompts-file` reads the prompts from a JSONL file
(a run's generate/prompts.jsonl) instead of the built-in train prompts. `--temperature T` samples (seeded); `--workload write` times the self-written prompts'
writing instead (`data.source: self`: rows start at the chat template's user turn, one domain hint each,
T = 1 unless `--temperature` says otherwise). `--transformers` adds transformers' batched `generate()` on
the same batches, in the first `--batched` setting, with the top-k log-probs taken by a forward hook
(the stage before it had a loop of its own); `--repeats N` times the batched modes N times each, in
turn, and reports each one's median; `--no-single` skips the one-at-a-time baseline. Prints a
table and writes JSON (default runs/bench/bench_generate.json). Goal (issue 4): >= 4x on a 2-core CPU
with the default target.
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.packed import packed_linears  # noqa: E402
from eval.report import format_table  # noqa: E402
from eval.fsutil import atomic_write_json  # noqa: E402
from train.completions import Row, cut_at_eos, generate_batch, left_padded  # noqa: E402
from eval.models import describe_processor, dtype_name, load_model, load_tokenizer, resolve_dtype  # noqa: E402
from eval.prompts import builtin_prompts, encode_prompt, read_jsonl_prompts, spread  # noqa: E402
from train.models import cast_weights  # noqa: E402
from train.generate import shard_batches  # noqa: E402
from train.recipe import DEFAULT_SELF_HINTS, DEFAULT_TARGET, GenerateSection  # noqa: E402
from train.self_written import request_prefix  # noqa: E402


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
    parser.add_argument("--steps", default="lean",
                        help="comma-separated generate.steps to time each batched setting with: lean, transformers")
    parser.add_argument("--batching", default="sorted",
                        help="comma-separated: sorted (rows of alike prompt length share a batch, as the stage batches "
                             "them), given (the prompts' own order)")
    parser.add_argument("--prompts-file", default=None,
                        help="a JSONL prompt file (e.g. a run's generate/prompts.jsonl) instead of the built-in train prompts")
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 = greedy (the answer workload's default); > 0 samples (the write workload's default: 1)")
    parser.add_argument("--workload", choices=["answer", "write"], default="answer",
                        help="answer the built-in train prompts (default), or write self-written requests")
    parser.add_argument("--repeats", type=int, default=1,
                        help="time the batched modes this many times each, in turn; report the median")
    parser.add_argument("--no-single", action="store_true", help="skip the one-prompt-at-a-time baseline")
    parser.add_argument("--transformers", action="store_true",
                        help="also time transformers' batched generate() on the same batches (first --batched setting)")
    parser.add_argument("--out", default="runs/bench/bench_generate.json")
    args = parser.parse_args()
    try:
        batched = [(dtype, int(size)) for dtype, size in (item.split(":") for item in args.batched.split(","))]
    except ValueError:
        sys.exit(f"--batched: expected DTYPE:BATCH_SIZE[,...], got '{args.batched}'")
    steps = args.steps.split(",")
    if not set(steps) <= {"lean", "transformers"}:
        sys.exit(f"--steps: expected lean and/or transformers, got '{args.steps}'")
    batchings = args.batching.split(",")
    if not set(batchings) <= {"sorted", "given"}:
        sys.exit(f"--batching: expected sorted and/or given, got '{args.batching}'")
    tokenizer = load_tokenizer(args.target)
    target = load_model(args.target)
    temperature = args.temperature if args.temperature is not None else (1.0 if args.workload == "write" else 0.0)
    if args.workload == "write":
        hints = list(DEFAULT_SELF_HINTS.values())
        rows = [Row(None, request_prefix(tokenizer, hints[i % len(hints)]), temperature, i) for i in range(args.prompts)]
        rows.sort(key=lambda r: len(r.prompt_ids))  # as the stage writes them: one domain's prefix a batch
    else:
        prompts = spread(read_jsonl_prompts(args.prompts_file) if args.prompts_file else builtin_prompts("train"), args.prompts)
        rows = [Row(p, encode_prompt(tokenizer, p), temperature, 0) for p in prompts]

    def timed(model, batch_size, write=functools.partial(generate_batch, steps=steps[0]), batching=batchings[0]):
        """Completions (in the rows' order) and seconds of generation for every row, `batch_size` rows a `write` call,
        batched as `batching` says."""
        settings = GenerateSection(temperatures=[temperature], max_new_tokens=args.max_new_tokens, batch_size=batch_size,
                                     topk_logprobs=args.topk_logprobs)
        with packed_linears(model, enabled=not args.plain_linears):
            write(model, tokenizer, rows[:2], settings, seed=0)  # warm-up
            batches = (shard_batches(rows, batch_size) if batching == "sorted" else
                       [list(range(i, min(i + batch_size, len(rows)))) for i in range(0, len(rows), batch_size)])
            start, completions = time.perf_counter(), [None] * len(rows)
            for b, batch in enumerate(batches):
                for i, r in zip(batch, write(model, tokenizer, [rows[i] for i in batch], settings, seed=b)):
                    completions[i] = r[0]
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

    table = []
    if args.no_single:
        single_rate = single_tokens = t_single = None
    else:
        single, t_single = timed(target, 1)
        single_tokens = sum(map(len, single))
        single_rate = single_tokens / t_single
        table.append([f"one prompt at a time ({dtype_name(target.dtype)}, {steps[0]} steps)", single_tokens, t_single, single_rate, 1.0, "-"])

    def versus_single(rate):
        return rate / single_rate if single_rate else None
    models = {}
    for setting, _ in batched:
        dtype = resolve_dtype(setting, target.device)
        models[setting] = target if dtype == target.dtype else cast_weights(copy.deepcopy(target), dtype)
    modes = [(f"batched ({size}, {setting}, {how} steps, {batching})", setting, size,
              functools.partial(generate_batch, steps=how), batching)
             for setting, size in batched for how in steps for batching in batchings]
    if args.transformers:
        setting, size = batched[0]
        modes.append((f"transformers generate() ({size}, {setting}, {batchings[0]})", setting, size, transformers_generate,
                      batchings[0]))
    # Each repeat times every mode once, in turn, so a drift of the processor's speed reaches them all alike;
    # a mode's figure is its median time.
    seconds, completions = {m[0]: [] for m in modes}, {}
    for _ in range(args.repeats):
        for label, setting, size, write, batching in modes:
            completions[label], taken = timed(models[setting], size, write, batching)
            seconds[label].append(taken)
    settings = []
    for label, setting, size, write, batching in modes:
        tokens = sum(map(len, completions[label]))
        rate = tokens / statistics.median(seconds[label])
        # Another dtype writes slightly other text: how much of it is still the loaded target's own greedy choice.
        agreement = (target_agreement(completions[label]) if write is not transformers_generate and models[setting] is not target
                     and temperature == 0 else None)
        settings.append({"dtype": setting, "batch_size": size, "batching": batching,
                         "steps": None if write is transformers_generate else write.keywords["steps"], "tokens": tokens, "seconds": seconds[label],
                         "tokens_per_s": rate, "ratio": versus_single(rate), "target_agreement": agreement,
                         "transformers": write is transformers_generate})
        table.append([label, tokens, statistics.median(seconds[label]), rate, settings[-1]["ratio"] or "-",
                      "-" if agreement is None else f"{agreement:.3f}"])
    result = {
        "workload": args.workload, "temperature": temperature, "prompts": len(rows), "repeats": args.repeats,
        "packed_linears": not args.plain_linears, "max_new_tokens": args.max_new_tokens,
        "topk_logprobs": args.topk_logprobs, "device": str(target.device), "processor": describe_processor(),
        "threads": torch.get_num_threads(),
        "tokens_single": single_tokens, "seconds_single": t_single, "tokens_per_s_single": single_rate,
        "batched": settings,
    }
    result["ratio"] = settings[0]["ratio"]
    result["ours_over_transformers"] = settings[0]["tokens_per_s"] / settings[-1]["tokens_per_s"] if args.transformers else None
    # Greedy, the two loops should write the same rows: how many do, token for token.
    result["rows_identical_to_transformers"] = (
        sum(a == b for a, b in zip(completions[modes[0][0]], completions[modes[-1][0]]))
        if args.transformers and temperature == 0 else None)
    # Our loop's modes two by two where they differ in one choice only (the steps, or the batching): the first
    # choice named on the command line over the other, per repeat, and greedy, how many rows they write alike.
    ours = [(m, label) for m, (label, *_) in zip(settings, modes) if m["steps"] is not None]
    result["comparisons"] = []
    for (a, a_label), (b, b_label) in itertools.combinations(ours, 2):
        differ = [key for key in ("steps", "batching") if a[key] != b[key]]
        if (a["dtype"], a["batch_size"]) != (b["dtype"], b["batch_size"]) or len(differ) != 1:
            continue
        same = sum(x == y for x, y in zip(completions[a_label], completions[b_label])) if temperature == 0 else None
        result["comparisons"].append({
            "dtype": a["dtype"], "batch_size": a["batch_size"], "differ": differ[0], "modes": [a[differ[0]], b[differ[0]]],
            "both": a["batching" if differ[0] == "steps" else "steps"],
            "speed_ratio": a["tokens_per_s"] / b["tokens_per_s"],
            "per_repeat": [y / x for x, y in zip(a["seconds"], b["seconds"])], "rows_identical": same})
    result["goal_ratio_ge_4"] = None if result["ratio"] is None else result["ratio"] >= 4
    print(f"{args.target}, {args.workload}, T = {temperature}, {len(rows)} rows, {args.max_new_tokens} new tokens, device {target.device}, "
          f"{result['processor']}, {'plain' if args.plain_linears else 'packed'} linears, top-{args.topk_logprobs} log-probs")
    print(format_table(["mode", "tokens", "seconds", "tokens/s", "x single", "target's greedy token"], table))
    if single_rate:
        print(f"ratio batched ({batched[0][1]}, {batched[0][0]}) / single: {result['ratio']:.2f}x (goal >= 4x)")
    if args.transformers:
        print(f"ours / transformers generate(), batched ({batched[0][1]}, {batched[0][0]}): "
              f"{result['ours_over_transformers']:.2f}x")
        if result["rows_identical_to_transformers"] is not None:
            print(f"rows identical to transformers generate(), token for token: "
                  f"{result['rows_identical_to_transformers']} of {len(rows)}")
    for pair in result["comparisons"]:
        same = "" if pair["rows_identical"] is None else f"; rows identical, token for token: {pair['rows_identical']} of {len(rows)}"
        print(f"{' / '.join(pair['modes'])} ({pair['differ']}), batched ({pair['batch_size']}, {pair['dtype']}, {pair['both']}): "
              f"{pair['speed_ratio']:.3f}x (per repeat: {', '.join(f'{r:.3f}' for r in pair['per_repeat'])}){same}")
    print(f"wrote {atomic_write_json(args.out, result)}")


@torch.no_grad()
def transformers_generate(model, tokenizer, rows, settings, seed):
    """The same left-padded batch through transformers' `generate()` (its sampler: `torch.multinomial`), the
    top-k log-probs of each step taken by a forward hook: how the generate stage wrote its rows before
    `train.completions.generate_batch` had a loop of its own."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    ids, mask = left_padded([r.prompt_ids for r in rows], pad)
    width = ids.shape[1]
    temperature = rows[0].temperature
    sampling = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature, top_p=None,
                                                                   top_k=None)
    steps = []

    def record(_module, _inputs, output):
        steps.append(output.logits[:, -1].float().log_softmax(-1).topk(settings.topk_logprobs, dim=-1))

    handle = model.register_forward_hook(record) if settings.topk_logprobs > 0 else None
    torch.manual_seed(seed)
    try:
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), eos_token_id=eos,
                             pad_token_id=pad, max_new_tokens=settings.max_new_tokens, **sampling)
    finally:
        if handle is not None:
            handle.remove()
    return [(cut_at_eos(completion, eos), None, None) for completion in out[:, width:].tolist()]


if __name__ == "__main__":
    main()
