"""What a study records for each way a trial's measurement can end (issue 14, "failure branches never run").

The measurement is a stand-in (tests/measurers.py) that ends exactly one way: what is under test is what
the study tells Optuna (the table at the top of autotune/study/runner.py), not how an engine fails;
tests/test_engine_vllm.py, tests/test_launcher.py and tests/test_measure_core.py make real failures.
Nothing is launched here.
"""

import sys
import time

import optuna
import pytest
from optuna.trial import TrialState

from autotune.daemon import loop
from autotune.daemon.config import load_daemon_config
from autotune.engine.failures import Failure, FailureClass
from autotune.errors import AutotuneError, ConfigError
from autotune.measure.metrics import RequestResult, summarize
from autotune.measure.session import Outcome, Step
from autotune.measure.slo import parse_slos
from autotune.publish.history import History
from autotune.publish.transaction import CanaryResult, publish, rollback
from autotune.study import runner
from autotune.study.definition import load_study
from autotune.study.records import constraints_of
from autotune.study.runner import StudyRun
from autotune.study.storage import make_sampler, open_study
from autotune.workload.source import LoadSteps
from tests.conftest import free_port
from tests.measurers import SetOutcomes
from tests.test_daemon import STAGING
from tests.test_daemon_decisions import daemon_file  # noqa: F401 (a fixture)

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _definition(tmp_path, tiny_model, extra_top="", trials=3, timeout=None):
    text = STAGING.format(root=tmp_path, python=sys.executable, port=free_port(), model=tiny_model)
    text = text.replace('builtin = ["vllm-defaults"]', "builtin = []")
    text = text.replace("[budget]\ntrials = 3", f"[budget]\ntrials = {trials}"
                        + (f'\ntimeout = "{timeout}"' if timeout else ""))
    text = text.replace('seed = 0\n', 'seed = 0\n' + extra_top)
    path = tmp_path / "tune.toml"
    path.write_text(text)
    return load_study(path)


def _step(load, ttft_s, rate_per_load=4.0):
    results = [RequestResult(i, i * 0.1, i * 0.1, True, ttft=ttft_s, itl=[0.01], e2e=ttft_s + 0.01, prompt_tokens=3,
                             output_tokens=2, expected_output_tokens=2) for i in range(20)]
    slo = parse_slos(["ttft<500ms"])
    s = summarize(results, slo)
    return Step(load, rate_per_load * load, s, s.verdicts(slo), 1.0, results)


def _stub(d, make):
    """A measurer that answers the n-th measurement with ``make(n)``."""
    return SetOutcomes.of(d, lambda _, n: make(n))


def _run(d, measurer):
    run = StudyRun(d, measurer, LoadSteps(d.workload))
    study = open_study(d)
    return run, study


@pytest.mark.parametrize("cls", [FailureClass.CRASHED, FailureClass.STARTUP_TIMEOUT, FailureClass.OOM])
def test_crashed_startup_timeout_and_oom_trials_are_pruned_and_the_study_goes_on(tmp_path, tiny_model, state_dir,
                                                                                 monkeypatch, cls):
    d = _definition(tmp_path, tiny_model)
    m = _stub(d, lambda i: Outcome(url="http://127.0.0.1:1", failure=Failure(cls, f"{cls.value} here"),
                                                 engine_failed_after_s=1.5))
    run, study = _run(d, m)
    run.optimize(study)
    trials = study.get_trials(deepcopy=False)
    assert len(m.asked) == 3  # the budget is spent: a bad config does not stop the study
    assert [t.state for t in trials] == [TrialState.PRUNED] * 3
    assert all(t.user_attrs["failure_class"] == cls.value for t in trials)


def test_invalid_args_fails_the_trial_and_stops_the_study(tmp_path, tiny_model, state_dir, monkeypatch):
    d = _definition(tmp_path, tiny_model)
    m = _stub(d, lambda i: Outcome(url="http://127.0.0.1:1", failure=Failure(
        FailureClass.INVALID_ARGS, "error: unrecognized arguments: --bogus")))
    run, study = _run(d, m)
    with pytest.raises(ConfigError, match="rejected trial 0's args.*fix the space"):
        run.optimize(study)
    assert len(m.asked) == 1  # no second trial was launched
    [t] = study.get_trials(deepcopy=False)
    assert t.state == TrialState.FAIL and t.user_attrs["failure_class"] == "invalid-args"


