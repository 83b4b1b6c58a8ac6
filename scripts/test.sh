#!/usr/bin/env bash
# The README's test command runs this: lint gates, then the test suite.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PWD/.tools/bin:$PATH"
bash scripts/lint.sh || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  # pytest's "no tests collected": a configuration mistake, never a pass.
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
