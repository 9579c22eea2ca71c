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
python -c "from eval.models import ensure_default_target; print('setup: default target at', ensure_default_target())"
if python -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then  # exit 0: no CUDA
  # Multi-process DeepSpeed on a CPU-only machine (the ZeRO tests) needs DeepSpeed's shared-memory
  # communication op; build it once here (about a minute) rather than inside the first test.
  echo "setup: building DeepSpeed's CPU shared-memory op (once; cached under ~/.cache/torch_extensions)"
  DS_ACCELERATOR=cpu python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load(verbose=False)" 2>&1 | grep -v WARNING || true
fi