def test_port_in_use_fails_the_trial_but_not_the_study(tmp_path, tiny_model, state_dir, monkeypatch):
    d = _definition(tmp_path, tiny_model)

    def outcome(i):
        if i == 0:
            return Outcome(url="http://127.0.0.1:1", failure=Failure(FailureClass.PORT_IN_USE, "Address already in use"))
        return Outcome(url="http://127.0.0.1:1", steps=[_step(1.0, 0.05)])

    m = _stub(d, outcome)
    run, study = _run(d, m)
    run.optimize(study)
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert states[0] == TrialState.FAIL  # not the config's fault: samplers ignore it
    # the study went on; this run's Optuna n_trials counted the FAIL, the budget does not: a rerun does one more
    assert states[1:] == [TrialState.COMPLETE] * 2 and len(m.asked) == 3
    assert run.remaining(study) == 1


def test_no_load_meeting_the_slos_is_complete_with_value_0_and_a_positive_constraint(tmp_path, tiny_model,
                                                                                      state_dir, monkeypatch):
    d = _definition(tmp_path, tiny_model, trials=1)
    m = _stub(d, lambda i: Outcome(url="http://127.0.0.1:1", steps=[_step(1.0, 1.2), _step(0.5, 0.9)]))
    run, study = _run(d, m)
    run.optimize(study)
    [t] = study.get_trials(deepcopy=False)
    assert t.state == TrialState.COMPLETE and t.value == 0.0
    assert max(constraints_of(t)) > 0  # infeasible: the lowest load missed the SLO


def test_a_trial_that_holds_the_slos_is_complete_with_its_capacity(tmp_path, tiny_model, state_dir, monkeypatch):
    d = _definition(tmp_path, tiny_model, trials=1)
    m = _stub(d, lambda i: Outcome(url="http://127.0.0.1:1", steps=[_step(1.0, 0.05), _step(2.0, 0.9)]))
    run, study = _run(d, m)
    run.optimize(study)
    [t] = study.get_trials(deepcopy=False)
    assert t.state == TrialState.COMPLETE and t.value == pytest.approx(4.0)  # load 1 x 4 req/s; load 2 missed


def test_an_engine_that_died_under_load_is_pruned_with_what_it_measured_before(tmp_path, tiny_model, state_dir,
                                                                              monkeypatch):
    d = _definition(tmp_path, tiny_model, trials=1)
    m = _stub(d, lambda i: Outcome(url="http://127.0.0.1:1", steps=[_step(1.0, 0.05)], failure=Failure(
        FailureClass.CRASHED, "died after becoming ready: exit code -9 (SIGKILL)", exit_code=-9)))
    run, study = _run(d, m)
    run.optimize(study)
    [t] = study.get_trials(deepcopy=False)
    assert t.state == TrialState.PRUNED and t.user_attrs["failure_class"] == "crashed"
    assert "SIGKILL" in t.user_attrs["failure"]
    assert t.value is None


def test_the_pruner_stops_a_trial_and_it_is_pruned(tmp_path, tiny_model, state_dir, monkeypatch):
    d = _definition(tmp_path, tiny_model, trials=1)
    m = _stub(d, lambda i: Outcome(url="http://127.0.0.1:1", steps=[_step(1.0, 0.05)], stopped_early=True))
    run, study = _run(d, m)
    run.optimize(study)
    [t] = study.get_trials(deepcopy=False)
    assert t.state == TrialState.PRUNED and t.user_attrs.get("failure_class") is None


@pytest.mark.parametrize("kind, cls", [("random", optuna.samplers.RandomSampler), ("gp", optuna.samplers.GPSampler),
                                       ("tpe", optuna.samplers.TPESampler)])
def test_each_sampler_runs_a_study_to_its_budget(tmp_path, tiny_model, state_dir, monkeypatch, kind, cls):
    assert isinstance(make_sampler(kind, 0), cls)
    d = _definition(tmp_path, tiny_model, extra_top=f'sampler = "{kind}"\n', trials=4)
    assert d.sampler == kind
    m = _stub(d, lambda i: Outcome(url="http://127.0.0.1:1", steps=[_step(1.0, 0.05 + 0.1 * i)]))
    run, study = _run(d, m)
    assert isinstance(study.sampler, cls)
    run.optimize(study)
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    # one engine start per distinct config: a sampler that draws a config again gets the earlier trial's result
    again = [t for t in trials if "same_config_as" in t.user_attrs]
    assert len(m.asked) == 4 - len(again)
    for t in again:
        twin = trials[t.user_attrs["same_config_as"]]
        assert twin.number < t.number and twin.user_attrs["engine_args"] == t.user_attrs["engine_args"]
        assert t.value == twin.value
    assert all(1 <= c["max_num_seqs"] <= 64 for c in m.asked if "max_num_seqs" in c)
    assert all(t.user_attrs["chosen_because"] for t in trials)


