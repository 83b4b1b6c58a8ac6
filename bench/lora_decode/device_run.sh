#!/usr/bin/env bash
# On any CUDA machine (repo root; loraplane need not be installed): the merge and graph-family GPU tests, the
# multi-LoRA engine GPU tests, then the LoRA decode benchmark.
#   OUT=DIR bash bench/lora_decode/device_run.sh   (results under ${OUT:-bench/lora_decode/results})
#   SKIP_TESTS=1 skips the tests; KERNEL_TESTS=1 adds the kernels' GPU tests; PDL_TESTS=1 runs the
#   programmatic-dependent-launch GPU tests first (WHEELS=DIR: the PEFT wheels that the graph-family tests need, as
#   in bench/churn/device_run.sh); SKIP_BENCH=1 skips the benchmark; BENCH_S bounds it
#   (seconds, default 540: the model, both engines and the sweep's recaptures come before its first row).
set -o pipefail
source scripts/device_env.sh
R="$PWD"; O="${OUT:-$R/bench/lora_decode/results}"; LP="${PYTHONPATH%%:*}"
export PYTHONUNBUFFERED=1
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
PT=(python3 -m pytest --rootdir="$R" -c "$R/pyproject.toml" -o "pythonpath=$LP $R" -p no:cacheprovider -q -rs)
if [ -n "$WHEELS" ]; then  # the PEFT wheels (bench/churn/peft-wheels.txt) on an image without them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ -n "$PDL_TESTS" ]; then
  (cd /tmp && timeout 120 "${PT[@]}" -m gpu "$R/tests/kernels/test_pdl.py" "$R/tests/kernels/test_decode_kernels.py" \
    "$R/tests/engine/test_attention.py" "$R/tests/engine/test_model_runner.py" -k pdl 2>&1 | tail -8 \
    | tee "$O/pdl-gpu-tests.txt")
  (cd /tmp && timeout 240 "${PT[@]}" -m gpu "$R/tests/engine/test_lora_graph_families.py" 2>&1 | tail -8 \
    | tee -a "$O/pdl-gpu-tests.txt")
fi
if [ -z "$SKIP_TESTS" ]; then
  (cd /tmp && timeout 200 "${PT[@]}" "$R/tests/engine/test_lora_merge.py" "$R/tests/engine/test_lora_engine.py" \
    "$R/tests/engine/test_lora_graph_families.py" \
    -k gpu 2>&1 | tail -30 | tee "$O/lora-decode-gpu-tests.txt")
  if [ -n "$KERNEL_TESTS" ]; then
    (cd /tmp && timeout 300 "${PT[@]}" -m gpu "$R/tests/kernels" 2>&1 | tail -30 | tee -a "$O/lora-decode-gpu-tests.txt")
  fi
fi
[ -n "$SKIP_BENCH" ] && exit 0
timeout "${BENCH_S:-540}" python3 bench/run.py lora_decode --out "$O" --name lora-decode "$@" 2>&1 | tee "$O/lora-decode-bench.log" | grep -v '^{'
