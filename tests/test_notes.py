"""The dashboard's notes: written into a real SQLite study, read back through optuna-dashboard's own API.

The trials are shaped as autotune/study/runner.py writes them (objective, _record_steps,
_record_failure); the notes are read the way the browser reads them: GET /api/studies/<id> on
optuna-dashboard's WSGI app, whose JSON carries each note's body and version.
"""

import io
import json
import logging
from wsgiref.util import setup_testing_defaults

import optuna
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState, create_trial
from optuna_dashboard import wsgi
from optuna_dashboard._note import get_note_from_system_attrs

from autotune.study.notes import KEEP, save_notes, study_note, trial_note
from autotune.study.records import StudyResult, TrialRecord

SLOS = ["ttft<500ms", "tpot<60ms"]
DIST = {"gpu_memory_utilization": CategoricalDistribution([0.85, 0.92]),
        "max_num_seqs": IntDistribution(2, 64, log=True)}
OOM_LINE = ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
            "when initializing the engine.")


def _step(load, rate, passed, ttft, tpot, tok_s):
    return {"load": load, "rate": rate, "passed": passed, "client_kept_up": True, "offered_share": 1.0,
            "replay_s": 2.0, "completed": 20, "failed": 0, "request_throughput": rate, "output_throughput": tok_s,
            "goodput": rate if passed else 0.0, "slo_attainment": 1.0 if passed else 0.2,
            "ttft_p95": ttft, "tpot_p95": tpot, "e2e_p95": 1.0, "send_lag_p99": 0.001,
            "slos": [{"slo": "ttft<500ms", "key": "p95_ttft", "target": 0.5, "measured": ttft, "holds": ttft < 0.5,
                      "violation": (ttft - 0.5) / 0.5},
                     {"slo": "tpot<60ms", "key": "p95_tpot", "target": 0.06, "measured": tpot, "holds": tpot < 0.06,
                      "violation": (tpot - 0.06) / 0.06}]}


def _attrs(params, baseline=None, **extra):
    a = {"argv": ["vllm", "serve", "m", "--max-num-seqs", str(params["max_num_seqs"])], "env": {"HF_TOKEN": "***"},
         "engine_args": {"values": dict(params), "env": {"HF_TOKEN": "***"}}, "host": "h", "worker": "h:1",
         "gpus": ["0:NVIDIA A10"], "engine_start_s": 1.0, "engine_stop_s": 0.5, "replay_s": 6.0, "trial_wall_s": 9.0}
    if baseline:
        a.update(baseline=baseline, baseline_args={}, baseline_notes=[])
    a.update(extra)
    return a


def _measured(params, cap, tok_s, baseline=None, **extra):
    steps = [_step(0, cap / 2, True, 0.1, 0.02, tok_s / 2), _step(1, cap, True, 0.3, 0.04, tok_s),
             _step(2, cap * 2, False, 0.9, 0.08, tok_s * 1.2)]
    return create_trial(state=TrialState.COMPLETE, value=cap, params=params, distributions=DIST,
                        user_attrs=_attrs(params, baseline, steps=steps, constraints=[-0.4, -0.33], capacity_rps=cap,
                                          capacity_output_tok_s=tok_s, **extra))


def _failed(params, state, cls, line, baseline=None):
    return create_trial(state=state, params=params, distributions=DIST, user_attrs=_attrs(
        params, baseline, failure_class=cls, failure=line, failure_excerpt="...\n" + line,
        failure_engine_seconds=3.5, constraints=[1000.0, 1000.0], capacity_rps=0.0))


def _study(tmp_path):
    storage = f"sqlite:///{tmp_path}/studies.db"
    study = optuna.create_study(study_name="notes", storage=storage, direction="maximize")
    study.add_trial(_measured({"gpu_memory_utilization": 0.92, "max_num_seqs": 64}, 4.0, 800.0, "vllm-defaults"))
    study.add_trial(_failed({"gpu_memory_utilization": 0.85, "max_num_seqs": 64}, TrialState.PRUNED, "oom", OOM_LINE,
                            "xinference-legacy"))
    study.add_trial(_measured({"gpu_memory_utilization": 0.92, "max_num_seqs": 32}, 5.0, 1000.0,
                              chosen_because="TPE", predicted_capacity_rps=5.5))
    study.add_trial(create_trial(  # measured, but not even the lowest load met the SLOs
        state=TrialState.COMPLETE, value=0.0, params={"gpu_memory_utilization": 0.92, "max_num_seqs": 2},
        distributions=DIST, user_attrs=_attrs({"gpu_memory_utilization": 0.92, "max_num_seqs": 2},
                                              steps=[_step(0, 1.0, False, 0.7, 0.03, 100.0)], constraints=[0.4, -0.5],
                                              capacity_rps=0.0, capacity_output_tok_s=0.0)))
    study.add_trial(_failed({"gpu_memory_utilization": 0.92, "max_num_seqs": 8}, TrialState.FAIL, "port-in-use",
                            "ERROR: [Errno 98] Address already in use"))
    return study, storage


