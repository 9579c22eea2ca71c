"""The distill stage: the draft learns the target's distribution, on one process or many (accelerate launch).

One loop, written out in `run_distill_stage`: target forward under no_grad (or the cached top-k
log-probs from generate), draft forward, weighted sum of losses, `accelerator.backward`, clip, step,
log, checkpoint, measure. accelerate is the only wrapper: DDP, DeepSpeed ZeRO-2 and ZeRO-3 come from
the launch config.

Normalisation: every loss term is a sum over the completion tokens of the global batch (all
micro-batches of the optimizer step on all processes) divided by that global token count, so the
loss and the gradient do not depend on how the batch is split over accumulation and processes.

Around the loop, each in a module named for it: batches and data order (train/batches.py), the target
signal (train/target_signal.py), the draft vocabulary (train/draft_vocab.py), checkpoints
(train/checkpoints.py), the Accelerator and DeepSpeed set-up (train/dist.py), the losses (train/losses.py).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from train import losses as L
from train.batches import Batch, build_examples, micro_batches, on_policy_batch
from train.checkpoints import (STATE_FILE, latest_good_checkpoint, list_checkpoints, prune_checkpoints, save_checkpoint,
                               truncate_log)
from train.dist import prepare_target, zero_stage
from train.draft_vocab import DraftVocab, prepare_draft_vocab
from eval.errors import UserError
from eval.fsutil import atomic_write_json
from eval.models import log
from train.models import cast_weights
from train.target_signal import (TargetSignal, columns, fused_head_weight, head_rows, last_hidden, model_logits,
                                 target_rows)


def lr_lambda(warmup: int, total: int, floor: float = 0.1):
    """Linear warm-up, then cosine decay to `floor` of the peak learning rate."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(total - warmup, 1)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return f


def batch_losses(recipe, draft, target, batch: Batch, device, on_policy: bool = False, cached=None,
                 restrict: DraftVocab | None = None) -> dict[str, torch.Tensor]:
    """One micro-batch's weighted loss terms: `target_signal`, `draft_forward`, `loss_terms`, the three calls of
    the loop's step."""
    signal = target_signal(recipe, target, batch, device, on_policy, cached)
    drafted = draft_forward(draft, batch, device, recipe.distill.loss_chunk_size)
    return loss_terms(recipe.distill, drafted, signal, batch, on_policy, restrict)


def target_signal(recipe, target, batch: Batch, device, on_policy: bool, cached) -> TargetSignal:
    """The target's side: online (a forward pass under no_grad; on-policy batches always), cached (the generate
    stage's top-k) or none (sequence_ce alone learns from the target's text, not its distribution)."""
    if not any(name != "sequence_ce" for name in recipe.distill.losses):
        kind = "none"
    else:
        kind = "online" if on_policy or recipe.distill.target_signal == "online" else "cached"
    return target_rows(kind, target=target, batch=batch, device=device, cached=cached)


@dataclass
class DraftForward:
    """The draft's side at the micro-batch's N loss positions: its logits, or, for the fused head, its last hidden
    states and the head weight that the loss applies chunk by chunk."""

    vocab: int
    logits: torch.Tensor | None = None  # (1, N, V)
    hidden: torch.Tensor | None = None  # (1, N, H)
    head: torch.Tensor | None = None  # (V, H)


def draft_forward(draft, batch: Batch, device, chunk_size: int) -> DraftForward:
    """With `loss_chunk_size` > 0 and a head it can reach, the draft's head runs inside the loss, chunk by chunk
    (`losses.fused_head_loss`: the draft's (N, V) logits never exist whole); otherwise its forward gives logits."""
    keep = batch.positions.to(device)  # (B, T): prompt and padding positions never enter a loss
    head = fused_head_weight(chunk_size, draft)
    if head is not None:
        return DraftForward(head.shape[0], hidden=last_hidden(draft, batch, device)[keep][None], head=head)
    logits = model_logits(draft, batch, device)[keep][None]
    return DraftForward(logits.shape[-1], logits=logits)


