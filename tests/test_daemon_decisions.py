"""The daemon's decisions an operator has to live with (issue 15): each test reproduces a wrong one.

Most run the daemon's own loop (``Daemon.tick``, ``TuningPhase.finish``) or the CLI commands an operator
types (status, retune, history, rollback) against a production that does not answer: what is
decided does not depend on production's traffic, and no engine has to start. The whole loop on
vllm-sim is tests/test_daemon.py.
"""

import datetime as dt
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial
from prometheus_client import generate_latest

from autotune.cli import main
from autotune.daemon.config import load_daemon_config
from autotune.daemon.exporter import DaemonMetrics
from autotune.daemon.fingerprint import Fingerprint
from autotune.daemon.loop import Daemon
from autotune.daemon.state import DaemonState, Observation, Phase, StateStore, decide
from autotune.daemon import tuning
from autotune.publish.history import History
from autotune.publish.transaction import publish, CanaryResult
from autotune.publish.vllm_config import VllmConfigTarget
from autotune.study.definition import load_study
from autotune.study.records import Attr, Remeasurement, StudyResult, TrialRecord
from tests.conftest import free_port
from tests.test_daemon import STAGING

DAEMON = """
name = "prod"
slos = ["ttft<500ms"]
{top}
[production]
url = "http://127.0.0.1:{port}"
config = "{root}/etc/production.yaml"
model = "llama-3.1-8b"
restart = ["touch", "{root}/restarted"]
health_timeout = "2s"

[staging]
study = "{root}/staging.toml"

[tuning]
{tuning}

[metrics]
listen = ""
"""


@pytest.fixture
def daemon_file(tmp_path, tiny_model, state_dir):
    """A daemon file whose production (a vLLM YAML, max_num_seqs 2) does not answer; its restart only touches
    ``restarted``, so a test sees whether production was restarted."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "production.yaml").write_text("model: llama-3.1-8b\nmax-num-seqs: 2\n")
    (tmp_path / "staging.toml").write_text(STAGING.format(root=tmp_path, python=sys.executable, port=free_port(),
                                                          model=tiny_model))

    def make(top="", tuning=""):
        p = tmp_path / "daemon.toml"
        p.write_text(DAEMON.format(port=free_port(), root=tmp_path, top=top, tuning=tuning))
        return p

    return make


def cli(capsys, *argv):
    code = main([str(x) for x in argv])
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def entry(root: Path, number: int, outcome: str, values: dict, **kw):
    d = {"number": number, "outcome": outcome, "values": values, "time": 1_700_000_000.0 + number, "source": {},
         "reason": "", "restored": None, "canary": None, **kw}
    (root / "history").mkdir(parents=True, exist_ok=True)
    (root / "history" / f"{number:04d}.json").write_text(json.dumps(d))


# --- 11: rollback --to a missing entry; autotune history; floats as a person writes them ----------------

def test_rollback_to_a_missing_entry_is_one_line_naming_the_entries(capsys, daemon_file, state_dir):
    p = daemon_file()
    root = state_dir / "daemon" / "prod"
    entry(root, 1, "adopted", {"max_num_seqs": 2})
    entry(root, 2, "rolled-back", {"max_num_seqs": 1}, reason="canary missed")
    entry(root, 3, "published", {"max_num_seqs": 32})
    code, _, err = cli(capsys, "rollback", "--config", p, "--to", 99)
    assert code == 2 and len(err) == 1, err
    assert err[0] == ("autotune: there is no history entry 99: the history has entries 1 to 3, of which 1, 3 can be "
                      "restored (autotune history lists them)")
    code, _, err = cli(capsys, "rollback", "--config", p, "--to", 2)
    assert code == 2 and "pick a published or adopted one: 1, 3 (autotune history lists them)" in err[0]
    assert not (p.parent / "restarted").exists()


def test_history_shows_whole_names_the_proposal_and_its_diff_against_production(capsys, daemon_file, state_dir):
    p = daemon_file()
    root = state_dir / "daemon" / "prod"
    study = "prod-tune-001-" + "x" * 150  # longer than any terminal: shown whole all the same
    entry(root, 1, "adopted", {"max_num_seqs": 2})
    entry(root, 2, "proposed", {"max_num_seqs": 48, "gpu_memory_utilization": 0.8600000000000001},
          source={"study": study, "trial": 7, "trigger": "requested: test",
                  "why": "trial 7 11.00 req/s vs production 5.00: +6.00 req/s, more than the noise (0.20)"})
    code, out, err = cli(capsys, "history", "--config", p)
    assert code == 0, err
    assert f"{study} trial 7" in out
    assert "max_num_seqs 2 -> 48" in out and "gpu_memory_utilization unset -> 0.86" in out
    assert "0.8600000000000001" not in out
    assert "  values: max_num_seqs=48 gpu_memory_utilization=0.86" in out
    assert "  against production: gpu_memory_utilization unset -> 0.86; max_num_seqs 2 -> 48" in out
    assert "  gain: trial 7 11.00 req/s vs production 5.00" in out


def test_floats_reach_production_as_a_person_writes_them(tmp_path, monkeypatch):
    monkeypatch.setattr("autotune.publish.vllm_config.wait_healthy", lambda url, timeout: None)
    target = VllmConfigTarget(tmp_path / "p.yaml", "m", ("true",), "http://127.0.0.1:9", table=None)
    monkeypatch.setattr(target, "validate", lambda values: None)
    history = History(tmp_path / "history")
    result = publish(target, {"max_num_seqs": 8, "gpu_memory_utilization": 0.8600000000000001}, history,
                     lambda url: CanaryResult(True, {}))
    assert result.ok
    text = (tmp_path / "p.yaml").read_text()
    assert "gpu-memory-utilization: 0.86\n" in text, text
    assert history.get(1).values["gpu_memory_utilization"] == 0.86


# --- 5: rollback to what production already runs ------------------------------------------------------

def test_rollback_to_what_production_runs_says_so_and_restarts_nothing(capsys, daemon_file, state_dir):
    p = daemon_file()
    root = state_dir / "daemon" / "prod"
    entry(root, 1, "adopted", {"max_num_seqs": 2})
    code, out, err = cli(capsys, "rollback", "--config", p, "--to", 1)
    assert code == 0, err
    assert out.strip() == "autotune: production already runs entry 1's config: nothing changed, nothing restarted"
    assert not (p.parent / "restarted").exists()
    assert [e.number for e in History(root / "history").entries()] == [1]


# --- 8: a tie is no gain ---------------------------------------------------------------------------------

def _ladder(capacity):
    """A trial's stored load steps: its capacity held, the next 1.05x step missed (nothing held at capacity 0)."""
    if capacity <= 0:
        return [{"load": 1.0, "rate": 1.0, "passed": False}]
    return [{"load": 1.0, "rate": capacity, "passed": True}, {"load": 1.05, "rate": capacity * 1.05, "passed": False}]


