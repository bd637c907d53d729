#!/usr/bin/env bash
# The test suite as CI runs it (docs/testing.md): first everything that starts no real engine, on four
# pytest-xdist workers (their wall time is mostly waiting); then the real engines (vLLM, Xinference) one at a
# time, alone on the host, since a real engine beside other tests measures a fraction of its speed and starves
# their simulated engines in turn. Extra arguments go to both runs. Both run, even when the first fails.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
"$py" -m pytest -n 4 --dist loadgroup -m "not engine and not xinference" --durations=25 "$@"
first=$?
"$py" -m pytest -p no:xdist -m "engine or xinference" --durations=25 "$@"
second=$?
exit $(( first != 0 ? first : second ))
