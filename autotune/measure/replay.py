"""Replay a workload against an OpenAI-compatible server, open loop, and time every token.

Requests leave at their arrival times (divided by ``load``), whether or not earlier ones
have finished: that is how real traffic arrives, and what makes queueing visible. An
optional concurrency cap holds requests back (their send lag then shows it). Each request
streams with ``ignore_eos`` and ``max_tokens`` so output lengths follow the workload, and
``stream_options.include_usage`` so token counts come from the server. Timing follows
``vllm bench serve`` (see metrics.py); each stream is read and timed by streams.py. The replayer
knows HTTP and the workload, nothing else.

One event loop on one core times about TOKENS_PER_WORKER streamed tokens a second before its own lag reads as
latency. Past that the requests are split across worker processes (``workers_for``), each with its own event loop
and connections, every request keeping its scheduled send time on the one monotonic clock the processes share;
their results merge into one replay. Every loop watches its own lag (how late a periodic timer fires): a replay
whose loops ran late (``Replay.client_bound``) timed the client, not only the server.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

import httpx

from autotune.engine.launcher import raise_if_interrupted
from autotune.errors import MeasurementError
from autotune.measure.metrics import Distribution, RequestResult
from autotune.measure.streams import Connections, error_text
from autotune.workload.eventloop import event_loop_factory
from autotune.workload.trace import Request, Workload

__all__ = [
    "ReplayOptions",
    "Replay",
    "GiveUp",
    "replay",
    "run_replay",
    "discover_model",
    "payload_for",
    "workers_for",
    "keep_workers",
    "CLIENT_LAG_S",
]

# The first sends are scheduled this far ahead, so that creating tasks never makes them late.
_START_DELAY_S = 0.02
LAG_TICK_S = 0.005  # how often each event loop checks its own lag
# An event loop whose timer fires later than this (p99) delays reading what the server sent by as much: the client
# then sets part of the latency it measures. uvloop on an idle core: about 0.5 ms.
CLIENT_LAG_S = 0.002
# Output tokens/s one worker process streams and times on one core, with room to spare: about half of the highest
# rate one held within 2 ms of an exact server (bench/README.md, "Replay client"); the auto worker count gives each
# worker at most this many.
TOKENS_PER_WORKER = 20_000
_FLUSH_S = 0.05  # how often a worker process sends its results so far to the replay


@dataclass(frozen=True)
class ReplayOptions:
    load: float = 1.0  # arrival-rate multiplier: 2.0 replays the trace twice as fast
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    warmup_requests: int = 4  # sent (concurrently) and discarded before the measured run
    warmup_output_tokens: int = 16
    model: str | None = None  # the served model name; asked from /v1/models when not given
    api_key: str | None = None
    workers: int | None = None  # processes that send and time the requests; None: as many as workers_for says


@dataclass
class Replay:
    model: str
    started_at: float  # wall clock
    results: list[RequestResult]
    wall_s: float  # the replay's own duration, warm-up excluded
    warmup_s: float
    cut: str = ""  # why the replay stopped before its last request (``give_up``); "" when it ran to the end
    loop_lag: Distribution = field(default_factory=lambda: Distribution.of([]))  # how late the loops' timers fired
    workers: int = 1

    def client_bound(self, bound_s: float = CLIENT_LAG_S) -> bool:
        """The client's own lag (p99 over its event loops) exceeded ``bound_s``: it set part of what it measured."""
        return (self.loop_lag.p99 or 0.0) > bound_s


# (results so far, requests in the workload, seconds since the replay started) -> why to stop now, or None
GiveUp = Callable[[list[RequestResult], int, float], str | None]
GIVE_UP_EVERY_S = 0.25  # how often ``give_up`` is asked


def payload_for(r: Request, model: str, max_tokens: int | None = None) -> tuple[str, dict]:
    """The request's URL path and JSON body."""
    common = {
        "model": model,
        "max_tokens": max_tokens or r.output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if r.prompt is None:
        raise MeasurementError("a request has no prompt text; build prompts with the model's tokenizer first")
    if r.api == "chat":
        messages = []
        if r.prefix is not None:
            messages.append({"role": "system", "content": r.prefix})
        messages.append({"role": "user", "content": r.prompt})
        return "/v1/chat/completions", {**common, "messages": messages}
    prompt = r.prompt if r.prefix is None else r.prefix + "\n" + r.prompt
    return "/v1/completions", {**common, "prompt": prompt}


def _client(options: ReplayOptions) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        headers={"Authorization": f"Bearer {options.api_key}"} if options.api_key else {},
        timeout=10.0,
        trust_env=False,  # a proxy from the environment would sit between us and localhost
    )