def _record(number, baseline, capacity, max_num_seqs):
    attrs = {Attr.CAPACITY_RPS: capacity, Attr.CONSTRAINTS: [0.0], Attr.STEPS: _ladder(capacity),
             Attr.ENGINE_ARGS: {"values": {"max_num_seqs": max_num_seqs}, "env": {}}}
    if baseline:
        attrs[Attr.BASELINE] = baseline
    return TrialRecord(number, TrialState.COMPLETE, {"max_num_seqs": max_num_seqs}, (capacity,), attrs)


def _verdict(cands, winner, baseline, gain, noise):
    return Remeasurement(candidates=cands, winner=winner, winner_trial=next(c["trial"] for c in cands
                                                                            if c["label"] == winner),
                         baseline=baseline, gain_rps=gain, noise_rps=noise, significant=winner != baseline
                         and gain > noise, trials_seen=4)


def _cand(label, trial, runs):
    return {"label": label, "trial": trial, "capacities": runs, "median": sorted(runs)[len(runs) // 2],
            "spread": max(runs) - min(runs), "runs": []}


def tie_with_the_defaults():
    """The sampled trial 3 and vllm-defaults tie on the re-measure; production measured less."""
    records = [_record(0, "vllm-defaults", 11.09, 64), _record(1, "production", 5.0, 2),
               _record(2, None, 4.0, 4), _record(3, None, 11.10, 24)]
    cands = [_cand("trial 3", 3, [11.10, 11.05, 11.12]), _cand("baseline vllm-defaults", 0, [11.09, 11.02, 11.11])]
    return StudyResult(records, False, _verdict(cands, "trial 3", "baseline vllm-defaults", 0.01, 0.09), 3)


def tie_with_production_one_run_each():
    """One run each: no spread to speak of, and trial 2 beats production by 0.004 req/s."""
    records = [_record(0, "production", 8.0, 2), _record(1, "vllm-defaults", 6.0, 64), _record(2, None, 8.004, 12)]
    cands = [_cand("trial 2", 2, [8.004]), _cand("baseline production", 0, [8.0])]
    return StudyResult(records, False, _verdict(cands, "trial 2", "baseline production", 0.004, 0.0), 2)


def test_a_tie_publishes_no_sampled_config():
    c = tuning.choose(tie_with_the_defaults())
    assert c.trial == 0, c  # vllm-defaults stands for the tie: the known config, not the sampled one
    assert c.winner == 0, c  # and it is the winner the best-capacity gauge reports, not trial 3
    assert "tie" in c.why and "baseline vllm-defaults 11.09 req/s vs production 5.00" in c.why
    c = tuning.choose(tie_with_production_one_run_each())
    assert c.trial is None and c.winner == 2, c  # the study's winner, within the noise of production: kept, not published
    assert "not surely a gain (P = " in c.why and "0.00 > 0.00" not in c.why, c.why


def test_a_gain_within_the_remeasurement_step_is_no_gain_over_production():
    """vllm-defaults re-measured 3 % above production, three runs each that agree: more than the 2 % floor, but
    the re-measurement steps in 1.05x, so the two may be the same config. A verdict an older autotune made
    (no step stored) keeps the 2 % floor."""
    records = [_record(0, "production", 10.0, 2), _record(1, "vllm-defaults", 10.3, 64), _record(2, None, 9.0, 12)]
    cands = [_cand("trial 2", 2, [9.0, 9.0, 9.0]), _cand("baseline production", 0, [10.0, 10.0, 10.0]),
             _cand("baseline vllm-defaults", 1, [10.3, 10.3, 10.3])]
    verdict = replace(_verdict(cands, "baseline vllm-defaults", "baseline vllm-defaults", 0.0, 0.0), resolution=1.05)
    c = tuning.choose(StudyResult(records, False, verdict, 1))
    assert c.trial is None, c
    assert "that it beats production by more than 5% (the re-measurement ladder's 1.05x step)" in c.why, c.why
    c = tuning.choose(StudyResult(records, False, replace(verdict, resolution=1.0), 1))
    assert c.trial is None and "by more than 2% (a gain worth a restart), 0.9 required" in c.why, c


def test_one_stalled_run_of_the_winner_does_not_veto_its_gain_over_production():
    """Trial 2 held 11 req/s in its trial and one re-measured run, and read 2 in a stalled one; production held 5 in
    every run. The runs' spread (9 req/s) would call a gain of 6 noise; the posterior, whose noise has heavy tails,
    reads the stall as the outlier it is and publishes, with the probability in the reason. Production as high as
    the winner makes the same evidence no gain."""
    records = [_record(0, "production", 5.0, 32), _record(1, "vllm-defaults", 4.0, 64), _record(2, None, 11.0, 48)]

    def result(prod_runs):
        cands = [_cand("trial 2", 2, [11.0, 2.0]), _cand("baseline production", 0, prod_runs)]
        return StudyResult(records, False, _verdict(cands, "trial 2", "baseline production", 6.0, 0.2), 2)

    c = tuning.choose(result([5.0, 5.1, 4.9]))
    p = float(re.search(r"P = ([\d.]+) that it beats production", c.why).group(1))
    assert c.trial == 2 and p >= 0.9, c
    assert c.why.startswith("trial 2 11.00 req/s vs production 5.00: +6.00 req/s; P = "), c.why
    records[0] = _record(0, "production", 11.0, 32)
    c = tuning.choose(result([11.0, 11.1, 10.9]))
    assert c.trial is None and "not surely a gain" in c.why, c


def test_a_baseline_that_runs_production_s_own_config_is_no_gain_over_it():
    """Production's baseline measured nothing (interrupted), and vllm-defaults is the same config: no publish."""
    records = [_record(0, "production", 0.0, 2), _record(1, "vllm-defaults", 11.09, 2), _record(2, None, 6.0, 12)]
    cands = [_cand("trial 2", 2, [6.0]), _cand("baseline vllm-defaults", 1, [11.09])]
    c = tuning.choose(StudyResult(records, False, _verdict(cands, "baseline vllm-defaults", "baseline vllm-defaults",
                                                           0.0, 0.0), 1))
    assert c.trial is None and "runs production's own config" in c.why, c


def test_the_daemon_keeps_production_on_a_tie(daemon_file, monkeypatch):
    d = Daemon(load_daemon_config(daemon_file()))
    d.state = d.store.save(DaemonState(phase=Phase.TUNING, study_name="prod-tune-001", trigger="requested: test"))
    d.read_result = lambda storage, name: tie_with_production_one_run_each()
    d.tuning.finish(0)
    assert d.state.phase is Phase.WATCHING and "production's config stays" in d.state.note, d.state.note
    assert d.publishing.job is None and [e.outcome for e in d.history.entries()] == []

    d.read_result = lambda storage, name: tie_with_the_defaults()
    d.cfg = replace(d.cfg, approval=True)
    d.state = d.store.save(replace(d.state, phase=Phase.TUNING))
    d.tuning.finish(0)
    proposal = d.history.proposal()
    assert proposal is not None and proposal.values == {"max_num_seqs": 64}  # vllm-defaults', not trial 3's
    assert proposal.source["trial"] == 0


# --- 4: a retune outside the tuning windows waits for one --------------------------------------------------

def _closed_window() -> str:
    """A tuning window that is not now (an hour long, starting two hours from now)."""
    start = (dt.datetime.now() + dt.timedelta(hours=2)).time()
    end = (dt.datetime.now() + dt.timedelta(hours=3)).time()
    return f'windows = ["{start:%H:%M}-{end:%H:%M}"]'


def test_a_retune_asked_while_a_tuning_runs_is_answered_by_it_not_queued(capsys, daemon_file):
    """A queued request would start a second tuning on the traffic after the first: on a surge's aftermath, not
    the surge the person asked about. One running answers it, and the command says so."""
    p = daemon_file()
    d = Daemon(load_daemon_config(p))
    d.state = d.store.save(DaemonState(phase=Phase.TUNING, study_name="prod-tune-004", trigger="traffic drift 0.57 > 0.50"))
    code, said, err = cli(capsys, "retune", "--config", p, "--reason", "the surge")
    assert code == 0, err
    assert said.startswith("autotune: a tuning is running (prod-tune-004, traffic drift 0.57 > 0.50): it answers this "
                           "request, so none is queued"), said
    assert d.store.retune_request() is None


def test_a_retune_outside_the_windows_stays_pending_until_one_opens(capsys, daemon_file, monkeypatch):
    p = daemon_file(tuning=_closed_window())
    cfg = load_daemon_config(p)
    d = Daemon(cfg)
    code, said, err = cli(capsys, "retune", "--config", p, "--reason", "test")
    assert code == 0, err
    d.tick()
    d.tick()
    assert (d.root / "retune-requested").read_text().strip() == "test"  # not consumed
    assert d.state.phase is Phase.WATCHING
    assert "requested: test; held until a tuning window opens (" in d.state.note, d.state.note
    assert "pending: outside the tuning windows" in said
    code, out, err = cli(capsys, "status", "--config", p)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("retune:"))
    assert line.startswith("retune: requested (test), pending: outside the tuning windows (") and "it starts when" in line

    # the window opens: the request starts the tuning it asked for, and only then is it taken
    d.cfg = replace(cfg, tuning_windows=())
    d.fingerprint = Fingerprint.from_json(_fingerprint())
    started = []
    monkeypatch.setattr(d.tuning, "start", lambda trigger, fp: started.append(trigger))
    d.tick()
    assert started == ["requested: test"] and d.store.retune_request() is None


