"""Replay a workload against an OpenAI-compatible server, open loop, and time every token.

Requests leave at their arrival times (divided by ``load``), whether or not earlier ones
have finished: that is how real traffic arrives, and what makes queueing visible. An
optional concurrency cap holds requests back (their send lag then shows it). Each request
streams with ``ignore_eos`` and ``max_tokens`` so output lengths follow the workload, and
``stream_options.include_usage`` so token counts come from the server. Timing follows
``vllm bench serve`` (see metrics.py). The replayer knows HTTP and the workload, nothing else.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from autotune.engine.launcher import raise_if_interrupted
from autotune.errors import MeasurementError
from autotune.measure.metrics import RequestResult
from autotune.workload.eventloop import event_loop_factory
from autotune.workload.trace import Request, Workload

__all__ = ["ReplayOptions", "Replay", "GiveUp", "replay", "run_replay", "discover_model", "warm_up", "payload_for"]

# The first sends are scheduled this far ahead, so that creating tasks never makes them late.
_START_DELAY_S = 0.02


@dataclass(frozen=True)
class ReplayOptions:
    load: float = 1.0  # arrival-rate multiplier: 2.0 replays the trace twice as fast
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    warmup_requests: int = 4  # sent (concurrently) and discarded before the measured run
    warmup_output_tokens: int = 16
    model: str | None = None  # the served model name; asked from /v1/models when not given
    api_key: str | None = None


@dataclass
class Replay:
    model: str
    started_at: float  # wall clock
    results: list[RequestResult]
    wall_s: float  # the replay's own duration, warm-up excluded
    warmup_s: float
    cut: str = ""  # why the replay stopped before its last request (``give_up``); "" when it ran to the end


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


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()  # built once: loading the CA store costs ~20 ms


def _client(url: str, options: ReplayOptions) -> httpx.AsyncClient:
    """An httpx client on aiohttp's transport.

    httpx's own transport (httpcore + h11, pure Python) costs about twice the CPU per request
    and per streamed chunk; with it one core cannot keep an open loop of hundreds of
    requests/s on schedule. httpx-aiohttp keeps the httpx API and uses aiohttp's C parser.
    """
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    cap = options.max_concurrency or 0  # aiohttp: 0 = no limit; an open loop must not queue in the client

    def session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=cap, ssl=_tls()),
            trust_env=False,  # a proxy from the environment would sit between us and localhost
        )

    return httpx.AsyncClient(
        base_url=url,
        headers=headers,
        timeout=httpx.Timeout(options.request_timeout_s, connect=10.0),
        transport=AiohttpTransport(client=session),
        trust_env=False,
    )


async def discover_model(client: httpx.AsyncClient) -> str:
    try:
        resp = await client.get("/v1/models", timeout=10.0)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise MeasurementError(f"cannot list the served models at {client.base_url}/v1/models: {e}") from e


_SSE_LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A text stream's lines as Server-Sent Events end them: CRLF, LF or CR, nothing else. httpx's ``aiter_lines``
    also ends a line at U+2028, U+0085 and the other ``str.splitlines`` boundaries, which JSON carries unescaped
    inside a token's text: a model that writes one would cut its own data line in two."""
    pending = ""
    async for text in chunks:
        pending += text
        # a CR at the end may be the first half of a CRLF: it waits for the next chunk
        end = len(pending) - 1 if pending.endswith("\r") else len(pending)
        *lines, rest = _SSE_LINE_END.split(pending[:end])
        pending = rest + pending[end:]
        for line in lines:
            yield line
    if last := pending.rstrip("\r"):
        yield last


