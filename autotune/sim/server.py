"""vllm-sim's HTTP server: vLLM's OpenAI-compatible API over the simulated engine, in real time.

One process, one asyncio loop (uvloop when installed), three parts:

- **Start-up** (``serve``): the memory plan of ``startup.plan_startup`` played back as vLLM's
  log lines, each phase slept for its duration x ``time_scale``; a config error or a start-up
  failure is printed the way vLLM prints it (exit 1). The listening socket is bound first
  (a port in use fails at once, ``[Errno 98]``) but listens only once start-up is complete:
  until then connections are refused, as with vLLM.
- **The engine loop** (``realtime.RealtimeEngine``): the same Scheduler and StepModel as
  ``virtual.simulate``, driven by the loop's clock (see realtime.py).
- **The API** (aiohttp): ``/health``, ``/ping``, ``/version``, ``/v1/models``, ``/metrics`` and
  ``/v1/completions`` / ``/v1/chat/completions`` (SSE or not), with the JSON shapes vLLM's
  pydantic models produce (field order and nulls included, read from vLLM's serving code).
  A client that goes away has its request aborted (``handler_cancellation``), freeing its KV
  blocks, as vLLM does.

Prompts become token ids, output lengths and generated text in text.py; the token ids give
the request's prefix-cache block hashes (``scheduler.block_hashes``). ``/metrics`` serves the
exposition of exposition.py; log lines are vLLM's (log.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from autotune.engine.model import ModelShape
from autotune.sim.config import SimConfig, not_modelled
from autotune.sim.exposition import SimMetrics
from autotune.sim.log import PID, log
from autotune.sim.perf import API_SERVER
from autotune.sim.profiles import GpuProfile
from autotune.sim.realtime import RealtimeEngine, Stream
from autotune.sim.scheduler import Request, block_hashes
from autotune.sim.startup import plan_startup
from autotune.sim.text import TextCodec, chat_prompt, eos_length, token_text
from autotune.sim.virtual import SimEngine

__all__ = ["VLLM_VERSION", "ServeOptions", "SimApi", "run", "serve"]

VLLM_VERSION = "0.33.0"


# --- the HTTP API ---------------------------------------------------------------------------------


def _dumps(obj: object) -> str:
    """pydantic's model_dump_json: compact, not ASCII-escaped."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class ApiError(Exception):
    def __init__(
        self, message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.err_type, self.param = status, err_type, param

    def response(self) -> web.Response:
        body = {"error": {"message": str(self), "type": self.err_type, "param": self.param, "code": self.status}}
        return web.Response(status=self.status, text=_dumps(body), content_type="application/json")


@dataclass
class _Call:
    """A parsed completion request."""

    chat: bool
    rid: str
    ids: list[int]
    max_tokens: int
    max_tokens_param: int | None
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    seed: int | None
    min_tokens: int


class SimApi:
    def __init__(
        self, engine: RealtimeEngine, codec: TextCodec, served_names: list[str], root: str, max_model_len: int
    ) -> None:
        self.engine = engine
        self.codec = codec
        self.names = served_names
        self.model = served_names[0]
        self.root = root
        self.max_model_len = max_model_len
        self._ids = itertools.count()  # clients may reuse X-Request-Id: the engine's ids must stay unique

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)  # long prompts
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_post("/ping", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION}, dumps=_dumps)

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        cards = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": self.root,
                "parent": None,
                "max_model_len": self.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in self.names
        ]
        return web.json_response({"object": "list", "data": cards}, dumps=_dumps)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.engine.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    # -- parsing ---------------------------------------------------------------------------------

    def _parse(self, request: web.Request, body: Any, chat: bool) -> _Call:
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        model = body.get("model")
        if model and model not in self.names:
            raise ApiError(
                f"The model `{model}` does not exist. Valid aliases: {', '.join(self.names)}.",
                404,
                "NotFoundError",
                "model",
            )
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError("messages: a non-empty list of messages is required", param="messages")
            ids = self.codec.encode(chat_prompt(messages))
            mt = body.get("max_completion_tokens") or body.get("max_tokens")
        else:
            ids = self._prompt_ids(body.get("prompt"))
            mt = body.get("max_tokens", 16)
        if body.get("stream_options") and not body.get("stream"):
            raise ApiError("Stream options can only be defined when `stream=True`.", param="stream_options")
        mml = self.max_model_len
        if len(ids) > mml:
            raise ApiError(
                f"This model's maximum context length is {mml} tokens. However, your prompt contains "
                f"{len(ids)} input tokens, which exceeds this limit even without any output tokens. "
                f"Please reduce the length of the input prompt. (parameter=input_tokens, "
                f"value={len(ids)})",
                param="input_tokens",
            )
        if mt is not None:
            if not isinstance(mt, int) or isinstance(mt, bool) or mt < 0:
                raise ApiError(f"max_tokens must be a non-negative integer, got {mt!r}", param="max_tokens")
            if mt > mml:
                name = "max_completion_tokens" if chat and body.get("max_completion_tokens") else "max_tokens"
                raise ApiError(
                    f"{name}={mt} cannot be greater than max_model_len={mml}. Please request fewer "
                    f"output tokens. (parameter={name}, value={mt})",
                    param=name,
                )
        # vLLM's get_max_tokens: the request's limit, clamped to what the context leaves
        limit = mml - len(ids) if mt is None else min(mt, mml - len(ids))
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
        seed = body.get("seed")
        base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        return _Call(
            chat=chat,
            rid=("chatcmpl-" if chat else "cmpl-") + base,
            ids=ids,
            max_tokens=limit,
            max_tokens_param=mt,
            ignore_eos=bool(body.get("ignore_eos", False)),
            stream=bool(body.get("stream", False)),
            include_usage=include_usage,
            continuous_usage=include_usage and bool(opts.get("continuous_usage_stats")),
            seed=seed if isinstance(seed, int) else None,
            min_tokens=int(body.get("min_tokens") or 0),
        )

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.codec.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)  # token ids, as vLLM accepts them
        if isinstance(prompt, list) and len(prompt) > 1:
            raise ApiError("vllm-sim serves one prompt per request; send a batch as separate requests", param="prompt")
        raise ApiError("prompt: a string or a list of token ids is required", param="prompt")

    # -- generation ------------------------------------------------------------------------------

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ApiError(f"invalid JSON body: {e}") from None
            try:
                call = self._parse(request, body, chat)
            except (TypeError, ValueError) as e:  # a field of the wrong type (pydantic's 400 in vLLM)
                raise ApiError(f"invalid request: {e}") from None
        except ApiError as e:
            return e.response()
        loop = asyncio.get_running_loop()
        created = int(time.time())
        text_seed = hash(call.rid) & 0xFFFF
        if call.max_tokens == 0:
            return await self._respond_empty(request, call, created)
        n = (
            call.max_tokens
            if call.ignore_eos
            else min(call.max_tokens, eos_length(call.ids, call.seed, call.min_tokens))
        )
        bs = self.engine.engine.config.block_size
        req = Request(f"{call.rid}-{next(self._ids)}", len(call.ids), n, loop.time(), block_hashes(call.ids, bs))
        s = Stream(req, req.arrival_s, call.max_tokens, call.max_tokens_param, text_seed)
        self.engine.add(s)
        try:
            if call.stream:
                return await self._stream(request, call, s, created)
            return await self._complete(call, s, created)
        finally:
            if not s.done:
                self.engine.abort(s)  # the client disconnected (or we are shutting down)

    async def _respond_empty(self, request: web.Request, call: _Call, created: int) -> web.StreamResponse:
        # max_tokens 0 (or a prompt that fills the context): nothing to generate, vLLM answers at once
        s = Stream(Request(call.rid, len(call.ids), 0), 0.0, 0, call.max_tokens_param, 0, finish_reason="length")
        if call.stream:
            return await self._stream(request, call, s, created)
        return await self._complete(call, s, created)

    def _usage(self, prompt: int, completion: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}

    async def _complete(self, call: _Call, s: Stream, created: int) -> web.Response:
        while not s.done:
            await s.event.wait()
            s.event.clear()
        if s.error:
            return ApiError(s.error, 500, "InternalServerError").response()
        n = s.released
        text = "".join(token_text(s.seed, j) for j in range(n))
        usage = {**self._usage(len(call.ids), n), "prompt_tokens_details": None, "completion_tokens_details": None}
        if call.chat:
            body: dict[str, Any] = {
                "id": call.rid,
                "object": "chat.completion",
                "created": created,
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "reasoning": None,
                        },
                        "logprobs": None,
                        "finish_reason": s.finish_reason,
                        "stop_reason": None,
                        "token_ids": None,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "prompt_text": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        else:
            body = {
                "id": call.rid,
                "object": "text_completion",
                "created": created,
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": s.finish_reason,
                        "stop_reason": None,
                        "token_ids": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": None,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        return web.Response(text=_dumps(body), content_type="application/json")

    async def _stream(self, request: web.Request, call: _Call, s: Stream, created: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        try:
            await resp.prepare(request)
            await self._write_events(resp, call, s, created)
        except ConnectionResetError:
            pass  # the client went away mid-stream: _generate aborts the request
        return resp

    async def _write_events(self, resp: web.StreamResponse, call: _Call, s: Stream, created: int) -> None:
        obj = "chat.completion.chunk" if call.chat else "text_completion"
        # the part every chunk starts with, serialized once
        head = f'data: {{"id":{_dumps(call.rid)},"object":"{obj}","created":{created},"model":{_dumps(self.model)},'
        prompt_len = len(call.ids)
        sent = 0
        while True:
            while s.released == sent and not s.done:
                await s.event.wait()
                s.event.clear()
            if s.error:
                err = {"error": {"message": s.error, "type": "InternalServerError", "param": None, "code": 500}}
                await resp.write(f"data: {_dumps(err)}\n\n".encode())
                break
            n = s.released
            finish = s.finish_reason
            if n > sent or finish:
                text = "".join(token_text(s.seed, j) for j in range(sent, n))
                out = []
                if call.chat:
                    if sent == 0:
                        # vLLM sends the role with the first engine output, not when the request arrives
                        role = (
                            '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                            '"finish_reason":null}]'
                        )
                        if call.continuous_usage:
                            role += f',"usage":{_dumps(self._usage(prompt_len, 0))}'
                        out.append(head + role + ',"prompt_token_ids":null,"prompt_text":null}\n\n')
                    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                if finish or not call.chat:
                    choice["stop_reason"] = None
                if not call.chat:
                    choice["prompt_token_ids"] = None
                choice["token_ids"] = None
                chunk = head + '"choices":[' + _dumps(choice) + "]"
                if call.continuous_usage:
                    chunk += ',"usage":' + _dumps(self._usage(prompt_len, n))
                out.append(chunk + "}\n\n")
                sent = n
                await resp.write("".join(out).encode())
            if finish:
                break
        tail = ""
        if call.include_usage and not s.error:
            tail = head + '"choices":[],"usage":' + _dumps(self._usage(prompt_len, sent)) + "}\n\n"
        await resp.write((tail + "data: [DONE]\n\n").encode())
        await resp.write_eof()