def _fingerprint():
    return {"request_rate": 4.0, "prompt_tokens_mean": 100.0, "prompt_tokens_p50": 100.0, "prompt_tokens_p90": 120.0,
            "output_tokens_mean": 8.0, "output_tokens_p50": 8.0, "output_tokens_p90": 8.0,
            "prefix_cache_hit_rate": None, "window_s": 5.0, "requests": 40}


def test_trigger_notes_read_as_a_person_would_say_them():
    at = decide(DaemonState(), Observation(0.503, False), now=0.0, drift_threshold=0.5, breach_windows=3,
                every_s=0, cooldown_s=0, in_window=True)
    assert at.trigger == "traffic drift 0.503 reached the threshold (0.50)"
    held = decide(DaemonState(last_tuning_end=1000.0), Observation(2.0, False), now=1000.0 + 6 * 3600 - 20,
                  drift_threshold=0.5, breach_windows=3, every_s=0, cooldown_s=6 * 3600, in_window=True)
    assert held.waiting.endswith("held by the cooldown for 20 s more"), held.waiting
    state = DaemonState(breach_streak=2)
    full = decide(state, Observation(0.1, True, saturated=True), now=0.0, drift_threshold=0.5, breach_windows=3,
                  every_s=0, cooldown_s=0, in_window=True)
    assert full.trigger == "production saturated: requests queued through 3 windows in a row"
    missed = decide(state, Observation(0.1, True), now=0.0, drift_threshold=0.5, breach_windows=3, every_s=0,
                    cooldown_s=0, in_window=True)
    assert missed.trigger == "SLO missed in 3 windows in a row"


# --- 7: warm starts neither repeat production or the defaults nor eat the budget --------------------------

def _earlier_study(storage, name, winners, floors=()):
    """Earlier winners (capacity, max_num_seqs), each bracketed by a load that missed above it; those in ``floors``
    held every load their ladder offered (their capacity is where it stopped)."""
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    for capacity, seqs in [*winners, *floors]:
        steps = [{"load": 1.0, "rate": capacity, "passed": True}]
        if (capacity, seqs) not in floors:
            steps.append({"load": 1.25, "rate": capacity * 1.25, "passed": False})
        study.add_trial(create_trial(
            params={"max_num_seqs": seqs}, distributions={"max_num_seqs": IntDistribution(2, 64, log=True)},
            value=capacity, state=TrialState.COMPLETE,
            user_attrs={Attr.CONSTRAINTS: [0.0], Attr.CAPACITY_RPS: capacity, Attr.STEPS: steps,
                        Attr.ENGINE_ARGS: {"values": {"max_num_seqs": seqs}, "env": {}}}))


def test_warm_starts_skip_production_and_the_defaults_and_keep_to_a_third_of_the_budget(tmp_path, tiny_model):
    text = STAGING.format(root=tmp_path, python=sys.executable, port=free_port(), model=tiny_model)
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 16, "output_tokens": 4}\n')

    def baselines(trials):
        (tmp_path / "staging.toml").write_text(text.replace("trials = 3", f"trials = {trials}"))
        staging = load_study(tmp_path / "staging.toml")
        out = tuning.write_tuning_study(tmp_path / "staging.toml", staging, tmp_path / f"t{trials}.toml",
                                        name=f"prod-tune-00{trials}", slos=["ttft<500ms"],
                                        fingerprint=Fingerprint.from_json(_fingerprint()), seed=0,
                                        deployed={"max_num_seqs": 2}, prefix="prod-tune-", trace=trace)
        return {b.name: b.values for b in load_study(out).baselines}

    storage = load_study_storage(tmp_path, text)
    # the best earlier winners: production's own config (2), vLLM's defaults (the space's default, 64), then others;
    # a ladder ceiling (40 req/s, every load held) is no measured capacity and never a warm start
    _earlier_study(storage, "prod-tune-001", [(12.0, 2), (11.0, 64), (10.0, 32), (9.0, 16)], floors=[(40.0, 48)])
    _earlier_study(storage, "prod-tune-002", [(8.0, 8), (7.0, 4), (6.5, 32)])
    assert baselines(9) == {"production": {"max_num_seqs": 2}, "earlier-1": {"max_num_seqs": 32},
                            "earlier-2": {"max_num_seqs": 16}, "earlier-3": {"max_num_seqs": 8}}  # 9 trials: 3 at most
    # 4 trials: vllm-defaults and production run anyway; one warm start leaves one sampled trial
    assert baselines(4) == {"production": {"max_num_seqs": 2}, "earlier-1": {"max_num_seqs": 32}}


