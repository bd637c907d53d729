"""The SLO breach trigger end to end: vllm-sim production's real /metrics, users' real traffic, the daemon's own
ticks (the tuning's child process is not spawned: what is under test is why a tuning starts).

Production keeps up with its users (16 sequences for 8 req/s: no queue, so no saturation), but every request's
TTFT is over the operator's SLO (the API server's path alone is longer). Windows of missed SLOs must start a
tuning once they are ``breach_windows`` (3) in a row, said as such, and not as a drift or a saturation.
"""

import pytest

from autotune.daemon.state import Phase
from tests.test_daemon_e2e import Prod, Users, running, ticks
from tests.test_daemon_e2e_triggers import _no_child

RATE = 8.0  # 32 requests in a 4 s window: above the 20 a window needs before it judges the SLOs


@pytest.fixture
def prod(tmp_path, tiny_model, state_dir):
    yield from running(tmp_path, tiny_model, max_num_seqs=16)


def test_slos_missed_in_three_windows_in_a_row_start_a_tuning(prod: Prod):
    path = prod.write()
    path.write_text(path.read_text().replace('slos = ["ttft<500ms"]', 'slos = ["ttft<20ms"]'))
    d = prod.daemon()
    started = _no_child(d)
    streaks: list[int] = []

    def watch(d) -> bool:
        streaks.append(d.state.breach_streak)
        return bool(started)

    with Users(prod.port, RATE) as users:
        seen = ticks(d, 60, until=watch)
    assert users.failed == 0
    assert started == ["SLO missed in 3 windows in a row"], seen
    assert d.state.phase is Phase.TUNING, seen
    # the streak grew a window at a time before it fired: 1 and 2 were seen, not a jump to 3
    assert {1, 2} <= set(streaks), streaks
    assert d.fingerprint is not None and not d.fingerprint.saturated, d.fingerprint
