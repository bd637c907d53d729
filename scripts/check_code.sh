#!/usr/bin/env bash
# The code checks CI runs (docs/contributing.md): ruff's linter and formatter, and mypy, on autotune/, with the
# settings in pyproject.toml. Fix what they find; `.venv/bin/ruff format autotune` rewrites the formatting.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${VENV:-.venv}/bin
# caches outside the checkout (the test run counts a write in the checkout as a fault)
cache=${TMPDIR:-/tmp}/autotune-checks-$(id -u)
export RUFF_CACHE_DIR=$cache/ruff
status=0
"$bin/ruff" check autotune || status=1
"$bin/ruff" format --check autotune || status=1
"$bin/mypy" --cache-dir "$cache/mypy" || status=1
exit $status
