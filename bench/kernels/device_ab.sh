#!/usr/bin/env bash
# On any CUDA machine (repo root; loraplane need not be installed): every GPU test of src/loraplane/kernels/, then the before/after
# benchmark of this tree's kernels against a baseline src/loraplane/kernels/ folder (ab.py), in one run.
#   BASELINE=path/to/baseline/kernels bash bench/kernels/device_ab.sh   (results under ${OUT:-bench/kernels/results})
# While the tests run, one process per shape compiles the benchmark's kernels (Triton's disk cache), so
# the timed pass compiles nothing.
set -o pipefail
source scripts/device_env.sh
R="$PWD"; O="${OUT:-$R/bench/kernels/results}"; LP="${PYTHONPATH%%:*}"; B="${BASELINE:?BASELINE=baseline src/loraplane/kernels/ folder}"
export PYTHONUNBUFFERED=1
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
for s in q_proj qkv gate_up down; do
  python3 bench/run.py kernels --out "/tmp/warm-$s" --ab "$B" --warm-only --shapes "$s" --no-ragged >"/tmp/warm-$s.log" 2>&1 &
done
python3 bench/run.py kernels --out /tmp/warm-ragged --ab "$B" --warm-only --shapes "" >/tmp/warm-ragged.log 2>&1 &
(cd /tmp && timeout 330 python3 -m pytest -n 8 --rootdir="$R" -c "$R/pyproject.toml" -o "pythonpath=$LP $R" \
  -p no:cacheprovider -q -m gpu "$R/tests/kernels" 2>&1 | tail -40 | tee "$O/kernels-gpu-tests.log")
wait
tail -n 3 /tmp/warm-*.log
python3 bench/run.py kernels --out "$O" --name kernels-ab --ab "$B" 2>&1 | tee "$O/kernels-ab.log" | grep -v '^|'