def test_tunings_keep_their_runs_under_the_state_dir_not_the_working_directory(daemon_file, tmp_path, monkeypatch):
    """A staging study that names no runs_dir nor storage: its tunings' runs and Optuna storage go under the
    daemon's state directory, never into a runs/ in the daemon's working directory (/ under systemd)."""
    p = daemon_file()
    staging = p.parent / "staging.toml"
    staging.write_text("\n".join(x for x in staging.read_text().splitlines()
                                 if not x.startswith(("storage =", "runs_dir ="))))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    d = Daemon(load_daemon_config(p))
    runs = d.root / "tunings" / "runs"
    path = d.root / "tunings" / "prod-tune-001.toml"
    d.tuning.write_study("prod-tune-001", path, Fingerprint.from_json(_fingerprint()), {"max_num_seqs": 2})
    derived = load_study(path)
    assert derived.run_dir == runs / "prod-tune-001", derived.runs_dir
    assert derived.storage == d.study.storage == f"sqlite:///{runs}/studies.db"
    assert list(cwd.iterdir()) == []


def test_a_tuning_replays_every_request_it_synthesized(daemon_file):
    """The synthesized trace's TUNING_REQUESTS requests are all the tuning's: a load step at twice the
    fingerprint's rate draws on all of them, not on the first 200 twice (repeated prompts are prefix-cache
    hits that no user would send)."""
    from autotune.workload.source import LoadSteps

    p = daemon_file()
    staging = p.parent / "staging.toml"  # its steps last as long as the daemon makes them: half the trace's span
    staging.write_text("\n".join(x for x in staging.read_text().splitlines() if not x.startswith("step_duration")))
    d = Daemon(load_daemon_config(p))
    path = d.root / "tunings" / "prod-tune-001.toml"
    d.tuning.write_study("prod-tune-001", path, Fingerprint.from_json(_fingerprint()), {"max_num_seqs": 2})
    derived = load_study(path)
    assert derived.workload.num_requests == tuning.TUNING_REQUESTS
    steps = LoadSteps(derived.workload, derived.objective.step_seconds)
    assert len(steps.base.requests) == tuning.TUNING_REQUESTS
    at_two = [r.prompt for r in steps.at(2.0).requests]
    assert len(at_two) >= 0.9 * tuning.TUNING_REQUESTS, len(at_two)
    # (a step rounded up to whole seconds may take a request or two again from the start)
    assert len(set(at_two)) >= 0.97 * len(at_two), f"{len(at_two) - len(set(at_two))} of {len(at_two)} repeated"


def load_study_storage(tmp_path, text):
    (tmp_path / "staging.toml").write_text(text)
    return load_study(tmp_path / "staging.toml").storage


# --- one source of truth for where the daemon keeps its state ----------------------------------------------

def test_status_reads_the_state_dir_the_config_names_whatever_the_environment(capsys, daemon_file, tmp_path,
                                                                              monkeypatch):
    p = daemon_file(top=f'state_dir = "{tmp_path}/daemon-state"')
    root = tmp_path / "daemon-state" / "daemon" / "prod"
    StateStore(root).save(DaemonState(note="tuning prod-tune-004: requested: test", since=1.0))
    monkeypatch.setenv("AUTOTUNE_STATE_DIR", str(tmp_path / "elsewhere"))
    code, out, err = cli(capsys, "status", "--config", p)
    assert code == 0, err
    assert "note: tuning prod-tune-004: requested: test" in out and f"state: {root}" in out
    assert Daemon(load_daemon_config(p)).root == root  # the daemon itself keeps it there too

    bare = daemon_file()  # no state_dir, and no daemon has run: one line saying so, not an empty "watching"
    code, out, err = cli(capsys, "status", "--config", bare)
    assert code == 2 and len(err) == 1 and out == "", (out, err)
    assert err[0].startswith(f"autotune: no daemon named 'prod' has kept state in {tmp_path}/elsewhere/daemon/prod")


# --- 10: metrics that survive a restart and count rollbacks by hand --------------------------------------

def test_publish_metrics_come_back_after_a_restart_and_count_rollbacks_by_hand(capsys, daemon_file, state_dir,
                                                                               monkeypatch):
    monkeypatch.setattr("autotune.publish.vllm_config.wait_healthy", lambda url, timeout: None)
    p = daemon_file()
    root = state_dir / "daemon" / "prod"
    entry(root, 1, "adopted", {"max_num_seqs": 2})
    entry(root, 2, "published", {"max_num_seqs": 32}, source={"study": "prod-tune-001", "trial": 3})
    metrics = DaemonMetrics()
    d = Daemon(load_daemon_config(p), metrics=metrics)  # a restarted daemon
    d._resume()
    text = generate_latest(metrics.registry).decode()
    assert 'autotune_publishes_total{outcome="published"} 1.0' in text
    stamp = next(x for x in text.splitlines() if x.startswith("autotune_last_publish_timestamp_seconds "))
    assert float(stamp.split()[1]) == 1_700_000_002.0
    assert "autotune_last_publish_success 1.0" in text

    (p.parent / "etc" / "production.yaml").write_text("model: llama-3.1-8b\nmax-num-seqs: 32\n")
    code, out, err = cli(capsys, "rollback", "--config", p, "--to", 1)  # by hand, from another process
    assert code == 0 and (p.parent / "restarted").exists(), (out, err)
    d.tick()
    journal = capsys.readouterr().out
    assert "watching: production rolled back by hand to entry 1 (entry 3)" in journal, journal  # one line of its own
    d.tick()
    assert "rolled back by hand" not in capsys.readouterr().out  # once
    text = generate_latest(metrics.registry).decode()
    assert "autotune_rollbacks_total 1.0" in text
    assert 'autotune_publishes_total{outcome="published"} 1.0' in text  # a rollback is no publish
    assert 'entry="3"' in text and 'max_num_seqs="2"' in text  # production's config, after the rollback