def test_the_time_budget_stops_the_study_before_the_trial_budget(tmp_path, tiny_model, state_dir, monkeypatch):
    d = _definition(tmp_path, tiny_model, trials=50, timeout="1s")
    assert d.budget.timeout_s == 1.0

    def slow(i):
        time.sleep(0.4)
        return Outcome(url="http://127.0.0.1:1", steps=[_step(1.0, 0.05)])

    m = _stub(d, slow)
    run, study = _run(d, m)
    t0 = time.monotonic()
    run.optimize(study)
    assert 1 <= len(m.asked) < 10  # Optuna stops starting trials after the timeout; the one running finishes
    assert time.monotonic() - t0 < 20


# --- publishing: a failing restart, a canary that fails and a rollback that fails too, rollback --to N -------



class FakeTarget:
    """Production in memory: ``deploy`` fails ("the restart failed") for the values listed in ``broken``."""

    name = "fake"

    def __init__(self, values, broken=()):
        self.running, self.broken, self.deploys = dict(values), list(broken), []

    def deployed(self):
        return dict(self.running)

    def deploy(self, values):
        self.deploys.append(dict(values))
        if dict(values) in self.broken:
            self.running = {}  # down: the restart left nothing serving
            raise AutotuneError(f"restart failed: production did not come back with {dict(values)}")
        self.running = dict(values)

    def endpoint(self):
        return "http://127.0.0.1:1"

    def production_values(self, values):
        return dict(values)


PASS = CanaryResult(True, {"slos": [{"slo": "tpot<10ms", "holds": True, "measured": 5}]})
MISS = CanaryResult(False, {"slos": [{"slo": "tpot<10ms", "holds": False, "measured": 30}]})


def test_a_failing_restart_rolls_back_to_the_last_good_config(tmp_path):
    old, new = {"max_num_seqs": 8}, {"max_num_seqs": 64}
    target, history = FakeTarget(old, broken=[new]), History(tmp_path / "h")
    checked = []
    result = publish(target, new, history, lambda url: checked.append(url) or PASS)
    assert not result.ok and checked == []  # no canary on an engine that did not restart
    assert target.running == old and target.deploys == [new, old]
    adopted, entry = history.entries()
    assert entry.outcome == "rolled-back" and entry.restored == adopted.number
    assert "restart failed" in entry.reason


def test_a_canary_that_fails_and_a_rollback_that_fails_too_is_loud_and_recorded(tmp_path):
    old, new = {"max_num_seqs": 8}, {"max_num_seqs": 64}
    target, history = FakeTarget(old, broken=[old]), History(tmp_path / "h")  # the old config no longer restarts
    with pytest.raises(AutotuneError, match=r"failed \(canary missed tpot<10ms \(measured 30\)\) and the rollback "
                                            r"to entry 1 failed too .*production needs a person"):
        publish(target, new, history, lambda url: MISS)
    adopted, entry = history.entries()
    assert adopted.outcome != "rolled-back" and entry.outcome == "rolled-back"
    assert "rollback to entry 1 FAILED" in entry.reason and entry.restored is None
    assert entry.canary == MISS.summary
    assert target.deploys == [new, old]


def test_a_canary_that_fails_with_no_earlier_good_config_says_production_needs_a_person(tmp_path):
    target, history = FakeTarget({}), History(tmp_path / "h")
    target.deployed = lambda: None  # nothing known runs: nothing to adopt
    with pytest.raises(AutotuneError, match="no earlier good config"):
        publish(target, {"max_num_seqs": 64}, history, lambda url: MISS)
    [entry] = history.entries()
    assert entry.outcome == "rolled-back" and "no earlier good config" in entry.reason


