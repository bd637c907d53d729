"""The replay client over real HTTP streams, against the fixed-timing server (known TTFT/ITL)."""

import contextlib
import ctypes
import itertools
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from autotune.errors import MeasurementError
from autotune.measure.metrics import lost_already, summarize
from autotune.measure.replay import ReplayOptions, payload_for, run_replay
from autotune.measure.slo import parse_slo
from autotune.workload.trace import Request, Workload
from tests.conftest import free_port

TTFT_MS, ITL_MS = 40.0, 10.0


def own_session_dying_with_parent() -> None:
    """preexec_fn: a process group of its own, and SIGKILL when the process that started it dies (Linux), so
    that a test process killed mid-test (a timeout, a mutation-testing worker) leaves no server behind."""
    os.setsid()
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def fixed_timing_server(ttft_ms: float, itl_ms: float, *extra: str):
    """Run autotune.sim.fixed_timing in its own process group; its URL. The group is killed whatever happens."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "autotune.sim.fixed_timing", "--port", str(port),
                             "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms), *extra],
                            preexec_fn=own_session_dying_with_parent, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, f"the fixed-timing server exited with {proc.returncode}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the fixed-timing server did not answer /health"
            time.sleep(0.05)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def server():
    with fixed_timing_server(TTFT_MS, ITL_MS) as url:
        yield url


@pytest.fixture(scope="module")
def packed_server():
    """Like vLLM with --stream-interval 4: several tokens per SSE chunk."""
    with fixed_timing_server(TTFT_MS, ITL_MS, "--stream-interval", "4") as url:
        yield url


def workload(n, gap, out=5, api="completion", prompt="hello"):
    return Workload(tuple(Request(i * gap, out, prompt=prompt, api=api) for i in range(n)))


def truth(url):
    return httpx.get(url + "/truth").json()


def test_timings_match_the_server(server):
    rep = run_replay(server, workload(20, 0.05, out=6), ReplayOptions(warmup_requests=2))
    assert rep.model == "fixed-timing"
    assert all(r.success for r in rep.results)
    assert all(r.output_tokens == 6 and len(r.itl) == 5 for r in rep.results)
    t = truth(server)
    run = {k: v for k, v in t.items() if not k.startswith("w")}
    prefix = max(k.rsplit("-", 1)[0] for k in run)
    ttft_err = [abs(r.ttft - t[f"{prefix}-{r.index}"]["ttft"]) for r in rep.results]
    itl_err = [abs(a - b) for r in rep.results for a, b in zip(r.itl, t[f"{prefix}-{r.index}"]["itl"])]
    assert statistics.median(ttft_err) < 0.010
    assert statistics.median(itl_err) < 0.005
    s = summarize(rep.results)
    assert s.completed == 20 and s.failed == 0
    assert s.ttft.p50 == pytest.approx(TTFT_MS / 1000, abs=0.015)
    assert s.tpot.p50 == pytest.approx(ITL_MS / 1000, abs=0.005)


@pytest.mark.parametrize("api", ["completion", "chat"])
def test_tokens_come_from_the_usage_chunk_not_the_chunk_count(packed_server, api):
    # 10 tokens as vLLM streams them with --stream-interval 4: chunks of 1, 4, 4 and 1 tokens
    rep = run_replay(packed_server, workload(6, 0.05, out=10, api=api), ReplayOptions(warmup_requests=0))
    assert all(r.success for r in rep.results)
    t = truth(packed_server)
    for r in rep.results:
        sizes = next(v["chunk_tokens"] for k, v in t.items() if k.endswith(f"-{r.index}"))
        assert len(r.itl) == len(sizes) - 1 < r.output_tokens - 1  # fewer chunks than tokens
        assert r.output_tokens == sum(sizes) == 10
    s = summarize(rep.results)
    assert s.output_tokens == 60
    # TPOT divides by tokens, not chunks: it is the server's per-token time, though chunks come 4 ITLs apart
    assert s.tpot.p50 == pytest.approx(ITL_MS / 1000, rel=0.3)
    assert s.itl.p50 == pytest.approx(4 * ITL_MS / 1000, rel=0.3)


def test_chat_api(server):
    rep = run_replay(server, workload(3, 0.0, out=4, api="chat"), ReplayOptions(warmup_requests=0))
    assert all(r.success and r.output_tokens == 4 for r in rep.results)


def test_open_loop_does_not_wait_for_earlier_requests(server):
    # each request takes ~40 + 39*10 = 430 ms; they arrive every 20 ms: request 5 is due 330 ms before
    # request 0 can end, a margin no VM stall of a few hundred ms closes
    rep = run_replay(server, workload(10, 0.02, out=40), ReplayOptions(warmup_requests=0))
    sends = [r.sent_s for r in rep.results]
    ends = [r.end_s for r in rep.results]
    assert sends[5] < ends[0]  # request 5 left before request 0 finished
    assert [r.scheduled_s for r in rep.results] == pytest.approx([i * 0.02 for i in range(10)])
    # sent on time: the median lag under half a request's 430 ms. A closed loop sends each request when the one
    # before it ends, ~410 ms later than scheduled per request before it: a median lag of ~1.8 s. A loaded CI host
    # delays an open loop's sends too (128 ms once, with six test workers on two cores), never by requests
    assert statistics.median(r.sent_s - r.scheduled_s for r in rep.results) < 0.215


def test_load_factor_scales_arrivals(server):
    rep = run_replay(server, workload(5, 0.2, out=2), ReplayOptions(load=4.0, warmup_requests=0))
    assert [r.scheduled_s for r in rep.results] == pytest.approx([i * 0.05 for i in range(5)])


def test_concurrency_cap_holds_requests_back(server):
    rep = run_replay(server, workload(4, 0.0, out=3), ReplayOptions(max_concurrency=1, warmup_requests=0))
    rs = sorted(rep.results, key=lambda r: r.sent_s)
    for a, b in zip(rs, rs[1:]):
        assert b.sent_s >= a.end_s - 0.002
    assert summarize(rep.results).send_lag.p99 > 0.05  # the cap shows as send lag


def test_failed_requests_are_counted_not_dropped(server):
    w = Workload((Request(0.0, 3, prompt="ok"), Request(0.01, 3, prompt="please FAIL"), Request(0.02, 3, prompt="ok")))
    rep = run_replay(server, w, ReplayOptions(warmup_requests=0))
    assert len(rep.results) == 3
    failed = [r for r in rep.results if not r.success]
    assert len(failed) == 1 and "HTTP 500" in failed[0].error
    s = summarize(rep.results)
    assert (s.completed, s.failed) == (2, 1)
    assert list(s.errors.values()) == [1]


def test_unreachable_server():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(MeasurementError, match="cannot list the served models"):
        run_replay(url, workload(1, 0.0))
    rep = run_replay(url, workload(2, 0.0), ReplayOptions(model="m", warmup_requests=0))
    assert [r.success for r in rep.results] == [False, False]
    assert all(r.error for r in rep.results)


def test_payload_shapes():
    path, body = payload_for(Request(0, 7, prompt="q", prefix="sys", prefix_tokens=3, prefix_group="g"), "m")
    assert path == "/v1/completions" and body["prompt"] == "sys\nq"
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    path, body = payload_for(Request(0, 7, prompt="q", prefix="sys", prefix_tokens=3, prefix_group="g", api="chat"), "m")
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]


def test_a_replay_that_gives_up_stops_sending_and_closes_what_is_in_flight():
    # every TTFT is 800 ms against a 300 ms SLO: once two requests waited 300 ms (numpy's p95 of 20 values lies
    # between the two largest), the step cannot pass whatever the rest do
    slos = [parse_slo("ttft<300ms")]
    with fixed_timing_server(800.0, 10.0) as url:
        rep = run_replay(url, workload(20, 0.1, out=5), ReplayOptions(warmup_requests=0),
                         give_up=lambda results, total, now: lost_already(slos, results, total, now))
    assert rep.cut.startswith("p95:ttft<300ms missed already: "), rep.cut
    assert 2 <= len(rep.results) < 20 and rep.wall_s < 1.9  # unsent requests stayed unsent; all 20: 2.7 s at least
    cut = [r for r in rep.results if not r.success]
    assert cut and all(r.error.startswith("cut: the step was already lost (p95:ttft<300ms") for r in cut)
    s = summarize(rep.results, slos)
    assert s.failed == len(cut)  # the step fails on its face too (session.Step.passed wants no failure)


def test_a_replay_that_can_still_pass_runs_to_its_end():
    slos = [parse_slo("ttft<1s")]
    asked = []

    def give_up(results, total, now):
        asked.append(now)
        return lost_already(slos, results, total, now)

    with fixed_timing_server(TTFT_MS, ITL_MS) as url:
        rep = run_replay(url, workload(10, 0.1, out=3), ReplayOptions(warmup_requests=0), give_up=give_up)
    assert rep.cut == "" and len(rep.results) == 10 and all(r.success for r in rep.results)
    assert len(asked) >= 2  # it was asked along the way, and said to go on


def test_sse_events_end_lines_only_where_server_sent_events_end_them():
    """CRLF, LF or CR end a line, a CRLF split across two reads included; U+2028, U+0085 and the other
    str.splitlines boundaries are text, as JSON carries them unescaped inside a token."""
    from autotune.measure.streams import SseEvents

    def events(*reads):
        e = SseEvents()
        return [x for r in reads for x in e.feed(r)] + e.close()

    data = 'data: {"text": "a\u2028b\x85c\x1cd"}'.encode()
    assert events(data + b"\r", b"\n\r\n", b"data: [DONE]\n\n") == [data[5:].strip(), b"[DONE]"]
    assert events(b"data: x\rdata: y\n", b"data: z") == [b"x", b"y", b"z"]
    assert events(b"da", b"ta: {\"a\"", b":1}\n", b": ping\n\n") == [b'{"a":1}']  # split anywhere; comments dropped


def test_a_token_with_a_unicode_line_separator_is_one_token_not_a_failed_request():
    """vLLM writes JSON with U+2028 unescaped (pydantic); a model that emits one (the tiny test model did, in CI)
    must not fail its request as "malformed SSE data"."""
    import asyncio
    import json as jsonlib

    from autotune.measure.metrics import RequestResult
    from autotune.measure.streams import Connections

    def chunk(obj):
        return b"data: " + jsonlib.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    body = (chunk({"choices": [{"index": 0, "text": "one\u2028two\x85"}]})
            + chunk({"choices": [{"index": 0, "text": " three"}]})
            + chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}) + b"data: [DONE]\n\n")
    assert "\u2028".encode() in body  # raw, as vLLM sends it

    async def go():
        from aiohttp import web

        async def stream(request):
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(body)
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", stream)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with Connections(f"http://127.0.0.1:{port}") as conns:
                result = RequestResult(index=0, scheduled_s=0.0, sent_s=0.0, success=False)
                await conns.stream("/v1/completions", b"{}", result)
                return result
        finally:
            await runner.cleanup()

    result = asyncio.run(go())
    assert result.success and result.error == "" and result.output_tokens == 2 and len(result.itl) == 1


def test_worker_processes_replay_one_schedule_and_merge_into_one_replay(server):
    """Requests split across two worker processes keep their send times; the merged replay has each request once,
    in the workload's order, timed as the server timed it, and on_result heard every one."""
    heard = []
    rep = run_replay(server, workload(24, 0.025, out=6), ReplayOptions(warmup_requests=2, workers=2),
                     on_result=heard.append)
    assert rep.workers == 2 and rep.model == "fixed-timing"
    assert [r.index for r in rep.results] == list(range(24)) and all(r.success for r in rep.results)
    assert sorted(r.index for r in heard) == list(range(24))
    assert [r.scheduled_s for r in rep.results] == pytest.approx([i * 0.025 for i in range(24)])
    assert statistics.median(r.sent_s - r.scheduled_s for r in rep.results) < 0.05
    t = truth(server)
    prefix = max(k.rsplit("-", 1)[0] for k in t if not k.startswith("w"))
    assert statistics.median(abs(r.ttft - t[f"{prefix}-{r.index}"]["ttft"]) for r in rep.results) < 0.010
    assert rep.loop_lag.count > 0  # both workers' loops watched themselves
    again = run_replay(server, workload(4, 0.01, out=2), ReplayOptions(warmup_requests=0, workers=2))
    assert again.workers == 2 and all(r.success for r in again.results)  # the same workers, a second replay