# --- start-up and serving -------------------------------------------------------------------------


@dataclass
class ServeOptions:
    model: str  # MODEL as given on the command line
    served_names: list[str]
    shape: ModelShape
    gpu: GpuProfile
    config: SimConfig
    host: str = "127.0.0.1"
    port: int = 8000
    tokenizer: str | None = None  # a tokenizer.json, or None for ~4 bytes a token
    time_scale: float = 1.0
    used_by_others: int = 0
    log_stats: bool = True
    non_default_args: dict[str, Any] = field(default_factory=dict)


def _config_class(error: str) -> str:
    if "gpu_memory_utilization" in error or "block_size" in error:
        return "CacheConfig"
    return "SchedulerConfig"


def print_validation_error(error: str, stream: TextIO | None = None) -> None:
    """vLLM's pydantic ValidationError, as it ends the traceback on stderr."""
    out = stream or sys.stderr
    print("Traceback (most recent call last):", file=out)
    print('  File "vllm/engine/arg_utils.py", in create_engine_config', file=out)
    print(f"pydantic_core._pydantic_core.ValidationError: 1 validation error for {_config_class(error)}", file=out)
    print(
        f"  Value error, {error} [type=value_error, input_value=ArgsKwargs((), {{...}}), input_type=ArgsKwargs]",
        file=out,
    )
    print("    For further information visit https://errors.pydantic.dev/2.12/v/value_error", file=out, flush=True)