async def discover_model(client: httpx.AsyncClient, url: str) -> str:
    try:
        resp = await client.get(url.rstrip("/") + "/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
        raise MeasurementError(f"cannot list the served models at {url}/v1/models: {error_text(e)}") from e


def _connections(url: str, options: ReplayOptions) -> Connections:
    return Connections(url, options.api_key, options.request_timeout_s)


def workers_for(workload: Workload, options: ReplayOptions) -> int:
    """How many worker processes replay ``workload``: ``options.workers`` when given, else enough that none streams
    more than TOKENS_PER_WORKER output tokens a second, and at most a quarter of the cores this process may use (the
    engine's own processes need the rest); 1 (in this process) where that suffices."""
    cap = options.max_concurrency or math.inf  # each worker holds its share of a concurrency cap: one request at least
    if options.workers is not None:
        return int(max(min(options.workers, cap), 1))
    reqs = workload.requests
    span = (reqs[-1].arrival_s - reqs[0].arrival_s) / options.load if len(reqs) > 1 else 0.0
    if span <= 0:
        return 1
    tokens_per_s = sum(r.output_tokens for r in reqs) / span
    return int(max(1, min(math.ceil(tokens_per_s / TOKENS_PER_WORKER), len(os.sched_getaffinity(0)) // 4, cap)))


@dataclass(frozen=True)
class _Send:
    """One request ready to leave: when (seconds after the replay starts), where, its JSON body encoded."""

    index: int
    scheduled_s: float
    path: str
    body: bytes
    expected_output_tokens: int


def _sends(workload: Workload, model: str, load: float) -> list[_Send]:
    """Every request of ``workload``, encoded ahead of its send so that the send costs nothing but the send."""
    t0 = workload.requests[0].arrival_s
    return [
        _Send(i, (r.arrival_s - t0) / load, *_encoded(payload_for(r, model)), r.output_tokens)
        for i, r in enumerate(workload.requests)
    ]


def _warm_up_sends(workload: Workload, model: str, options: ReplayOptions) -> list[_Send]:
    n, tokens = options.warmup_requests, options.warmup_output_tokens
    reqs = [workload.requests[i % len(workload)] for i in range(max(n, 0))]
    return [_Send(i, 0.0, *_encoded(payload_for(r, model, tokens)), tokens) for i, r in enumerate(reqs)]


def _encoded(payload: tuple[str, dict]) -> tuple[str, bytes]:
    return payload[0], json.dumps(payload[1]).encode()


async def _warm_up(conns: Connections, sends: list[_Send]) -> None:
    if not sends:
        return
    results = [RequestResult(s.index, 0.0, 0.0, False) for s in sends]
    await asyncio.gather(*(conns.stream(s.path, s.body, res) for s, res in zip(sends, results, strict=True)))
    if not any(res.success for res in results):
        raise MeasurementError(f"every warm-up request failed; the first: {results[0].error}")


class _Run:
    """Sends on one event loop, each at its time after ``t0`` (perf_counter, which every process shares), open
    loop; and the loop's own lag, sampled every LAG_TICK_S while they run."""

    def __init__(
        self,
        conns: Connections,
        sends: list[_Send],
        run_id: str,
        max_concurrency: int | None,
        on_result: Callable[[RequestResult], None] | None = None,
    ) -> None:
        self.conns, self.sends, self.run_id, self.on_result = conns, sends, run_id, on_result
        self.sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self.results: list[RequestResult] = []  # in send order, each from the moment it leaves
        self.done: list[RequestResult] = []  # finished, in the order they finished
        self.lag: list[float] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.t0 = 0.0

    def start(self, t0: float) -> asyncio.Task[None]:
        """Start sending; the task that ends when every request has."""
        self.t0 = t0
        self.sending = asyncio.create_task(self._send_all())
        self._watching = asyncio.create_task(self._watch_lag())
        return self.sending

    async def _send_all(self) -> None:
        for s in self.sends:
            # One clock (perf_counter) for the schedule and the measurement. Event-loop timers are
            # coarser (uvloop's: 1 ms), so a send can be up to a millisecond early: the send lag shows it.
            delay = self.t0 + s.scheduled_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            self.tasks.append(asyncio.create_task(self._one(s)))
        await asyncio.gather(*self.tasks)

    async def _one(self, s: _Send) -> None:
        if self.sem is not None:
            await self.sem.acquire()
        try:
            res = RequestResult(
                s.index,
                s.scheduled_s,
                time.perf_counter() - self.t0,
                False,
                expected_output_tokens=s.expected_output_tokens,
            )
            self.results.append(res)
            await self.conns.stream(s.path, s.body, res, request_id=f"{self.run_id}-{s.index}")
            res.elapsed = time.perf_counter() - self.t0 - res.sent_s
        finally:
            if self.sem is not None:
                self.sem.release()
        self.done.append(res)
        if self.on_result is not None:
            self.on_result(res)

    async def _watch_lag(self) -> None:
        while True:
            due = time.perf_counter() + LAG_TICK_S
            await asyncio.sleep(LAG_TICK_S)
            self.lag.append(max(time.perf_counter() - due, 0.0))

    def cut(self) -> None:
        """Stop sending and close what is in flight (which aborts it in vLLM)."""
        self.sending.cancel()
        for t in self.tasks:
            t.cancel()

    async def finish(self, cut: bool) -> None:
        try:
            await asyncio.gather(self.sending, *self.tasks, return_exceptions=cut)
        finally:
            self._watching.cancel()

    def cancel_all(self) -> None:
        for t in (self.sending, *self.tasks, self._watching):
            t.cancel()


async def replay(
    url: str,
    workload: Workload,
    options: ReplayOptions = ReplayOptions(),
    on_result: Callable[[RequestResult], None] | None = None,
    give_up: GiveUp | None = None,
) -> Replay:
    """Replay ``workload`` against ``url`` on this event loop. ``give_up``, asked every GIVE_UP_EVERY_S, may stop
    it early: the requests not sent yet are left out, those in flight are closed (which aborts them in vLLM) and
    marked as cut, and ``Replay.cut`` says why."""
    if options.model:
        model = options.model
    else:
        async with _client(options) as client:
            model = await discover_model(client, url)
    async with _connections(url, options) as conns:
        tw = time.perf_counter()
        await _warm_up(conns, _warm_up_sends(workload, model, options))
        warmup_s = time.perf_counter() - tw
        started_at = time.time()
        run = _Run(
            conns, _sends(workload, model, options.load), _run_id(started_at), options.max_concurrency, on_result
        )

        async def watch(sending: asyncio.Task[None]) -> str:
            while not sending.done():
                await asyncio.sleep(GIVE_UP_EVERY_S)
                why = give_up(run.results, len(workload), time.perf_counter() - run.t0) if give_up else None
                if why:
                    run.cut()
                    return why
            return ""

        sending = run.start(time.perf_counter() + _START_DELAY_S)
        watcher = asyncio.create_task(watch(sending)) if give_up is not None else None
        try:
            cut = ""
            if watcher is not None:
                await asyncio.wait({sending, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if watcher.done():
                    cut = watcher.result()
                else:
                    watcher.cancel()
            await run.finish(bool(cut))
        except BaseException:
            run.cancel_all()
            if watcher is not None:
                watcher.cancel()
            raise
        wall_s = time.perf_counter() - run.t0
    return Replay(model, started_at, _in_order(run.results, cut), wall_s, warmup_s, cut, Distribution.of(run.lag))


def _run_id(started_at: float) -> str:
    return f"autotune-{int(started_at * 1000):x}"


def _in_order(results: list[RequestResult], cut: str) -> list[RequestResult]:
    """The results in the workload's order, those a cut step left unanswered marked as cut."""
    for res in results:
        if cut and not res.success and not res.error:
            res.error = f"cut: the step was already lost ({cut})"
    return sorted(results, key=lambda x: x.index)


@dataclass(frozen=True)
class _Job:
    """One worker's share of a replay."""

    url: str
    options: ReplayOptions
    sends: list[_Send]
    run_id: str
    warm_up: list[_Send]  # the engine's warm-up: the first worker sends it


def _worker(fd: int) -> None:
    """A replay worker process (_Pool): runs each share it is sent on ``fd`` until it is sent None or its replay's
    process is gone. A thread reads the socket (which stays blocking, for the sends) into a queue."""
    conn = multiprocessing.connection.Connection(fd)
    # A Ctrl-C or a service's stop reaches the whole process group: the replay's process acts on it and stops its
    # workers (engine.launcher.stop_on_signals), and a worker whose replay's process is gone exits by itself.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = None
            inbox.put(message)
            if message is None:
                return

    threading.Thread(target=read, name="replay-inbox", daemon=True).start()
    while (job := inbox.get()) is not None:
        if isinstance(job, _Job):  # else a ("cut",) that came after its share had ended anyway
            try:
                with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                    runner.run(_work(conn, inbox, job))
            except OSError:  # the replay's process is gone (a broken pipe): nobody is left to tell
                return


async def _work(conn: multiprocessing.connection.Connection, inbox: queue.SimpleQueue[object], job: _Job) -> None:
    """Warm up, say ready, wait for ("go", t0), send on schedule; every _FLUSH_S send what was sent and what
    finished, and stop at ("cut",) or when the replay's process is gone."""
    async with _connections(job.url, job.options) as conns:
        tw = time.perf_counter()
        try:
            await _warm_up(conns, job.warm_up)
        except MeasurementError as e:
            conn.send(("error", str(e)))
            return
        conn.send(("ready", time.perf_counter() - tw))
        while inbox.empty():
            await asyncio.sleep(0.001)
        go = inbox.get()
        if not (isinstance(go, tuple) and go[0] == "go"):
            inbox.put(go)  # None (the replay's process is gone): _worker must see it too, and exit
            return
        run = _Run(conns, job.sends, job.run_id, job.options.max_concurrency)
        sending = run.start(go[1])
        reported = 0
        cut = False

        def progress() -> tuple[list[tuple[int, float, float, int]], list[RequestResult]]:
            nonlocal reported
            sent = [(r.index, r.scheduled_s, r.sent_s, r.expected_output_tokens) for r in run.results[reported:]]
            reported = len(run.results)
            done, run.done = run.done, []
            return sent, done

        while not sending.done():
            await asyncio.wait({sending}, timeout=_FLUSH_S)
            if not inbox.empty() and (message := inbox.get()) in (None, ("cut",)):
                if message is None:
                    inbox.put(None)  # for _worker, which exits on it
                run.cut()
                cut = True
                break
            conn.send(("progress", *progress()))
        await run.finish(cut)
        conn.send(("end", *progress(), run.lag))


class _Pool:
    """Replay worker processes, started once and kept for every later replay of this process.

    Each is a fresh interpreter that imports this module alone (not multiprocessing's spawn, which imports the
    caller's main module again), on one end of a socket pair: when this process dies, the worker reads the end
    of its socket and exits."""

    def __init__(self, n: int) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))}
        self.conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        for _ in range(n):
            here, there = socket.socketpair()
            with there:
                code = f"from autotune.measure.replay import _worker; _worker({there.fileno()})"
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", code], pass_fds=(there.fileno(),), env=env, stdin=subprocess.DEVNULL
                    )
                )
            self.conns.append(multiprocessing.connection.Connection(here.detach()))

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


class _Kept(threading.local):
    """This thread's worker pools: trials measured side by side (a parallel study) each replay on their own."""

    def __init__(self) -> None:
        self.pools: dict[int, _Pool] = {}
        self.blocks = 0  # how many ``keep_workers`` blocks are open


_kept = _Kept()
_every_pool: set[_Pool] = set()  # every thread's, for the exit


@contextlib.contextmanager
def keep_workers() -> Iterator[None]:
    """Replay worker processes started in this block serve every replay in it and stop at its end (a measurement
    session's steps: their start-up is paid once). Outside any block a replay's workers stop when it ends."""
    _kept.blocks += 1
    try:
        yield
    finally:
        _kept.blocks -= 1
        if not _kept.blocks:
            _close_pools()


def _close_pools() -> None:
    while _kept.pools:
        pool = _kept.pools.popitem()[1]
        _every_pool.discard(pool)
        pool.close()


@atexit.register
def _close_every_pool() -> None:
    for pool in list(_every_pool):
        pool.close()


def _pool(n: int) -> _Pool:
    if n not in _kept.pools:
        _kept.pools[n] = pool = _Pool(n)
        _every_pool.add(pool)
    return _kept.pools[n]


def _discover_model_sync(url: str, options: ReplayOptions) -> str:
    async def ask() -> str:
        async with _client(options) as client:
            return await discover_model(client, url)

    return asyncio.run(ask())


def _replay_in_workers(
    url: str,
    workload: Workload,
    options: ReplayOptions,
    n: int,
    on_result: Callable[[RequestResult], None] | None,
    give_up: GiveUp | None,
) -> Replay:
    """``replay`` split across ``n`` worker processes: request i goes to worker i mod n at its own time."""
    model = options.model or _discover_model_sync(url, options)
    started_at = time.time()
    sends = _sends(workload, model, options.load)
    warm = _warm_up_sends(workload, model, options)
    pool = _pool(n)
    try:
        for w, conn in enumerate(pool.conns):
            cap = options.max_concurrency
            share = replace(options, max_concurrency=cap // n + (w < cap % n)) if cap else options
            conn.send(_Job(url, share, sends[w::n], _run_id(started_at), warm if w == 0 else []))
        warmup_s = 0.0
        for conn in pool.conns:
            kind, said = _receive(conn)
            if kind == "error":
                raise MeasurementError(said)
            warmup_s = max(warmup_s, said)
        t0 = time.perf_counter() + _START_DELAY_S
        for conn in pool.conns:
            conn.send(("go", t0))
        results: dict[int, RequestResult] = {}
        lag: list[float] = []
        running = set(pool.conns)
        cut = ""
        ask_at = t0 + GIVE_UP_EVERY_S
        while running:
            for ready in multiprocessing.connection.wait(list(running), timeout=GIVE_UP_EVERY_S):
                conn = cast(multiprocessing.connection.Connection, ready)  # wait() gives back what it was given
                kind, sent, done, *rest = _receive(conn)
                for i, scheduled, sent_s, expected in sent:
                    results.setdefault(i, RequestResult(i, scheduled, sent_s, False, expected_output_tokens=expected))
                for res in done:
                    results[res.index] = res
                    if on_result is not None:
                        on_result(res)
                if kind == "end":
                    lag += rest[0]
                    running.discard(conn)
            if give_up is not None and not cut and time.perf_counter() >= ask_at:
                ask_at += GIVE_UP_EVERY_S
                if why := give_up(list(results.values()), len(workload), time.perf_counter() - t0):
                    cut = why
                    for conn in running:
                        conn.send(("cut",))
        wall_s = time.perf_counter() - t0
    except BaseException:
        # a signal, a dead worker, a bug: the workers may be mid-replay; they are not reused
        del _kept.pools[n]
        _every_pool.discard(pool)
        pool.kill()
        raise
    if not _kept.blocks:
        _close_pools()
    return Replay(
        model, started_at, _in_order(list(results.values()), cut), wall_s, warmup_s, cut, Distribution.of(lag), n
    )


def _receive(conn: multiprocessing.connection.Connection) -> tuple:
    try:
        return conn.recv()
    except (EOFError, OSError) as e:
        raise MeasurementError("a replay worker process died mid-replay; the replay is lost") from e


def run_replay(
    url: str,
    workload: Workload,
    options: ReplayOptions = ReplayOptions(),
    on_result: Callable[[RequestResult], None] | None = None,
    give_up: GiveUp | None = None,
) -> Replay:
    """Replay ``workload`` against ``url``: in this process, or in ``workers_for`` worker processes."""
    n = workers_for(workload, options)
    if n > 1:
        return _replay_in_workers(url, workload, options, n, on_result, give_up)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        try:
            return runner.run(replay(url, workload, options, on_result, give_up))
        except asyncio.CancelledError:
            raise_if_interrupted()  # a stop signal cancelled the replay (engine.launcher.stop_on_signals)
            raise
