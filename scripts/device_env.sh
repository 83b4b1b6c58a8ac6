# Source this on a machine where loraplane is not installed (the GPU image has no package index):
#   source scripts/device_env.sh
# It exposes the repository's folders under their import names through a symlinked path.
_lp_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_lp_path="${TMPDIR:-/tmp}/loraplane-path"
mkdir -p "$_lp_path/loraplane"
cp "$_lp_root"/loraplane/*.py "$_lp_path/loraplane/"
for _lp_pkg in kernels server operator; do ln -sfn "$_lp_root/$_lp_pkg" "$_lp_path/loraplane/$_lp_pkg"; done
export PYTHONPATH="$_lp_path${PYTHONPATH:+:$PYTHONPATH}"
unset _lp_root _lp_path _lp_pkg
