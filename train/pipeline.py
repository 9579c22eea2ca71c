"""The recipe's stages in order: generate -> distill -> eval -> export; each skips work already finished.

Stages not built yet say so and are skipped; the run directory still gets the resolved recipe.
"""

from __future__ import annotations

import yaml

from train.errors import UserError
from train.fsutil import atomic_write_text
from train.models import build_draft, check_model_vocab, load_model, load_tokenizer, log, pick_device
from train.recipe import Recipe, dump_recipe

IDENTITY_KEYS = ("target", "draft", "data", "generate", "distill", "seed")


def prepare_run_dir(recipe: Recipe, overwrite: bool = False):
    """Create the run directory and write the resolved recipe; refuse a directory holding another recipe's run."""
    run_dir = recipe.run_dir
    stored = run_dir / "recipe.yaml"
    if stored.is_file() and not overwrite:
        previous = yaml.safe_load(stored.read_text()) or {}
        current = recipe.to_dict()
        changed = [key for key in IDENTITY_KEYS if previous.get(key) != current.get(key)]
        if changed:
            raise UserError(
                f"output directory '{run_dir}' holds a run of a different recipe (section '{changed[0]}' differs); "
                "use another output_dir or pass --overwrite"
            )
    atomic_write_text(stored, dump_recipe(recipe))
    return run_dir


def run(recipe: Recipe, overwrite: bool = False, dry_run: bool = False) -> None:
    from train.dist import distributed_state, wait_for_everyone

    state = distributed_state()
    device = state.device if state.num_processes > 1 else pick_device()
    log(f"recipe '{recipe.name}': stages {' -> '.join(recipe.stages)}; run directory {recipe.run_dir}; device {device}")
    tokenizer = load_tokenizer(recipe.target.model, trust_remote_code=recipe.target.trust_remote_code,
                               revision=recipe.target.revision)
    target = load_model(recipe.target.model, dtype=recipe.target.dtype, device=device,
                        trust_remote_code=recipe.target.trust_remote_code, revision=recipe.target.revision)
    check_model_vocab(target, tokenizer, recipe.target.model)
    draft, draft_name = build_draft(recipe, target, tokenizer)
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    log(f"target {recipe.target.model}: {n_target / 1e6:.1f}M parameters; draft {draft_name}: {n_draft / 1e6:.1f}M parameters")
    if dry_run:
        log("dry run: recipe and model pair are valid; nothing was run")
        return
    if state.is_main_process:
        prepare_run_dir(recipe, overwrite)
    wait_for_everyone()
    run_dir = recipe.run_dir
    for stage in recipe.stages:
        if stage == "generate":
            from train.generate import run_generate_stage

            run_generate_stage(recipe, target, tokenizer, run_dir, state)
        elif stage == "eval":
            if not state.is_main_process:
                continue
            from eval.stage import run_eval_stage

            run_eval_stage(recipe, target, draft, tokenizer, draft_name, run_dir)
        else:
            log(f"stage '{stage}' is not built yet in this version; skipped")
