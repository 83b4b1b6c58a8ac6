#!/usr/bin/env bash
# Quality gates: ruff, import contracts, and a (non-failing) list of modules over ~400 lines.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
"$BIN/ruff" check .
"$BIN/ruff" format --check .
# import-linter walks the package folder on disk: src/loraplane is exactly the import tree.
PYTHONPATH=src "$BIN/lint-imports"
# The chart ships a copy of crds/: they must stay identical.
.venv/bin/python scripts/sync_chart_crds.py --check
big=$(git ls-files '*.py' | grep -Ev '^(tests|e2e)/' | xargs -r wc -l | awk '$2 != "total" && $1 > 400 {print "  " $2 " (" $1 " lines)"}')
if [ -n "$big" ]; then
  echo "warning: modules over ~400 lines:"
  echo "$big"
fi
