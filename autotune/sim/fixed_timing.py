"""A fake OpenAI-compatible streaming server with fixed, known timings (a test instrument).

Real vLLM cannot tell us the truth about its own latencies, so the replay client is measured
against this: every stream waits ``ttft`` before its first token and ``itl`` between tokens,
emits exactly ``max_tokens`` tokens in vLLM's SSE shapes (completion and chat, usage chunk,
``[DONE]``), and records when it actually wrote each chunk. A prompt containing FAIL gets
an HTTP 500, to test how failures are counted. ``GET /truth`` returns those
records, keyed by the request's ``x-request-id`` header, so a benchmark compares the client's
TTFT and ITL with what the server did. Plain asyncio, HTTP/1.1 keep-alive, one process.

    python -m autotune.sim.fixed_timing --port 8200 --ttft-ms 20 --itl-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

MODEL = "fixed-timing"


class FixedTimingServer:
    def __init__(self, ttft_s: float, itl_s: float) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.truth: dict[str, dict[str, object]] = {}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                t_recv = time.perf_counter()
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
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
        writer.write(f"HTTP/1.1 {status} OK\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n".encode() + data)
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
        start = t_recv
        for i in range(n):
            due = start + self.ttft_s + i * self.itl_s
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if chat:
                delta = {"role": "assistant", "content": ""} if i == 0 else {"content": " tok"}
                choice = {"index": 0, "delta": delta, "finish_reason": "length" if i == n - 1 else None}
            else:
                choice = {"index": 0, "text": " tok", "finish_reason": "length" if i == n - 1 else None}
            writer.write(chunk({"id": "x", "object": obj, "model": MODEL, "choices": [choice]}))
            await writer.drain()
            writes.append(time.perf_counter())
        usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
        writer.write(chunk({"id": "x", "object": obj, "model": MODEL, "choices": [], "usage": usage}))
        writer.write(chunk(b"[DONE]") + b"0\r\n\r\n")
        await writer.drain()
        if rid is not None:
            self.truth[rid] = {"ttft": writes[0] - t_recv, "itl": [b - a for a, b in zip(writes, writes[1:])]}


async def serve(host: str, port: int, ttft_s: float, itl_s: float) -> None:
    srv = FixedTimingServer(ttft_s, itl_s)
    server = await asyncio.start_server(srv.handle, host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8200)
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--itl-ms", type=float, default=5.0)
    a = ap.parse_args()
    try:
        try:
            import uvloop
            factory = uvloop.new_event_loop
        except ImportError:
            factory = None
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve(a.host, a.port, a.ttft_ms / 1000, a.itl_ms / 1000))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
