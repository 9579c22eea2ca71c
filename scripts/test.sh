#!/usr/bin/env bash
# Run the test suite on CPU: bash scripts/test.sh [pytest arguments]
# Runs scripts/setup.sh first when .venv is missing. Test files are spread over one worker per core
# (pytest-xdist; each test runs single-threaded); `-n 0` runs them in this process, one after another.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -c "import xdist" 2>/dev/null || pip install --quiet --disable-pip-version-check -e ".[dev]"  # a .venv from before xdist
export OMP_NUM_THREADS=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q -n auto --dist loadfile "$@"
