"""What starts the cooldown (issue 15): a tuning that reached a verdict does, and says so; one that reached none
(every trial failed to start, the child failed or was interrupted) does not, and its trigger is retried after a
backoff instead of every tick.

The daemon's own ``TuningPhase.finish`` and ``tick`` against a production that does not answer (tests/
test_daemon_decisions.py's file); the study's result is made up, as there.
"""

from dataclasses import replace

import pytest
from optuna.trial import TrialState

from autotune.daemon import tuning_phase
from autotune.daemon.config import load_daemon_config
from autotune.daemon.loop import Daemon
from autotune.daemon.state import DaemonState, Observation, Phase, decide
from autotune.study.records import Attr, StudyResult, TrialRecord
from tests.test_daemon_decisions import _fingerprint, daemon_file, tie_with_production_one_run_each  # noqa: F401

H = 3600.0
TUNED = {"request_rate": 1.0}  # the traffic production's config was tuned for, before this tuning


def _failed_to_start():
    """Every trial crashed or timed out before its engine served: nothing measured."""
    def crashed(n, state):
        return TrialRecord(n, state, {"max_num_seqs": 8}, (), {Attr.FAILURE_CLASS: "crashed", Attr.CAPACITY_RPS: 0.0})
    return StudyResult([crashed(0, TrialState.PRUNED), crashed(1, TrialState.PRUNED), crashed(2, TrialState.FAIL)],
                       False, None, None)


@pytest.fixture
def tuning_daemon(daemon_file, capsys):  # noqa: F811 (daemon_file: a fixture)
    d = Daemon(replace(load_daemon_config(daemon_file()), tuning_windows=()))
    d.cfg = replace(d.cfg, triggers=replace(d.cfg.triggers, cooldown_s=6 * H))
    d.state = d.store.save(DaemonState(phase=Phase.TUNING, study_name="prod-tune-001", trigger="traffic drift 0.90 > "
                                       "0.50", tuned_fingerprint=TUNED, tunings=1))
    capsys.readouterr()
    return d


def _decide(d, now, manual=None):
    return decide(d.state, Observation(0.9, False), now=now, drift_threshold=0.5, breach_windows=3, every_s=7 * 86400,
                  cooldown_s=d.cfg.triggers.cooldown_s, in_window=True, manual=manual)


def test_a_tuning_that_measured_nothing_starts_no_cooldown_and_retries_after_a_backoff(tuning_daemon,
                                                                                        capsys):
    d = tuning_daemon
    d.read_result = lambda storage, name: _failed_to_start()
    d.tuning.finish(1)  # `autotune study` says "no trial met every SLO"
    st = d.state
    assert st.phase is Phase.WATCHING
    assert st.last_tuning_end == 0.0, "a tuning that measured nothing started the cooldown"
    assert st.tuned_fingerprint == TUNED  # production's config was not tuned for the new traffic
    said = capsys.readouterr().out
    assert ("watching: tuning prod-tune-001 measured nothing (trials: 1 fail, 2 pruned): no verdict, so no cooldown; "
            "its trigger is tried again in 10 min") in said, said
    assert st.retry_at == pytest.approx(st.since + tuning_phase.RETRY_S, abs=2)

    held = _decide(d, st.since + 60)
    assert held.trigger is None and held.waiting.endswith("the last tuning reached no verdict, tried again in 9 min")
    assert _decide(d, st.since + 60, manual="by hand").trigger == "requested: by hand"  # a person is not held
    assert _decide(d, st.since + tuning_phase.RETRY_S + 1).trigger == "traffic drift 0.90 > 0.50"

    # a second one in a row waits twice as long; one that reached a verdict ends the streak
    d.state = d.store.save(replace(d.state, phase=Phase.TUNING))
    d.tuning.finish(143)  # interrupted (the child was signalled) before anything was measured
    assert d.state.empty_tunings == 2 and d.state.last_tuning_end == 0.0
    assert d.state.retry_at == pytest.approx(d.state.since + 2 * tuning_phase.RETRY_S, abs=2)
    assert "failed (exit 143); see its log" in d.state.note and "tried again in 20 min" in d.state.note


def test_a_tuning_that_published_nothing_starts_the_cooldown_and_says_so(tuning_daemon, capsys):
    d = tuning_daemon
    d.state = d.store.save(replace(d.state, empty_tunings=2, retry_at=1.0))
    d.read_result = lambda storage, name: tie_with_production_one_run_each()
    d.tuning.finish(0)
    st = d.state
    assert st.phase is Phase.WATCHING and d.publishing.job is None
    assert st.last_tuning_end == pytest.approx(st.since, abs=2)  # hysteresis: the same drift does not re-tune now
    assert (st.empty_tunings, st.retry_at) == (0, 0.0)
    said = capsys.readouterr().out
    assert "production's config stays" in said
    assert "; triggers wait out the cooldown (6 h), `autotune retune` does not" in said, said
    assert "held by the cooldown for 6 h" in _decide(d, st.since + 1).waiting