def loss_terms(section, drafted: DraftForward, signal: TargetSignal, batch: Batch, on_policy: bool,
               restrict: DraftVocab | None = None) -> dict[str, torch.Tensor]:
    """Each weighted loss as a sum over the N loss positions (normalised later by the global token count).

    `restrict`: a reduced draft vocabulary; both distributions are taken over its tokens, and a label outside
    it counts in no sequence_ce term. Returns {loss name: weighted sum}; their sum carries the gradient of all.
    """
    device = drafted.head.device if drafted.head is not None else drafted.logits.device
    labels = batch.input_ids[:, batch.first + 1:].to(device)[batch.positions.to(device)][None]  # (1, N)
    label_ok = torch.ones(labels.shape, dtype=torch.float32, device=device)
    if restrict is not None:
        labels, inside = restrict.labels(labels)
        label_ok = inside.float()
    # Same tokenizer, but the heads may be padded to different sizes (Qwen2.5 0.5B has 151936 rows, 7B 152064):
    # compare the rows both have; the rest are padding no text uses.
    vocab = min(drafted.vocab, signal.vocab) if signal.vocab is not None else drafted.vocab
    target_chunk = None if signal.rows is None else (lambda lo, hi: signal.rows(lo, hi, vocab, restrict))
    active = _active_losses(section, on_policy)

    if drafted.head is None:
        draft_logits = columns(drafted.logits, vocab, restrict)
        target_logits = target_chunk(0, draft_logits.shape[1]) if target_chunk is not None else None
        terms = {}
        for name, weight, kwargs in active:
            if name == "sequence_ce":
                value = L.sequence_ce(draft_logits, labels, label_ok, reduction="sum", chunk_size=section.loss_chunk_size)
            else:
                value = L.DIVERGENCES[name](draft_logits, target_logits, None, temperature=section.temperature,
                                            reduction="sum", chunk_size=section.loss_chunk_size, **kwargs)
            terms[name] = weight * value
        return terms

    values = {name: torch.zeros((), device=device) for name, _, _ in active}

    def chunk_value_and_grad(lo, hi, logits):  # (1, C, V) -> (), (1, C, V)
        target_logits = target_chunk(lo, hi) if target_chunk is not None else None
        ones = logits.new_ones(logits.shape[:2], dtype=torch.float32)
        grad, chunk_value = None, torch.zeros((), device=logits.device)
        for name, w, kwargs in active:
            if name == "sequence_ce":
                value, g = L.ce_value_and_grad(logits, labels[:, lo:hi], label_ok[:, lo:hi])
            else:
                value, g = L.divergence_value_and_grad(name, logits, target_logits, ones,
                                                       temperature=section.temperature, **kwargs)
            values[name] += w * value
            chunk_value += w * value
            grad = g.mul_(w) if grad is None else grad.add_(g, alpha=w)
            del g
        return chunk_value, grad

    total = L.fused_head_loss(drafted.hidden, head_rows(drafted.head, vocab, restrict), chunk_value_and_grad,
                              section.loss_chunk_size)
    terms = {name: value.detach() for name, value in values.items()}
    if terms:
        first = next(iter(terms))
        terms[first] = terms[first] + (total - total.detach())  # the value of one term, the gradient of all
    return terms


def _active_losses(section, on_policy: bool) -> list[tuple[str, float, dict]]:
    """(name, weight, keyword arguments) of each loss term this batch computes."""
    return [(name, weight, {"beta": section.jsd_beta} if name == "jsd" else {})
            for name, weight in section.losses.items()
            # draft-written tokens are not targets; on-policy batches learn from the divergences only
            if not (on_policy and name == "sequence_ce")]


