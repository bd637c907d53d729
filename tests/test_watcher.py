"""The production watcher against vllm-sim's /metrics (vLLM 0.33's names, labels and buckets).

Requests go to the simulator as token-id prompts, so their lengths and shared prefixes are
exact: the counts the watcher reads back can be asserted exactly, the quantiles within the
histogram bucket they fall in.
"""

from __future__ import annotations

import itertools
import json
import math
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from autotune.daemon.fingerprint import Fingerprint, drift, drift_features, workload_from
from autotune.daemon.prometheus import Histogram, Snapshot, parse_metrics, scrape
from autotune.daemon.watcher import Watcher
from autotune.daemon.window import Window
from autotune.workload.prompts import PromptBuilder, load_tokenizer, materialize
from autotune.measure.replay import ReplayOptions, run_replay
from autotune.measure.slo import parse_slos
from autotune.workload.trace import read_workload, write_trace
from tests.conftest import free_port

MODEL = "llama-3.1-8b"
_ids = itertools.count(1000)  # fresh token ids: no accidental prefix sharing between tests


def fresh(n: int) -> list[int]:
    return [next(_ids) for _ in range(n)]


@pytest.fixture(scope="module")
def sim(vllm_sim) -> str:
    return vllm_sim


def stream_completion(client: httpx.Client, prompt: list[int], max_tokens: int) -> float:
    """Send one streamed completion; the client-side TTFT."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    t = time.perf_counter()
    ttft = None
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {") and ttft is None:
                ttft = time.perf_counter() - t
    assert ttft is not None
    return ttft


def bucket_containing(h: Histogram, x: float) -> tuple[float, float]:
    lo = 0.0
    for le, _ in h.buckets:
        if x <= le:
            return lo, le
        lo = le
    raise AssertionError("no bucket")


# --- against the simulator ------------------------------------------------------------------------

def test_window_reads_what_was_sent(sim):
    prefix = fresh(256)  # 16 whole blocks of 16: every request after the first finds them cached
    with httpx.Client(base_url=sim, timeout=30, trust_env=False) as client:
        s0 = scrape(sim, client)
        ttfts = [stream_completion(client, prefix + fresh(44), 20) for _ in range(6)]
        ttfts += [stream_completion(client, fresh(1000), 50) for _ in range(4)]
        s1 = scrape(sim, client)
    w = Window.between(s0, s1)
    assert not w.reset and w.dt > 0
    # counts are exact
    assert w.requests == 10
    assert w.counters["prompt_tokens"] == 6 * 300 + 4 * 1000
    assert w.counters["generation_tokens"] == 6 * 20 + 4 * 50
    assert w.counters["requests_failed"] == 0
    assert w.request_rate == pytest.approx(10 / w.dt)
    assert w.histograms["ttft"].count == 10 and w.histograms["e2e"].count == 10
    # means come from sums: exact
    assert w.prompt_tokens_mean == pytest.approx(580)
    assert w.output_tokens_mean == pytest.approx(32)
    # percentiles: within the 1-2-5 bucket the true value lies in (true p50 300, p90 1000; outputs 20 and 50)
    assert 200 < w.prompt_tokens_p50 <= 500
    assert 500 < w.prompt_tokens_p90 <= 1000
    assert 10 < w.output_tokens_p50 <= 20
    assert 20 < w.output_tokens_p90 <= 50
    # prefix cache: five requests found the 256-token prefix; every prompt token was looked up once
    assert w.prefix_cache_hit_rate == pytest.approx(5 * 256 / 5800)
    # TTFT: the server's clock starts later and stops earlier than the client's, never the other way
    h = w.histograms["ttft"]
    assert h.sum <= sum(ttfts) + 1e-6
    assert h.sum >= sum(ttfts) - 10 * 0.1  # at most 100 ms of HTTP and Python a request on these cores
    for q in (0.5, 0.9):
        lo, _ = h.bucket_of(q)
        client_q = float(np.quantile(ttfts, q, method="inverted_cdf"))
        assert lo <= client_q  # the server's q-quantile is at most the client's
        assert 0 < w.quantile("ttft", q) <= bucket_containing(h, client_q)[1]
    # gauges are read too (idle now)
    assert w.gauges["running"] == 0 and w.gauges["waiting"] == 0 and 0 <= w.gauges["kv_cache_usage"] <= 1

    est = {e.slo.key: e for e in w.slo_compliance(parse_slos(
        ["ttft<10s", "p50:ttft<0.5ms", "mean:e2e<60s", "p99:tpot<1s", "itl<5s", "goodput>1", "rps>0.001",
         "throughput>1000000000tok/s"]))}
    assert est["p95_ttft"].holds is True and est["p95_ttft"].samples == 10 and est["p95_ttft"].certain
    assert est["p50_ttft"].holds is False  # a prefill takes longer than half a millisecond
    assert est["mean_e2e"].holds is True and est["mean_e2e"].value == pytest.approx(w.histograms["e2e"].mean)
    assert est["p99_tpot"].holds is True
    assert est["p95_itl"].holds is True and est["p95_itl"].samples == 6 * 19 + 4 * 49  # one gap a token after the first
    assert est["goodput"].holds is None and est["goodput"].value is None and "goodput" in est["goodput"].note
    assert est["rps"].holds is True and est["rps"].value == pytest.approx(10 / w.dt)
    assert est["throughput"].holds is False and est["throughput"].value == pytest.approx(320 / w.dt)

    fp = Fingerprint.of(w)
    assert fp.requests == 10 and fp.window_s == pytest.approx(w.dt) and fp.prompt_tokens_mean == pytest.approx(580)
    assert Fingerprint.from_json(json.dumps(fp.to_json())) == fp


def test_idle_window_and_latency_slos_without_samples(sim):
    with httpx.Client(base_url=sim, timeout=30, trust_env=False) as client:
        s0 = scrape(sim, client)
        time.sleep(0.05)
        s1 = scrape(sim, client)
    w = Window.between(s0, s1)
    assert w.requests == 0 and w.request_rate == 0
    assert w.prompt_tokens_mean is None and w.quantile("ttft", 0.95) is None and w.prefix_cache_hit_rate is None
    (e,) = w.slo_compliance(parse_slos(["ttft<1s"]))
    assert e.holds is None and e.samples == 0 and e.value is None
    fp = Fingerprint.of(w)
    assert fp.request_rate == 0 and fp.prompt_tokens_p90 is None
    assert Fingerprint.from_json(fp.to_json()) == fp
    with pytest.raises(KeyError, match="not a watched histogram"):
        w.quantile("vllm:time_to_first_token_seconds", 0.5)


def test_watcher_polls_and_survives_errors(sim):
    port = free_port()  # nothing listens there
    with Watcher(f"http://127.0.0.1:{port}", window_s=60, timeout=1) as dead:
        assert dead.poll() is None and dead.poll() is None
        assert dead.errors == 2 and dead.consecutive_errors == 2 and "ConnectError" in dead.last_error
    with Watcher(sim, window_s=60, keep=4) as w:
        assert w.poll() is None  # one snapshot: nothing to compare yet
        with httpx.Client(base_url=sim, timeout=30, trust_env=False) as client:
            stream_completion(client, fresh(100), 5)
        win = w.poll()
        assert win is not None and win.requests == 1 and w.errors == 0
        for _ in range(5):
            w.poll()
        assert len(w.snapshots) == 4  # a ring
        # younger than window_s: the window reaches back to the oldest snapshot kept
        assert w.window().t0 == w.snapshots[0].t
    with httpx.Client(base_url=sim, timeout=5, trust_env=False) as client:
        text = client.get("/metrics").text
    assert parse_metrics(text).counters["requests"] >= 1


def test_workload_from_replays_like_the_fingerprint(sim, tiny_model):
    """The purpose of it all: replaying the synthetic workload gives production's fingerprint back."""
    fp = Fingerprint(request_rate=25.0, prompt_tokens_mean=400.0, prompt_tokens_p50=350.0, prompt_tokens_p90=700.0,
                     output_tokens_mean=24.0, output_tokens_p50=20.0, output_tokens_p90=40.0,
                     prefix_cache_hit_rate=0.5, window_s=300.0, requests=7500)
    wl = workload_from(fp, requests=120, seed=7, max_model_len=4096)
    wl = materialize(wl, PromptBuilder(load_tokenizer(tiny_model)), seed=11)
    with httpx.Client(base_url=sim, timeout=30, trust_env=False) as client:
        s0 = scrape(sim, client)
        rep = run_replay(sim, wl, ReplayOptions(warmup_requests=0, model=MODEL))
        s1 = scrape(sim, client)
    assert all(r.success for r in rep.results)
    w = Window.between(s0, s1)
    got = Fingerprint.of(w)
    assert w.requests == 120
    # lengths are the workload's own, exactly (the server counts the same tokenizer's tokens)
    assert got.prompt_tokens_mean == pytest.approx(np.mean([r.prompt_tokens for r in wl.requests]), rel=0.02)
    assert got.output_tokens_mean == pytest.approx(np.mean([r.output_tokens for r in wl.requests]))
    # ... and like the fingerprint, within sampling error
    d = drift_features(fp, got)
    assert d["prompt_tokens_mean"] < 0.15 and d["output_tokens_mean"] < 0.15
    assert d["prompt_tokens_p90"] < 0.3 and d["output_tokens_p90"] < 0.3
    # each group's first request misses, and the cache hits whole blocks only: a little lower
    assert 0.35 < got.prefix_cache_hit_rate <= 0.5
    assert len(wl) / wl.span_s == pytest.approx(25.0, rel=0.3)


