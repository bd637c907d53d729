#!/usr/bin/env python3
"""Where a study's time went, from its Optuna storage alone.

    .venv/bin/python scripts/study_overhead.py --storage sqlite:///runs/studies.db --study-name tiny-cpu-chat

Per trial, Optuna's own start and completion times give the wall time; the trial's user attrs
give engine start-up, replay and stop seconds. autotune's overhead is what is left: sampling,
prompt handling, storage writes, artifact uploads, the pre-check. Also: engine seconds spent
on `oom` trials, split into those the pre-check pruned (zero engine seconds) and those vLLM had
to find out itself.
"""

import argparse
import statistics

import optuna
from optuna.trial import TrialState

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--storage", required=True)
ap.add_argument("--study-name", required=True)
a = ap.parse_args()
study = optuna.load_study(study_name=a.study_name, storage=a.storage)
rows = []
for t in study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED)):
    if t.datetime_start is None or t.datetime_complete is None:
        continue
    wall = (t.datetime_complete - t.datetime_start).total_seconds()
    start, replay, stop = (float(t.user_attrs.get(k, 0.0)) for k in ("engine_start_s", "replay_s", "engine_stop_s"))
    rows.append((t, wall, start, replay, stop))
measured = [r for r in rows if r[3] > 0]
print(f"study {a.study_name}: {len(rows)} finished trials, {len(measured)} measured")
if measured:
    wall = sum(r[1] for r in measured)
    start = sum(r[2] for r in measured)
    replay = sum(r[3] for r in measured)
    stop = sum(r[4] for r in measured)
    own = wall - start - replay - stop
    shares = [(r[1] - r[2] - r[3] - r[4]) / r[1] for r in measured]
    print(f"  wall {wall:.1f} s = engine start {start:.1f} s ({start / wall:.1%}) + replay {replay:.1f} s "
          f"({replay / wall:.1%}) + engine stop {stop:.1f} s ({stop / wall:.1%}) + autotune's own {own:.1f} s ({own / wall:.1%})")
    print(f"  autotune's own share per trial: median {statistics.median(shares):.2%}, max {max(shares):.2%}; "
          f"outside start-up and replay (stop included): {(own + stop) / wall:.1%}")
ooms = [r for r in rows if r[0].user_attrs.get("failure_class") == "oom"]
pre = [r for r in ooms if r[0].user_attrs.get("precheck")]
eng = [r for r in ooms if not r[0].user_attrs.get("precheck")]
print(f"  oom trials: {len(ooms)}; pruned by the pre-check: {len(pre)} "
      f"({sum(float(r[0].user_attrs.get('failure_engine_seconds', 0)) for r in pre):.1f} engine s); "
      f"found by vLLM: {len(eng)} ({sum(r[1] for r in eng):.1f} s of trial wall time, of which vLLM's own time to fail "
      f"{sum(float(r[0].user_attrs.get('failure_engine_seconds', 0)) for r in eng):.1f} s)")