def test_rollback_to_n_deploys_that_entry_and_records_it(tmp_path):
    a, b, c = {"max_num_seqs": 8}, {"max_num_seqs": 16}, {"max_num_seqs": 32}
    target, history = FakeTarget(a), History(tmp_path / "h")
    assert publish(target, b, history, lambda url: PASS).ok
    assert publish(target, c, history, lambda url: PASS).ok
    assert [e.number for e in history.entries()] == [1, 2, 3]
    entry = rollback(target, history, to=1)
    assert target.running == a and entry.number == 4 and entry.source == {"rollback_to": 1, "by": "hand"}
    assert rollback(target, history, to=1) is None  # already running it: nothing restarts
    assert len(target.deploys) == 3
    entry = rollback(target, history, to=2)
    assert target.running == b and entry.values == b


# --- the daemon judges no window of fewer than 20 finished requests (autotune/daemon/loop.py MIN_REQUESTS) ----



class _Window:
    def __init__(self, requests, dt, saturated=False, offered=False):
        self.requests, self.saturated, self.dt, self.request_rate = requests, saturated, dt, requests / dt
        self.offered = offered  # the proxy's log counted users' requests

    def slo_compliance(self, slos):
        return []


class _Watcher:
    def __init__(self, window):
        self.window, self.consecutive_errors, self.url = window, 0, "http://127.0.0.1:1"

    def poll(self):
        return self.window

    def since_change(self, min_span_s):
        return None  # one level of traffic through the window

    def recent(self, span_s):
        return None  # too few scrapes to say


@pytest.mark.parametrize("requests, saturated, expect", [
    (19, False, (None, None, False)),  # too few to judge anything
    (19, True, (None, True, True)),  # too few finish, but the queue never empties: saturated is a breach
])
def test_a_window_below_the_20_request_minimum_says_nothing_but_saturation(daemon_file, monkeypatch, requests,  # noqa: F811
                                                                          saturated, expect):
    assert loop.MIN_REQUESTS == 20
    d = loop.Daemon(load_daemon_config(daemon_file()))
    monkeypatch.setattr(d, "watcher", _Watcher(_Window(requests, d.cfg.window_s, saturated)))  # a whole window
    monkeypatch.setattr(d, "_scrape_news", lambda: None)
    fingerprinted = []
    monkeypatch.setattr(loop.Fingerprint, "of", staticmethod(lambda w, recent=None: fingerprinted.append(w) or 1 / 0))
    o = d._observe()
    assert (o.drift, o.breach, o.saturated) == expect and fingerprinted == []


@pytest.mark.parametrize("window", [
    lambda dt: _Window(20, dt),
    # fewer finished, but the proxy counted what users sent to a saturated production: that is the demand to imitate
    lambda dt: _Window(3, dt, saturated=True, offered=True),
])
def test_a_window_of_20_requests_or_of_a_saturated_production_the_proxy_counts_is_fingerprinted(  # noqa: F811
        daemon_file, monkeypatch, window):
    d = loop.Daemon(load_daemon_config(daemon_file()))
    monkeypatch.setattr(d, "watcher", _Watcher(window(d.cfg.window_s)))
    monkeypatch.setattr(d, "_scrape_news", lambda: None)

    class Reached(Exception):
        pass

    def of(w, recent=None):
        raise Reached

    monkeypatch.setattr(loop.Fingerprint, "of", staticmethod(of))
    with pytest.raises(Reached):
        d._observe()


def test_the_watcher_gauges_reach_the_exported_metrics(daemon_file, monkeypatch):  # noqa: F811
    """autotune_production_request_rate, _slo_value, _slo_met and _scrape_errors, as the loop sets them."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    d = loop.Daemon(load_daemon_config(daemon_file()))
    slo = SimpleNamespace(text="ttft<500ms", is_latency=True)
    window = _Window(6, d.cfg.window_s)
    window.slo_compliance = lambda slos: [SimpleNamespace(slo=slo, value=0.812, holds=False)]
    watcher = _Watcher(window)
    watcher.consecutive_errors, watcher.last_error = 2, "connection refused"
    monkeypatch.setattr(d, "watcher", watcher)
    d._observe()
    text = generate_latest(d.metrics.registry).decode()
    assert f"autotune_production_request_rate {6 / d.cfg.window_s!r}" in text
    assert 'autotune_production_slo_value{slo="ttft<500ms"} 0.812' in text
    assert 'autotune_production_slo_met{slo="ttft<500ms"} 0.0' in text
    assert "autotune_production_scrape_errors_total 1.0" in text
