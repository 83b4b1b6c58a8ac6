#!/usr/bin/env bash
# On any CUDA machine (repo root; loraplane need not be installed): the unified-memory GPU test, then unified
# against split.
#   OUT=DIR bash bench/unified/device_run.sh [bench args...]   (results under ${OUT:-bench/unified/results})
#   SKIP_TESTS=1 skips the test; SKIP_BENCH=1 skips the benchmark.
set -o pipefail
source scripts/device_env.sh
R="$PWD"; O="${OUT:-$R/bench/unified/results}"; LP="${PYTHONPATH%%:*}"
export PYTHONUNBUFFERED=1
mkdir -p "$O"
if [ -z "$SKIP_TESTS" ]; then
  (cd /tmp && timeout 240 python3 -m pytest --rootdir="$R" -c "$R/pyproject.toml" -o "pythonpath=$LP $R" \
    -p no:cacheprovider -q -rs "$R/tests/engine/test_unified_memory.py" -k gpu 2>&1 | tail -60 | tee "$O/unified-gpu-tests.log")
fi
if [ -z "$SKIP_BENCH" ]; then
  python3 bench/run.py unified --out "$O" --cuda "$@" 2>&1 | tee "$O/unified-bench.log" | grep -v '^{'
fi