# --- pure: snapshots, windows, quantiles ----------------------------------------------------------

def snap(t: float, requests: float, prompt_buckets: tuple[float, ...], prompt_sum: float, hits: float = 0,
         queries: float = 0) -> Snapshot:
    les = (10.0, 100.0, 1000.0, math.inf)
    h = Histogram(tuple(zip(les, prompt_buckets)), prompt_buckets[-1], prompt_sum)
    return Snapshot(t, {"requests": requests, "prompt_tokens": prompt_sum, "prefix_cache_hits": hits,
                        "prefix_cache_queries": queries}, {"request_prompt_tokens": h}, {"running": 1.0})


def test_counter_reset_counts_the_new_process_from_zero():
    prev = snap(100.0, 1000, (100, 600, 1000, 1000), 250_000, hits=5000, queries=250_000)
    cur = snap(160.0, 30, (0, 20, 30, 30), 9_000, hits=4500, queries=9000)  # production restarted meanwhile
    w = Window.between(prev, cur)
    assert w.reset and w.requests == 30 and w.dt == 60
    assert w.request_rate == pytest.approx(0.5)
    assert w.prompt_tokens_mean == pytest.approx(300)
    assert w.prefix_cache_hit_rate == pytest.approx(0.5)
    normal = Window.between(prev, snap(160.0, 1030, (100, 620, 1030, 1030), 259_000, hits=9500, queries=259_000))
    assert not normal.reset and normal.requests == 30 and normal.prompt_tokens_mean == pytest.approx(300)
    assert dict(normal.histograms["request_prompt_tokens"].buckets) == {10.0: 0, 100.0: 20, 1000.0: 30, math.inf: 30}

    w2 = Watcher("http://unused", window_s=30)
    assert w2.add(prev) is None
    assert not w2.add(snap(130.0, 1010, (100, 610, 1010, 1010), 253_000, hits=6000, queries=253_000)).reset
    after = w2.add(cur)
    assert after.reset and w2.resets == 1 and list(w2.snapshots) == [cur]  # the old process's history is gone
    w2.close()


