"""A fake OpenAI-compatible streaming server with fixed, known timings (a test instrument).

Real vLLM cannot tell us the truth about its own latencies, so the replay client is measured
against this: every stream waits ``ttft`` before its first token and ``itl`` between tokens,
emits exactly ``max_tokens`` tokens in vLLM's SSE shapes (completion and chat, usage chunk,
``[DONE]``), and records when it actually wrote each chunk. ``stream_interval`` (``--stream-interval``,
vLLM's flag of the same name) packs tokens into chunks as vLLM does: the first token alone, then
a chunk once ``stream_interval`` more tokens are generated, and the rest when the stream ends;
each chunk leaves when its last token is due, so the usage chunk's ``completion_tokens`` is
the only true token count. A prompt containing FAIL gets
an HTTP 500, to test how failures are counted. ``GET /truth`` returns those
records, keyed by the request's ``x-request-id`` header, so a benchmark compares the client's
TTFT and ITL with what the server did. Plain asyncio, HTTP/1.1 keep-alive, one process.

    python -m autotune.sim.fixed_timing --port 8200 --ttft-ms 20 --itl-ms 5 [--stream-interval 4]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time

MODEL = "fixed-timing"


def chunk_sizes(n: int, stream_interval: int = 1) -> list[int]:
    """Tokens per streamed chunk for ``n`` output tokens, as vLLM's output processor groups them."""
    if stream_interval < 1:
        raise ValueError(f"stream_interval must be at least 1, not {stream_interval}")
    sizes: list[int] = []
    pending = 0
    for i in range(n):
        pending += 1
        if i == 0 or pending >= stream_interval or i == n - 1:
            sizes.append(pending)
            pending = 0
    return sizes


class FixedTimingServer:
    def __init__(self, ttft_s: float, itl_s: float, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, not {stream_interval}")
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.stream_interval = stream_interval
        self.truth: dict[str, dict[str, object]] = {}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                t_recv = time.perf_counter()
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:] if ":" in h)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "GET":
                    await self._json(writer, self._get(path))
                elif path in ("/v1/completions", "/v1/chat/completions"):
                    req = json.loads(body)
                    if "FAIL" in json.dumps(req.get("prompt", req.get("messages"))):
                        await self._json(writer, {"error": "asked to fail"}, 500)  # to test failure counting
                    else:
                        await self._stream(writer, path, req, headers.get("x-request-id"), t_recv)
                else:
                    await self._json(writer, {"error": "not found"}, 404)
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def _get(self, path: str) -> object:
        if path == "/truth":
            return self.truth
        if path == "/v1/models":
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
        return {}  # /health

    async def _json(self, writer: asyncio.StreamWriter, obj: object, status: int = 200) -> None:
        data = json.dumps(obj).encode()
        writer.write(
            f"HTTP/1.1 {status} OK\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n".encode()
            + data
        )
        await writer.drain()

    async def _stream(self, writer, path: str, req: dict, rid: str | None, t_recv: float) -> None:
        chat = path.endswith("chat/completions")
        n = int(req.get("max_tokens") or 16)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

        def chunk(obj: object) -> bytes:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            return f"{len(data):x}\r\n".encode() + data + b"\r\n"

        obj = "chat.completion.chunk" if chat else "text_completion"
        writes = []
        sizes = chunk_sizes(n, self.stream_interval)
        start = t_recv
        last_token = -1  # index of the last token written so far
        for k, size in enumerate(sizes):
            last_token += size
            due = start + self.ttft_s + last_token * self.itl_s  # a chunk leaves when its last token is due
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            finish = "length" if k == len(sizes) - 1 else None
            if chat:
                delta = {"role": "assistant", "content": ""} if k == 0 else {"content": " tok" * size}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": " tok" * size, "finish_reason": finish}
            writer.write(chunk({"id": "x", "object": obj, "model": MODEL, "choices": [choice]}))
            await writer.drain()
            writes.append(time.perf_counter())
        usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
        writer.write(chunk({"id": "x", "object": obj, "model": MODEL, "choices": [], "usage": usage}))
        writer.write(chunk(b"[DONE]") + b"0\r\n\r\n")
        await writer.drain()
        if rid is not None:
            self.truth[rid] = {
                "ttft": writes[0] - t_recv,
                "itl": [b - a for a, b in itertools.pairwise(writes)],
                "chunk_tokens": sizes,
            }


async def serve(host: str, port: int, ttft_s: float, itl_s: float, stream_interval: int = 1) -> None:
    srv = FixedTimingServer(ttft_s, itl_s, stream_interval)
    server = await asyncio.start_server(srv.handle, host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8200)
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--itl-ms", type=float, default=5.0)
    ap.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per SSE chunk after the first, as vLLM's --stream-interval (default: 1)",
    )
    a = ap.parse_args()
    if a.stream_interval < 1:
        ap.error("--stream-interval must be at least 1")
    try:
        try:
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:
            factory = None
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve(a.host, a.port, a.ttft_ms / 1000, a.itl_ms / 1000, a.stream_interval))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
