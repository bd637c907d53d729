#!/usr/bin/env bash
# Mutation testing of the measurement core (issue 14): a benchmark, not CI.
#
#   bash scripts/mutation.sh                          # the core (below), one worker
#   MUTATION_JOBS=2 bash scripts/mutation.sh 'autotune.measure.slo.*'   # some mutants (fnmatch on names)
#   bash scripts/mutation.sh '*'                      # every mutant of the five files
#
# mutmut (3.x, a dev-only dependency: .venv/bin/python -m pip install 'mutmut>=3.8,<4') mutates
# the rules that decide capacity and runs only the fast tests that cover each mutant (no engine:
# the fixed-timing server at most). The core, by mutant name:
#   metrics.py   what a request and a run measure (all of it)
#   slo.py       the grammar and the verdicts (all of it)
#   profiles.py  the load ladder (all of it)
#   session.py   Step, Outcome (passed, capacity, the JSON), the step loop, replay_on, measure_url;
#                not measure_engine (starting and stopping an engine: the `engine` tests' job)
#   records.py   judge, Candidate, Remeasurement; not the Optuna-storage readers
#
# The checkout is never touched: the sources and tests are copied to $MUTATION_WORKDIR (default:
# a fresh temporary folder), a setup.cfg with the [mutmut] section is written there, and mutmut
# runs in that copy. It prints the score (killed + timeout over all mutants run, "no tests"
# counting as survivors) and the surviving mutants, and writes them with their diffs to
# $MUTATION_WORKDIR/survivors.txt; `mutmut show NAME` in that folder shows one mutant.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
JOBS="${MUTATION_JOBS:-1}"
WORK="${MUTATION_WORKDIR:-$(mktemp -d "${TMPDIR:-/tmp}/autotune-mutation.XXXXXX")}"

MODULES=(autotune/measure/metrics.py autotune/measure/slo.py autotune/measure/profiles.py
         autotune/measure/session.py autotune/study/records.py)
PATTERNS=("$@")
if [ ${#PATTERNS[@]} -eq 0 ]; then
  S=autotune.measure.session R=autotune.study.records
  PATTERNS=('autotune.measure.metrics.*' 'autotune.measure.slo.*' 'autotune.measure.profiles.*'
            "$S.xǁStepǁ*" "$S.xǁOutcomeǁ*" "$S.x__step__mutmut_*" "$S.x__run_steps__mutmut_*"
            "$S.x_replay_on__mutmut_*" "$S.x_measure_url__mutmut_*"
            "$R.x_judge__mutmut_*" "$R.xǁCandidateǁ*" "$R.xǁRemeasurementǁ*")
fi
TESTS=(tests/test_measure_core.py tests/test_metrics.py tests/test_slo.py tests/test_replay.py
       tests/test_study_space.py tests/test_study_runner.py tests/test_report.py
       tests/test_study_race.py::test_a_race_starts_at_the_incumbent_and_ends_at_its_first_miss)

if ! "$PY" -c 'import mutmut' 2>/dev/null; then
  echo "mutation.sh: mutmut is not installed in $PY; run: $PY -m pip install 'mutmut>=3.8,<4'" >&2
  exit 2
fi

echo "mutation.sh: copying the sources to $WORK" >&2
mkdir -p "$WORK"
(cd "$ROOT" && tar --exclude=./.venv --exclude=./.venv-xinference --exclude=./.git --exclude=./models \
   --exclude=./runs --exclude=./mutants --exclude='*/__pycache__' -cf - autotune tests scripts pyproject.toml) \
  | tar -xf - -C "$WORK"

# mutmut 3 leaves decorated functions alone, and the capacity rules are properties (Step.passed,
# Outcome.capacity, RequestResult.tpot, ...). In the copy only, each `@property def NAME` becomes a
# plain method `_prop_NAME` and `NAME = property(_prop_NAME)`: same behaviour, and mutmut mutates it.
"$PY" - "$WORK" "${MODULES[@]}" <<'PYEOF'
import re, sys
from pathlib import Path

work = Path(sys.argv[1])
for module in sys.argv[2:]:
    path = work / module
    lines = path.read_text().splitlines(keepends=True)
    out, i, n_props = [], 0, 0
    while i < len(lines):
        m = re.match(r"( *)@property\s*$", lines[i])
        d = re.match(r"( *)def (\w+)\(", lines[i + 1]) if m and i + 1 < len(lines) else None
        if not (m and d and d[1] == m[1]):
            out.append(lines[i])
            i += 1
            continue
        indent, name = m[1], d[2]
        out.append(lines[i + 1].replace(f"def {name}(", f"def _prop_{name}(", 1))
        j = i + 2
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip(" ")) > len(indent)):
            j += 1
        body = lines[i + 2:j]
        while body and not body[-1].strip():  # the blank lines go after the new assignment
            body.pop()
        out += body
        out.append(f"{indent}{name} = property(_prop_{name})\n")
        out += lines[i + 2 + len(body):j]
        i, n_props = j, n_props + 1
    path.write_text("".join(out))
    print(f"mutation.sh: {module}: {n_props} properties made mutable", file=sys.stderr)
PYEOF

{
  echo "[mutmut]"
  echo "source_paths = autotune"
  echo "also_copy = scripts"
  echo "only_mutate ="
  for m in "${MODULES[@]}"; do echo "    $m"; done
  echo "pytest_add_cli_args_test_selection ="
  for t in "${TESTS[@]}"; do echo "    $t"; done
  echo "pytest_add_cli_args = -p no:cacheprovider -q"
} > "$WORK/setup.cfg"

# The tiny model (a few tests size memory from its config.json) is the checkout's, never rebuilt in the copy.
export AUTOTUNE_TINY_MODEL="${AUTOTUNE_TINY_MODEL:-$ROOT/models/tiny-llama}"
export HF_HUB_OFFLINE=1

cd "$WORK"
"$PY" -m mutmut run --max-children "$JOBS" "${PATTERNS[@]}" >"$WORK/run.log" 2>&1 || { tail -40 "$WORK/run.log" >&2; exit 1; }
"$PY" -m mutmut results --all true >"$WORK/results.txt" 2>&1 || "$PY" -m mutmut results >"$WORK/results.txt" 2>&1

"$PY" - "$WORK" <<'EOF'
import re, subprocess, sys
from collections import Counter
from pathlib import Path

work = Path(sys.argv[1])
status = Counter()
survivors = []
for line in (work / "results.txt").read_text().splitlines():
    m = re.match(r"\s*(\S+__mutmut_\d+):\s*(.+?)\s*$", line)
    if m:
        status[m[2]] += 1
        if m[2] == "survived":
            survivors.append(m[1])
killed = status["killed"] + status["timeout"]
total = sum(n for s, n in status.items() if s not in ("skipped", "not checked"))
print(f"mutants: {dict(status)}")
print(f"score: {killed}/{total} killed = {100 * killed / max(total, 1):.1f} %")
with open(work / "survivors.txt", "w") as f:
    for name in survivors:
        diff = subprocess.run([sys.executable, "-m", "mutmut", "show", name], capture_output=True, text=True).stdout
        f.write(f"## {name}\n{diff}\n")
        print(f"survived: {name}")
print(f"diffs of the survivors: {work / 'survivors.txt'}")
EOF