def test_watcher_window_picks_the_newest_snapshot_old_enough():
    w = Watcher("http://unused", window_s=30, keep=100)
    for i in range(10):  # every 10 s, one request a second
        w.add(snap(10.0 * i, 10 * i, (0, 10 * i, 10 * i, 10 * i), 50.0 * 10 * i))
    win = w.window()
    assert (win.t0, win.t1) == (60.0, 90.0) and win.requests == 30 and win.request_rate == pytest.approx(1.0)
    w.close()


def queue(t: float, finished: float, running: float, waiting: float) -> Snapshot:
    return Snapshot(t, {"requests": finished}, {}, {"running": running, "waiting": waiting})


def test_a_saturated_production_shows_its_demand_and_its_queue():
    """vLLM counts no aborted request, so a production that cannot keep up finishes what it can serve, not what
    users send: demand is what finished plus the backlog's growth, and a queue that never empties is saturation."""
    w = Watcher("http://unused", window_s=100, keep=100)
    # 10 s scrapes; 1 request a second arrives, 0.2 a second finish: the waiting queue grows by 8 each scrape
    for i in range(11):
        w.add(queue(10.0 * i, 2.0 * i, 4.0, 8.0 * i))
    win = w.window()
    assert (win.t0, win.t1, win.scrapes) == (0.0, 100.0, 11)
    assert win.request_rate == pytest.approx(0.2) and win.arrivals == 100 and win.arrival_rate == pytest.approx(1.0)
    assert win.backlog_growth == 80 and win.saturated
    assert Fingerprint.of(win).request_rate == pytest.approx(1.0) and Fingerprint.of(win).saturated

    # a steady queue (clients give up as fast as new ones queue): no growth, but requests waited at every scrape
    steady = Watcher("http://unused", window_s=40, keep=100)
    for i in range(5):
        steady.add(queue(10.0 * i, 3.0 * i, 4.0, 30.0 + (i % 2)))
    win = steady.window()
    assert win.waiting_min == 30 and win.saturated and win.arrival_rate == pytest.approx(win.request_rate, abs=0.05)

    # a healthy production: a request waits now and then, the backlog ends where it began
    healthy = Watcher("http://unused", window_s=40, keep=100)
    for i, waiting in enumerate((0, 2, 0, 1, 0)):
        healthy.add(queue(10.0 * i, 10.0 * i, 3.0, waiting))
    win = healthy.window()
    assert win.waiting_min == 0 and not win.saturated
    assert win.arrivals == win.requests == 40 and win.arrival_rate == pytest.approx(1.0)

    # two scrapes with a queue at both ends say too little; a backlog that grew by 2 of 42 arrivals is noise
    short = Window.between(queue(0.0, 0.0, 3.0, 5.0), queue(10.0, 40.0, 3.0, 7.0))
    assert short.waiting_min == 5 and short.arrivals == 42 and not short.saturated
    # after a restart the new process began empty: its backlog grew from nothing
    restarted = Window.between(queue(0.0, 500.0, 8.0, 9.0), queue(10.0, 10.0, 4.0, 6.0))
    assert restarted.reset and restarted.arrivals == 20 and restarted.saturated
    # /metrics without the queue gauges: what finished is all it can say
    bare = Window.between(Snapshot(0.0, {"requests": 0.0}, {}, {}), Snapshot(10.0, {"requests": 30.0}, {}, {}))
    assert bare.arrivals == 30 and bare.waiting_min is None and not bare.saturated
    for x in (w, steady, healthy):
        x.close()


