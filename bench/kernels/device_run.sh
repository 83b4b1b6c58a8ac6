#!/usr/bin/env bash
# On any CUDA machine (repo root; loraplane need not be installed): GPU tests of src/loraplane/kernels/, then the benchmark.
#   bash bench/kernels/device_run.sh [bench args...]   (results under ${OUT:-bench/kernels/results})
set -o pipefail
source scripts/device_env.sh
R="$PWD"; O="${OUT:-$R/bench/kernels/results}"; LP="${PYTHONPATH%%:*}"
export PYTHONUNBUFFERED=1
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
if [ -z "$SKIP_TESTS" ]; then
  (cd /tmp && timeout 240 pytest --rootdir="$R" -c "$R/pyproject.toml" -o "pythonpath=$LP $R" -p no:cacheprovider \
    -q -m gpu "$R/tests/kernels" 2>&1 | tail -25 | tee "$O/kernels-gpu-tests.log")
fi
python3 bench/run.py kernels --out "$O" --plot "$O/kernels.png" "$@" 2>&1 | tee "$O/kernels-bench.log" | grep -v '^|'
if [ -n "$SWEEP" ]; then
  python3 bench/run.py kernels --out "$O" --name kernels-sweep --sweep 2>&1 | grep '^sweep' > "$O/kernels-sweep.log"
fi
