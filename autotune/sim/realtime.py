"""The simulated engine in real time: the shared Scheduler and StepModel, driven by the loop's clock.

``RealtimeEngine`` steps the same Scheduler and StepModel as ``virtual.simulate``, driven by
the asyncio loop's monotonic clock. A step starts where the previous one ended *in simulated
time* (its target), not when Python got round to it, so the time Python spends scheduling,
serializing and writing is absorbed instead of adding up as drift; only when the host falls
more than ``MAX_CATCH_UP_S`` behind does the simulation give up the lost time (and say so in
the log). Tokens produced by a step are handed to the request's ``Stream`` at the step's end,
honouring ``--stream-interval`` the way vLLM's output processor does (the first token at once,
then every N tokens, and the last). A request aborted while a step is in flight (its client
went away) is freed after that step. What the engine does feeds ``exposition.SimMetrics``
and vLLM's periodic stats line.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import cast

from autotune.sim.exposition import SimMetrics
from autotune.sim.log import log
from autotune.sim.scheduler import Request, StepPlan
from autotune.sim.virtual import SimEngine

__all__ = ["LOG_STATS_INTERVAL_S", "MAX_CATCH_UP_S", "RealtimeEngine", "Stream"]

MAX_CATCH_UP_S = 0.25  # how far behind real time the engine may run and still make it up
LOG_STATS_INTERVAL_S = 10.0  # vLLM's LoggingStatLogger interval


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
        # the API server's serialized costs (the same perf.FrontEnd predict applies); here only the
        # request side: outputs reach the client at the step's end (the per-token cost is predict's only)
        self.front_end = engine.front_end.reset() if engine.front_end is not None else None
        self._in_api_server: set[str] = set()
        self._front_end_timer: asyncio.TimerHandle | None = None  # when its next piece of work starts
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
        """A request from the API: to the scheduler once the API server's own cost has passed (perf.FrontEnd)."""
        self.streams[stream.req.id] = stream
        fe = self.front_end
        if fe is None:
            self._admit(stream)
            return
        self._in_api_server.add(stream.req.id)
        fe.arrive(asyncio.get_running_loop().time(), stream, stream.req.prompt_len)
        self._run_front_end()

    def _run_front_end(self) -> None:
        """The API server's process up to now, in its event loop's order (perf.FrontEnd.run): a request reaches
        the scheduler when its admission ends, and the process is run again when its next piece of work starts
        (a request that arrives before then is rendered first, as in vLLM)."""
        fe = self.front_end
        assert fe is not None
        loop = asyncio.get_running_loop()
        now = loop.time()
        admitted, _ = fe.run(now)
        for at, stream in admitted:
            loop.call_later(max(0.0, at - now), self._admit, cast(Stream, stream))
        if self._front_end_timer is not None:
            self._front_end_timer.cancel()
        nxt = fe.next_at
        self._front_end_timer = loop.call_at(nxt, self._run_front_end) if nxt != math.inf else None

    def _admit(self, stream: Stream) -> None:
        self._in_api_server.discard(stream.req.id)
        if self.streams.get(stream.req.id) is not stream:
            return  # the client went away while the API server held the request
        self.sched.add(stream.req)
        self._wake.set()

    def abort(self, stream: Stream) -> None:
        """The client went away: free what its request holds (after the step in flight, if any)."""
        if self.streams.pop(stream.req.id, None) is None or stream.req.finished:
            return
        if stream.req.id in self._in_api_server:
            return  # never reached the scheduler
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
                    log(
                        "WARNING",
                        "sim",
                        f"the simulation runs {now - target:.2f} s behind real time: this host "
                        "is too slow for the load (latencies include the lag)",
                    )
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
        log(
            "ERROR",
            "core.py",
            f"request {req.id} cannot be scheduled (prompt {req.prompt_len} tokens, "
            f"{sched.kv.num_blocks} KV blocks): failing it",
            proc="EngineCore",
        )
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
                parts = [
                    f"Avg prompt throughput: {w['prompt'] / dt:.1f} tokens/s",
                    f"Avg generation throughput: {w['generation'] / dt:.1f} tokens/s",
                    f"Running: {len(self.sched.running)} reqs",
                    f"Waiting: {len(self.sched.waiting)} reqs",
                ]
                if w["preemptions"]:
                    parts.append(f"Preemptions: {w['preemptions']}")
                parts.append(f"GPU KV cache usage: {self.sched.kv.usage * 100:.1f}%")
                if w["queries"]:
                    parts.append(f"Prefix cache hit rate: {w['hits'] / w['queries'] * 100:.1f}%")
                log("INFO", "loggers.py", "Engine 000: " + ", ".join(parts))
            self._last_logged_busy = busy
            self._window = dict.fromkeys(w, 0)
