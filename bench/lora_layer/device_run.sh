#!/usr/bin/env bash
# On any CUDA machine (repo root; loraplane need not be installed): the one-layer before/after bench against a
# baseline src/loraplane/kernels/ folder, the multi-LoRA engine's decode bench, then the GPU tests of the
# kernels' launch plans and pooled launches and the engine's multi-LoRA GPU tests (each under its own time limit).
#   BASELINE=path/to/baseline/kernels OUT=DIR bash bench/lora_layer/device_run.sh
#   (results under ${OUT:-bench/lora_layer/results}; the engine's under ${LORA_OUT:-bench/lora/results};
#   SKIP_ENGINE=1 leaves that run out)
set -o pipefail
source scripts/device_env.sh
R="$PWD"; O="${OUT:-$R/bench/lora_layer/results}"; LP="${PYTHONPATH%%:*}"; B="${BASELINE:?BASELINE=baseline src/loraplane/kernels/ folder}"
export PYTHONUNBUFFERED=1
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
timeout 150 python3 bench/run.py lora_layer --out "$O" --name "${NAME:-lora-layer}" --baseline "$B" 2>&1 | grep -v '^|'
LO="${LORA_OUT:-$R/bench/lora/results}"; mkdir -p "$LO"
[ -z "$SKIP_ENGINE" ] && timeout 170 python3 bench/run.py lora --out "$LO" --skip bytes slora 2>&1 \
  | tee "$LO/lora-bench.log" | grep -v '^|'
PT=(python3 -m pytest --rootdir="$R" -c "$R/pyproject.toml" -o "pythonpath=$LP $R" -p no:cacheprovider -q -rs)
(cd /tmp && timeout 100 "${PT[@]}" -n 8 -m gpu "$R/tests/kernels/test_plans.py" "$R/tests/kernels/test_many.py" \
  "$R/tests/kernels/test_ops.py" 2>&1 | tail -20 | tee "$O/lora-layer-gpu-tests.txt")
(cd /tmp && timeout 100 "${PT[@]}" "$R/tests/engine/test_lora_engine.py" -k gpu 2>&1 | tail -20 \
  | tee -a "$O/lora-layer-gpu-tests.txt")
