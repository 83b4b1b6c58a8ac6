#!/usr/bin/env bash
# On the H200 (repo root, loraplane not installed): the engine's GPU tests, then the engine benchmark.
#   bash bench/engine/device_run.sh [bench args...]   (results under ${OUT:-bench/results})
#   SKIP_TESTS=1 skips the tests; SKIP_BENCH=1 skips the benchmark.
set -o pipefail
source scripts/device_env.sh
R="$PWD"; O="${OUT:-$R/bench/results}"; LP="${PYTHONPATH%%:*}"
export PYTHONUNBUFFERED=1
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
if [ -z "$SKIP_TESTS" ]; then
  (cd /tmp && timeout 300 pytest --rootdir="$R" -c "$R/pyproject.toml" -o "pythonpath=$LP $R" -p no:cacheprovider \
    -q "$R/tests/engine/test_attention.py" "$R/tests/engine/test_model_runner.py" -k "gpu or paged or fused or write" \
    2>&1 | tail -25 | tee "$O/engine-gpu-tests.log")
fi
if [ -z "$SKIP_BENCH" ]; then
  python3 bench/run.py engine --out "$O" "$@" 2>&1 | tee "$O/engine-bench.log" | grep -v '^{'
fi
