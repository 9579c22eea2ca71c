"""Benchmark the speculative decoder: python scripts/bench_decoder.py [--prompts 4] [--max-new-tokens 64] [--k 4]

On the default target (SmolLM2-135M-Instruct), greedy, with (a) the target itself as draft and (b) a draft
made of a few of the target's layers, it times in one run, on the same prompts: vanilla decoding (ours),
our speculative decoding, and transformers' assisted generation (`assistant_model=`, same k, constant
schedule), each with plain linear layers and with oneDNN-packed ones (`eval/packed.py`, what the eval
uses on a CPU). A second table gives the target's forward time over m = 1..9 tokens both ways. Prints
the tables and writes JSON (default runs/bench/bench_decoder.json).

Goals (issue 3): our speculative wall time <= assisted generation's on the same pair and k; observed
speedup >= 0.85 x the theoretical speedup from measured costs and alpha.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.metrics import measure_costs, predicted_speedup  # noqa: E402
from eval.packed import packed_linears  # noqa: E402
from eval.report import eos_ids, format_table  # noqa: E402
from eval.speculative import speculative_decode, vanilla_decode  # noqa: E402
from train.fsutil import atomic_write_json  # noqa: E402
from train.models import draft_from_layers, load_model, load_tokenizer  # noqa: E402
from train.prompts import builtin_prompts, encode_prompt, spread  # noqa: E402
from train.recipe import DEFAULT_TARGET  # noqa: E402


def assisted_generate(target, draft, ids: list[int], k: int, max_new_tokens: int, eos: list[int]) -> tuple[list[int], float]:
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # keep k fixed, as in our decoder
    inputs = torch.tensor([ids])
    start = time.perf_counter()
    out = target.generate(inputs, attention_mask=torch.ones_like(inputs), assistant_model=draft, do_sample=False,
                          max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(ids):].tolist(), time.perf_counter() - start


def bench_pair(name, target, draft, prompts, k, max_new_tokens, eos, vocab, packed: bool):
    with packed_linears(target, enabled=packed), packed_linears(draft, enabled=packed):
        row = _bench_pair(target, draft, prompts, k, max_new_tokens, eos, vocab)
    return {"pair": name, "linears": "packed" if packed else "plain"} | row


def _bench_pair(target, draft, prompts, k, max_new_tokens, eos, vocab):
    # Warm up every path once (first calls allocate and pick kernels).
    vanilla_decode(target, prompts[0], max_new_tokens=4, eos_token_ids=eos, vocab_size=vocab)
    speculative_decode(target, draft, prompts[0], k=k, max_new_tokens=4, eos_token_ids=eos, vocab_size=vocab)
    assisted_generate(target, draft, prompts[0], k, 4, eos)
    costs = measure_costs(target, draft, prompts[0], k_max=max(8, k))
    t_van = t_spec = t_hf = 0.0
    n_van = n_spec = n_hf = rounds = 0
    beta = verified = 0.0
    identical = 0
    for ids in prompts:
        van = vanilla_decode(target, ids, max_new_tokens=max_new_tokens, eos_token_ids=eos, vocab_size=vocab)
        spec = speculative_decode(target, draft, ids, k=k, max_new_tokens=max_new_tokens, eos_token_ids=eos, vocab_size=vocab)
        hf_ids, hf_time = assisted_generate(target, draft, ids, k, max_new_tokens, eos)
        t_van, t_spec, t_hf = t_van + van.wall_time, t_spec + spec.wall_time, t_hf + hf_time
        n_van, n_spec, n_hf = n_van + van.tokens_generated, n_spec + spec.tokens_generated, n_hf + len(hf_ids)
        rounds += spec.rounds
        beta += spec.beta_sum
        verified += spec.verified
        identical += spec.output_ids == van.output_ids
    alpha = beta / verified if verified else 0.0
    theory = predicted_speedup(alpha, k, costs)
    observed = t_van / t_spec
    return {
        "k": k,
        "alpha": alpha,
        "tau": n_spec / rounds,
        "c": costs.c,
        "costs": costs.to_dict(),
        "tokens_per_s_vanilla": n_van / t_van,
        "tokens_per_s_ours": n_spec / t_spec,
        "tokens_per_s_assisted": n_hf / t_hf,
        "wall_time_vanilla": t_van,
        "wall_time_ours": t_spec,
        "wall_time_assisted": t_hf,
        "speedup_observed": observed,
        "speedup_theoretical": theory,
        "observed_over_theoretical": observed / theory,
        "ours_over_assisted_time": t_spec / t_hf,
        "greedy_identical": identical / len(prompts),
        "goal_no_slower_than_assisted": t_spec <= t_hf,
        "goal_observed_ge_0.85_theoretical": observed >= 0.85 * theory,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--layers", default="0,1,29", help="target layers making draft (b)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default="runs/bench/bench_decoder.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.target)
    target = load_model(args.target, device="cpu" if not torch.cuda.is_available() else None)
    layers = [int(i) for i in args.layers.split(",")]
    eos = eos_ids(tokenizer, target)
    prompts = [encode_prompt(tokenizer, p) for p in spread(builtin_prompts("independent"), args.prompts)]
    layer_draft = draft_from_layers(target, layers).to(target.device).eval()
    rows = [
        bench_pair(name, target, draft, prompts, args.k, args.max_new_tokens, eos, len(tokenizer), packed)
        for name, draft in (("target as its own draft", target), (f"layers {args.layers} of the target", layer_draft))
        for packed in (False, True)
    ]
    headers = ["pair", "linears", "alpha", "tau", "c", "tok/s vanilla", "tok/s ours", "tok/s assisted", "ours/assisted time",
               "speedup obs", "speedup theo", "obs/theo", "greedy =="]
    table = [[r["pair"], r["linears"], r["alpha"], r["tau"], r["c"], r["tokens_per_s_vanilla"], r["tokens_per_s_ours"],
              r["tokens_per_s_assisted"], r["ours_over_assisted_time"], r["speedup_observed"],
              r["speedup_theoretical"], r["observed_over_theoretical"], r["greedy_identical"]] for r in rows]
    print(f"greedy, k={args.k}, {len(prompts)} independent evaluation prompts, {args.max_new_tokens} new tokens, "
          f"device {target.device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(format_table(headers, table))
    costs = {r["linears"]: r["costs"]["t_target_ms"] for r in rows if r["pair"] == "target as its own draft"}
    print("\ntarget forward time (ms) over m tokens after a cached prompt")
    print(format_table(["linears"] + [f"m={m}" for m in costs["plain"]], [[name] + list(t.values()) for name, t in costs.items()]))
    out = atomic_write_json(args.out, {"settings": vars(args) | {"threads_used": torch.get_num_threads()}, "results": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