def test_the_journal_has_a_line_per_decision_and_none_for_a_steady_tick(capsys, daemon_file):
    """The daemon's stdout (the journal under systemd) says what it decided and why, once: a countdown
    or an unchanged note on the next tick adds nothing."""
    p = daemon_file(tuning=_closed_window())
    d = Daemon(load_daemon_config(p))
    capsys.readouterr()
    main(["retune", "--config", str(p), "--reason", "by the test"])
    capsys.readouterr()
    d.tick()
    first = capsys.readouterr().out.splitlines()
    assert len(first) == 1 and first[0].startswith("watching: ") and "held until a tuning window opens" in first[0]
    d.tick()
    d.tick()
    assert capsys.readouterr().out == ""  # the same decision: nothing new to say
    d.enter(Phase.TUNING, note="tuning prod-1: requested: by the test")
    assert capsys.readouterr().out.splitlines() == ["tuning: tuning prod-1: requested: by the test"]


def test_a_reload_applies_the_file_but_not_where_the_daemon_lives(capsys, daemon_file):
    p = daemon_file()
    d = Daemon(load_daemon_config(p))
    text = p.read_text()
    p.write_text(text.replace('name = "prod"', 'name = "elsewhere"').replace('slos = ["ttft<500ms"]',
                                                                         'slos = ["ttft<300ms"]\n[publish]\napproval = true'))
    d.reload()
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [f"autotune: reloaded {p}; name changed and take a restart"]
    assert d.cfg.approval is True and [s.text for s in d.cfg.slos] == ["p95:ttft<300ms"]
    assert d.cfg.name == "prod" and d.root.name == "prod"  # the state stays where the running daemon keeps it
    p.write_text("not toml [")
    d.reload()
    assert "not applied, the running config stays" in capsys.readouterr().err
    assert d.cfg.approval is True


# --- 3: the canary's requests are no drift of production's traffic -------------------------------------------

def test_the_canary_s_requests_start_no_tuning_after_a_publish(daemon_file, monkeypatch):
    """Users send 4 req/s; the canary adds 12 req/s for 5 s while the daemon verifies its publish. Right after
    the publish, no window may span the canary: the old one would read "traffic drift 0.92 > 0.50"."""
    import concurrent.futures

    from autotune.daemon.prometheus import Snapshot
    from autotune.daemon.watcher import Watcher
    from autotune.publish.transaction import PublishResult

    cfg = load_daemon_config(daemon_file())
    cfg = replace(cfg, window_s=10.0, tuning_windows=(), triggers=replace(cfg.triggers, cooldown_s=0.0, every_s=0.0))
    d = Daemon(cfg)
    clock = {"t": 0.0, "requests": 0.0}
    d.watcher = Watcher(cfg.production.url, window_s=10.0,
                        scraper=lambda url, client, timeout: Snapshot(clock["t"], {"requests": clock["requests"]},
                                                                      {}, {}))
    started = []
    monkeypatch.setattr(d.tuning, "start", lambda trigger, fp: started.append(trigger))

    def serve(seconds, rate):  # one scrape, one tick a second
        for _ in range(seconds):
            clock["t"] += 1.0
            clock["requests"] += rate
            d.tick()

    serve(12, 4.0)
    assert d.state.tuned_fingerprint["request_rate"] == pytest.approx(4.0)
    d.enter(Phase.TUNING, note="tuning prod-tune-001: test")
    d.enter(Phase.PUBLISHING, note="publishing")
    d.enter(Phase.VERIFYING)
    serve(5, 16.0)  # the canary, on top of the users' traffic
    published = d.history.add("published", {"max_num_seqs": 32}, source={"study": "prod-tune-001", "trial": 3})
    job = concurrent.futures.Future()
    job.set_result(PublishResult(published, True))
    d.publishing.job = job
    serve(1, 4.0)
    assert d.state.phase is Phase.WATCHING
    serve(15, 4.0)
    assert started == [], started
    assert d.state.phase is Phase.WATCHING and "drift" not in d.state.note, d.state.note
    serve(1, 12.0)
    serve(10, 12.0)  # users' traffic drifting for real still triggers
    assert started and started[0].startswith("traffic drift"), started


# --- 1: production's config changed under a running tuning ----------------------------------------------------

def _beats_production():
    """Trial 2 (max_num_seqs 48) clearly beats production's baseline (max_num_seqs 32, as it was deployed)."""
    records = [_record(0, "production", 5.0, 32), _record(1, "vllm-defaults", 6.0, 64), _record(2, None, 11.0, 48)]
    cands = [_cand("trial 2", 2, [11.0, 10.9, 11.1]), _cand("baseline vllm-defaults", 1, [6.0, 6.1, 5.9])]
    return StudyResult(records, False, _verdict(cands, "trial 2", "baseline vllm-defaults", 5.0, 0.2), 2)


def test_a_rollback_during_a_tuning_is_not_ignored(capsys, daemon_file, state_dir, monkeypatch):
    monkeypatch.setattr("autotune.publish.vllm_config.wait_healthy", lambda url, timeout: None)
    p = daemon_file(top="")
    (p.parent / "etc" / "production.yaml").write_text("model: llama-3.1-8b\nmax-num-seqs: 32\n")
    root = state_dir / "daemon" / "prod"
    entry(root, 1, "adopted", {"max_num_seqs": 2})
    entry(root, 2, "published", {"max_num_seqs": 32}, source={"study": "prod-tune-000", "trial": 1})
    metrics = DaemonMetrics()
    d = Daemon(replace(load_daemon_config(p), approval=True), metrics=metrics)
    monkeypatch.setattr(d.tuning, "write_study", lambda *a: None)
    monkeypatch.setattr(d.tuning, "spawn", lambda: None)
    d.tuning.start("requested: test", Fingerprint.from_json(_fingerprint()))
    assert d.state.phase is Phase.TUNING and d.state.production_values["max_num_seqs"] == 32
    code, out, err = cli(capsys, "rollback", "--config", p, "--to", 1)  # by hand, while the tuning runs
    assert code == 0, err
    d.tuning.child = None
    d.tuning.step = lambda: None  # the child is still running: the tick only follows production
    d.tick()
    text = generate_latest(metrics.registry).decode()
    assert 'entry="3"' in text and 'max_num_seqs="2"' in text, text  # the metric follows the rollback at once
    capsys.readouterr()
    d.read_result = lambda storage, name: _beats_production()
    d.tuning.finish(0)
    assert d.history.proposal() is None  # measured against a config production no longer runs: nothing proposed
    assert d.state.phase is Phase.WATCHING
    assert "production's config changed while it ran (max_num_seqs 32 -> 2" in d.state.note, d.state.note
    said = capsys.readouterr().out
    assert "watching: tuning prod-tune-001: nothing published: production's config changed" in said, said


