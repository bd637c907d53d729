"""The proxy's arrivals log (autotune/daemon/arrivals.py) and the windows made from it: users' demand, served or not.

Lines are written as nginx writes them with the shipped snippet's format (systemd/nginx-autotune.conf); the
real nginx writing them is tests/test_daemon_e2e_saturation.py's and tests/test_bluegreen.py's.
"""

import os
import re
from pathlib import Path

import pytest

from autotune.daemon.arrivals import LOG_FORMAT, ArrivalCount, ArrivalLog, counts
from autotune.daemon.prometheus import Snapshot
from autotune.daemon.watcher import Watcher
from autotune.daemon.window import Window, level_change

ROOT = Path(__file__).resolve().parent.parent


def line(status: int = 200, method: str = "POST", uri: str = "/v1/completions", t: float = 1.0) -> str:
    return f'{t:.3f} 0.412 {status} {method} "{uri}" 127.0.0.1:8001\n'


def test_the_shipped_snippet_writes_the_format_the_reader_parses():
    snippet = (ROOT / "systemd" / "nginx-autotune.conf").read_text()
    assert f"log_format autotune_arrivals '{LOG_FORMAT}';" in snippet
    assert re.search(r"access_log /var/log/nginx/autotune/arrivals\.log autotune_arrivals;", snippet)


@pytest.mark.parametrize(("text", "expected"), [
    (line(), (True, False)),
    (line(uri="/v1/chat/completions"), (True, False)),
    (line(499), (True, True)),  # the user gave up
    (line(504), (True, True)),
    (line(429), (True, True)),
    (line(400), (True, False)),  # a bad request is the user's, not production's failure
    (line(method="GET", uri="/metrics"), (False, False)),  # the watcher's own scrapes
    (line(method="GET", uri="/health"), (False, False)),
    (line(method="GET", uri="/v1/models"), (False, False)),
    ("garbage", (False, False)),
    ('1.0 0.1 abc POST "/v1/completions" -', (False, False)),
])
def test_a_line_counts_as_a_users_request_and_maybe_a_failed_one(text, expected):
    assert counts(text) == expected


def test_the_reader_starts_at_the_end_and_counts_only_whole_new_lines(tmp_path):
    path = tmp_path / "arrivals.log"
    path.write_text(line() * 5)  # before the daemon: not this window's traffic
    log = ArrivalLog(path)
    assert log.read() == ArrivalCount(0, 0)
    with path.open("a") as f:
        f.write(line() + line(499) + line(method="GET", uri="/metrics") + line()[:10])  # the last one half written
    assert log.read() == ArrivalCount(2, 1)
    with path.open("a") as f:
        f.write(line()[10:])
    assert log.read() == ArrivalCount(3, 1)


def test_a_rotation_loses_no_line_and_totals_only_grow(tmp_path):
    path = tmp_path / "arrivals.log"
    path.write_text("")
    log = ArrivalLog(path)
    log.read()
    with path.open("a") as f:
        f.write(line() * 2)
    os.rename(path, tmp_path / "arrivals.log.1")  # logrotate's rename...
    with (tmp_path / "arrivals.log.1").open("a") as f:
        f.write(line())  # ...nginx writes the old file until USR1 reopens its logs
    path.write_text(line(502) * 4)  # then the new one
    assert log.read() == ArrivalCount(7, 4)
    with path.open("a") as f:
        f.write(line())
    assert log.read() == ArrivalCount(8, 4)
    path.write_text(line())  # copytruncate: the same file, cut and written again
    assert log.read() == ArrivalCount(9, 4)
    log.close()


def test_a_missing_log_is_an_error_not_an_exception_and_counts_from_its_start_once_it_appears(tmp_path):
    path = tmp_path / "arrivals.log"
    log = ArrivalLog(path)
    assert log.read() == ArrivalCount(0, 0) and "No such file" in log.error
    path.write_text(line() * 3)  # nginx created it after the daemon started: every line is new
    assert log.read() == ArrivalCount(3, 0) and log.error is None
    log.close()


def snap(t: float, finished: float, arrived: int | None, failed: int = 0, waiting: float = 0.0) -> Snapshot:
    proxy = None if arrived is None else ArrivalCount(arrived, failed)
    return Snapshot(t, {"requests": finished}, {}, {"running": 4.0, "waiting": waiting}, proxy=proxy)


def test_a_window_counts_what_the_proxy_saw_where_metrics_only_see_what_finished():
    # production finished 40 in 10 s; users sent 100 (60 gave up and vLLM aborted them: no counter, no backlog)
    w = Window.between(snap(0, 100, 500, 10), snap(10, 140, 600, 70))
    assert w.offered and w.arrivals == 100 and w.arrival_rate == pytest.approx(10.0)
    assert w.request_rate == pytest.approx(4.0)
    assert w.saturated  # 60 of 100 failed at the proxy
    # the same window without the proxy: a lower bound, and nothing says production could not keep up
    blind = Window.between(snap(0, 100, None), snap(10, 140, None))
    assert not blind.offered and blind.arrival_rate == pytest.approx(4.0) and not blind.saturated
    # a few failures are not saturation (one in twenty at least, three at least)
    assert not Window.between(snap(0, 0, 0), snap(10, 100, 100, 2)).saturated
    assert Window.between(snap(0, 0, 0), snap(10, 100, 100, 5)).saturated


def test_the_proxys_count_holds_across_a_production_restart():
    w = Window.between(snap(0, 500, 1000), snap(10, 30, 1080))  # vLLM's counters restarted, the proxy's did not
    assert w.reset and w.arrivals == 80 + 4  # and the 4 running in the restarted engine, which began empty


def test_a_jump_users_make_is_found_in_the_proxys_count_though_production_finishes_the_same():
    # production serves 4 req/s throughout; users go from 4 to 12 req/s at t=30, and the extra give up
    snaps, arrived = [], 0
    for t in range(0, 61, 5):
        snaps.append(snap(t, 4.0 * t, arrived, failed=max(0, arrived - 4 * t)))
        arrived += 20 if t < 30 else 60
    assert level_change([snap(s.t, s.counters["requests"], None) for s in snaps], 10.0) is None
    k = level_change(snaps, 10.0)
    assert k is not None and snaps[k].t == 30.0


def test_the_watcher_reads_the_log_at_each_scrape(tmp_path):
    path = tmp_path / "arrivals.log"
    path.write_text("")
    scrapes = iter([Snapshot(0.0, {"requests": 0.0}, {}, {}), Snapshot(10.0, {"requests": 10.0}, {}, {})])
    with Watcher("http://x", window_s=10, scraper=lambda *a: next(scrapes), arrivals=ArrivalLog(path)) as w:
        assert w.poll() is None
        path.write_text(line() * 30)
        window = w.poll()
    assert window.offered and window.arrivals == 30 and window.requests == 10
