"""The reduced draft vocabulary in training (`draft.vocab_size`; EAGLE-3): which tokens, chosen once from the
generated data into RUN/draft_vocab.json, and the index that maps token ids and labels onto them.
eval/draft_vocab.py holds the decoding side (the file format, the restricted head)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from eval.draft_vocab import FILENAME as DRAFT_VOCAB_FILE
from eval.draft_vocab import build_draft_vocab, load_draft_vocab, save_draft_vocab, subset_index
from eval.errors import UserError
from eval.models import log


@dataclass(frozen=True)
class DraftVocab:
    """A reduced draft vocabulary in training (`draft.vocab_size`, `eval.draft_vocab`): the draft's head
    and the target's distribution are both taken over `ids` only."""

    ids: torch.Tensor
    """(S,) the token ids, ascending."""
    index: torch.Tensor
    """(V,) the position of each token id in `ids`, -1 for the others."""

    @classmethod
    def of(cls, ids: list[int], vocab: int, device) -> "DraftVocab":
        return cls(torch.as_tensor(ids, dtype=torch.long, device=device), subset_index(ids, vocab, device))

    def labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Labels as positions in `ids` and a mask of those inside it (a label outside is no target)."""
        size = self.index.shape[0]  # a draft-sampled token may be a padding row past the tokenizer's ids
        mapped = torch.where(labels < size, self.index[labels.clamp_max(size - 1)], -1)
        return mapped.clamp_min(0), mapped >= 0


def prepare_draft_vocab(recipe, run_dir: Path, tokenizer, dataset=None, accelerator=None) -> list[int] | None:
    """The reduced draft vocabulary of this run (`draft.vocab_size`), or None for the full one.

    Built once from the generated data (the tokens with the most target probability in its top-k, or the
    most frequent completion tokens when no top-k was kept) into RUN/draft_vocab.json, which later stages
    and a resumed run read back.
    """
    from train.generate import load_generated

    size = recipe.draft.vocab_size
    if size <= 0:
        return None
    run_dir = Path(run_dir)
    path = run_dir / DRAFT_VOCAB_FILE
    vocab = len(tokenizer)
    main = accelerator is None or accelerator.is_main_process
    if main and (not path.is_file() or json.loads(path.read_text()).get("requested") != size):
        if not (run_dir / "generate" / "manifest.json").is_file():
            raise UserError(f"recipe key 'draft.vocab_size': the draft vocabulary is chosen from generated data; "
                            f"{run_dir / 'generate'} has none yet (run the generate stage first)")
        dataset = dataset if dataset is not None else load_generated(run_dir)
        completions = dataset["completion_ids"]
        if "topk_ids" in dataset.column_names:
            rows, lps = dataset["topk_ids"], dataset["topk_logprobs"]
        else:
            rows, lps = [[[t] for t in c] for c in completions], [[[0.0]] * len(c) for c in completions]
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids = build_draft_vocab(rows, lps, size, vocab, always=eos)
        inside = set(ids)
        total = sum(len(c) for c in completions)
        coverage = sum(t in inside for c in completions for t in c) / max(total, 1)
        save_draft_vocab(run_dir, ids, requested=size, vocab=vocab, generated_tokens_covered=coverage)
        log(f"draft vocabulary: {len(ids)} of {vocab} tokens, covering {100 * coverage:.1f}% of the generated tokens ({path})")
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return load_draft_vocab(run_dir)
