"""vllm-sim's HTTP server: vLLM's OpenAI-compatible API over the simulated engine, in real time.

One process, one asyncio loop (uvloop when installed), three parts:

- **Start-up** (``serve``): the memory plan of ``startup.plan_startup`` played back as vLLM's
  log lines, each phase slept for its duration x ``time_scale``; a config error or a start-up
  failure is printed the way vLLM prints it (exit 1). The listening socket is bound first
  (a port in use fails at once, ``[Errno 98]``) but listens only once start-up is complete:
  until then connections are refused, as with vLLM.
- **The engine loop** (``RealtimeEngine``): the same Scheduler and StepModel as
  ``virtual.simulate``, driven by the loop's monotonic clock. A step starts where the
  previous one ended *in simulated time* (its target), not when Python got round to it, so
  the time Python spends scheduling, serializing and writing is absorbed instead of adding up
  as drift; only when the host falls more than ``MAX_CATCH_UP_S`` behind does the simulation
  give up the lost time (and say so in the log). Tokens produced by a step are handed to the
  request's ``Stream`` at the step's end, honouring ``--stream-interval`` the way vLLM's output
  processor does (the first token at once, then every N tokens, and the last).
- **The API** (aiohttp): ``/health``, ``/ping``, ``/version``, ``/v1/models``, ``/metrics`` and
  ``/v1/completions`` / ``/v1/chat/completions`` (SSE or not), with the JSON shapes vLLM's
  pydantic models produce (field order and nulls included, read from vLLM's serving code).
  A client that goes away has its request aborted (``handler_cancellation``), freeing its KV
  blocks, as vLLM does.

Prompts are counted with the model's tokenizer when there is one (``tokenizer.json``),
otherwise as ~4 bytes a token; the token ids feed chained per-block hashes, so requests that
share a prefix share KV blocks through the prefix cache. Without ``ignore_eos`` a request may
end early at a simulated EOS: each token is EOS with probability ``1/EOS_MEAN_TOKENS``, drawn
from a generator seeded with the prompt's tokens (and the request's ``seed``), so the same
request always gets the same length, as under greedy decoding.

The Prometheus metrics are vLLM 0.33's names, help texts, label names and buckets
(v1/metrics/loggers.py, buckets.py), fed from what the simulation did: TTFT is a token's
step end minus the request's arrival, and so on.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import os
import random
import signal
import socket
import sys
import time
import uuid
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from autotune.engine.model import ModelShape
from autotune.sim.config import SimConfig
from autotune.sim.profiles import GpuProfile
from autotune.sim.scheduler import Request, StepPlan
from autotune.sim.startup import MemoryPlan, plan_startup
from autotune.sim.virtual import SimEngine

__all__ = [
    "VLLM_VERSION",
    "RealtimeEngine",
    "ServeOptions",
    "SimApi",
    "SimMetrics",
    "Stream",
    "TextCodec",
    "block_hashes",
    "eos_length",
    "log",
    "run",
    "serve",
]

VLLM_VERSION = "0.33.0"
PID = os.getpid()
MAX_CATCH_UP_S = 0.25  # how far behind real time the engine may run and still make it up
EOS_MEAN_TOKENS = 256  # mean output length when EOS is not ignored (EOS probability 1/256 a token)
LOG_STATS_INTERVAL_S = 10.0  # vLLM's LoggingStatLogger interval
# Generated text: one short word piece per token, always non-empty (benchmarks count chunks with text).
WORDS = (" the", " of", " and", " to", " in", " a", " is", " that", " for", " it", " as", " was", " with",
         " be", " by", " on", " not", " he", " this", " are", " or", " his", " from", " at", " which",
         " but", " have", " an", " had", " they", " you", " were", " their", " one", " all", " we", " can",
         " her", " has", " there", " been", " if", " more", " when", " will", " would", " who", " so",
         " no", " time", " out", " up", " new", " some", " could", " these", " two", " may", " first",
         " then", " do", " any", " like", " my")


def log(level: str, where: str, message: str, *, proc: str = "APIServer", stream: TextIO | None = None) -> None:
    """One vLLM-style log line: ``(APIServer pid=N) INFO 11-22 10:00:00 [api_server.py] message``."""
    print(f"({proc} pid={PID}) {level} {time.strftime('%m-%d %H:%M:%S')} [{where}] {message}",
          file=stream or sys.stdout, flush=True)


# --- prompts: token ids, block hashes, output length ---------------------------------------------

class TextCodec:
    """Text -> token ids: the model's tokenizer when there is one, else ~4 bytes a token."""

    def __init__(self, tokenizer_file: str | None = None) -> None:
        self.path = tokenizer_file
        self._tok = None
        if tokenizer_file:
            # imported only when a tokenizer is given: tokenizers is an optional dependency
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(tokenizer_file)

    @staticmethod
    def find(tokenizer: str | None, model: str) -> str | None:
        """tokenizer.json from --tokenizer (a file or a directory), else from the model directory."""
        for cand in (tokenizer, model):
            if not cand:
                continue
            p = Path(cand)
            if p.is_file():
                return str(p)
            if (p / "tokenizer.json").is_file():
                return str(p / "tokenizer.json")
        return None

    def encode(self, text: str) -> list[int]:
        if self._tok is not None:
            return list(self._tok.encode(text).ids)
        # Pseudo token ids: one per 4-byte chunk (the last chunk takes the 1-3 bytes left over), so
        # equal text prefixes give equal ids and the count is what virtual.py assumes for text traces.
        b = text.encode()
        k = max(1, len(b) // 4)
        return [int.from_bytes(b[4 * i:4 * i + 4] if i < k - 1 else b[4 * i:], "little") for i in range(k)]


def chat_prompt(messages: Sequence[dict[str, Any]]) -> str:
    """A simple chat template (the tiny test model's): ``<|role|>\\ncontent\\n`` per message, then the assistant's turn."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|>\n{content or ''}\n")
    return "".join(parts) + "<|assistant|>\n"


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block, chained over the ids (vLLM's prefix-cache keys): equal prefixes, equal hashes."""
    out: list[int] = []
    h = 0
    for i in range(len(token_ids) // block_size):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


def eos_length(token_ids: Sequence[int], seed: int | None = None, min_tokens: int = 0) -> int:
    """Where a request would emit EOS: geometric with mean EOS_MEAN_TOKENS, fixed by the prompt (and seed)."""
    # a digest, not hash(): the same request must end at the same length in every process
    digest = hashlib.blake2b(array("Q", (t & 0xFFFFFFFFFFFFFFFF for t in token_ids)).tobytes(), digest_size=8,
                             key=str(seed).encode()[:64]).digest()
    u = random.Random(int.from_bytes(digest, "little")).random()
    # inverse CDF of the geometric distribution with p = 1/EOS_MEAN_TOKENS, lengths from 1
    n = 1 + int(math.log(1.0 - u) / math.log(1.0 - 1.0 / EOS_MEAN_TOKENS))
    return max(n, min_tokens, 1)


def token_text(seed: int, j: int) -> str:
    return WORDS[(seed + j * 7) % len(WORDS)]


# --- metrics --------------------------------------------------------------------------------------

# vllm/v1/metrics/buckets.py (0.33)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, ... up to max_value (vLLM's request_tokens family)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return out
            out.append(v)
        exponent += 1


class SimMetrics:
    """vLLM 0.33's Prometheus metrics (the ones the study and dashboards read), in a private registry."""

    def __init__(self, model_name: str, config: SimConfig, plan: MemoryPlan) -> None:
        self.registry = r = CollectorRegistry()
        names = ["model_name", "engine"]
        lv = (model_name, "0")

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=r).labels(*lv)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=r).labels(*lv)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, names, buckets=list(buckets), registry=r).labels(*lv)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          names + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(*lv, reason) for reason in FINISH_REASONS}
        tokens = build_1_2_5_buckets(config.max_model_len)
        self.req_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.req_generation_tokens = histogram("vllm:request_generation_tokens",
                                               "Number of generation tokens processed.", tokens)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.", tokens)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                  REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", tokens)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.req_preemptions = histogram("vllm:request_num_preemptions",
                                         "Histogram of the number of times a request was preempted.",
                                         REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.prefill_kv_computed = histogram("vllm:request_prefill_kv_computed_tokens",
                                             "Histogram of new KV tokens computed during prefill "
                                             "(excluding cached tokens).", tokens)
        # An info-style gauge set to 1, its labels the CacheConfig's fields as vLLM's metrics_info() gives them.
        info = cache_config_info(config, plan)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=r).labels(**info).set(1)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def cache_config_info(config: SimConfig, plan: MemoryPlan) -> dict[str, str]:
    """vLLM's CacheConfig.metrics_info() after start-up (str() of every field), plus ``engine``."""
    return {
        "block_size": str(config.block_size), "user_specified_block_size": "True", "kv_cache_layout": "None",
        "prefix_match_unit": "None", "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "cache_dtype": config.kv_cache_dtype, "is_attention_free": "False", "num_gpu_blocks_override": "None",
        "sliding_window": "None", "enable_prefix_caching": str(config.enable_prefix_caching),
        "prefix_caching_hash_algo": "sha256", "prefix_cache_retention_interval": "0",
        "kv_cache_dtype_skip_layers": "[]", "mamba_page_size_padded": "None", "skip_page_size_padded": "None",
        "mamba_block_size": "None", "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto",
        "mamba_cache_mode": "none", "enable_mamba_shared_prefix_checkpoint": "False", "replayssm_buffer_len": "16",
        "use_replayssm": "False", "use_kda_recoverssm": "False", "num_gpu_blocks": str(plan.num_blocks),
        "num_cpu_blocks": "0", "effective_attention_block_size": str(config.block_size),
        "kv_cache_size_tokens": str(plan.kv_tokens),
        "kv_cache_max_concurrency": str(round(plan.kv_tokens / config.max_model_len, 2)),
        "hash_block_size": str(config.block_size), "cache_hit_alignment_tokens": str(config.block_size),
        "kv_sharing_fast_prefill": "False", "swa_bounded_replay": "True",
        "kv_cache_memory_bytes": str(config.kv_cache_memory_bytes), "kv_offloading_size": "None",
        "kv_offloading_backend": "native", "_block_size_resolved": "True", "engine": "0",
    }


