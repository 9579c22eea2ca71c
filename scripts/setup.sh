#!/usr/bin/env bash
# Install specdistill into .venv (torch first, pinned, so pip never pulls a CUDA build by accident), then
# fetch and convert the embedded default target once. Run: bash scripts/setup.sh
# TORCH_SPEC overrides the torch requirement (e.g. a CUDA build on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python_bin" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  echo "setup: installing ${TORCH_SPEC:-torch==2.13.0}"
  pip install --quiet --disable-pip-version-check ${TORCH_SPEC:-torch==2.13.0}
fi
echo "setup: installing specdistill and its dependencies"
pip install --quiet --disable-pip-version-check -e ".[dev]"
echo "setup: default target (fetched and converted once, then read from the cache)"
python -c "from train.models import ensure_default_target; print('setup: default target at', ensure_default_target())"
