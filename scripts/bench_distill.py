"""Benchmark distillation steps: python scripts/bench_distill.py [--seq-len 512] [--batch-size 1] [--steps 2] [--draft-vocab N]

For each loss (forward_kl, reverse_kl, jsd, tvd, sequence_ce), with and without chunking over the
sequence, and with the online vs the cached (top-k) target signal: training tokens/s and peak memory
of one optimizer step on the default target (vocabulary 49152) and a draft of its layers (embeddings
and head frozen, as in the default recipe), through
`batch_losses`: the target signal, draft forward and loss terms of the distill step. Each configuration runs in its own process so that
peak memory is its own: CUDA max_memory_allocated on a GPU; on CPU the peak resident memory sampled
every 0.5 ms during the timed steps, over what the process held before them (models, batch and
optimizer state, created by a warm-up step, are the baseline). `--draft-vocab N` trains over a reduced
draft vocabulary of N tokens (`draft.vocab_size`), whose cost is what is measured (the ids do not matter).
Prints a table and writes JSON (default runs/bench/bench_distill.json).

Goal (issue 5): chunked peak memory at most half of unchunked at vocabulary 49152 and sequence 512,
at no more than 10% lower tokens/s.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOSSES = ("forward_kl", "reverse_kl", "jsd", "tvd", "sequence_ce")


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


class PeakRSS:
    """Peak resident memory of this process while the block runs, sampled by a thread (torch ops
    release the GIL). Large tensors are mmapped and returned to the system when freed, so this tracks
    the step's own high-water mark."""

    def __enter__(self):
        self.base = self.peak = rss_bytes()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.0005)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()


def one_config(args) -> dict:
    """Run warm-up + timed steps of one configuration in this process; return its measurements."""
    from train.batches import Example, collate
    from train.distill import batch_losses
    from train.draft_vocab import DraftVocab
    from eval.models import load_model
    from train.models import draft_from_layers
    from train.recipe import parse_recipe

    torch.manual_seed(0)
    target = load_model(args.target)
    device = target.device
    draft = draft_from_layers(target, args.layers).float().to(device).train()
    draft.get_input_embeddings().requires_grad_(False)  # as the default recipe (freeze_embeddings): the
    draft.get_output_embeddings().requires_grad_(False)  # tied head's gradient would be in both columns
    recipe = parse_recipe({"distill": {"losses": {args.loss: 1.0}, "loss_chunk_size": args.chunk,
                                       "target_signal": args.signal}})
    vocab = draft.config.vocab_size
    prompt_len = 32
    examples, topk_ids, topk_lp = [], [], []
    for b in range(args.batch_size):
        ids = torch.randint(0, vocab, (args.seq_len,)).tolist()
        examples.append(Example(ids=ids, start=prompt_len, row=b))
        n = args.seq_len - prompt_len
        topk_ids.append(torch.randint(0, vocab, (n, args.topk)).tolist())
        topk_lp.append(torch.log_softmax(torch.randn(n, 64), -1).topk(args.topk, -1).values.tolist())
    batch = collate(examples, pad_id=0)
    restrict = DraftVocab.of(list(range(args.draft_vocab)), vocab, device) if args.draft_vocab else None
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-5)

    def step():
        terms = batch_losses(recipe, draft, target, batch, device, cached=(topk_ids, topk_lp), restrict=restrict)
        (sum(terms.values()) / batch.tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # The optimizer state is created by the first step; measure memory from after a warm-up step
    # so that it counts in the baseline, not in the step's peak.
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with PeakRSS() as rss:
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
        peak = rss.peak - rss.base
    elapsed = time.perf_counter() - start
    return {"loss": args.loss, "chunk": args.chunk, "signal": args.signal, "device": str(device),
            "tokens_per_s": batch.tokens * args.steps / elapsed, "step_peak_mib": peak / 2**20,
            "seconds_per_step": elapsed / args.steps}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 29])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=64, help="chunk length of the chunked runs")
    parser.add_argument("--topk", type=int, default=20, help="cached log-probs per position")
    parser.add_argument("--draft-vocab", type=int, default=0, help="train over a reduced draft vocabulary of N tokens (0: all)")
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--signals", default="online,cached")
    parser.add_argument("--out", default="runs/bench/bench_distill.json")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # internal: one configuration
    parser.add_argument("--loss", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--signal", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_config(args)))
        return

    from eval.report import format_table
    from eval.fsutil import atomic_write_json

    common = ["--target", args.target, "--layers", *map(str, args.layers), "--seq-len", str(args.seq_len),
              "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--topk", str(args.topk),
              "--draft-vocab", str(args.draft_vocab)]
    results = []
    for signal in args.signals.split(","):
        for loss in args.losses.split(","):
            if loss == "sequence_ce" and signal == "cached":
                continue  # sequence_ce does not read the target signal
            for chunk in (0, args.chunk_size):
                cmd = [sys.executable, __file__, "--one", "--loss", loss, "--chunk", str(chunk), "--signal", signal, *common]
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                if proc.returncode != 0:
                    sys.exit(f"bench_distill: {loss}/{signal}/chunk {chunk} failed:\n{proc.stderr[-2000:]}")
                results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                r = results[-1]
                print(f"  {signal:6s} {loss:12s} chunk {chunk:4d}: {r['tokens_per_s']:8.1f} tok/s, "
                      f"step peak {r['step_peak_mib']:8.1f} MiB", file=sys.stderr, flush=True)

    rows, verdicts = [], []
    for signal in args.signals.split(","):
        for loss in args.losses.split(","):
            pair = [r for r in results if r["loss"] == loss and r["signal"] == signal]
            if len(pair) != 2:
                continue
            plain, chunked = sorted(pair, key=lambda r: r["chunk"])
            mem_ratio = chunked["step_peak_mib"] / plain["step_peak_mib"]
            speed_ratio = chunked["tokens_per_s"] / plain["tokens_per_s"]
            ok = mem_ratio <= 0.5 and speed_ratio >= 0.9
            verdicts.append({"loss": loss, "signal": signal, "memory_ratio": mem_ratio, "speed_ratio": speed_ratio, "goal_met": ok})
            rows.append([signal, loss, plain["tokens_per_s"], chunked["tokens_per_s"], speed_ratio,
                         plain["step_peak_mib"], chunked["step_peak_mib"], mem_ratio, "yes" if ok else "no"])
    device = results[0]["device"] if results else "?"
    print(f"{args.target} -> draft layers {args.layers}, batch {args.batch_size} x {args.seq_len} tokens, "
          f"vocabulary 49152{f' (draft vocabulary {args.draft_vocab})' if args.draft_vocab else ''}, chunk {args.chunk_size}, device {device}, {torch.get_num_threads()} threads")
    print(format_table(["signal", "loss", "tok/s plain", "tok/s chunked", "speed ratio", "peak MiB plain",
                        "peak MiB chunked", "memory ratio", "goal"], rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, {"settings": {k: v for k, v in vars(args).items() if k not in ("one", "loss", "chunk", "signal")},
                            "results": results, "comparisons": verdicts})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