async def _stream_one(
    client: httpx.AsyncClient,
    r: Request,
    model: str,
    result: RequestResult,
    max_tokens: int | None = None,
    request_id: str | None = None,
) -> None:
    path, body = payload_for(r, model, max_tokens)
    content = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if request_id is not None:
        headers["x-request-id"] = request_id  # vLLM logs it; test servers key their records on it
    st = time.perf_counter()
    last = st
    first = True
    chunks = 0
    try:
        async with client.stream("POST", path, content=content, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")[:300]
                result.error = f"HTTP {resp.status_code}: {text}"
                return
            async for line in sse_lines(resp.aiter_text()):
                if not line.startswith("data:"):
                    continue  # blank separators and ": ping" comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ts = time.perf_counter()
                msg = json.loads(data)
                if msg.get("choices"):
                    if first:
                        result.ttft = ts - st
                        first = False
                    else:
                        result.itl.append(ts - last)
                    last = ts
                    chunks += 1
                elif usage := msg.get("usage"):
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                elif "error" in msg:
                    result.error = f"server error in stream: {msg['error']}"
                    return
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return
    except json.JSONDecodeError as e:
        result.error = f"malformed SSE data: {e}"
        return
    if first:
        result.error = "the stream ended without a token"
        return
    if not result.output_tokens:
        result.output_tokens = chunks  # no usage chunk: one token per chunk is vLLM's default stream_interval
    result.e2e = last - st
    result.success = True


async def warm_up(client: httpx.AsyncClient, workload: Workload, model: str, n: int, max_tokens: int) -> None:
    """Send n requests from the workload concurrently and throw the timings away."""
    if n <= 0:
        return
    reqs = [workload.requests[i % len(workload)] for i in range(n)]
    results = [RequestResult(i, 0.0, 0.0, False) for i in range(n)]
    await asyncio.gather(
        *(_stream_one(client, r, model, res, max_tokens) for r, res in zip(reqs, results, strict=True))
    )
    if not any(res.success for res in results):
        raise MeasurementError(f"every warm-up request failed; the first: {results[0].error}")


async def replay(
    url: str,
    workload: Workload,
    options: ReplayOptions = ReplayOptions(),
    on_result: Callable[[RequestResult], None] | None = None,
    give_up: GiveUp | None = None,
) -> Replay:
    """Replay ``workload`` against ``url``. ``give_up``, asked every GIVE_UP_EVERY_S, may stop it early: the
    requests not sent yet are left out, those in flight are closed (which aborts them in vLLM) and marked as
    cut, and ``Replay.cut`` says why."""
    async with _client(url, options) as client:
        model = options.model or await discover_model(client)
        tw = time.perf_counter()
        await warm_up(client, workload, model, options.warmup_requests, options.warmup_output_tokens)
        warmup_s = time.perf_counter() - tw
        sem = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
        t0_arrival = workload.requests[0].arrival_s
        results: list[RequestResult] = []

        async def one(i: int, r: Request, scheduled: float) -> None:
            if sem is not None:
                await sem.acquire()
            try:
                res = RequestResult(
                    i, scheduled, time.perf_counter() - t0_perf, False, expected_output_tokens=r.output_tokens
                )
                results.append(res)
                await _stream_one(client, r, model, res, request_id=f"{run_id}-{i}")
                res.elapsed = time.perf_counter() - t0_perf - res.sent_s
            finally:
                if sem is not None:
                    sem.release()
            if on_result is not None:
                on_result(res)

        async def send_all() -> None:
            for i, r in enumerate(workload.requests):
                scheduled = (r.arrival_s - t0_arrival) / options.load
                # One clock (perf_counter) for the schedule and the measurement. Event-loop timers are
                # coarser (uvloop's: 1 ms), so a send can be up to a millisecond early: the send lag shows it.
                delay = t0_perf + scheduled - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, r, scheduled)))
            await asyncio.gather(*tasks)

        async def watch(sending: asyncio.Task[None]) -> str:
            while not sending.done():
                await asyncio.sleep(GIVE_UP_EVERY_S)
                why = give_up(results, len(workload), time.perf_counter() - t0_perf) if give_up else None
                if why:
                    sending.cancel()
                    for t in tasks:
                        t.cancel()
                    return why
            return ""

        started_at = time.time()
        run_id = f"autotune-{int(started_at * 1000):x}"
        t0_perf = time.perf_counter() + _START_DELAY_S
        tasks: list[asyncio.Task[None]] = []
        sending = asyncio.create_task(send_all())
        watcher = asyncio.create_task(watch(sending)) if give_up is not None else None
        try:
            cut = ""
            if watcher is not None:
                await asyncio.wait({sending, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if watcher.done():
                    cut = watcher.result()
                else:
                    watcher.cancel()
            await asyncio.gather(sending, *tasks, return_exceptions=bool(cut))
        except BaseException:
            for t in (sending, *tasks, *([watcher] if watcher else [])):
                t.cancel()
            raise
        wall_s = time.perf_counter() - t0_perf
    return Replay(model, started_at, _in_order(results, cut), wall_s, warmup_s, cut)


def _in_order(results: list[RequestResult], cut: str) -> list[RequestResult]:
    """The results in the workload's order, those a cut step left unanswered marked as cut."""
    for res in results:
        if cut and not res.success and not res.error:
            res.error = f"cut: the step was already lost ({cut})"
    return sorted(results, key=lambda x: x.index)


def run_replay(
    url: str,
    workload: Workload,
    options: ReplayOptions = ReplayOptions(),
    on_result: Callable[[RequestResult], None] | None = None,
    give_up: GiveUp | None = None,
) -> Replay:
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        try:
            return runner.run(replay(url, workload, options, on_result, give_up))
        except asyncio.CancelledError:
            raise_if_interrupted()  # a stop signal cancelled the replay (engine.launcher.stop_on_signals)
            raise
