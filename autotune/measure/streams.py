"""Streamed completions over HTTP/1.1, each token timed where its bytes arrive.

A replay's ``Connections`` holds its keep-alive connections to one server. Each connection is an asyncio protocol
that parses its responses with httptools (the C parser uvicorn serves vLLM with) and times a token in
``data_received``: a streamed token costs the client one read and one parse, and no task switch; only a request's
end wakes the task that sent it. Every event of one read from the socket takes that read's time, as in
``vllm bench serve``. Token events are recognised by ``"choices":[{`` without being decoded (a JSON string cannot
hold that unescaped); every other event (usage, an error, another server's spacing) is decoded in full.
"""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
import time
import urllib.parse

import httptools

from autotune.errors import MeasurementError
from autotune.measure.metrics import RequestResult

__all__ = ["Connections", "SseEvents", "error_text"]

_TOKEN_EVENT = b'"choices":[{'
# A connection idle longer is closed, not reused: servers close idle ones (uvicorn after 5 s), and a request sent
# on one as it closes would be lost.
_IDLE_S = 1.0
_CONNECT_S = 10.0
_ERROR_BODY = 300  # bytes of a failed response's body kept for its error


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()  # built once: loading the CA store costs ~20 ms


def error_text(e: BaseException) -> str:
    """An exception as a result's error: its type, and its message where it has one."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class SseEvents:
    """The data of Server-Sent Events, from a byte stream read in arbitrary pieces: lines end at CRLF, LF or CR
    and nothing else (U+2028 and the other ``str.splitlines`` boundaries are text, which JSON carries unescaped
    inside a token's text)."""

    def __init__(self) -> None:
        self.pending = b""  # a line's first part, waiting for the rest of it

    def feed(self, data: bytes) -> list[bytes]:
        """The data fields of the lines ``data`` completes."""
        buf = self.pending + data
        if b"\r" in buf:
            # a CR at the end may be the first half of a CRLF: it waits for the next piece
            keep = buf.endswith(b"\r")
            buf = buf[:-1] if keep else buf
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if keep else b"")
        *lines, self.pending = buf.split(b"\n")
        return [line[5:].strip() for line in lines if line.startswith(b"data:")]

    def close(self) -> list[bytes]:
        """The data field of a last line the stream did not end."""
        last, self.pending = self.pending.rstrip(b"\r"), b""
        return [last[5:].strip()] if last.startswith(b"data:") else []


class _Reading:
    """One streamed response read into its request's result: TTFT at the first event with choices, ITL between
    such events, token counts from the usage event."""

    __slots__ = ("chunks", "done", "error_body", "events", "finished", "last", "over", "result", "sent_at", "status")

    def __init__(self, result: RequestResult, sent_at: float, finished: asyncio.Future[None]) -> None:
        self.result, self.sent_at, self.finished = result, sent_at, finished
        self.last = sent_at
        self.chunks = 0
        self.events = SseEvents()
        self.status = 0
        self.error_body = b""
        self.done = False  # [DONE] was read
        self.over = False  # the result is final

    def body(self, data: bytes, ts: float) -> None:
        if self.over:
            return
        if self.status != 200:
            self.error_body = (self.error_body + data)[:_ERROR_BODY]
            return
        if self.chunks and data.endswith(b"\n\n") and not self.events.pending and b"\r" not in data:
            # The common read: whole events, each a token's. They are counted, not split: a token event is the
            # only thing that holds the marker, and holds it once (one choice per chunk).
            n = data.count(_TOKEN_EVENT)
            if n and n == data.count(b"data:"):
                itl = self.result.itl
                itl.append(ts - self.last)
                if n > 1:
                    itl.extend([0.0] * (n - 1))  # events of one read share its time, as vllm bench serve's do
                self.last = ts
                self.chunks += n
                return
        try:
            for event in self.events.feed(data):
                self._event(event, ts)
        except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
            self.end(f"malformed SSE data: {e}")

    def flush(self, ts: float) -> None:
        """The stream is over: a last line it did not end is read too."""
        if self.status == 200 and not self.over:
            try:
                for event in self.events.close():
                    self._event(event, ts)
            except ValueError as e:
                self.end(f"malformed SSE data: {e}")

    def _event(self, event: bytes, ts: float) -> None:
        if self.done or self.over:
            return
        if event == b"[DONE]":
            self.done = True
            return
        r = self.result
        if _TOKEN_EVENT not in event:
            msg = json.loads(event)
            if not msg.get("choices"):
                if usage := msg.get("usage"):
                    r.output_tokens = int(usage.get("completion_tokens") or 0)
                    r.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                elif "error" in msg:
                    self.end(f"server error in stream: {msg['error']}")
                return
        if self.chunks:
            r.itl.append(ts - self.last)
        else:
            r.ttft = ts - self.sent_at
        self.last = ts
        self.chunks += 1

    def end(self, error: str = "") -> None:
        """The response is over; ``error`` when it did not end as a response does."""
        if self.over:
            return
        self.over = True
        r = self.result
        if error:
            r.error = error
        elif self.status != 200:
            r.error = f"HTTP {self.status}: {self.error_body.decode('utf-8', 'replace')}"
        elif not self.chunks:
            r.error = "the stream ended without a token"
        else:
            if not r.output_tokens:
                r.output_tokens = self.chunks  # no usage event: one token per event is vLLM's default stream_interval
            r.e2e = self.last - self.sent_at
            r.success = True
        if not self.finished.done():  # a stream that timed out has had its future cancelled
            self.finished.set_result(None)


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; httptools calls its ``on_*`` methods as it parses a response."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reading: _Reading | None = None
        self.ts = 0.0  # when the bytes being parsed arrived
        self.idle_since = 0.0
        self.complete = False  # the last response was read to its end
        self.served = False  # it has served a request before
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream socket's transport

    def data_received(self, data: bytes) -> None:
        self.ts = time.perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if self.reading is not None:
                self.reading.end(f"malformed HTTP response: {e}")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if (reading := self.reading) is not None:
            reading.flush(time.perf_counter())
            why = f": {error_text(exc)}" if exc else ""
            reading.end("" if reading.done else f"ServerDisconnectedError: the server closed the connection{why}")

    def on_headers_complete(self) -> None:
        if self.reading is not None:
            self.reading.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.reading is not None:
            self.reading.body(body, self.ts)

    def on_message_complete(self) -> None:
        reading, self.reading = self.reading, None
        self.complete = self.parser.should_keep_alive()
        if reading is not None:
            reading.flush(self.ts)
            reading.end()

    def send(self, data: bytes, reading: _Reading) -> None:
        assert self.transport is not None
        self.reading, self.complete = reading, False
        self.transport.write(data)

    def close(self) -> None:
        """Close it from this end: what it was reading is left as it is (the reader has stopped, or has ended it)."""
        self.closed = True
        self.reading = None
        if self.transport is not None:
            self.transport.close()