def test_a_replay_in_workers_that_gives_up_cuts_every_worker():
    slos = [parse_slo("ttft<300ms")]
    with fixed_timing_server(800.0, 10.0) as url:
        rep = run_replay(url, workload(20, 0.1, out=5), ReplayOptions(warmup_requests=0, workers=2),
                         give_up=lambda results, total, now: lost_already(slos, results, total, now))
    assert rep.cut.startswith("p95:ttft<300ms missed already: "), rep.cut
    assert 2 <= len(rep.results) < 20 and rep.wall_s < 1.9
    cut = [r for r in rep.results if not r.success]
    assert cut and all(r.error.startswith("cut: the step was already lost") for r in cut)


def test_a_starved_client_is_client_bound_and_its_miss_bounds_no_capacity(server):
    """An event loop kept busy (here: 150 ms of blocking work per finished request) reads the server's tokens late.
    The step at that load misses its TTFT SLO on the client's lag, not the server's: it is client-bound, its miss
    bounds nothing (the capacity below it is a floor), and the trial's line says so and what to do."""
    import optuna

    from autotune.measure.profiles import FixedLoad
    from autotune.measure.session import measure_url
    from autotune.study.lines import trial_line
    from autotune.study.records import Attr, TrialRecord, held_every_load

    # a 200 ms target: a 20 ms bound, twice the lag a calm client showed on a loaded CI host (9.9 ms)
    slos = [parse_slo("ttft<200ms")]
    w = workload(30, 0.05, out=4)
    calm = measure_url(server, lambda load: w, slos, ReplayOptions(warmup_requests=0), FixedLoad())
    starved = measure_url(server, lambda load: w, slos, ReplayOptions(warmup_requests=0, load=1.25), FixedLoad(),
                          on_result=lambda _: time.sleep(0.15))
    ok, bound = calm.steps[0], starved.steps[0]
    assert ok.passed and not ok.client_bound, ok.client_lag_p99
    assert bound.client_bound and not bound.client_kept_up, (bound.client_lag_p99, bound.client_lag_bound)
    assert bound.client_lag_bound == pytest.approx(0.02)  # a tenth of the 200 ms target, over the 2 ms floor
    records = [ok.record(), bound.record()]
    assert not bound.passed and held_every_load(records)  # the miss above the pass is no bound: a floor
    trial = optuna.trial.create_trial(
        params={}, distributions={}, value=ok.rate,
        user_attrs={Attr.STEPS: [r.to_json() for r in records], Attr.CAPACITY_RPS: ok.rate, Attr.CONSTRAINTS: [0.0]})
    line = trial_line(TrialRecord.of(trial), None)
    assert f"client-bound at {bound.rate:.2f} req/s" in line and "replay_workers" in line, line
    assert "it held every load offered" not in line, line