def test_histogram_quantile_is_prometheus_interpolation():
    h = Histogram(((1.0, 2), (2.0, 6), (5.0, 10), (math.inf, 10)), 10, 25.0)
    assert h.quantile(0.5) == pytest.approx(1.75)  # rank 5 in (1, 2]: 3 of its 4
    assert h.quantile(0.1) == pytest.approx(0.5)  # the first bucket starts at 0
    assert h.quantile(1.0) == pytest.approx(5.0)
    assert h.bucket_of(0.5) == (1.0, 2.0)
    tail = Histogram(((1.0, 2), (math.inf, 4)), 4, 10.0)
    assert tail.quantile(0.9) == 1.0  # in the +Inf bucket: the highest finite bound
    empty = Histogram(((1.0, 0), (math.inf, 0)), 0, 0.0)
    assert empty.quantile(0.5) is None and empty.mean is None
    with pytest.raises(ValueError):
        h.quantile(95)


def test_a_scrape_on_a_connection_the_server_drops_is_sent_again():
    """A kept-alive connection the server closes as the GET goes out (uvicorn's idle timeout on a busy loop):
    one more try on a new connection, not an error. A real socket server that reads the first request and closes."""
    body = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 2.0\n" \
           "# TYPE vllm:request_success_total counter\nvllm:request_success_total{engine=\"0\"} 5.0\n"
    served: list[str] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def serve() -> None:
            for answer in (False, True):
                conn, _ = server.accept()
                with conn:
                    served.append(conn.recv(65536).decode().split("\r\n", 1)[0])
                    if answer:
                        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                                     f"Connection: close\r\n\r\n{body}".encode())

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with httpx.Client(timeout=5, trust_env=False) as client:
            snap = scrape(f"http://127.0.0.1:{port}", client)
        thread.join(5)
    assert served == ["GET /metrics HTTP/1.1"] * 2
    assert snap.gauges["running"] == 2.0 and snap.counters["requests"] == 5.0


