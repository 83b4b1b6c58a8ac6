#!/usr/bin/env bash
# On any CUDA machine (repo root; loraplane need not be installed): the merge and graph-family GPU tests, the
# multi-LoRA engine GPU tests, then the LoRA decode benchmark.
#   OUT=DIR bash bench/lora_decode/device_run.sh   (results under ${OUT:-bench/lora_decode/results})
#   SKIP_TESTS=1 skips the tests; KERNEL_TESTS=1 adds the kernels' GPU tests; BENCH_S bounds the benchmark
#   (seconds, default 540: the model, both engines and the sweep's recaptures come before its first row).
set -o pipefail
source scripts/device_env.sh
R="$PWD"; O="${OUT:-$R/bench/lora_decode/results}"; LP="${PYTHONPATH%%:*}"
export PYTHONUNBUFFERED=1
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
PT=(python3 -m pytest --rootdir="$R" -c "$R/pyproject.toml" -o "pythonpath=$LP $R" -p no:cacheprovider -q -rs)
if [ -z "$SKIP_TESTS" ]; then
  (cd /tmp && timeout 200 "${PT[@]}" "$R/tests/engine/test_lora_merge.py" "$R/tests/engine/test_lora_engine.py" \
    "$R/tests/engine/test_lora_graph_families.py" \
    -k gpu 2>&1 | tail -30 | tee "$O/lora-decode-gpu-tests.txt")
  if [ -n "$KERNEL_TESTS" ]; then
    (cd /tmp && timeout 300 "${PT[@]}" -m gpu "$R/tests/kernels" 2>&1 | tail -30 | tee -a "$O/lora-decode-gpu-tests.txt")
  fi
fi
timeout "${BENCH_S:-540}" python3 bench/run.py lora_decode --out "$O" --name lora-decode "$@" 2>&1 | tee "$O/lora-decode-bench.log" | grep -v '^{'
