#!/usr/bin/env bash
# Before/after in one run on a CUDA machine (repo root of the new code; loraplane not installed):
#   bash bench/engine/compare_run.sh BEFORE_ROOT     (results under ${OUT:-bench/engine/results})
# 1. this tree's engine benchmark against BEFORE_ROOT's engine (engine-before.json; no sweep, no profile);
# 2. this tree's GPU tests of attention, the runner and the engine (gpu-tests.log);
# 3. this tree's benchmark with --sweep and --profile (engine.{json,md}, profile-{decode,mixed}.md).
# GPU clocks and power are logged once a second meanwhile (clocks.csv); all output also goes to run.log.
set -o pipefail
NEW="$PWD"; BEFORE="$(cd "${1:?usage: compare_run.sh BEFORE_ROOT}" && pwd)"; O="${OUT:-$NEW/bench/engine/results}"
export PYTHONUNBUFFERED=1
mkdir -p "$O"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 1000 \
  > "$O/clocks.csv" 2>/dev/null &
SMI=$!
{
  echo "== before: engine of $BEFORE, benchmark of $NEW $(date -u +%T)"
  (cd "$BEFORE" && source scripts/device_env.sh && timeout "${BEFORE_S:-110}" python3 "$NEW/bench/run.py" engine \
    --out /tmp/lp-before --skip-hf) | grep -v '^| '
  cp /tmp/lp-before/engine.json "$O/engine-before.json"
  echo "== GPU tests $(date -u +%T)"
  source scripts/device_env.sh
  LP="${PYTHONPATH%%:*}"
  (cd /tmp && timeout "${TESTS_S:-100}" python3 -m pytest --rootdir="$NEW" -c "$NEW/pyproject.toml" \
    -o "pythonpath=$LP $NEW" -p no:cacheprovider -q -rs "$NEW/tests/engine/test_attention.py" \
    "$NEW/tests/engine/test_model_runner.py" "$NEW/tests/engine/test_engine_vs_transformers.py" \
    -k "(gpu or paged or fused or write or cuda or varlen) and not async and not demo" 2>&1 | tail -40 \
    | tee "$O/gpu-tests.log")
  echo "== after: $NEW $(date -u +%T)"
  timeout "${AFTER_S:-170}" python3 bench/run.py engine --out "$O" --skip-hf --sweep --profile "$O"
  echo "== done $(date -u +%T)"
} 2>&1 | tee "$O/run.log"
kill "$SMI" 2>/dev/null
