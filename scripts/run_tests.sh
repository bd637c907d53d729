#!/usr/bin/env bash
# The test suite as CI runs it (docs/testing.md), in three runs:
# 1. everything that starts no real engine, on four pytest-xdist workers (their wall time is mostly waiting);
# 2. the real engines (vLLM, Xinference) whose tests assert no speed, two at a time: a start is three processes
#    importing torch one after the other, one core each, so two starts share the two cores;
# 3. the real-engine tests whose assertions rest on the engine's speed (marked `alone`), one at a time, alone on
#    the host: a real engine beside other tests measures a fraction of its speed and starves their simulated
#    engines in turn.
# Extra arguments go to every run. All three run, even when one fails.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
"$py" -m pytest -n 4 --dist loadgroup -m "not engine and not xinference" --durations=25 "$@"
first=$?
"$py" -m pytest -n 2 --dist loadgroup -m "(engine or xinference) and not alone" --durations=10 "$@"
second=$?
"$py" -m pytest -p no:xdist -m "alone" --durations=10 "$@"
third=$?
for status in $first $second $third; do
  [ "$status" -ne 0 ] && exit "$status"
done
exit 0
