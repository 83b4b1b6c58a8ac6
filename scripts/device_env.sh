# Source this on a machine where loraplane is not installed (the bare GPU image has torch, triton,
# safetensors, numpy and pytest, and no package index):
#   source scripts/device_env.sh
# The package tree is the import tree, so putting src/ on the path is enough.
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/src${PYTHONPATH:+:$PYTHONPATH}"