def print_startup_failure(lines: Sequence[str]) -> None:
    """The engine core's root cause on stdout, the API server's generic error on stderr (vLLM's split)."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    prefix = f"(EngineCore pid={PID}) ERROR {stamp} [core.py] "
    print(prefix + "EngineCore failed to start.", flush=True)
    print(prefix + "Traceback (most recent call last):", flush=True)
    for line in lines:
        print(prefix + line, flush=True)
    print("Traceback (most recent call last):", file=sys.stderr)
    print(
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        file=sys.stderr,
        flush=True,
    )


def _bind(host: str, port: int) -> socket.socket:
    """Bind now, listen later: the port is ours at once but refuses connections until start-up is done."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


async def _sleep_or_stop(seconds: float, stop: asyncio.Event) -> bool:
    """Sleep; True when a signal asked to stop meanwhile."""
    if seconds <= 0:
        return stop.is_set()
    try:
        await asyncio.wait_for(stop.wait(), seconds)
        return True
    except TimeoutError:
        return False


async def serve(opts: ServeOptions) -> int:
    """Start up like vLLM, serve until SIGTERM/SIGINT; the process's exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    c = opts.config
    log("INFO", "utils.py", f"vLLM API server version {VLLM_VERSION} (vllm-sim: simulated {opts.gpu.name})")
    log("INFO", "utils.py", f"non-default args: {opts.non_default_args}")
    ignored = not_modelled(opts.shape, opts.non_default_args, model="the model")
    if ignored:
        log("WARNING", "sim", f"not modelled, simulated as if absent: {ignored}")
    try:
        sock = _bind(opts.host, opts.port)
    except OSError as e:
        print("Traceback (most recent call last):", file=sys.stderr)
        print(f"OSError: [Errno {e.errno}] {e.strerror}", file=sys.stderr, flush=True)
        log(
            "ERROR",
            "api_server.py",
            f"OSError: [Errno {e.errno}] {e.strerror} ({opts.host}:{opts.port})",
            stream=sys.stderr,
        )
        return 1
    try:
        error = c.validate()
        if error is not None:
            print_validation_error(error)
            return 1
        log("INFO", "model.py", f"Using max model len {c.max_model_len}")
        startup = plan_startup(opts.shape, opts.gpu, c, used_by_others=opts.used_by_others)
        for phase in startup.phases:
            if await _sleep_or_stop(phase.seconds * opts.time_scale, stop):
                return 0
            for line in phase.lines:
                log("INFO", "core.py", line, proc="EngineCore")
        if startup.failure or startup.plan is None:
            print_startup_failure(startup.failure or ("RuntimeError: start-up failed",))
            return 1
        engine = SimEngine(opts.shape, opts.gpu, c, startup.plan, API_SERVER)
        metrics = SimMetrics(opts.served_names[0], c, startup.plan)
        rt = RealtimeEngine(engine, metrics, log_stats=opts.log_stats)
        codec = TextCodec(opts.tokenizer)
        if codec.path is None:
            log("WARNING", "sim", "no tokenizer.json found: counting ~4 bytes a prompt token")
        api = SimApi(rt, codec, opts.served_names, opts.model, c.max_model_len)
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its request
        runner = web.AppRunner(api.app(), access_log=None, handler_cancellation=True, shutdown_timeout=0.1)
        await runner.setup()
        shown = f"[{opts.host}]" if ":" in opts.host else opts.host
        log("INFO", "api_server.py", f"Starting vLLM server on http://{shown}:{opts.port}")
        site = web.SockSite(runner, sock, backlog=4096)
        await site.start()
        print(f"(APIServer pid={PID}) INFO:     Started server process [{PID}]", flush=True)
        print(f"(APIServer pid={PID}) INFO:     Waiting for application startup.", flush=True)
        print(f"(APIServer pid={PID}) INFO:     Application startup complete.", flush=True)
        tasks = [asyncio.create_task(rt.run(), name="engine")]
        if opts.log_stats:
            tasks.append(asyncio.create_task(rt.log_stats_forever(), name="log-stats"))
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
        crashed = [t for t in done if t is not stopped and t.exception() is not None]
        print(f"(APIServer pid={PID}) INFO:     Shutting down", flush=True)
        for t in (stopped, *tasks):
            t.cancel()
        try:
            await asyncio.wait_for(runner.cleanup(), 1.0)
        except TimeoutError:
            log("WARNING", "api_server.py", "open connections did not close within 1 s: leaving them")
        if crashed:
            exc = crashed[0].exception()
            log(
                "ERROR",
                "core.py",
                f"EngineCore encountered a fatal error: {exc!r}",
                proc="EngineCore",
                stream=sys.stderr,
            )
            return 1
        print(f"(APIServer pid={PID}) INFO:     Application shutdown complete.", flush=True)
        return 0
    finally:
        sock.close()


def run(opts: ServeOptions) -> int:
    factory: Callable[[], asyncio.AbstractEventLoop] | None
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(serve(opts))
