#!/usr/bin/env bash
# The test suite as CI runs it (docs/testing.md), in four runs:
# 1. everything that starts no real engine, on six pytest-xdist workers (their wall time is mostly waiting);
# 2. the real engines (vLLM, Xinference) whose tests assert no speed, two at a time: a start is three processes
#    importing torch one after the other, one core each, so two starts share the two cores;
# 3. the two real studies (marked `paired`), side by side: many engine starts each, and assertions on mechanisms
#    (the order of trials, ladders, the verdict's arithmetic) and on gaps a loaded host keeps;
# 4. the real-engine tests whose assertions rest on the engine's speed (marked `alone`), one at a time, alone on
#    the host: a real engine beside other tests measures a fraction of its speed and starves their simulated
#    engines in turn.
# Beside the second run, the code checks (scripts/check_code.sh). Extra arguments go to every pytest run. All of
# it runs, even when one part fails.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
"$py" -m pytest -n 6 --dist loadgroup -m "not engine and not xinference" --durations=25 "$@"
first=$?
# the code checks (ruff, mypy: scripts/check_code.sh) beside the second run, whose engines assert no speed
checks_log=$(mktemp)
bash scripts/check_code.sh >"$checks_log" 2>&1 &
checks=$!
"$py" -m pytest -n 2 --dist loadgroup -m "(engine or xinference) and not paired and not alone" --durations=10 "$@"
second=$?
wait "$checks"
checked=$?
echo "code checks (scripts/check_code.sh): $([ "$checked" -eq 0 ] && echo passed || echo FAILED)"
cat "$checks_log"
rm -f "$checks_log"
"$py" -m pytest -n 2 --dist loadgroup -m "paired" --durations=10 "$@"
third=$?
"$py" -m pytest -p no:xdist -m "alone" --durations=10 "$@"
fourth=$?
# one line that names each part's outcome (a failure early in a long log is easy to miss at its end); the exit
# status is the first failed part's
names=("tests without engines" "engine tests" "code checks" "paired studies" "alone tests")
statuses=("$first" "$second" "$checked" "$third" "$fourth")
parts="" failed=0
for i in "${!names[@]}"; do
  parts+="${parts:+, }${names[i]} $([ "${statuses[i]}" -eq 0 ] && echo passed || echo FAILED)"
  [ "$failed" -eq 0 ] && failed=${statuses[i]}
done
echo "run_tests: $parts"
exit "$failed"