def test_parse_metrics_sums_over_labels_and_ignores_created():
    text = "\n".join([
        "# TYPE vllm:request_success_total counter",
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0',
        'vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 1.0',
        'vllm:request_success_total{engine="1",finished_reason="length",model_name="m"} 4.0',
        "# TYPE vllm:request_success_created gauge",
        'vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7e+09',
        "# TYPE vllm:time_to_first_token_seconds histogram",
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 2.0',
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3.0',
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 3.0',
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.9',
        'vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="m"} 1.0',
        'vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="m"} 1.0',
        'vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 1.0',
        'vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 0.05',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2',
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.4',
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 2',
        'vllm:num_requests_running{engine="1",model_name="m"} 3',
        "",
    ])
    s = parse_metrics(text, t=1.0)
    assert s.counters == {"requests": 8.0, "requests_failed": 1.0}
    h = s.histograms["ttft"]
    assert h.buckets == ((0.1, 3.0), (math.inf, 4.0)) and h.count == 4 and h.sum == pytest.approx(0.95)
    assert s.gauges["kv_cache_usage"] == pytest.approx(0.3) and s.gauges["running"] == 5


# --- pure: drift and synthetic workloads -----------------------------------------------------------

BASE = Fingerprint(request_rate=10.0, prompt_tokens_mean=800.0, prompt_tokens_p50=600.0, prompt_tokens_p90=1800.0,
                   output_tokens_mean=200.0, output_tokens_p50=150.0, output_tokens_p90=450.0,
                   prefix_cache_hit_rate=0.6, window_s=300.0, requests=3000)


def changed(**kw: float) -> Fingerprint:
    from dataclasses import replace

    return replace(BASE, **kw)


def test_drift_is_a_scale_free_distance():
    assert drift(BASE, BASE) == 0
    twice = changed(request_rate=20.0)
    assert drift(BASE, twice) == pytest.approx(math.log(2))
    assert drift(twice, BASE) == drift(BASE, twice)  # symmetric
    assert drift(BASE, changed(request_rate=5.0)) == pytest.approx(math.log(2))  # halving reads like doubling
    assert drift(BASE, changed(request_rate=11.0)) == pytest.approx(math.log(1.1))  # +10 % reads ~0.1
    steps = [drift(BASE, changed(prompt_tokens_mean=800.0 * f)) for f in (1.0, 1.2, 1.5, 3.0)]
    assert steps == sorted(steps) and steps[0] == 0  # grows with the change
    assert drift(BASE, changed(prefix_cache_hit_rate=0.4)) == pytest.approx(0.2)  # points of hit rate
    assert drift_features(BASE, changed(request_rate=20.0, output_tokens_p90=900.0)).keys() >= {
        "request_rate", "output_tokens_p90", "prefix_cache_hit_rate"}
    # missing features on one side are left out, an idle window still reads as a big change of rate
    idle = Fingerprint(0.0, None, None, None, None, None, None, None, 300.0, 0)
    assert drift(BASE, idle) == pytest.approx(math.log(10.0 / 0.01))
    assert drift(idle, idle) == 0


def test_fingerprint_json_round_trip():
    assert Fingerprint.from_json(json.dumps(BASE.to_json())) == BASE
    assert Fingerprint.from_json(BASE.to_json()) == BASE
    with pytest.raises(ValueError, match="unknown fingerprint field"):
        Fingerprint.from_json({**BASE.to_json(), "colour": 1})


def test_workload_from_matches_the_fingerprint(tmp_path):
    wl = workload_from(BASE, requests=4000, seed=3)
    prompts = np.array([r.prompt_tokens for r in wl.requests], dtype=float)
    outputs = np.array([r.output_tokens for r in wl.requests], dtype=float)
    prefixes = np.array([r.prefix_tokens for r in wl.requests], dtype=float)
    assert len(wl) == 4000
    assert (len(wl) - 1) / wl.span_s == pytest.approx(10.0, rel=0.05)
    assert prompts.mean() == pytest.approx(800, rel=0.05) and outputs.mean() == pytest.approx(200, rel=0.05)
    assert np.median(prompts) == pytest.approx(600, rel=0.15)
    assert np.quantile(prompts, 0.9) == pytest.approx(1800, rel=0.15)
    assert np.median(outputs) == pytest.approx(150, rel=0.15)
    assert np.quantile(outputs, 0.9) == pytest.approx(450, rel=0.15)
    assert prefixes.sum() / prompts.sum() == pytest.approx(0.6, abs=0.02)
    assert all(r.prefix_tokens < r.prompt_tokens for r in wl.requests)
    groups = {(r.prefix_group, r.prefix_tokens) for r in wl.requests if r.prefix_group}
    assert 1 < len(groups) <= 4 and len({g for g, _ in groups}) == len(groups)  # one length per group
    # deterministic, a valid trace, and capped by the context when asked
    assert workload_from(BASE, requests=50, seed=3) == workload_from(BASE, requests=50, seed=3)
    write_trace(wl, tmp_path / "t.jsonl")
    assert read_workload(tmp_path / "t.jsonl").requests == wl.requests
    capped = workload_from(BASE, requests=500, seed=1, max_model_len=1024)
    assert max(r.prompt_tokens + r.output_tokens for r in capped.requests) <= 1024
    plain = workload_from(changed(prefix_cache_hit_rate=None), requests=20, seed=1, api="chat")
    assert all(r.prefix_group is None and r.api == "chat" for r in plain.requests)
    from autotune.errors import ConfigError

    with pytest.raises(ConfigError, match="idle"):
        workload_from(changed(request_rate=0.0), requests=10, seed=0)


