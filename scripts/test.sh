#!/usr/bin/env bash
# The README's test command runs this: lint gates, then the test suite.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PWD/.tools/bin:$PATH"
bash scripts/lint.sh || exit 1
# The tests' Kubernetes control plane: built from Go modules once, then reused from ~/.cache/loraplane/kube.
if ! LORAPLANE_KUBE_BIN="$(nice -n 5 .venv/bin/python scripts/build_kube.py | tail -n 1)"; then
  echo "error: building kube-apiserver and kube-controller-manager failed (see above)" >&2
  exit 1
fi
export LORAPLANE_KUBE_BIN
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  # pytest's "no tests collected": a configuration mistake, never a pass.
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
