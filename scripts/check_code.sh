#!/usr/bin/env bash
# The code checks CI runs (docs/contributing.md): ruff's linter and formatter, and mypy, on autotune/, with the
# settings in pyproject.toml. Fix what they find; `.venv/bin/ruff format autotune` rewrites the formatting.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${VENV:-.venv}/bin
status=0
"$bin/ruff" check autotune || status=1
"$bin/ruff" format --check autotune || status=1
"$bin/mypy" || status=1
exit $status
