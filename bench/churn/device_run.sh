#!/usr/bin/env bash
# On any CUDA machine (repo root; loraplane need not be installed): the adapter-churn GPU-relevant tests, then
# the churn benchmark.
#   OUT=DIR bash bench/churn/device_run.sh [bench args...]   (results under ${OUT:-bench/churn/results})
#   SKIP_TESTS=1 skips the tests; SKIP_BENCH=1 skips the benchmark; DIR_ADAPTERS=path puts the adapter files
#   on that disk (default: a temporary folder); WHEELS=DIR installs the PEFT anchor's wheels (peft-wheels.txt).
set -o pipefail
source scripts/device_env.sh
R="$PWD"; O="${OUT:-$R/bench/churn/results}"; LP="${PYTHONPATH%%:*}"
export PYTHONUNBUFFERED=1
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
df -h "${DIR_ADAPTERS:-/tmp}" | tail -1; free -g | head -2
if [ -n "$WHEELS" ]; then  # the PEFT anchor's packages (peft-wheels.txt) on an image without them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ -z "$SKIP_TESTS" ]; then
  (cd /tmp && timeout 240 python3 -m pytest --rootdir="$R" -c "$R/pyproject.toml" -o "pythonpath=$LP $R" \
    -p no:cacheprovider -q -rs "$R/tests/engine/test_lora_engine.py" "$R/tests/engine/test_lora_weights.py" -k "gpu or weights" \
    2>&1 | tail -60 | tee "$O/churn-gpu-tests.log")
fi
if [ -z "$SKIP_BENCH" ]; then
  python3 bench/run.py churn --out "$O" ${DIR_ADAPTERS:+--dir "$DIR_ADAPTERS"} "$@" 2>&1 | tee "$O/churn-bench.log" | grep -v '^{"case"'
  python3 bench/churn/plot.py "$O/churn.json" "$O/churn-ttft.png" "$O/churn-throughput.png" 2>&1 | tail -3 || true
fi