def _dashboard_notes(storage, study):
    """The notes as the dashboard's page gets them: {None: study note, number: trial note}, bodies and versions."""
    app = wsgi(storage)
    env: dict = {"PATH_INFO": f"/api/studies/{study._study_id}", "REQUEST_METHOD": "GET", "QUERY_STRING": ""}
    setup_testing_defaults(env)
    env["wsgi.input"] = io.BytesIO()
    status = []
    body = b"".join(app(env, lambda s, h, e=None: status.append(s)))
    assert status[0].startswith("200"), (status, body[:500])
    detail = json.loads(body)
    out = {None: detail["note"]}
    out.update({t["number"]: t["note"] for t in detail["trials"]})
    return out


def test_notes_are_written_and_the_dashboard_reads_them(tmp_path):
    study, storage = _study(tmp_path)
    save_notes(study, SLOS)
    notes = _dashboard_notes(storage, optuna.load_study(study_name="notes", storage=storage))

    defaults = notes[0]["body"]
    assert defaults.startswith("### vllm-defaults: meets every SLO")
    assert "Chosen because: baseline vllm-defaults." in defaults
    assert "**Capacity: 4.00 req/s, 800 output tok/s**" in defaults
    assert "This is the reference baseline" in defaults
    assert "| `max_num_seqs` | `64` |" in defaults and "| env `HF_TOKEN` | `***` |" in defaults
    assert "`p95_ttft`" not in defaults and "`ttft<500ms` 300 ms (holds)" in defaults  # at the capacity step

    oom = notes[1]["body"]
    assert oom.startswith("### xinference-legacy: misses: oom")
    assert "**Failed: oom**" in oom and OOM_LINE in oom
    assert "```text\n" + OOM_LINE + "\n```" in oom  # the engine's words as they are, in a block
    assert "- `failure_excerpt`: the engine's log around the failure" in oom

    sampled = notes[2]["body"]
    assert sampled.startswith("### sampled: meets every SLO") and "Chosen because: TPE." in sampled
    assert "**Capacity: 5.00 req/s, 1000 output tok/s**" in sampled
    assert "**+25.0 %** over the baseline vllm-defaults (4.00 req/s, trial 0)" in sampled
    assert "Predicted capacity (simulator): 5.50 req/s (measured: 91 % of it)." in sampled

    missed = notes[3]["body"]
    assert missed.startswith("### sampled: misses an SLO at every load")
    assert "`ttft<500ms` 700 ms (misses)" in missed and "+" not in missed.partition(KEEP)[0].split("\n")[0]

    port = notes[4]["body"]
    assert port.startswith("### sampled: misses: port-in-use") and "Address already in use" in port

    s = notes[None]["body"]
    assert s.startswith("### Winner: trial 2 (sampled), 5.00 req/s, 1000 output tok/s")
    assert "**+25.0 %** over the best baseline, vllm-defaults (4.00 req/s, trial 0)." in s
    assert "Re-measurement: none yet" in s
    assert "Trials: 5 (3 complete, 1 fail, 1 pruned)." in s and "SLOs: `ttft<500ms`, `tpot<60ms`." in s
    assert all(n["version"] == 1 for n in notes.values())
    # the raw data stays as the runner wrote it
    assert study.trials[1].user_attrs["failure"] == OOM_LINE


def test_saving_again_with_nothing_changed_writes_no_new_version(tmp_path):
    study, storage = _study(tmp_path)
    save_notes(study, SLOS)
    before = study._storage.get_study_system_attrs(study._study_id)
    save_notes(study, SLOS)
    assert study._storage.get_study_system_attrs(study._study_id) == before

    # a new trial changes the study note (counts) but not the others' (same reference baseline)
    study.add_trial(_measured({"gpu_memory_utilization": 0.85, "max_num_seqs": 16}, 3.0, 600.0))
    save_notes(study, SLOS)
    notes = _dashboard_notes(storage, study)
    assert notes[None]["version"] == 2 and "Trials: 6" in notes[None]["body"]
    assert [notes[n]["version"] for n in range(5)] == [1] * 5
    assert notes[5]["version"] == 1 and "**-25.0 %** over the baseline vllm-defaults" in notes[5]["body"]


def test_what_a_person_writes_below_the_line_is_kept(tmp_path):
    study, storage = _study(tmp_path)
    from optuna_dashboard._note import save_note_with_version

    # a study note written by hand before autotune's first: kept whole, below the line
    save_note_with_version(study._storage, study._study_id, None, 1, "my own words")
    save_notes(study, SLOS)
    body = get_note_from_system_attrs(study._storage.get_study_system_attrs(study._study_id), None)["body"]
    assert body.startswith("### Winner:") and body.endswith(KEEP + "my own words")

    # edited in the dashboard below the line, then a trial lands: autotune's part changes, the person's stays
    trial0 = study.trials[0]._trial_id
    attrs = study._storage.get_study_system_attrs(study._study_id)
    old = get_note_from_system_attrs(attrs, trial0)
    save_note_with_version(study._storage, study._study_id, trial0, old["version"] + 1, old["body"] + "\nslow host")
    study.add_trial(_measured({"gpu_memory_utilization": 0.85, "max_num_seqs": 16}, 8.0, 1600.0, "faster-base"))
    save_notes(study, SLOS)
    notes = _dashboard_notes(storage, study)
    assert notes[0]["body"].endswith(KEEP + "\nslow host")
    assert "**-50.0 %** over the baseline faster-base" in notes[0]["body"]
    assert notes[0]["version"] == old["version"] + 2
    assert notes[None]["body"].endswith(KEEP + "my own words")


