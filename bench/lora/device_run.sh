#!/usr/bin/env bash
# On any CUDA machine (repo root; loraplane need not be installed): the multi-LoRA GPU tests, then the multi-LoRA benchmark.
#   OUT=DIR bash bench/lora/device_run.sh [bench args...]   (results under ${OUT:-bench/lora/results})
#   SKIP_TESTS=1 skips the tests; SKIP_BENCH=1 skips the benchmark.
set -o pipefail
source scripts/device_env.sh
R="$PWD"; O="${OUT:-$R/bench/lora/results}"; LP="${PYTHONPATH%%:*}"
export PYTHONUNBUFFERED=1
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
if [ -z "$SKIP_TESTS" ]; then
  (cd /tmp && timeout 240 python3 -m pytest --rootdir="$R" -c "$R/pyproject.toml" -o "pythonpath=$LP $R" \
    -p no:cacheprovider -q -rs "$R/tests/engine/test_lora_engine.py" -k gpu 2>&1 | tail -150 | tee "$O/lora-gpu-tests.log")
fi
if [ -z "$SKIP_BENCH" ]; then
  python3 bench/run.py lora --out "$O" "$@" 2>&1 | tee "$O/lora-bench.log" | grep -v '^{'
fi
