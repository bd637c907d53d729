"""A saturated production hides its demand from /metrics, end to end (issue 15, found by the daemon's soak).

vLLM counts no aborted request in ``request_success_total`` (vllm-project/vllm#31503, #55634), so a production
that cannot keep up finishes what it can serve, whatever users send: the daemon read 0.66 req/s while users sent
4, tuned for that, and no trigger fired, because the requests that did finish met the SLO. Here production is a
vllm-sim (an A10 serving in real time; only its start-up is sped up) with four sequences at a time, which serves
about half of what its users send, under an SLO the finished requests meet: the daemon must read the demand from the backlog's growth, and tune because requests queue.

Users who give up hide even the backlog (vLLM aborts what they asked for): then only the proxy in front of production
counts them, in the shipped nginx snippet's arrivals log (issue 30, item 1).
"""

import time
from dataclasses import replace

import httpx
import pytest

from autotune.daemon.state import Phase
from tests.bluegreen_rig import Nginx
from tests.conftest import free_port
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


GIVE_UP_S = 2.0  # users' own timeout: past it they close the connection, and vLLM aborts what they asked for


class GivingUpUsers(LongerUsers):
    """LongerUsers through the proxy, who give up after GIVE_UP_S: what production never finishes, /metrics never
    counts (an aborted request is in no counter, and it leaves the queue, so the backlog does not grow either)."""

    def __init__(self, port: int, rate: float) -> None:
        super().__init__(port, rate)
        self._client.close()
        self._client = httpx.Client(timeout=GIVE_UP_S, limits=httpx.Limits(max_connections=256))


def test_a_saturated_production_whose_users_give_up_is_tuned_for_what_they_send_through_the_proxy(saturated):
    prod = saturated
    nginx = Nginx(prod.root / "nginx", free_port(), prod.root / "nginx" / "vllm-upstream.conf")
    nginx.upstream_file.parent.mkdir(parents=True)
    nginx.upstream_file.write_text(f"server 127.0.0.1:{prod.port} max_fails=0;\n")
    nginx.start()
    try:
        path = prod.write()
        path.write_text(path.read_text().replace('slos = ["ttft<500ms"]', 'slos = ["ttft<60s"]')
                        .replace("[watch]\n", f'[watch]\narrivals_log = "{nginx.arrivals_log}"\n'))
        with GivingUpUsers(nginx.port, RATE) as users:
            # the proxy logs a request when it ends: a user who gives up shows GIVE_UP_S after arriving, so the
            # daemon starts watching once that lag is behind (a 4 s window here; minutes, in production)
            time.sleep(GIVE_UP_S + 1.0)
            d = prod.daemon()
            seen = ticks(d, 90, until=lambda d: d.state.phase is not Phase.WATCHING)
        window = d.watcher.window()
    finally:
        nginx.stop()
    assert d.state.phase is Phase.TUNING, seen
    assert d.state.trigger.startswith("production saturated"), seen
    assert users.failed > 0  # they did give up
    fp = d.fingerprint
    assert fp.offered and fp.saturated and fp.request_rate == pytest.approx(RATE, rel=0.25), fp
    # what /metrics alone would have said: what finished, plus a queue that the aborts keep from growing
    metrics_only = replace(window, proxy_arrived=None, proxy_failed=None)
    assert metrics_only.arrival_rate < 0.8 * RATE, (metrics_only.arrival_rate, window)
    assert window.proxy_failed > 0
    assert (f"imitating {fp.request_rate:.2f} req/s (users' requests at the proxy, production could not keep up)"
            in d.state.note), d.state.note
