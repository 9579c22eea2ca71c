#!/usr/bin/env bash
# One prepared GPU check (about 8 minutes on one GPU): bash scripts/gpu_check.sh TARGET [OUT_DIR]
#   TARGET: the default target as a local model directory or .gguf file (a GPU machine may have no hub access).
# 1. the default recipe with fewer prompts and steps on CUDA (generate, distill, eval with eval.compile=auto, export);
# 2. the exported draft measured with `python -m eval`, compiled, in float32 and in bfloat16 (the share of greedy
#    requests identical to vanilla is in each report);
# 3. the decoder benchmark (eager against compiled, transformers' static-cache generate() as the baseline);
# and one JSON summary, OUT_DIR/gpu_check.json (default OUT_DIR: runs/gpu_check), with the GPU's name.
# Knobs (environment): GPU_CHECK_STEPS (default 300), GPU_CHECK_WRITTEN (self-written training prompts, default 400),
# GPU_CHECK_PROMPTS (eval prompts, default 20),
# GPU_CHECK_WHEELS (a folder of wheels to install first, offline), PYTHON (default python).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: bash scripts/gpu_check.sh TARGET [OUT_DIR]   (TARGET: a model directory or .gguf file)" >&2
  exit 2
fi
target=$1
out=${2:-runs/gpu_check}
py=${PYTHON:-python}
steps=${GPU_CHECK_STEPS:-300}
written=${GPU_CHECK_WRITTEN:-400}
prompts=${GPU_CHECK_PROMPTS:-20}
if [ ! -e "$target" ]; then
  echo "gpu_check: error: target '$target' not found (a model directory or .gguf file)" >&2
  exit 2
fi
if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
  "$py" -m pip install -q --no-index --find-links "$GPU_CHECK_WHEELS" "$GPU_CHECK_WHEELS"/*.whl
fi
mkdir -p "$out"
export WANDB_MODE=offline HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
stamp() { date +%s.%N; }
t0=$(stamp)
# 1. The default recipe, fewer prompts and steps, on the GPU (the recipe picks cuda when there is one).
"$py" -m train recipes/default.yaml "target.model=$target" "output_dir=$out/run" tracking.report_to=none \
  "data.self_written.num_prompts=$written" "distill.max_steps=$steps" "distill.checkpoint_every=$steps" generate.batch_size=64 "eval.num_prompts=$prompts" eval.compile=auto \
  2>&1 | tee "$out/train.log" | grep -v -E "it/s|s/it|step/s|s/step|req/s|s/req" || true
t1=$(stamp)
# 2. The export measured compiled, in float32 and bfloat16 (vanilla and speculative in the same dtype).
for dtype in float32 bfloat16; do
  "$py" -m eval --target "$target" --draft "$out/run/export" --dtype "$dtype" --compile on --num-prompts "$prompts" \
    --k 8 --draft-confidence 0.5 --temperatures 0,0.7 --max-new-tokens 80 --out "$out/eval-$dtype" --quiet --no-plots \
    2>&1 | tee "$out/eval-$dtype.log"
done
t2=$(stamp)
# 3. The decoder benchmark on the same pair.
"$py" scripts/bench_decoder.py --target "$target" --draft "$out/run/export" --k 8 --draft-confidence 0.5 \
  --prompts 8 --out "$out/bench_decoder.json" 2>&1 | tee "$out/bench_decoder.log"
t3=$(stamp)
"$py" - "$out" "$t0" "$t1" "$t2" "$t3" <<'EOF'
"""Collect the check's figures into one JSON summary."""
import json
import sys
from pathlib import Path

import torch

out, t0, t1, t2, t3 = Path(sys.argv[1]), *map(float, sys.argv[2:])


def load(path):
    return json.loads(path.read_text()) if path.is_file() else None


def brief(report):
    if report is None:
        return None
    return {"decoder": report.get("decoder"), "costs": report["costs"], "greedy_identical_to_vanilla": report["greedy_identical_to_vanilla"],
            "by_temperature": {t: {k: r.get(k) for k in ("alpha", "tau", "speedup_observed", "speedup_theoretical")}
                               for t, r in report["by_temperature"].items()}}


summary_path = out / "run" / "eval" / "summary.json"
summary = load(summary_path)
best = summary["best"] if summary else None
summary = {
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    "torch": torch.__version__,
    "seconds": {"recipe": t1 - t0, "eval_fp32_bf16": t2 - t1, "bench": t3 - t2, "total": t3 - t0},
    "recipe_best_checkpoint": best,
    "recipe_eval": brief(load(out / "run" / "eval" / best / "report.json")) if best else None,
    "eval_float32": brief(load(out / "eval-float32" / "report.json")),
    "eval_bfloat16": brief(load(out / "eval-bfloat16" / "report.json")),
    "bench_decoder": load(out / "bench_decoder.json"),
}
tmp = out / "gpu_check.json.tmp"
tmp.write_text(json.dumps(summary, indent=2))
tmp.replace(out / "gpu_check.json")
print(f"wrote {out / 'gpu_check.json'} ({summary['gpu'] or 'no GPU'}, {summary['seconds']['total']:.0f} s)")
EOF
