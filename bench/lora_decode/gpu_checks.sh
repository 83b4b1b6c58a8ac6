#!/usr/bin/env bash
# On any CUDA machine (repo root): the GPU tests of the captured LoRA launches' streams and of the start
# (compile ahead, fast launches), with a time limit. WHEELS=DIR: the PEFT wheels the engine tests need.
#   OUT=DIR [LIMIT_S=150] bash bench/lora_decode/gpu_checks.sh [pytest -k expression]
set -o pipefail
source scripts/device_env.sh
R="$PWD"; O="${OUT:-/tmp}"; LP="${PYTHONPATH%%:*}"
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
cd /tmp && timeout "${LIMIT_S:-150}" python3 -m pytest --rootdir="$R" -c "$R/pyproject.toml" -o "pythonpath=$LP $R" \
  -p no:cacheprovider -q -rs -m gpu -k "${1:-beside or overlap or fast_launch or no_compile}" \
  "$R/tests/kernels/test_overlap.py" "$R/tests/kernels/test_plans.py" "$R/tests/engine/test_lora_warmup.py" \
  "$R/tests/engine/test_lora_graph_families.py" 2>&1 | tail -25 | tee "$O/gpu-checks.txt"
