"""A saturated production hides its demand from /metrics, end to end (issue 15, found by the daemon's soak).

vLLM counts no aborted request in ``request_success_total`` (vllm-project/vllm#31503, #55634), so a production
that cannot keep up finishes what it can serve, whatever users send: the daemon read 0.66 req/s while users sent
4, tuned for that, and no trigger fired, because the requests that did finish met the SLO. Here production is a
vllm-sim (an A10 serving in real time; only its start-up is sped up) with four sequences at a time, which serves
about half of what its users send, under an SLO the finished requests meet: the daemon must read the demand from the backlog's growth, and tune because requests queue.
"""

import time

import httpx
import pytest

from autotune.daemon.state import Phase
from tests.test_daemon_e2e import Users, running, ticks

RATE = 14.0  # users' requests per second: about twice what four sequences at a time serve here
TOKENS = 16


class LongerUsers(Users):
    """The e2e users, asking for TOKENS tokens each: the engine, not the front-end, is what runs out."""

    def _one(self) -> None:
        try:
            r = self._client.post(self.url, json={"model": "llama-3.1-8b", "prompt": "hello " * 40,
                                                  "max_tokens": TOKENS, "ignore_eos": True})
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        with self._lock:
            self.failed += not ok


@pytest.fixture
def saturated(tmp_path, tiny_model, state_dir):
    yield from running(tmp_path, tiny_model, max_num_seqs=4)


def test_a_saturated_production_is_tuned_for_what_users_send(saturated):
    prod = saturated
    path = prod.write()
    # an SLO the finished requests meet: only the queue can tell that users wait
    path.write_text(path.read_text().replace('slos = ["ttft<500ms"]', 'slos = ["ttft<60s"]'))
    d = prod.daemon()
    with LongerUsers(prod.port, RATE) as users:
        seen = ticks(d, 90, until=lambda d: d.state.phase is not Phase.WATCHING)
        sent, t_sent = users.sent, time.monotonic()
    assert d.state.phase is Phase.TUNING, seen
    assert d.state.trigger.startswith("production saturated: requests queued through 3 windows in a row"), seen
    fp = d.fingerprint
    served = fp.requests / fp.window_s
    # what finished is what the engine could serve; demand is what users sent
    assert served < 0.75 * RATE, (served, fp)
    assert fp.saturated and fp.request_rate == pytest.approx(RATE, rel=0.25), (fp, sent, t_sent)
    assert f"imitating {fp.request_rate:.2f} req/s (at least: production could not keep up)" in d.state.note