# --- the engine in real time ----------------------------------------------------------------------

@dataclass(eq=False)
class Stream:
    """One request on its way from the engine to its HTTP response."""

    req: Request
    arrival: float  # loop time when the API server took the request
    max_tokens: int  # the client's limit (after clamping to the context): reaching it is "length"
    max_tokens_param: int | None  # as the client sent it (for vllm:request_params_max_tokens)
    seed: int  # picks the generated words
    event: asyncio.Event = field(default_factory=asyncio.Event)
    released: int = 0  # tokens handed to the response (stream_interval applied)
    finish_reason: str | None = None
    error: str | None = None
    first_token_s: float | None = None
    last_token_s: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RealtimeEngine:
    """Steps the scheduler against the loop's clock and hands out tokens (see the module docstring)."""

    def __init__(self, engine: SimEngine, metrics: SimMetrics, *, log_stats: bool = True) -> None:
        self.engine = engine
        self.sched = engine.scheduler
        self.step_model = engine.step_model
        self.metrics = metrics
        self.interval = max(1, engine.config.stream_interval)
        self.log_stats = log_stats
        self.streams: dict[str, Stream] = {}
        self._wake = asyncio.Event()
        self._stepping = False  # between schedule() and finish_step(): aborts must wait
        self._aborts: list[Request] = []
        self._seen = (0, 0, 0)  # kv.queries, kv.hits, num_preemptions already counted
        self.steps = 0
        self.lag_dropped_s = 0.0  # real time the simulation could not make up (host too slow)
        # for the periodic stats line
        self._window = {"prompt": 0, "generation": 0, "queries": 0, "hits": 0, "preemptions": 0}
        self._last_logged_busy = False

    # -- requests in and out ---------------------------------------------------------------------

    def add(self, stream: Stream) -> None:
        self.streams[stream.req.id] = stream
        self.sched.add(stream.req)
        self._wake.set()

    def abort(self, stream: Stream) -> None:
        """The client went away: free what its request holds (after the step in flight, if any)."""
        if self.streams.pop(stream.req.id, None) is None or stream.req.finished:
            return
        if self._stepping:
            self._aborts.append(stream.req)
        else:
            self.sched.abort(stream.req)

    def _apply_aborts(self) -> None:
        for req in self._aborts:
            if not req.finished:  # it may have finished in the very step it was aborted in
                self.sched.abort(req)
        self._aborts.clear()

    # -- the loop --------------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.sched
        target = loop.time()
        last_lag_log = -1e9
        while True:
            self._apply_aborts()
            if not sched.has_work:
                self._update_gauges()
                self._wake.clear()
                await self._wake.wait()
                target = loop.time()  # idle time is not a debt to make up
                continue
            now = loop.time()
            start = target
            if now - target > MAX_CATCH_UP_S:
                # Python could not keep up with the simulated GPU: drop the debt rather than burst tokens.
                self.lag_dropped_s += now - target
                start = now
                if now - last_lag_log > 60:
                    last_lag_log = now
                    log("WARNING", "sim", f"the simulation runs {now - target:.2f} s behind real time: this host "
                        "is too slow for the load (latencies include the lag)")
            plan = sched.schedule(start)
            if not plan.scheduled:
                self._count_scheduler()
                if not plan.preempted:
                    self._fail_stuck()
                target = start
                await asyncio.sleep(0)
                continue
            end = start + self.step_model.step_seconds(plan)
            self._stepping = True
            try:
                delay = end - loop.time()
                await asyncio.sleep(max(0, delay))
            finally:
                self._stepping = False
            produced = sched.finish_step(plan)
            self.steps += 1
            self._deliver(produced, end)
            self._count_scheduler(plan)
            target = end

    def _fail_stuck(self) -> None:
        # Cannot happen when start-up checked that one max_model_len request fits: a safety net, so that a
        # scheduler bug shows as one failed request (HTTP 500) instead of a server that hangs.
        sched = self.sched
        req = sched.waiting[0] if sched.waiting else sched.running[0]
        sched.abort(req)
        log("ERROR", "core.py", f"request {req.id} cannot be scheduled (prompt {req.prompt_len} tokens, "
            f"{sched.kv.num_blocks} KV blocks): failing it", proc="EngineCore")
        s = self.streams.pop(req.id, None)
        if s is not None:
            s.error = "the request cannot be scheduled: it needs more KV cache blocks than the engine has"
            s.event.set()

    def _deliver(self, produced: list[Request], t: float) -> None:
        m = self.metrics
        interval = self.interval
        for req in produced:
            s = self.streams.get(req.id)
            if s is None:
                continue  # aborted during the step
            n = req.num_output
            m.generation_tokens.inc()
            self._window["generation"] += 1
            if n == 1:
                s.first_token_s = t
                m.ttft.observe(max(t - s.arrival, 0.0))
                m.prompt_tokens.inc(req.prompt_len)
                self._window["prompt"] += req.prompt_len
            else:
                m.itl.observe(t - s.last_token_s)
            s.last_token_s = t
            if req.finished:
                s.finish_reason = "length" if n >= s.max_tokens else "stop"
                self.streams.pop(req.id, None)
                self._finished(s, t)
            if req.finished or s.released == 0 or n - s.released >= interval:
                s.released = n
                s.event.set()

    def _finished(self, s: Stream, t: float) -> None:
        m, req = self.metrics, s.req
        first = s.first_token_s if s.first_token_s is not None else t
        scheduled = req.first_scheduled_s if req.first_scheduled_s is not None else s.arrival
        n = req.num_output
        m.success[s.finish_reason or "stop"].inc()
        m.e2e.observe(max(t - s.arrival, 0.0))
        m.queue.observe(max(scheduled - s.arrival, 0.0))
        m.prefill.observe(max(first - scheduled, 0.0))
        m.decode.observe(t - first)
        m.inference.observe(max(t - scheduled, 0.0))
        m.tpot.observe((t - first) / (n - 1) if n > 1 else 0.0)
        m.req_prompt_tokens.observe(req.prompt_len)
        m.req_generation_tokens.observe(n)
        m.req_preemptions.observe(req.num_preemptions)
        m.prefill_kv_computed.observe(req.prompt_len - req.num_cached_tokens)
        m.max_generation_tokens.observe(s.max_tokens)
        m.params_n.observe(1)
        if s.max_tokens_param:
            m.params_max_tokens.observe(s.max_tokens_param)

    def _count_scheduler(self, plan: StepPlan | None = None) -> None:
        m, kv = self.metrics, self.sched.kv
        q, h, p = kv.queries, kv.hits, self.sched.num_preemptions
        q0, h0, p0 = self._seen
        if q > q0:
            m.prefix_queries.inc(q - q0)
        if h > h0:
            m.prefix_hits.inc(h - h0)
        if p > p0:
            m.preemptions.inc(p - p0)
        self._window["queries"] += q - q0
        self._window["hits"] += h - h0
        self._window["preemptions"] += p - p0
        self._seen = (q, h, p)
        if plan is not None:
            m.iteration_tokens.observe(plan.num_tokens)
        self._update_gauges()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(len(self.sched.running))
        m.waiting.set(len(self.sched.waiting))
        m.kv_usage.set(self.sched.kv.usage)

    async def log_stats_forever(self) -> None:
        """vLLM's periodic ``Engine 000: Avg prompt throughput ...`` line (not while idle)."""
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(LOG_STATS_INTERVAL_S)
            now = loop.time()
            w, dt = self._window, max(now - last, 1e-9)
            last = now
            busy = bool(w["prompt"] or w["generation"] or self.sched.has_work)
            if busy or self._last_logged_busy:
                parts = [f"Avg prompt throughput: {w['prompt'] / dt:.1f} tokens/s",
                         f"Avg generation throughput: {w['generation'] / dt:.1f} tokens/s",
                         f"Running: {len(self.sched.running)} reqs", f"Waiting: {len(self.sched.waiting)} reqs"]
                if w["preemptions"]:
                    parts.append(f"Preemptions: {w['preemptions']}")
                parts.append(f"GPU KV cache usage: {self.sched.kv.usage * 100:.1f}%")
                if w["queries"]:
                    parts.append(f"Prefix cache hit rate: {w['hits'] / w['queries'] * 100:.1f}%")
                log("INFO", "loggers.py", "Engine 000: " + ", ".join(parts))
            self._last_logged_busy = busy
            self._window = dict.fromkeys(w, 0)