def run_distill_stage(recipe, accelerator, target, draft, tokenizer, run_dir: Path, on_checkpoint=None):
    """Train the draft; write `checkpoint-STEP/` every `checkpoint_every` steps and at the end.

    `on_checkpoint(step, path, draft)` runs on every process after each checkpoint is complete (the eval
    hook; it decides itself which process measures). Returns the list of (step, path) checkpoints.
    """
    section = recipe.distill
    run_dir = Path(run_dir)
    done_marker = run_dir / "distill" / "done.json"
    if done_marker.is_file():
        log(f"distill: already finished ({done_marker}); skipped")
        return list_checkpoints(run_dir)
    examples, cached, dataset = load_examples(recipe, run_dir)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    global_batch = section.batch_size * section.grad_accum * world
    vocab_ids = prepare_draft_vocab(recipe, run_dir, tokenizer, dataset, accelerator)
    restrict = None if vocab_ids is None else DraftVocab.of(vocab_ids, len(tokenizer), device)

    torch.manual_seed(recipe.train_seed)
    draft, optimizer, scheduler = prepare_draft(recipe, accelerator, draft)
    target = prepare_target(accelerator, target) if (section.target_signal == "online" or section.on_policy_lambda > 0) else None
    stage = zero_stage(accelerator)
    start_step = resume(run_dir, accelerator, scheduler, global_batch, section.max_steps)
    log(f"distill: {len(examples)} examples, global batch {global_batch} sequences "
        f"({section.batch_size} x {section.grad_accum} accumulation x {world} processes), steps {start_step}->{section.max_steps}, "
        f"losses {section.losses}, target signal {section.target_signal}, on-policy lambda {section.on_policy_lambda}, "
        f"precision {accelerator.mixed_precision}" + (f", DeepSpeed ZeRO-{stage}" if stage >= 0 else "")
        + (f", draft vocabulary {len(vocab_ids)} tokens" if vocab_ids else ""))

    log_path = run_dir / "distill" / "log.jsonl"  # one JSON line of metrics per optimizer step
    if accelerator.is_main_process:
        truncate_log(log_path, start_step)
    checkpoints = list_checkpoints(run_dir)
    bar = tqdm(total=section.max_steps, initial=start_step, desc="distill", unit="step",
               disable=not accelerator.is_main_process)
    try:
        for step in range(start_step, section.max_steps):
            t0 = time.perf_counter()
            # This process's micro-batches; on a seeded draw (the same on every process) the draft writes them.
            micro = micro_batches(examples, step, batch_size=section.batch_size, grad_accum=section.grad_accum, world=world,
                                  rank=rank, seed=recipe.train_seed, pad_id=tokenizer.pad_token_id,
                                  group_by_length=section.group_by_length)
            gen = torch.Generator().manual_seed(recipe.train_seed * 7_919 + step)
            on_policy = section.on_policy_lambda > 0 and torch.rand((), generator=gen).item() < section.on_policy_lambda
            if on_policy:
                micro = [on_policy_batch(accelerator.unwrap_model(draft), b, tokenizer, recipe.generate.max_new_tokens,
                                         section.temperature, seed=recipe.train_seed * 1_000_003 + step * 131 + a * 7 + rank,
                                         synced_gpus=stage == 3 and world > 1) for a, b in enumerate(micro)]
            global_tokens = accelerator.reduce(torch.tensor(float(sum(b.tokens for b in micro)), device=device), "sum").item()
            # accelerate divides by grad_accum, DDP/DeepSpeed average over processes: undo both so the
            # gradient is sum(all tokens) / global_tokens.
            scale = section.grad_accum * world / max(global_tokens, 1.0)

            sums = {}
            for b in micro:
                with accelerator.accumulate(draft):
                    with accelerator.autocast():
                        signal = target_signal(recipe, target, b, device, on_policy, cached)  # under no_grad, or cached
                        drafted = draft_forward(draft, b, device, section.loss_chunk_size)
                        terms = loss_terms(section, drafted, signal, b, on_policy, restrict)
                    accelerator.backward(sum(terms.values()) * scale)
                    for name, value in terms.items():
                        sums[name] = sums.get(name, 0.0) + value.detach().float()
            names = sorted(sums)
            totals = accelerator.reduce(torch.stack([sums[n] for n in names]).to(device), "sum") / max(global_tokens, 1.0)
            loss_value = totals.sum().item()
            if not math.isfinite(loss_value):
                last = checkpoints[-1][1] if checkpoints else None
                raise UserError(f"distill: loss is {loss_value} at step {step + 1}; stopped. "
                                + (f"Last good checkpoint: {last}" if last else "No checkpoint was written yet"))

            # Clip, step.
            grad_norm = accelerator.clip_grad_norm_(draft.parameters(), section.max_grad_norm)
            lr = scheduler.get_last_lr()[0]  # the rate this step uses
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            # Log.
            elapsed = time.perf_counter() - t0
            metrics = {"train/loss": loss_value, "train/lr": lr,
                       "train/tokens_per_s": global_tokens / elapsed, "train/tokens": global_tokens,
                       "train/on_policy": float(on_policy)}
            metrics.update({f"train/{n}": v.item() for n, v in zip(names, totals)})
            if grad_norm is not None:
                metrics["train/grad_norm"] = float(grad_norm)
            accelerator.log(metrics, step=step + 1)
            if accelerator.is_main_process:
                with log_path.open("a") as fh:
                    fh.write(json.dumps({"step": step + 1, **metrics}) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{global_tokens / elapsed:.0f}")

            # Checkpoint (and measure it).
            if (step + 1) % section.checkpoint_every == 0 or step + 1 == section.max_steps:
                path = save_checkpoint(recipe, accelerator, draft, scheduler, tokenizer, run_dir, step + 1, global_batch)
                if on_checkpoint is not None:
                    on_checkpoint(step + 1, path, accelerator.unwrap_model(draft))
                prune_checkpoints(accelerator, run_dir, section.keep_checkpoints)
                checkpoints = list_checkpoints(run_dir)
    finally:
        bar.close()  # before any error line, so that the error is the last line printed
    if accelerator.is_main_process:
        atomic_write_json(done_marker, {"steps": section.max_steps, "checkpoints": [p.name for _, p in checkpoints]})
    accelerator.wait_for_everyone()
    return checkpoints


def load_examples(recipe, run_dir: Path):
    """The generated data as training examples, the cached target signal (topk_ids, topk_logprobs) or (None, None),
    and the dataset itself."""
    from train.generate import load_generated

    section = recipe.distill
    if not (run_dir / "generate" / "manifest.json").is_file():
        raise UserError(f"distill: no generated data in {run_dir / 'generate'}; run the generate stage first")
    dataset = load_generated(run_dir)
    if section.target_signal == "cached" and "topk_ids" not in dataset.column_names:
        raise UserError("recipe key 'distill.target_signal': 'cached' needs generate.topk_logprobs > 0 "
                        "(the generated data holds no top-k log-probs)")
    cached = (dataset["topk_ids"], dataset["topk_logprobs"]) if section.target_signal == "cached" else (None, None)
    return build_examples(dataset, section.max_seq_len), cached, dataset


def prepare_draft(recipe, accelerator, draft):
    """The trainable draft (float32 master weights, embeddings frozen if asked), its AdamW and LR schedule, prepared."""
    section = recipe.distill
    if any(p.dtype != torch.float32 for p in draft.parameters()):
        # Master weights in float32; bf16 on GPU comes from autocast (mixed_precision), not from the weights.
        cast_weights(draft, torch.float32)
    if section.freeze_embeddings:
        draft.get_input_embeddings().requires_grad_(False)
        draft.get_output_embeddings().requires_grad_(False)
    draft.train()
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=section.lr,
                                  weight_decay=section.weight_decay, betas=(0.9, 0.95))
    # The schedule is stepped by hand once per optimizer step (accelerate's prepared scheduler steps
    # once per process, which would make the schedule depend on the world size).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(section.warmup_steps, section.max_steps))
    draft, optimizer = accelerator.prepare(draft, optimizer)
    return draft, optimizer, scheduler


def resume(run_dir: Path, accelerator, scheduler, global_batch: int, max_steps: int) -> int:
    """Load the newest whole checkpoint's state (optimizer, RNG, schedule); the step to continue from (0: none)."""
    found = latest_good_checkpoint(run_dir)
    if found is None:
        return 0
    step, path = found
    state = json.loads((path / STATE_FILE).read_text())
    if state["global_batch"] != global_batch:
        raise UserError(f"distill: {path} was written with a global batch of {state['global_batch']} "
                        f"sequences, this launch has {global_batch}; resume with the same batch_size x "
                        "grad_accum x processes or start a new output_dir")
    accelerator.load_state(str(path / "state"))
    scheduler.load_state_dict(state["scheduler"])
    log(f"distill: resuming from {path} (step {step} of {max_steps})")
    return step