class Connections:
    """Keep-alive connections to the server at ``url`` (http or https, with any path prefix), opened as requests
    need them: an open-loop replay holds one per request in flight."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float | None = None) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise MeasurementError(f"cannot replay against {url!r}: give an http:// or https:// URL")
        self.host, self.tls = u.hostname, u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        self.timeout_s = timeout_s
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self._headers = f"Host: {u.netloc}\r\n{auth}Content-Type: application/json\r\n".encode()
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()

    async def __aenter__(self) -> Connections:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for conn in self._open:
            conn.close()
        self._open.clear()
        self._idle.clear()

    async def _connection(self, fresh: bool = False) -> _Connection:
        now = time.perf_counter()
        while self._idle and not fresh:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < _IDLE_S:
                return conn
            self._drop(conn)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(_CONNECT_S):
            _, conn = await loop.create_connection(_Connection, self.host, self.port, ssl=_tls() if self.tls else None)
        self._open.add(conn)
        return conn

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self._open.discard(conn)

    async def stream(self, path: str, body: bytes, result: RequestResult, request_id: str | None = None) -> None:
        """POST ``body`` (JSON) to ``path`` and time its stream into ``result``; a failure is ``result.error``.
        A cancelled stream closes its connection, which aborts the request in vLLM."""
        st = time.perf_counter()
        rid = f"x-request-id: {request_id}\r\n" if request_id is not None else ""  # test servers key on it
        data = (
            f"POST {self.prefix}{path} HTTP/1.1\r\n".encode()
            + self._headers
            + f"{rid}Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                for fresh in (False, True):
                    conn = await self._connection(fresh)
                    reading = _Reading(result, st, asyncio.get_running_loop().create_future())
                    reused = conn.served
                    conn.send(data, reading)
                    await reading.finished
                    # a kept-alive connection the server closed as this request went out (a proxy's reload, an
                    # idle timeout) never saw it: it is sent once more, on a new connection
                    if not (reused and reading.status == 0 and conn.closed and not result.success):
                        break
                    self._drop(conn)
                    result.error = ""
        except (OSError, TimeoutError) as e:
            result.error = error_text(e)
        except BaseException:
            if conn is not None:
                self._drop(conn)
            raise
        if conn is None:
            return
        if conn.complete and not conn.closed:
            conn.served = True
            conn.idle_since = time.perf_counter()
            self._idle.append(conn)
        else:
            self._drop(conn)