# --- the HTTP API ---------------------------------------------------------------------------------

def _dumps(obj: object) -> str:
    """pydantic's model_dump_json: compact, not ASCII-escaped."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
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
    def __init__(self, engine: RealtimeEngine, codec: TextCodec, served_names: list[str], root: str,
                 max_model_len: int) -> None:
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
        cards = [{
            "id": name, "object": "model", "created": created, "owned_by": "vllm", "root": self.root, "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [{"id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission",
                            "created": created, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}],
        } for name in self.names]
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
            raise ApiError(f"The model `{model}` does not exist. Valid aliases: {', '.join(self.names)}.",
                           404, "NotFoundError", "model")
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
            raise ApiError(f"This model's maximum context length is {mml} tokens. However, your prompt contains "
                           f"{len(ids)} input tokens, which exceeds this limit even without any output tokens. "
                           f"Please reduce the length of the input prompt. (parameter=input_tokens, "
                           f"value={len(ids)})", param="input_tokens")
        if mt is not None:
            if not isinstance(mt, int) or isinstance(mt, bool) or mt < 0:
                raise ApiError(f"max_tokens must be a non-negative integer, got {mt!r}", param="max_tokens")
            if mt > mml:
                name = "max_completion_tokens" if chat and body.get("max_completion_tokens") else "max_tokens"
                raise ApiError(f"{name}={mt} cannot be greater than max_model_len={mml}. Please request fewer "
                               f"output tokens. (parameter={name}, value={mt})", param=name)
        # vLLM's get_max_tokens: the request's limit, clamped to what the context leaves
        limit = mml - len(ids) if mt is None else min(mt, mml - len(ids))
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
        seed = body.get("seed")
        base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        return _Call(
            chat=chat, rid=("chatcmpl-" if chat else "cmpl-") + base, ids=ids, max_tokens=limit, max_tokens_param=mt,
            ignore_eos=bool(body.get("ignore_eos", False)), stream=bool(body.get("stream", False)),
            include_usage=include_usage,
            continuous_usage=include_usage and bool(opts.get("continuous_usage_stats")),
            seed=seed if isinstance(seed, int) else None, min_tokens=int(body.get("min_tokens") or 0),
        )

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.codec.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)  # token ids, as vLLM accepts them
        if isinstance(prompt, list) and len(prompt) > 1:
            raise ApiError("vllm-sim serves one prompt per request; send a batch as separate requests",
                           param="prompt")
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
        n = call.max_tokens if call.ignore_eos else min(call.max_tokens, eos_length(call.ids, call.seed,
                                                                                        call.min_tokens))
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
                "id": call.rid, "object": "chat.completion", "created": created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                                     "annotations": None, "audio": None, "function_call": None,
                                                     "reasoning": None},
                             "logprobs": None, "finish_reason": s.finish_reason, "stop_reason": None,
                             "token_ids": None, "routed_experts": None}],
                "service_tier": None, "system_fingerprint": None, "usage": usage, "prompt_logprobs": None,
                "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None,
                "ec_transfer_params": None, "metrics": None,
            }
        else:
            body = {
                "id": call.rid, "object": "text_completion", "created": created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": s.finish_reason,
                             "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                             "prompt_token_ids": None, "routed_experts": None}],
                "service_tier": None, "system_fingerprint": None, "usage": usage, "kv_transfer_params": None,
                "ec_transfer_params": None, "metrics": None,
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
                        role = ('"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                                '"finish_reason":null}]')
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
    print(f"  Value error, {error} [type=value_error, input_value=ArgsKwargs((), {{...}}), input_type=ArgsKwargs]",
          file=out)
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
    print("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
          file=sys.stderr, flush=True)


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
    try:
        sock = _bind(opts.host, opts.port)
    except OSError as e:
        print("Traceback (most recent call last):", file=sys.stderr)
        print(f"OSError: [Errno {e.errno}] {e.strerror}", file=sys.stderr, flush=True)
        log("ERROR", "api_server.py", f"OSError: [Errno {e.errno}] {e.strerror} ({opts.host}:{opts.port})",
            stream=sys.stderr)
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
        engine = SimEngine(opts.shape, opts.gpu, c, startup.plan)
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
            log("ERROR", "core.py", f"EngineCore encountered a fatal error: {exc!r}", proc="EngineCore",
                stream=sys.stderr)
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
