#!/usr/bin/env bash
# On a machine with 2 GPUs (repo root, loraplane not installed): the tensor-parallel GPU tests, then the
# decode-step benchmarks (70B shape base-only and with 32 adapters, 8B shape at TP=2; TP=1 of the 8B shape
# is bench/run.py engine).
#   OUT=DIR bash bench/tp/device_run.sh          (results under ${OUT:-bench/results})
set -o pipefail
source scripts/device_env.sh
R="$PWD"; O="${OUT:-$R/bench/results}"; LP="${PYTHONPATH%%:*}"
export PYTHONUNBUFFERED=1
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
(cd /tmp && timeout 420 python3 -m pytest --rootdir="$R" -c "$R/pyproject.toml" -o "pythonpath=$LP $R" \
  -p no:cacheprovider -q -rs "$R/tests/engine/test_tensor_parallel.py" "$R/tests/engine/test_tensor_parallel_agreement.py" -k gpu 2>&1 | tail -50 | tee "$O/tp-gpu-tests.log")
python3 bench/run.py tp --out "$O" --name tp-70b --shape llama3-70b --tp 2
python3 bench/run.py tp --out "$O" --name tp-70b-32adapters --shape llama3-70b --tp 2 --adapters 32
python3 bench/run.py tp --out "$O" --name tp-8b --shape llama3-8b --tp 2
