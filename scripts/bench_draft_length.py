"""Benchmark the draft length: python scripts/bench_draft_length.py --draft runs/default/export [--configs 3:0,8:0.5] ...

For one (target, draft) pair on the independent evaluation prompts it decodes every prompt at every temperature
once with vanilla decoding and once per config, back to back in one run. A config is `k:confidence`: at most k
draft tokens a round, a round stopping after a draft token of probability below `confidence` (0: always k;
`speculative_decode`'s `confidence`, the recipe's `eval.draft_confidence`). The draft's `draft_vocab.json` is
used as in `python -m eval`, and the decoder runs as the eval stage runs it (`--compile auto|on|off`, as
`eval.compile`: eager on a CPU with lean steps, eval/lean.py, or a static KV cache and compiled steps; `--device`
picks a GPU when there is one). Prints a table (α, drafted tokens
and τ per round, ms per round, observed speedup per generated token) and writes JSON (default
runs/bench/bench_draft_length.json). Greedy output must equal vanilla output in every config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.compiled import prepare_decoders  # noqa: E402
from eval.settings import COMPILE_MODES  # noqa: E402
from eval.draft_vocab import load_draft_vocab, restricted_head  # noqa: E402
from eval.metrics import per_token_speedup  # noqa: E402
from eval.report import eos_ids, format_table  # noqa: E402
from eval.speculative import Sampling, ratio, speculative_decode, vanilla_decode  # noqa: E402
from eval.fsutil import atomic_write_json  # noqa: E402
from eval.models import load_model, load_tokenizer, pick_device  # noqa: E402
from eval.prompts import builtin_prompts, encode_prompt, spread  # noqa: E402
from eval.models import DEFAULT_TARGET  # noqa: E402


def _configs(text: str) -> list[tuple[int, float]]:
    try:
        configs = [(int(k), float(c)) for k, c in (item.split(":") for item in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected k:confidence,..., got {text!r}") from None
    if any(k < 1 or not 0 <= c < 1 for k, c in configs):
        raise argparse.ArgumentTypeError("k must be >= 1 and confidence in [0, 1)")
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", required=True, help="a draft directory (its draft_vocab.json is used)")
    parser.add_argument("--configs", type=_configs, default=_configs("3:0,4:0,6:0.5,8:0.4,8:0.5,8:0.6"))
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--draft-dtype", default="bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile", default="auto", choices=COMPILE_MODES)
    parser.add_argument("--out", default="runs/bench/bench_draft_length.json")
    args = parser.parse_args()

    device = pick_device(args.device)
    tokenizer = load_tokenizer(args.target)
    target = load_model(args.target, dtype=args.dtype, device=device)
    draft = load_model(args.draft, dtype=args.draft_dtype, device=device)
    vocab_ids = load_draft_vocab(args.draft) if Path(args.draft).is_dir() else None
    sub_ids = None if vocab_ids is None else torch.tensor(vocab_ids, device=device)
    prompts = spread(builtin_prompts("independent"), args.num_prompts)
    encoded = [encode_prompt(tokenizer, p, 512) for p in prompts]
    eos, vocab = eos_ids(tokenizer, target), len(tokenizer)
    temperatures = [float(t) for t in args.temperatures.split(",")]

    rows = []
    k_max = max(k for k, _ in args.configs)
    with restricted_head(draft, vocab_ids):
        decoders = prepare_decoders(target, draft, args.compile, vocab_size=vocab, draft_vocab=sub_ids, probe_ids=encoded[0],
                                    max_length=max(map(len, encoded)) + args.max_new_tokens, k=k_max)
        print(f"decoder: {decoders.to_dict()}", file=sys.stderr, flush=True)
        with decoders.running(target, draft):
            target, draft = decoders.target, decoders.draft  # the models, or their compiled StaticLMs
            speculative_decode(target, draft, encoded[0], k=3, max_new_tokens=8, vocab_size=vocab, draft_vocab=sub_ids)  # warm up
            for t_index, temperature in enumerate(temperatures):
                sampling = Sampling(temperature)
                vanilla_time = vanilla_tokens = 0
                totals = {config: dict(time=0.0, tokens=0, rounds=0, drafted=0, beta=0.0, verified=0, identical=0)
                          for config in args.configs}
                for p_index, ids in enumerate(encoded):
                    seed = t_index * 10_007 + p_index
                    common = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, eos_token_ids=eos, vocab_size=vocab)
                    vanilla = vanilla_decode(target, ids, generator=torch.Generator(device).manual_seed(seed), **common)
                    vanilla_time, vanilla_tokens = vanilla_time + vanilla.wall_time, vanilla_tokens + vanilla.tokens_generated
                    for (k, confidence), total in totals.items():
                        spec = speculative_decode(target, draft, ids, k=k, confidence=confidence, draft_vocab=sub_ids,
                                                  generator=torch.Generator(device).manual_seed(seed), **common)
                        for key, value in (("time", spec.wall_time), ("tokens", spec.tokens_generated), ("rounds", spec.rounds),
                                           ("drafted", spec.total_drafted), ("beta", spec.beta_sum), ("verified", spec.verified),
                                           ("identical", spec.output_ids == vanilla.output_ids)):
                            total[key] += value
                for (k, confidence), total in totals.items():
                    rows.append({
                        "temperature": temperature, "k": k, "draft_confidence": confidence,
                        "alpha": ratio(total["beta"], total["verified"]),
                        "drafted_per_round": ratio(total["drafted"], total["rounds"]),
                        "tau": ratio(total["tokens"], total["rounds"]),
                        "ms_per_round": 1e3 * total["time"] / total["rounds"],
                        "ms_per_token_vanilla": 1e3 * vanilla_time / vanilla_tokens,
                        "speedup_observed": per_token_speedup(vanilla_time, vanilla_tokens, total["time"], total["tokens"]),
                        "identical_to_vanilla": total["identical"] / len(encoded) if temperature == 0 else None,
                    })
                    print(f"T={temperature} k={k} confidence={confidence}: speedup {rows[-1]['speedup_observed']:.3f}",
                          file=sys.stderr, flush=True)

    headers = ["T", "k", "confidence", "alpha", "drafted/round", "tau", "ms/round", "vanilla ms/token", "speedup_obs", "greedy identical"]
    print(format_table(headers, [[r["temperature"], r["k"], r["draft_confidence"], r["alpha"], r["drafted_per_round"], r["tau"],
                                  r["ms_per_round"], r["ms_per_token_vanilla"], r["speedup_observed"], r["identical_to_vanilla"]]
                                 for r in rows]))
    result = {"target": args.target, "draft": args.draft, "dtype": args.dtype, "draft_dtype": args.draft_dtype,
              "device": str(device), "decoder": decoders.to_dict(),
              "draft_vocab_size": None if vocab_ids is None else len(vocab_ids), "prompts": len(encoded),
              "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(), "rows": rows}
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