# --- 2: production's baseline that measured nothing is unknown, not 0 ------------------------------------------

def _interrupted_production():
    """The daemon stopped during production's baseline (FAIL, no measurement); vllm-defaults measured 11.09."""
    failed = TrialRecord(1, TrialState.FAIL, {"max_num_seqs": 2}, (),
                         {Attr.BASELINE: "production", Attr.ENGINE_ARGS: {"values": {"max_num_seqs": 2}, "env": {}}})
    records = [_record(0, "vllm-defaults", 11.09, 64), failed, _record(2, None, 6.0, 12)]
    cands = [_cand("trial 2", 2, [6.0]), _cand("baseline vllm-defaults", 0, [11.09])]
    return records, cands


def test_an_interrupted_production_baseline_publishes_nothing(daemon_file, monkeypatch):
    records, cands = _interrupted_production()
    verdict = _verdict(cands, "baseline vllm-defaults", "baseline vllm-defaults", 0.0, 0.0)
    c = tuning.choose(StudyResult(records, False, verdict, 0))
    assert c.trial is None, c
    assert "production's baseline has no measurement (trial 1 fail)" in c.why and "vs production 0.00" not in c.why
    assert tuning.production_capacity(StudyResult(records, False, verdict, 0)) is None

    # re-run after the interruption: the re-run is production's measurement, not the failed trial
    rerun = _record(3, "production", 5.0, 2)
    c = tuning.choose(StudyResult([*records, rerun], False, verdict, 0))
    assert c.trial == 0 and "baseline vllm-defaults 11.09 req/s vs production 5.00" in c.why, c

    metrics = DaemonMetrics()
    d = Daemon(load_daemon_config(daemon_file()), metrics=metrics)
    d.state = d.store.save(DaemonState(phase=Phase.TUNING, study_name="prod-tune-001", trigger="requested: test"))
    d.read_result = lambda storage, name: StudyResult(records, False, verdict, 0)
    d.tuning.finish(0)
    assert d.publishing.job is None and d.history.entries() == [] and d.state.phase is Phase.WATCHING
    assert "no measurement" in d.state.note and "unknown, not 0" in d.state.note, d.state.note


# --- 10: production's capacity, and trial gauges once a tuning ended ------------------------------------------

def test_production_capacity_is_set_and_trial_gauges_settle_when_a_tuning_ends(daemon_file, monkeypatch):
    waiting = TrialRecord(4, TrialState.WAITING, {}, (), {Attr.BASELINE: "earlier-1"})
    result = tie_with_the_defaults()
    result = StudyResult([*result.records, waiting], False, result.remeasurement, 3)
    metrics = DaemonMetrics()
    d = Daemon(load_daemon_config(daemon_file(top="")), metrics=metrics)
    d.state = d.store.save(DaemonState(phase=Phase.TUNING, study_name="prod-tune-001", trigger="requested: test"))
    d.metrics.set_trials({"running": 1, "waiting": 1, "complete": 3})  # as the last scrape of the running study saw
    d.read_result = lambda storage, name: result
    monkeypatch.setattr(d.publishing, "_publish", lambda values, source, entry=None: None)
    d.tuning.finish(0)
    text = generate_latest(metrics.registry).decode()
    assert "autotune_production_capacity_requests_per_second 5.0" in text, text
    assert 'autotune_trials{state="waiting"} 0.0' in text and 'autotune_trials{state="running"} 0.0' in text
    assert 'autotune_trials{state="complete"} 4.0' in text


# --- 6: an approved proposal is published by the daemon, on its own loop -----------------------------------------

def test_publish_approve_is_done_by_the_daemon_which_shows_publishing_and_verifying(capsys, daemon_file, state_dir,
                                                                                     monkeypatch):
    import threading

    from autotune.cli import daemon as cli_daemon

    monkeypatch.setattr("autotune.publish.vllm_config.wait_healthy", lambda url, timeout: None)
    monkeypatch.setattr(cli_daemon, "POLL_S", 0.02, raising=False)
    p = daemon_file(top="")
    root = state_dir / "daemon" / "prod"
    entry(root, 1, "adopted", {"max_num_seqs": 2})
    entry(root, 2, "proposed", {"max_num_seqs": 32}, source={"study": "prod-tune-001", "trial": 3})
    d = Daemon(replace(load_daemon_config(p), approval=True))
    d.state = d.store.save(DaemonState(phase=Phase.AWAITING_APPROVAL, note="entry 2 waits"))
    monkeypatch.setattr(d.publishing, "canary", lambda: (lambda url: CanaryResult(True, {})))
    phases = []
    real_set = d.enter
    monkeypatch.setattr(d, "enter", lambda phase, **kw: (phases.append(phase), real_set(phase, **kw)))
    capsys.readouterr()
    codes = []
    approver = threading.Thread(target=lambda: codes.append(main(["publish", "--config", str(p), "--approve"])))
    approver.start()
    while approver.is_alive() and len(phases) < 10:
        d.tick()
        approver.join(0.05)
    approver.join(5)
    assert codes == [0], codes
    for _ in range(100):  # the daemon's next tick sees its publish done
        if d.state.phase is Phase.WATCHING:
            break
        d.tick()
        approver.join(0.02)
    assert phases[:3] == [Phase.PUBLISHING, Phase.VERIFYING, Phase.WATCHING], phases
    assert (p.parent / "restarted").exists()  # the daemon restarted production, not the command
    assert d.history.get(2).outcome == "published" and not (root / "publish-approved").exists()
    out = capsys.readouterr().out
    assert "publishing: publishing entry 2 (approved by hand)" in out and "verifying: entry 2 deployed" in out, out
    assert "autotune: entry 2: published" in out
    assert "watching: entry 2: published" in out


def test_publish_approve_no_wait_records_it_and_a_timeout_says_no_daemon_took_it(capsys, daemon_file, state_dir):
    p = daemon_file(top="")
    root = state_dir / "daemon" / "prod"
    entry(root, 1, "adopted", {"max_num_seqs": 2})
    entry(root, 2, "proposed", {"max_num_seqs": 32}, source={"study": "prod-tune-001", "trial": 3})
    code, out, err = cli(capsys, "publish", "--config", p, "--approve", "--no-wait")
    assert code == 0 and "entry 2 approved; the daemon starts publishing it within one scrape interval (" in out, (out, err)
    assert StateStore(root).approval() == 2
    code, out, err = cli(capsys, "publish", "--config", p, "--approve", "--timeout", "0.3")
    assert code == 1 and "no daemon has taken the approval yet" in err[-1], err
    assert History(root / "history").get(2).outcome == "proposed"  # nothing published by the command itself
    assert not (p.parent / "restarted").exists()


