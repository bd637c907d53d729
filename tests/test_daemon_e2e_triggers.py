"""The drift and schedule triggers end to end: vllm-sim production's real /metrics, users' real traffic, the
daemon's own ticks (only the tuning's child process is not spawned: what is under test is why and when a tuning
starts, and the study it is given).

- drift: users double their rate after a full window; the fingerprint moves past the threshold and a tuning
  starts for the new rate, said with its numbers;
- schedule: with ``every`` past since the last tuning, a tuning starts on steady traffic, and the trigger says how
  long it has been.
"""

import re
import time

import pytest

from autotune.daemon.state import DaemonState, Phase
from autotune.study.definition import load_study
from tests.test_daemon_e2e import RATE, Prod, Users, running, ticks, watched_a_full_window


@pytest.fixture
def prod(tmp_path, tiny_model, state_dir):
    """Production with room for its users at 2x their rate (16 sequences): a drift, not a saturation."""
    yield from running(tmp_path, tiny_model, max_num_seqs=16)


def _no_child(d) -> list[str]:
    """The tuning's child process is not started; the triggers that would start one are kept in order."""
    started: list[str] = []
    d.tuning.spawn = lambda: started.append(d.state.trigger)
    return started


def test_users_doubling_their_rate_start_a_drift_tuning_for_the_new_rate(prod: Prod):
    prod.write()
    d = prod.daemon()
    started = _no_child(d)
    with Users(prod.port, RATE):
        ticks(d, 30, until=watched_a_full_window)
        assert watched_a_full_window(d), d.state.note
        tuned = d.state.tuned_fingerprint["request_rate"]
        assert tuned == pytest.approx(RATE, rel=0.3)
        ticks(d, 12)  # steady traffic: no drift
        assert started == [] and d.state.phase is Phase.WATCHING, d.state.note
    with Users(prod.port, 2 * RATE):
        seen = ticks(d, 30, until=lambda d: bool(started))
    assert started and started[0].startswith("traffic drift "), seen
    # "traffic drift 0.62 > 0.50", or at a score that rounds to the threshold
    # "traffic drift 0.502 reached the threshold (0.50)" (state.decide never writes "0.50 > 0.50")
    said = re.fullmatch(r"traffic drift (\d\.\d+)(?: > | reached the threshold \()(\d\.\d\d)\)?", started[0])
    assert said, started
    score, threshold = said.groups()
    assert float(score) > 0.5 and threshold == "0.50", started
    exported = d.metrics.registry.get_sample_value("autotune_traffic_drift_score")
    assert exported == pytest.approx(float(score), abs=0.005), (exported, score)
    assert d.state.phase is Phase.TUNING and "imitating" in d.state.note and "at least" not in d.state.note, seen
    # the tuning imitates the new traffic (its window may still hold a little of the old), not the tuned one
    assert d.fingerprint.request_rate > 1.4 * tuned, (d.fingerprint, tuned)
    assert f"imitating {d.fingerprint.request_rate:.2f} req/s" in d.state.note
    assert load_study(d.state.study_file).name == d.state.study_name  # the study it was given loads


def test_a_tuning_is_scheduled_once_every_has_passed(prod: Prod):
    path = prod.write()
    path.write_text(path.read_text().replace('every = "0"', 'every = "1d"'))
    d = prod.daemon()
    started = _no_child(d)
    with Users(prod.port, RATE):
        ticks(d, 30, until=watched_a_full_window)
        ticks(d, 3)
        assert started == [], started  # the last tuning is recent (none yet: nothing is scheduled from nothing)
        two_days_ago = time.time() - 2 * 86400
        d.state = d.store.save(DaemonState(phase=Phase.WATCHING, since=two_days_ago, tunings=1,
                                           last_tuning_end=two_days_ago, tuned_fingerprint=d.state.tuned_fingerprint))
        seen = ticks(d, 10, until=lambda d: bool(started))
    assert started == ["scheduled: 2.0 days since the last tuning"], seen
    assert d.state.phase is Phase.TUNING and d.state.tunings == 2