# --- issue 30, 1: a jump in the rate is imitated at the new rate, not at the window's blend ----------------------

def _arrivals(counts, every=10.0):
    """Snapshots ``every`` seconds apart, with ``counts`` requests finished between each and the next."""
    total, out = 0.0, [Snapshot(0.0, {"requests": 0.0}, {}, {})]
    for i, n in enumerate(counts, 1):
        total += n
        out.append(Snapshot(every * i, {"requests": total}, {}, {}))
    return out


def test_the_rate_after_a_jump_is_read_from_the_change_point():
    from autotune.daemon.window import level_change

    w = Watcher("http://unused", window_s=150, keep=100)
    for s in _arrivals([10] * 10 + [30] * 5):  # 1 req/s for 100 s, then 3 req/s for 50 s
        w.add(s)
    assert w.window().arrival_rate == pytest.approx(250 / 150)  # the blend: what the daemon imitated before
    now = w.since_change(min_span_s=20)
    assert (now.t0, now.t1) == (100.0, 150.0) and now.arrival_rate == pytest.approx(3.0)
    assert level_change(_arrivals([30] * 6 + [10] * 6), 20) == 6  # a drop is a change too
    w.close()


def test_the_newest_scrape_says_when_the_traffic_has_moved_from_a_fingerprints_rate():
    from autotune.daemon.window import moved_from

    def last(n, dt=1.0):  # n requests arrived in the newest dt seconds
        return Window(0.0, dt, {"requests": float(n)}, {}, {})

    assert moved_from(last(12), 6.13)  # one 1-s scrape into a 3 -> 12 req/s surge, against the window's blend
    assert not moved_from(last(12), 12.0) and not moved_from(last(4), 3.0)  # at the rate: settled
    assert not moved_from(last(7), 3.0)  # 2.3x, but seven requests in a second at 3 req/s is Poisson luck
    assert moved_from(last(0, dt=2.0), 3.0)  # nothing for 2 s where 6 were due: the traffic stopped
    assert not moved_from(last(110, dt=10.0), 10.0)  # 10 % off: no change of level, however sure


def test_steady_traffic_with_poisson_noise_has_no_change_point():
    import numpy as np

    from autotune.daemon.window import level_change

    rng = np.random.default_rng(7)
    for _ in range(50):
        counts = rng.poisson(10, size=20).tolist()  # 1 req/s in 10-s scrapes: its noise is no level change
        assert level_change(_arrivals(counts), 20) is None, counts
    assert level_change(_arrivals([10] * 19 + [13]), 10) is None  # too little after the split to say


def test_a_percentile_is_called_a_breach_only_when_its_whole_bucket_misses():
    # issue 30: 100 TPOTs between 25 and 50 ms (the clients measured about 33 ms): interpolation reads p95 48.75 ms
    h = Histogram(((0.025, 0.0), (0.05, 100.0), (math.inf, 100.0)), 100.0, 3.3)
    w = Window(0.0, 60.0, {"requests": 100.0}, {"tpot": h}, {})
    (inside,), (below,), (above,) = (w.slo_compliance(parse_slos([t])) for t in ("tpot<50ms", "tpot<40ms",
                                                                                  "tpot<20ms"))
    assert inside.value == pytest.approx(0.04875) and inside.holds is True and inside.certain
    # the target inside the bucket: the true p95 may be under it, so no false alarm, and it says why
    assert below.holds is True and not below.certain and "lies in 25-50 ms, across the target" in below.note
    # the whole bucket over the target: a breach for certain
    assert above.holds is False and above.certain and above.note == ""