# --- issue 30, 3: a publish is a diff of the tuned keys --------------------------------------------------------

def test_a_proposal_changes_only_the_tuned_keys_and_production_keeps_its_own(capsys, daemon_file, state_dir,
                                                                            tiny_model, monkeypatch):
    """Production runs keys the staging study does not have (a utilization, a longer context); staging fixes keys
    production must never get (its tokenizer path, its max_model_len). The proposal changes max_num_seqs alone."""
    p = daemon_file(top="")
    (p.parent / "etc" / "production.yaml").write_text(
        "model: llama-3.1-8b\nmax-num-seqs: 32\ngpu-memory-utilization: 0.9\nmax-model-len: 16384\n")
    d = Daemon(replace(load_daemon_config(p), approval=True))
    monkeypatch.setattr(d.tuning, "write_study", lambda *a: None)
    monkeypatch.setattr(d.tuning, "spawn", lambda: None)
    d.tuning.start("requested: test", Fingerprint.from_json(_fingerprint()))
    staging_only = {"max_model_len": 8192, "tokenizer": str(tiny_model)}  # tests/test_daemon.py's [engine.args]

    def ran(number, baseline, capacity, max_num_seqs):
        attrs = {Attr.CAPACITY_RPS: capacity, Attr.CONSTRAINTS: [0.0], Attr.STEPS: _ladder(capacity),
                 Attr.ENGINE_ARGS: {"values": {"max_num_seqs": max_num_seqs, **staging_only}, "env": {}},
                 **({Attr.BASELINE: baseline} if baseline else {})}
        return TrialRecord(number, TrialState.COMPLETE, {"max_num_seqs": max_num_seqs}, (capacity,), attrs)

    records = [ran(0, "production", 5.0, 32), ran(1, "vllm-defaults", 6.0, 64), ran(2, None, 11.0, 48)]
    cands = [_cand("trial 2", 2, [11.0, 10.9, 11.1]), _cand("baseline vllm-defaults", 1, [6.0, 6.1, 5.9])]
    result = StudyResult(records, False, _verdict(cands, "trial 2", "baseline vllm-defaults", 5.0, 0.2), 2)
    d.read_result = lambda storage, name: result
    d.tuning.finish(0)

    proposal = d.history.proposal()
    assert proposal is not None, d.state.note
    assert proposal.values == {"max_num_seqs": 48, "gpu_memory_utilization": 0.9, "max_model_len": 16384}
    capsys.readouterr()
    code, out, err = cli(capsys, "history", "--config", p)
    assert code == 0, err
    assert "  against production: max_num_seqs 32 -> 48\n" in out, out


def test_a_tuned_key_the_winner_ran_without_is_unset_and_a_baselines_own_value_is_kept():
    from autotune.daemon.tuning import for_production

    deployed = {"max_num_seqs": 32, "enable_prefix_caching": False, "max_model_len": 16384}
    # the winner ran prefix caching at vLLM's default (the space searched it) and a baseline's own block size
    ran = {"max_num_seqs": 48, "block_size": 32, "tokenizer": "/staging/tok"}
    tuned = {"max_num_seqs", "enable_prefix_caching", "block_size"}
    assert for_production(deployed, ran, tuned) == {"max_num_seqs": 48, "block_size": 32, "max_model_len": 16384}
    assert for_production(None, ran, tuned) == {"max_num_seqs": 48, "block_size": 32}


# --- issue 30, 2: a ladder's ceiling is no capacity ----------------------------------------------------------

def test_no_publish_over_a_production_that_held_every_load_and_a_floor_winner_gains_at_least():
    def ladder(capacity, missed):
        """A run that held half its capacity and its capacity, and (``missed``) missed twice it, else stopped there."""
        held = [{"load": 0.5, "rate": capacity / 2, "passed": True}, {"load": 1.0, "rate": capacity, "passed": True}]
        return [*held, {"load": 2.0, "rate": 2 * capacity, "passed": False}] if missed else held

    def result(prod_missed, pick_missed):
        records = [_record(0, "production", 5.0, 32), _record(1, "vllm-defaults", 6.0, 64), _record(2, None, 11.0, 48)]
        cands = [{**_cand("trial 2", 2, [11.0, 10.9, 11.1]), "runs": [ladder(11.0, pick_missed)] * 3,
                  "at_least": not pick_missed},
                 {**_cand("baseline production", 0, [5.0, 5.1, 4.9]), "runs": [ladder(5.0, prod_missed)] * 3,
                  "at_least": not prod_missed}]
        return StudyResult(records, False, _verdict(cands, "trial 2", "baseline production", 6.0, 0.2), 2)

    c = tuning.choose(result(prod_missed=False, pick_missed=True))
    assert c.trial is None and "production's config held every load it was offered" in c.why, c
    c = tuning.choose(result(prod_missed=True, pick_missed=False))
    assert c.trial == 2 and c.why.startswith("trial 2 at least 11.00 req/s vs production 5.00: +6.00 req/s"), c


# --- issue 30, 4-6: true numbers; a publish a restart cut short is said, and an approved one asked again ----------

def test_an_approved_publish_a_crash_cut_before_deploying_is_proposed_again_and_status_says_so(capsys, daemon_file,
                                                                                                 state_dir):
    p = daemon_file()
    root = state_dir / "daemon" / "prod"
    entry(root, 1, "adopted", {"max_num_seqs": 2})  # what production.yaml still holds: the crash came before writing
    entry(root, 2, "pending", {"max_num_seqs": 32},
          source={"study": "prod-tune-001", "trial": 3, "approved": "by hand", "why": "+6.00 req/s"})
    StateStore(root).save(DaemonState(phase=Phase.PUBLISHING, last_decision="publishing entry 2 (approved by hand)"))
    metrics = DaemonMetrics()
    d = Daemon(replace(load_daemon_config(p), approval=True), metrics=metrics)
    d._resume()
    entries = d.history.entries()
    assert [(e.number, e.outcome) for e in entries] == [(1, "adopted"), (2, "rolled-back"), (3, "proposed")]
    assert entries[2].values == {"max_num_seqs": 32} and "approved" not in entries[2].source
    assert not entries[1].reached_production
    assert d.state.phase is Phase.AWAITING_APPROVAL
    assert d.state.last_decision.startswith("recovered entry 2: rolled-back (interrupted before it was "
                                            "deployed); it was approved but never served"), d.state.last_decision
    text = generate_latest(metrics.registry).decode()
    assert "autotune_rollbacks_total 0.0" in text, text  # nothing production served was rolled back
    assert 'autotune_publishes_total{outcome="abandoned"} 1.0' in text
    assert not (p.parent / "restarted").exists()
    capsys.readouterr()
    code, out, _ = cli(capsys, "status", "--config", p)
    assert code == 0 and "last decision:" in out and "publishing entry 2" not in out, out


