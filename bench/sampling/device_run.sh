#!/usr/bin/env bash
# On any CUDA machine (repo root; loraplane need not be installed; torch, triton, safetensors, numpy, pytest):
# the sampling controls' GPU tests, then the benchmark of the decode step at B=64 with and without them.
#   OUT=DIR bash bench/sampling/device_run.sh [bench args...]   (results under ${OUT:-bench/sampling/results})
#   SKIP_TESTS=1 skips the tests.
set -o pipefail
source scripts/device_env.sh
R="$PWD"; O="${OUT:-$R/bench/sampling/results}"; LP="${PYTHONPATH%%:*}"
export PYTHONUNBUFFERED=1
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
if [ -z "$SKIP_TESTS" ]; then
  (cd /tmp && timeout 300 pytest --rootdir="$R" -c "$R/pyproject.toml" -o "pythonpath=$LP $R" -p no:cacheprovider \
    -q -rs "$R/tests/engine/test_logits_processing.py" "$R/tests/engine/test_sampler.py" \
    "$R/tests/engine/test_grammar_mask.py") 2>&1 \
    | tee "$O/sampling-gpu-tests.txt"
fi
python3 bench/run.py sampling --out "$O" "$@" 2>&1 | tee "$O/sampling.log"