def test_no_winner_and_the_remeasured_verdict(tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/s.db", direction="maximize")
    study.add_trial(_failed({"gpu_memory_utilization": 0.85, "max_num_seqs": 64}, TrialState.PRUNED, "oom", OOM_LINE,
                            "xinference-legacy"))
    assert study_note(StudyResult.of(study), SLOS).startswith("### No configuration met every SLO")

    study.add_trial(_measured({"gpu_memory_utilization": 0.92, "max_num_seqs": 64}, 4.0, 800.0, "vllm-defaults"))
    study.add_trial(_measured({"gpu_memory_utilization": 0.92, "max_num_seqs": 32}, 5.0, 1000.0))
    study.set_user_attr("remeasure", {
        "candidates": [{"label": "trial 2", "trial": 2, "capacities": [4.8, 5.1], "median": 4.95, "spread": 0.3,
                        "runs": []},
                       {"label": "baseline vllm-defaults", "trial": 1, "capacities": [4.0, 4.1], "median": 4.05,
                        "spread": 0.1, "runs": []}],
        "winner": "trial 2", "winner_trial": 2, "baseline": "baseline vllm-defaults", "gain_rps": 0.9,
        "noise_rps": 0.3, "significant": True, "trials_seen": 3})
    s = study_note(StudyResult.of(study), SLOS)
    assert s.startswith("### Winner: trial 2 (sampled)")
    assert ("Re-measured, interleaved: trial 2 beats baseline vllm-defaults by 0.90 req/s, more than the noise "
            "(0.30: the spread of their runs): deploy trial 2.") in s
    assert "| trial 2 | 4.80, 5.10 | 4.95 |" in s and "Not recommended" not in s

    raw = study.user_attrs["remeasure"]
    study.set_user_attr("remeasure", {**raw, "noise_rps": 1.2, "significant": False})
    s = study_note(StudyResult.of(study), SLOS)
    assert s.startswith("### Winner: trial 1 (vllm-defaults)")  # what best.yaml holds: the verdict, not the leader
    assert ("Re-measured, interleaved: no gain: trial 2 leads baseline vllm-defaults by 0.90 req/s, within the "
            "noise (1.20: the spread of their runs): keep baseline vllm-defaults.") in s
    assert "Not recommended: trial 2 (sampled), kept beside the best files as not-recommended.*." in s

    study.set_user_attr("remeasure", {**raw, "winner": "baseline vllm-defaults", "winner_trial": 1, "gain_rps": 0.0,
                                      "significant": False})
    s = study_note(StudyResult.of(study), SLOS)
    assert s.startswith("### Winner: trial 1 (vllm-defaults), 4.00 req/s")
    assert "The best baseline, vllm-defaults, is the winner" in s
    assert ("Re-measured, interleaved: no gain: no searched config beat baseline vllm-defaults on the median; keep "
            "baseline vllm-defaults.") in s


def test_pareto_mode_names_the_front(tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/p.db", directions=["maximize", "minimize"])
    t = _measured({"gpu_memory_utilization": 0.92, "max_num_seqs": 64}, 4.0, 800.0, "vllm-defaults")
    study.add_trial(create_trial(state=TrialState.COMPLETE, values=[800.0, 0.3], params=t.params,
                                 distributions=DIST, user_attrs=t.user_attrs))
    s = study_note(StudyResult.of(study), SLOS)
    assert s.startswith("### Pareto front: trial 0 (vllm-defaults)") and "- trial 0 (vllm-defaults): 800, 0.3" in s


def test_a_dashboard_problem_is_logged_never_raised(tmp_path, caplog):
    study, _ = _study(tmp_path)

    def broken(*a, **k):
        raise RuntimeError("database is locked")

    study._storage.set_study_system_attr = broken
    with caplog.at_level(logging.WARNING, logger="autotune"):
        save_notes(study, SLOS)
    assert "database is locked" in caplog.text



def test_a_trial_without_a_record_gets_no_note(tmp_path):
    study, storage = _study(tmp_path)
    # a waiting baseline copy dropped by _dedupe_baselines: FAIL with no engine args
    study.add_trial(create_trial(state=TrialState.FAIL, params={}, distributions={},
                                 user_attrs={"baseline": "vllm-defaults"}))
    save_notes(study, SLOS)
    notes = _dashboard_notes(storage, study)
    assert notes[5] == {"version": 0, "body": ""} and notes[4]["version"] == 1
    assert trial_note(TrialRecord.of(study.trials[0]), None).startswith("### vllm-defaults: meets every SLO")