def test_the_worker_count_follows_the_token_rate_the_cores_and_the_concurrency_cap(monkeypatch):
    from autotune.measure.replay import TOKENS_PER_WORKER, workers_for

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    fast = Workload(tuple(Request(i / 100, int(TOKENS_PER_WORKER * 2.5 / 100), prompt="x") for i in range(200)))
    assert workers_for(fast, ReplayOptions()) == 3  # 2.5 workers' worth of tokens a second
    assert workers_for(fast, ReplayOptions(load=0.3)) == 1  # the same requests, a third as fast
    assert workers_for(fast, ReplayOptions(load=10)) == 4  # a quarter of the 16 cores at most
    assert workers_for(fast, ReplayOptions(workers=6)) == 6  # as asked
    assert workers_for(fast, ReplayOptions(workers=6, max_concurrency=2)) == 2  # each holds one of the cap's 2
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert workers_for(fast, ReplayOptions()) == 1  # two cores: the engine needs the rest


def test_worker_processes_share_a_concurrency_cap(server):
    rep = run_replay(server, workload(8, 0.0, out=10), ReplayOptions(max_concurrency=2, workers=2,
                                                                    warmup_requests=0))
    events = sorted([(r.sent_s, 1) for r in rep.results] + [(r.end_s, -1) for r in rep.results])
    in_flight = max(itertools.accumulate(d for _, d in events))
    assert rep.workers == 2 and all(r.success for r in rep.results) and in_flight <= 2


