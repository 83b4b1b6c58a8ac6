#!/usr/bin/env bash
# On a machine with 2 GPUs (repo root, loraplane not installed): the tensor-parallel decode-step benchmarks
# (Llama-3-8B shape at TP=2 against TP=1; Llama-3-70B shape at TP=2, base-only and with 32 adapters), then
# the tensor-parallel GPU tests. Every phase runs under its own time limit and every process prints its
# progress unbuffered, so a phase that hangs shows where and the next ones still run: at its limit a phase
# gets SIGABRT, on which every Python process of it prints its stacks (PYTHONFAULTHANDLER).
#   OUT=DIR bash bench/tp/device_run.sh     (results under ${OUT:-bench/tp/results}; the log: tp-device.log)
#   PHASES="8b 70b tests" picks phases; LIMIT_8B, LIMIT_70B, LIMIT_TESTS set their limits in seconds.
source scripts/device_env.sh
R="$PWD"; O="${OUT:-$R/bench/tp/results}"; LP="${PYTHONPATH%%:*}"
mkdir -p "$O"
exec > >(tee -a "$O/tp-device.log") 2>&1
# NVLink multicast stays off (shared host); every process started below inherits these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 NCCL_DEBUG=WARN
PHASES="${PHASES:-8b 70b tests}"
stamp() { echo "=== $(date -u +%T) $*"; }
stamp start; nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
python3 -c 'import torch, triton; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "triton", triton.__version__, "gpus", torch.cuda.device_count())'

if [[ " $PHASES " == *" 8b "* ]]; then
  L="${LIMIT_8B:-95}"; stamp "8b bench (limit $L s)"
  timeout -s ABRT -k 5 "$L" python3 bench/run.py tp --out "$O" --name tp-8b --shape llama3-8b --tp 2 --with-tp1 \
    --watchdog-s $((L / 2 + 10)); stamp "8b bench exit $?"
fi
if [[ " $PHASES " == *" 70b "* ]]; then
  L="${LIMIT_70B:-115}"; stamp "70b bench (limit $L s)"
  timeout -s ABRT -k 5 "$L" python3 bench/run.py tp --out "$O" --name tp-70b --shape llama3-70b --tp 2 --adapters 32 \
    --watchdog-s $((L - 10)); stamp "70b bench exit $?"
fi
if [[ " $PHASES " == *" tests "* ]]; then
  L="${LIMIT_TESTS:-150}"; stamp "gpu tests (limit $L s; two pytest processes side by side)"
  pt() { (cd /tmp && timeout -s ABRT -k 5 "$L" python3 -m pytest --rootdir="$R" -c "$R/pyproject.toml" \
    -o "pythonpath=$LP $R" -p no:cacheprovider -s -v -rs -k gpu "$@"); }
  pt "$R/tests/engine/test_tensor_parallel.py" "$R/tests/engine/test_tensor_parallel_lora.py" \
    > "$O/tp-gpu-tests.log" 2>&1 &
  A=$!
  pt "$R/tests/engine/test_tensor_parallel_agreement.py" > /tmp/tp-agreement.log 2>&1
  echo "agreement pytest exit $?"; wait $A; echo "engine pytest exit $?"
  { echo; echo "----- tests/engine/test_tensor_parallel_agreement.py -----"; cat /tmp/tp-agreement.log; } \
    >> "$O/tp-gpu-tests.log"
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Timeout|still running" "$O/tp-gpu-tests.log"
fi
stamp end
