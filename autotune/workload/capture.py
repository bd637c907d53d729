"""Record production traffic as a trace: a reverse proxy in front of an OpenAI-compatible server.

    clients  ->  capture proxy (127.0.0.1:8001)  ->  vLLM (upstream)
                      |
                      +-> trace.jsonl: one line per completed completion / chat completion

Every request is forwarded (any method, any path, headers minus the hop-by-hop ones) and its
response relayed as it arrives: SSE streams event by event, other bodies whole. For each
``/v1/completions`` or ``/v1/chat/completions`` request that completes with HTTP 200 the proxy
appends one line in autotune's trace format (``trace.py``):

    {"arrival_s": 12.034, "prompt_tokens": 1542, "output_tokens": 128, "api": "chat"}

- ``arrival_s``: when the proxy received the request, in seconds after the first such request.
  Lines are written when requests *complete*, so they are ordered by completion; the trace
  reader sorts by arrival. A capture appended to an existing trace continues after its last
  arrival (plus one second) instead of starting again at 0.
- ``prompt_tokens`` / ``output_tokens``: from the response's ``usage``, i.e. counted by the
  server's own tokenizer, chat template included. A streamed request that did not ask for usage
  is forwarded with ``stream_options.include_usage`` set, and the extra usage-only chunk is taken
  out of what the client sees: the client gets the events it asked for, byte for byte.
- No prompt text unless ``with_prompts`` (production prompts are often not ours to keep). With
  it, a completion's prompt is kept as sent; a chat's messages are kept as their contents joined
  by newlines (the trace format has one prompt string; the roles are not kept).

Requests the client abandons, that fail, or that produce no tokens are forwarded but not recorded.
Each line is flushed as it is written: a crash loses at most the requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from autotune.errors import ConfigError
from autotune.workload.trace import Api, Request

__all__ = ["DEFAULT_HOST", "CaptureProxy", "CaptureStats", "TraceWriter", "run_capture", "serve_capture"]

DEFAULT_HOST = "127.0.0.1"  # production traffic passes through: listen on localhost unless told
RECORDED: dict[str, Api] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
# RFC 9110 7.6.1: meaningful for one connection only, never forwarded. Host and Content-Length are
# set again by the client library for the new request and body.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "proxy-connection",
        "host",
        "content-length",
    }
)
_EVENT_END = re.compile(rb"\r?\n\r?\n")  # an SSE event ends at a blank line


@dataclass
class CaptureStats:
    forwarded: int = 0  # requests relayed, any path
    recorded: int = 0  # trace lines written
    not_recorded: int = 0  # completions that failed, were abandoned, had no usage or no tokens
    upstream_errors: int = 0  # requests that could not reach upstream (answered 502)


@dataclass
class _Exchange:
    """What one proxied response delivered; filled in as it streams, so a cancelled handler still knows."""

    usage: dict[str, Any] | None = None
    # Upstream sent the whole response (an SSE stream its [DONE]). Decided before the last bytes go
    # to the client: a client that hangs up as soon as it has [DONE] cancels the handler (aiohttp's
    # handler_cancellation) while it is still writing, and the request was complete all the same.
    complete: bool = False


def _is_done(event: bytes) -> bool:
    return event.rstrip() in (b"data: [DONE]", b"data:[DONE]")


def _forward_headers(headers: Any, drop: frozenset[str] = frozenset()) -> CIMultiDict[str]:
    """A copy without hop-by-hop headers (and those the Connection header names), repeated headers kept."""
    named = {h.strip().lower() for v in headers.getall("Connection", []) for h in v.split(",")}
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        lk = k.lower()
        if lk not in HOP_BY_HOP and lk not in named and lk not in drop:
            out.add(k, v)
    return out


def _prompt_text(api: Api, payload: dict[str, Any]) -> str | None:
    if api == "completion":
        p = payload.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]  # a batch of one
        return p if isinstance(p, str) else None  # token ids have no text to keep
    parts = []
    for m in payload.get("messages") or []:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, list):  # [{"type": "text", "text": ...}, ...]
            c = "".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
        if c:
            parts.append(str(c))
    return "\n".join(parts) if parts else None


def _usage_of(event: bytes) -> tuple[dict[str, Any] | None, bool]:
    """(usage, usage-only chunk) of one SSE event; (None, False) when it carries none.

    Only events that mention usage are parsed: the proxy sits in production's path, and every
    token chunk passes through here.
    """
    if b'"usage"' not in event:
        return None, False
    data = b"\n".join(line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:"))
    if not data or data == b"[DONE]":
        return None, False
    try:
        msg = json.loads(data)
    except ValueError:
        return None, False
    usage = msg.get("usage") if isinstance(msg, dict) else None
    if not isinstance(usage, dict):
        return None, False
    return usage, not msg.get("choices")


def _bad_gateway(upstream: str, error: BaseException) -> web.Response:
    """vLLM's error shape, so that OpenAI clients show the message."""
    msg = {
        "error": {
            "message": f"capture proxy: upstream {upstream} failed: {type(error).__name__}: {error}",
            "type": "BadGateway",
            "param": None,
            "code": 502,
        }
    }
    return web.json_response(msg, status=502)