def test_unknown_is_absent_and_a_removed_slo_leaves_no_gauge():
    from types import SimpleNamespace

    metrics = DaemonMetrics()
    text = generate_latest(metrics.registry).decode()
    for name in ("autotune_best_capacity_requests_per_second", "autotune_production_capacity_requests_per_second",
                 "autotune_traffic_drift_score", "autotune_production_request_rate"):
        assert f"\n{name} " not in text, name  # nothing measured yet: no sample, not a 0
    metrics.best_capacity.set(7.5)
    assert "autotune_best_capacity_requests_per_second 7.5" in generate_latest(metrics.registry).decode()

    def estimate(text, holds):
        return SimpleNamespace(slo=SimpleNamespace(text=text), value=0.2, holds=holds)

    metrics.set_slos([estimate("p95:ttft<500ms", False)])
    metrics.set_slos([estimate("p95:ttft<800ms", True)])  # after a reload that replaced the SLO
    text = generate_latest(metrics.registry).decode()
    assert 'autotune_production_slo_met{slo="p95:ttft<800ms"} 1.0' in text
    assert "ttft<500ms" not in text, text


def test_a_part_window_is_not_judged(daemon_file):
    from autotune.daemon.window import Window

    d = Daemon(load_daemon_config(daemon_file()))
    part = Window(0.0, 0.6 * d.cfg.window_s, {"requests": 200.0}, {}, {}, False, {}, None, 2)  # judged before
    d.watcher.poll = lambda: part
    assert d._observe() == Observation(None, None)


# --- issue 30, 1: a tuning imitates the traffic after a jump, and production is then judged against that ----------

def test_a_retune_asked_as_the_traffic_jumps_waits_for_the_new_level_and_imitates_it(daemon_file, monkeypatch):
    """A person asks for a tuning one scrape into a surge (3 -> 12 req/s): the fingerprint's rate is a blend of the
    two levels (a split must span two scrape intervals), and the newest scrape already arrives at another rate. Whichever trigger
    fires, the tuning waits for the traffic to settle (the request stays pending) and imitates the new level."""
    from autotune.daemon.prometheus import Snapshot

    d = Daemon(load_daemon_config(daemon_file()))
    monkeypatch.setattr(d.tuning, "write_study", lambda *a: None)
    monkeypatch.setattr(d.tuning, "spawn", lambda: None)
    every, n = d.cfg.scrape_interval_s, round(d.cfg.window_s / d.cfg.scrape_interval_s)
    state = {"t": 0.0, "total": 0.0}

    def scrape(rate):
        state["t"] += every
        state["total"] += rate * every
        return d.watcher.add(Snapshot(state["t"], {"requests": state["total"]}, {}, {}))

    d.watcher.add(Snapshot(0.0, {"requests": 0.0}, {}, {}))
    rates = iter([3.0] * n + [12.0] * n)
    d.watcher.poll = lambda: scrape(next(rates))
    for _ in range(n + 1):  # a full window at 3 req/s, then one scrape at 12
        obs = d._observe()
    assert 3.0 * 1.25 < d.fingerprint.request_rate < 0.8 * 12, d.fingerprint  # the blend the tuning must not imitate
    d.store.request_retune("the surge")
    d._watching(obs)
    assert d.state.phase is Phase.WATCHING and "the traffic is changing level" in d.state.note, d.state.note
    assert d.store.retune_request() == "the surge"  # still pending: the tuning it asked for has not started
    for _ in range(n - 1):
        d._watching(d._observe())
        if d.state.phase is Phase.TUNING:
            break
    assert d.state.phase is Phase.TUNING and d.state.trigger == "requested: the surge", d.state
    assert d.state.imitated["request_rate"] == pytest.approx(12.0), d.state.imitated
    assert d.store.retune_request() is None


def test_a_jump_in_rate_is_imitated_at_the_new_rate_and_recorded_as_tuned_for(daemon_file, monkeypatch):
    from autotune.daemon.prometheus import Snapshot

    d = Daemon(load_daemon_config(daemon_file()))
    every = d.cfg.scrape_interval_s
    # a full window at 0.3 req/s (the traffic recorded as tuned for), then users jump to 3.0 for a fifth of a window
    rates = [0.3] * round(d.cfg.window_s / every) + [3.0] * round(0.2 * d.cfg.window_s / every)
    snaps, total = [Snapshot(0.0, {"requests": 0.0}, {}, {})], 0.0
    for i, rate in enumerate(rates, 1):
        total += rate * every
        snaps.append(Snapshot(every * i, {"requests": total}, {}, {}))
    feed = iter(snaps)
    d.watcher.poll = lambda: d.watcher.add(next(feed))
    for _ in snaps:
        obs = d._observe()
    window = d.watcher.window()
    assert window.dt >= d.cfg.window_s and window.arrival_rate < 1.0  # the window's mean: what was imitated before
    assert d.fingerprint.request_rate == pytest.approx(3.0), d.fingerprint
    assert obs.drift is not None and obs.drift > 2.0  # against 0.3 req/s, recorded from the first full window

    monkeypatch.setattr(d.tuning, "write_study", lambda *a: None)
    monkeypatch.setattr(d.tuning, "spawn", lambda: None)
    d.tuning.start("traffic drift", d.fingerprint)
    assert "imitating 3.00 req/s" in d.state.note, d.state.note
    d.fingerprint = replace(d.fingerprint, request_rate=0.5)  # what the window shows when the verdict comes
    d.read_result = lambda storage, name: tie_with_the_defaults()
    monkeypatch.setattr(d.publishing, "_publish", lambda values, source, entry=None: None)
    d.tuning.finish(0)
    assert Fingerprint.from_json(d.state.tuned_fingerprint).request_rate == pytest.approx(3.0)


# --- issue 30, 5: too little traffic to verify a switch is said, never "verified" ------------------------------------

def test_a_switch_verified_on_too_few_requests_is_kept_but_not_verified(monkeypatch):
    from autotune.daemon import production
    from autotune.daemon.prometheus import Snapshot
    from autotune.measure.slo import parse_slo

    reads = iter([Snapshot(0.0, {"requests": 100.0}, {}, {}), Snapshot(30.0, {"requests": 104.0}, {}, {})])
    monkeypatch.setattr(production, "scrape", lambda url: next(reads))
    result = production.production_verifier([parse_slo("ttft<500ms")], window_s=0.0)("http://127.0.0.1:9")
    assert result.passed and result.summary["verified"] is False  # the canary's verdict stands, unverified
    assert result.summary["note"] == "4 requests in 30 s: too few to judge; the canary's verdict stands"
