"""Run a recipe: `python -m train RECIPE.yaml [key.sub=value ...] [--stages eval,export]`.

The same command runs on one process or many (`accelerate launch -m train RECIPE.yaml`).
"""

from __future__ import annotations

import argparse
import warnings

from eval.errors import UserError, cli_main
from train.recipe import STAGES, load_recipe


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__)
    parser.add_argument("recipe", help="YAML recipe file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. distill.lr=1e-4 eval.k=3")
    parser.add_argument("--stages", default=None, help=f"comma-separated subset of {','.join(STAGES)} (default: the recipe's)")
    parser.add_argument("--overwrite", action="store_true", help="reuse an output directory that holds a different recipe's run")
    parser.add_argument("--dry-run", action="store_true", help="validate the recipe and the model pair, print the plan, run nothing")
    return parser.parse_intermixed_args(argv)  # overrides may come before or after the options


@cli_main
def main(argv=None):
    # DeepSpeed calls collectives torch has renamed; the warning repeats on every step and helps no user.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    args = parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    if args.stages:
        stages = [s.strip() for s in args.stages.split(",") if s.strip()]
        unknown = [s for s in stages if s not in STAGES]
        if unknown:
            raise UserError(f"--stages: unknown stage '{unknown[0]}'; expected some of {', '.join(STAGES)}")
        recipe.stages = stages
    from train.pipeline import run

    run(recipe, overwrite=args.overwrite, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