def test_a_stop_signal_mid_replay_leaves_no_worker_behind(server, tmp_path):
    """As systemd stops a service (SIGTERM to the whole group): the workers leave it to the replay's process, which
    stops them and exits; none outlives it."""
    import json

    import psutil

    trace = tmp_path / "w.jsonl"
    trace.write_text("".join(json.dumps({"prompt": f"r{i}", "output_tokens": 20}) + "\n" for i in range(400)))
    proc = psutil.Popen([sys.executable, "-m", "autotune", "replay", "--url", server, "--workload", str(trace),
                         "--rate", "20", "--workers", "2", "--warmup", "0"], start_new_session=True,
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        workers = []
        while len(workers) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            workers = [c for c in proc.children() if "_worker(" in " ".join(c.cmdline())]
            time.sleep(0.1)
        time.sleep(1.0)  # mid-replay
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        assert proc.returncode != 0  # interrupted, not finished: 400 requests at 20/s take 20 s
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, alive
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_stream_reader_times_every_read_and_says_how_a_response_failed():
    """streams.Connections against a server that writes in awkward pieces: events of one read share its time (an
    ITL of 0, as vllm bench serve has it), an event split across reads is one token, a kept-alive connection
    serves the next request, a path prefix is kept, and an error status or a stream broken off fails its request
    with the reason."""
    import asyncio

    from aiohttp import web

    from autotune.measure.metrics import RequestResult
    from autotune.measure.streams import Connections

    tok = b'data: {"choices":[{"index":0,"text":" t"}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":4}}\n\ndata: [DONE]\n\n'
    peers = []

    async def stream(request):
        peers.append(request.transport.get_extra_info("peername"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for piece in (tok, tok + tok, tok[:20], tok[20:] + usage):
            await resp.write(piece)
            await asyncio.sleep(0.02)
        return resp

    async def broken(request):
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(tok)
        request.transport.close()
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/prefix/v1/completions", stream)
        app.router.add_post("/prefix/v1/broken", broken)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        results = [RequestResult(index=i, scheduled_s=0.0, sent_s=0.0, success=False) for i in range(4)]
        try:
            async with Connections(f"http://127.0.0.1:{port}/prefix/") as conns:
                for res, path in zip(results, ("/v1/completions", "/v1/completions", "/v1/nope", "/v1/broken")):
                    await conns.stream(path, b"{}", res)
        finally:
            await runner.cleanup()
        return results

    first, second, missing, cut = asyncio.run(go())
    for r in (first, second):
        assert r.success and r.error == "" and r.output_tokens == 4 and r.prompt_tokens == 2, r
        assert len(r.itl) == 3 and r.itl[1] == 0.0 and r.itl[0] > 0.01 and r.itl[2] > 0.01, r.itl
    assert len(peers) == 2 and peers[0] == peers[1]  # one connection, kept alive
    assert not missing.success and missing.error.startswith("HTTP 404: "), missing.error
    assert not cut.success and cut.error.startswith("ServerDisconnectedError"), cut.error


def test_a_request_the_server_closed_a_kept_alive_connection_on_is_sent_once_more_on_a_new_one():
    """A server that closes a kept-alive connection as the next request arrives, answering nothing (a proxy's
    reload, an idle timeout), never saw that request: it is sent again on a new connection and succeeds there.
    A new connection closed before any answer is the server's failure, said once, not retried."""
    import asyncio

    from autotune.measure.metrics import RequestResult
    from autotune.measure.streams import Connections

    body = b'data: {"choices":[{"index":0,"text":" t"}]}\n\ndata: [DONE]\n\n'
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    served = []  # (connection, its n-th request, answered)

    async def handle(reader, writer):
        conn = len({c for c, _, _ in served})
        for n in range(1, 10):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")).split(b":")[1])
            await reader.readexactly(length)
            answered = n == 1 and b"/v1/drop" not in head
            served.append((conn, n, answered))
            if not answered:
                writer.close()
                return
            writer.write(answer)
            await writer.drain()

    async def go():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        results = [RequestResult(index=i, scheduled_s=0.0, sent_s=0.0, success=False) for i in range(3)]
        try:
            async with Connections(f"http://127.0.0.1:{port}") as conns:
                for res, path in zip(results, ("/v1/completions", "/v1/completions", "/v1/drop")):
                    await conns.stream(path, b"{}", res)
        finally:
            server.close()
        return results

    first, second, dropped = asyncio.run(go())
    assert first.success and second.success and second.output_tokens == 1, (first, second)
    # connection 0 served the first and closed on the second, which connection 1 then served as its first
    assert served[:3] == [(0, 1, True), (0, 2, False), (1, 1, True)], served
    assert not dropped.success and dropped.error, dropped
    # the dropped request: sent on kept-alive connection 1, then once on new connection 2, and no more
    assert served[3:] == [(1, 2, False), (2, 1, False)], served