class TraceWriter:
    """Appends trace lines to a file, one flushed write per request."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise ConfigError(f"the trace file {self.path} is a directory; give a file name in it")
        if not self.path.parent.is_dir():
            raise ConfigError(
                f"cannot write the trace {self.path}: its directory {self.path.parent} does not exist; create it first"
            )
        self.offset = self._resume()
        self._f: IO[str] = self.path.open("a", encoding="utf-8")
        self._t0: float | None = None

    def _resume(self) -> float:
        """Where arrivals continue in an existing trace; a half-written last line (a crash) is cut off."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return 0.0
        raw = self.path.read_bytes()
        if not raw.endswith(b"\n"):
            keep = raw.rfind(b"\n") + 1
            with self.path.open("r+b") as f:
                f.truncate(keep)
            raw = raw[:keep]
        last = -1.0
        for line in raw.splitlines():
            try:
                a = json.loads(line).get("arrival_s")
            except (ValueError, AttributeError):
                continue
            if isinstance(a, (int, float)) and math.isfinite(a):
                last = max(last, float(a))
        return last + 1.0 if last >= 0 else 0.0

    def arrived(self) -> float:
        """The arrival time of a request received now (the first one sets the trace's zero)."""
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        return self.offset + now - self._t0

    def write(self, request: Request) -> None:
        self._f.write(json.dumps(request.to_json(), ensure_ascii=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class CaptureProxy:
    """The recording reverse proxy (an aiohttp application plus the client session it forwards with)."""

    def __init__(self, upstream_url: str, out_path: str | Path, *, with_prompts: bool = False) -> None:
        try:
            url = URL(upstream_url)
        except ValueError:
            url = None
        if url is None or url.scheme not in ("http", "https") or not url.host:
            raise ConfigError(
                f"the upstream must be production's base URL, e.g. http://127.0.0.1:8000, got {upstream_url!r}"
            )
        self.upstream = upstream_url.rstrip("/")
        self.with_prompts = with_prompts
        self.writer = TraceWriter(out_path)
        self.stats = CaptureStats()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)  # long prompts; aiohttp's default is 1 MiB
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def start(self, host: str = DEFAULT_HOST, port: int = 0, shutdown_timeout: float = 2.0) -> int:
        """Listen; the port listened on (port 0 picks a free one)."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),  # an open door: the proxy must not queue production
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),  # a generation may take minutes
            auto_decompress=False,  # bodies pass through as the server sent them
            cookie_jar=aiohttp.DummyCookieJar(),  # one client's cookies are not another's
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),  # forward the client's, not ours
            trust_env=False,
        )
        # handler_cancellation: a client that goes away cancels its handler, which closes the upstream
        # connection, which makes vLLM abort the request and free its KV cache
        self._runner = web.AppRunner(
            self.app(), access_log=None, handler_cancellation=True, shutdown_timeout=shutdown_timeout
        )
        await self._runner.setup()
        # our own socket, so that the port bound (port 0: any free one) can be read back
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            await web.SockSite(self._runner, sock, backlog=1024).start()
        except BaseException:
            sock.close()
            raise
        return int(sock.getsockname()[1])

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        self.writer.close()

    # -- one request -------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        api = RECORDED.get(request.path) if request.method == "POST" else None
        arrival = self.writer.arrived() if api is not None else 0.0
        body = await request.read()
        payload: dict[str, Any] | None = None
        strip_usage = False
        drop: frozenset[str] = frozenset()
        if api is not None:
            try:
                parsed = json.loads(body) if body else None
            except ValueError:
                parsed = None  # upstream answers the 400
            if isinstance(parsed, dict):
                payload = parsed
                body, strip_usage = self._ask_for_usage(payload, body)
                drop = frozenset({"accept-encoding"})  # the proxy reads these bodies: keep them plain
        headers = _forward_headers(request.headers, drop)
        self.stats.forwarded += 1
        assert self._session is not None, "start() first"
        try:
            upstream = await self._session.request(
                request.method,
                URL(self.upstream + request.raw_path, encoded=True),
                headers=headers,
                data=body or None,
                allow_redirects=False,
            )
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            self.stats.upstream_errors += 1
            if api is not None:
                self.stats.not_recorded += 1
            return _bad_gateway(self.upstream, e)
        except asyncio.CancelledError:  # the client left before the response began
            if api is not None:
                self.stats.not_recorded += 1
            raise
        ex = _Exchange()
        try:
            out_headers = _forward_headers(upstream.headers)
            record = api is not None and payload is not None and upstream.status == 200
            if upstream.content_type == "text/event-stream":
                resp = await self._relay_events(request, upstream, out_headers, ex, record, strip_usage)
            elif "Content-Length" in upstream.headers or record:
                try:
                    data = await upstream.read()
                except aiohttp.ClientError as e:  # upstream broke off (a crash mid-response)
                    self.stats.upstream_errors += 1
                    return _bad_gateway(self.upstream, e)
                ex.complete = True
                if record:
                    try:
                        found = json.loads(data).get("usage")
                    except (ValueError, AttributeError):
                        found = None
                    ex.usage = found if isinstance(found, dict) else None
                resp = web.Response(status=upstream.status, reason=upstream.reason, headers=out_headers, body=data)
            else:
                resp = await self._relay_bytes(request, upstream, out_headers, ex)
        finally:
            # Also on cancellation (the client went away): a response upstream has not finished is
            # dropped with its connection, not pooled, so that the server stops generating for nobody.
            if ex.complete:
                upstream.release()
            else:
                upstream.close()
            if api is not None:
                if ex.complete and ex.usage is not None:
                    self._record(api, payload or {}, arrival, ex.usage)
                else:
                    self.stats.not_recorded += 1
        return resp

    @staticmethod
    def _ask_for_usage(payload: dict[str, Any], body: bytes) -> tuple[bytes, bool]:
        """The body to forward, and whether the usage chunk must be kept from the client."""
        if not payload.get("stream"):
            return body, False  # a plain response always has usage
        opts = payload.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            return body, False  # malformed: let the server say so
        if opts and opts.get("include_usage"):
            return body, False  # the client asked for it: it sees it
        new_opts = dict(opts or {})
        new_opts["include_usage"] = True
        # continuous_usage_stats only counts with include_usage; set, it would add usage to every chunk
        new_opts.pop("continuous_usage_stats", None)
        return json.dumps({**payload, "stream_options": new_opts}, ensure_ascii=False).encode(), True

    async def _relay_events(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        headers: CIMultiDict[str],
        ex: _Exchange,
        record: bool,
        strip_usage: bool,
    ) -> web.StreamResponse:
        """Relay an SSE stream event by event (each as soon as it is complete), picking out the usage."""
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        buf = b""
        try:
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                buf += chunk
                out = []
                pos = 0
                while (m := _EVENT_END.search(buf, pos)) is not None:
                    event = buf[pos : m.end()]
                    pos = m.end()
                    if _is_done(event):
                        ex.complete = True
                    elif record:
                        u, usage_only = _usage_of(event)
                        if u is not None:
                            ex.usage = u  # the last one wins: with continuous usage every chunk has a running count
                            if usage_only and strip_usage:
                                continue  # ours, not the client's
                    out.append(event)
                buf = buf[pos:]
                if out:
                    await resp.write(b"".join(out))
            ex.complete = True  # upstream ended the stream (with or without [DONE])
            if buf:
                await resp.write(buf)  # an unterminated last event: pass it on as it is
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientPayloadError):
            pass  # the client went away, or upstream broke off: complete only if [DONE] came first
        return resp

    @staticmethod
    async def _relay_bytes(
        request: web.Request, upstream: aiohttp.ClientResponse, headers: CIMultiDict[str], ex: _Exchange
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        try:
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
            ex.complete = True
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientPayloadError):
            pass
        return resp

    def _record(self, api: Api, payload: dict[str, Any], arrival: float, usage: dict[str, Any]) -> None:
        try:
            prompt_tokens = int(usage.get("prompt_tokens") or 0)
            output_tokens = int(usage.get("completion_tokens") or 0)
        except (TypeError, ValueError):
            self.stats.not_recorded += 1
            return
        n = payload.get("n")
        if isinstance(n, int) and n > 1:
            output_tokens = round(output_tokens / n)  # usage counts every choice; a replay asks for one
        if prompt_tokens < 1 or output_tokens < 1:
            self.stats.not_recorded += 1  # the trace format needs both (max_tokens 0 requests have no output)
            return
        prompt = _prompt_text(api, payload) if self.with_prompts else None
        self.writer.write(
            Request(
                arrival_s=round(arrival, 6),
                output_tokens=output_tokens,
                prompt=prompt,
                prompt_tokens=prompt_tokens,
                api=api,
            )
        )
        self.stats.recorded += 1


async def serve_capture(
    listen_host: str,
    listen_port: int,
    upstream_url: str,
    out_path: str | Path,
    *,
    with_prompts: bool = False,
    stop: asyncio.Event | None = None,
    stop_event: threading.Event | None = None,
    on_ready: Callable[[int], None] | None = None,
) -> CaptureStats:
    """Run the proxy in the running loop until ``stop`` or ``stop_event`` is set (or SIGINT/SIGTERM
    in the main thread); its counts. ``on_ready`` gets the port once it listens."""
    proxy = CaptureProxy(upstream_url, out_path, with_prompts=with_prompts)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
                handled.append(sig)
            except (NotImplementedError, RuntimeError):
                pass
    try:
        port = await proxy.start(listen_host, listen_port)
        if on_ready is not None:
            on_ready(port)
        while not stop.is_set() and not (stop_event is not None and stop_event.is_set()):
            # a threading.Event cannot wake the loop: look at it ten times a second
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        await proxy.close()
    return proxy.stats


def run_capture(
    listen_host: str,
    listen_port: int,
    upstream_url: str,
    out_path: str | Path,
    *,
    with_prompts: bool = False,
    stop_event: threading.Event | None = None,
    on_ready: Callable[[int], None] | None = None,
) -> CaptureStats:
    """Blocking: record traffic to ``out_path`` until ``stop_event`` is set or SIGINT/SIGTERM.

    Pass ``DEFAULT_HOST`` (127.0.0.1) as listen_host unless the proxy must be reachable from
    other hosts. May run in a thread of its own (it makes its own event loop).
    """
    from autotune.workload.eventloop import event_loop_factory

    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(
            serve_capture(
                listen_host,
                listen_port,
                upstream_url,
                out_path,
                with_prompts=with_prompts,
                stop_event=stop_event,
                on_ready=on_ready,
            )
        )
