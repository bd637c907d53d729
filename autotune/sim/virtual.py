"""The simulated engine in virtual time: a workload under a config in a fraction of a second.

The same Scheduler and StepModel as the HTTP server, without the clock: time jumps from one
step's end to the next, or to the next arrival when the engine is idle. Results are the
replay client's RequestResult records, so ``workload.metrics.summarize`` and the SLO verdicts
apply unchanged, and so capacity means here what it means for a real engine.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import cast

from autotune.engine.model import ModelShape
from autotune.measure.metrics import RequestResult, summarize
from autotune.measure.slo import SLO
from autotune.sim.config import SimConfig
from autotune.sim.perf import FrontEnd, StepModel
from autotune.sim.profiles import GpuProfile
from autotune.sim.scheduler import Request, Scheduler, block_hashes
from autotune.sim.startup import MemoryPlan, Startup, plan_startup
from autotune.workload.trace import Request as WorkloadRequest
from autotune.workload.trace import Workload

__all__ = ["SimEngine", "StartupFailed", "simulate", "capacity", "prompt_length"]


class StartupFailed(Exception):
    def __init__(self, startup: Startup) -> None:
        super().__init__(startup.failure[0] if startup.failure else "start-up failed")
        self.startup = startup


@dataclass
class SimEngine:
    """A started engine: the memory plan, the scheduler, the step cost."""

    shape: ModelShape
    gpu: GpuProfile
    config: SimConfig
    plan: MemoryPlan
    front_end: FrontEnd | None = None  # the API server's costs (perf.FrontEnd); None: the engine alone

    @classmethod
    def start(
        cls,
        shape: ModelShape,
        gpu: GpuProfile,
        config: SimConfig,
        used_by_others: int = 0,
        front_end: FrontEnd | None = None,
    ) -> SimEngine:
        s = plan_startup(shape, gpu, config, used_by_others=used_by_others)
        if s.plan is None:
            raise StartupFailed(s)
        return cls(shape, gpu, config, s.plan, front_end)

    def __post_init__(self) -> None:
        c = self.config
        self.scheduler = Scheduler(
            num_blocks=self.plan.num_blocks,
            block_size=c.block_size,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            chunked_prefill=c.enable_chunked_prefill,
            prefix_caching=c.enable_prefix_caching,
            long_prefill_token_threshold=c.long_prefill_token_threshold,
            max_model_len=c.max_model_len,
            window_blocks=self.shape.window_blocks(c.block_size),
        )
        gpu, fe = self.gpu, self.front_end
        if fe is not None and c.era == "v0":
            # V0's LLMEngine detokenized each step's outputs in its own loop, serial with the GPU: a token's
            # detokenization is a host cost per sequence of the step; the server still writes the chunks
            gpu = replace(gpu, host_seq_s=gpu.host_seq_s + fe.output_token_s)
            self.front_end = replace(fe, output_token_s=0.0)
        self.step_model = StepModel(self.shape, gpu, c)


def prompt_length(r: WorkloadRequest) -> int:
    """A request's prompt in tokens when its token ids are not known: its count, else ~4 bytes of text a token."""
    if r.prompt_tokens is not None:
        return r.prompt_tokens
    return max(1, len(((r.prefix or "") + (r.prompt or "")).encode()) // 4)  # text-only traces: ~4 bytes a token


def prompt_blocks(
    index: int | str, prompt_len: int, prefix_group: str | None, prefix_tokens: int, block_size: int
) -> list[tuple[object, int]]:
    """A stand-in for each full block of a prompt whose tokens are not known, for ``block_hashes``.

    Blocks wholly inside a shared prefix are ``(prefix_group, i)``, alike across the group; the
    rest are ``(index, i)``, the request's own. As the shared blocks come first, chaining their
    hashes shares exactly the blocks that hashing each stand-in alone would.
    """
    shared = min(prefix_tokens, prompt_len) // block_size if prefix_group else 0
    return [(prefix_group, i) if i < shared else (index, i) for i in range(prompt_len // block_size)]


def simulate(
    engine: SimEngine,
    workload: Workload,
    *,
    warmup: int = 0,
    keep_itl: bool = False,
    on_step: Callable[[float, int], None] | None = None,
    max_concurrency: int | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
) -> list[RequestResult]:
    """Replay ``workload`` (arrival times as given) on the engine; one result per request.

    ``warmup``: first send that many of the workload's requests at once, 16 tokens each, and
    run them to completion unmeasured, as the replay client's warm-up does (it fills the
    prefix cache the way a running production engine has it filled).
    ``max_concurrency``: the replay client's cap on requests in flight; a request that arrives
    while the cap is reached is sent when one finishes, first come first sent (its ``sent_s``
    and latencies start then, its send lag shows the wait), as ``--max-concurrency`` does.
    ``prompt_ids``: each request's prompt as the server would tokenize it (``predict``); its
    length is the prompt's and its blocks are hashed as the server hashes them, so requests
    (and the warm-up) share prefix-cache blocks exactly where their tokens agree. Without it a
    prompt is its token count, its prefix group and stand-in blocks (``prompt_blocks``).
    """
    if warmup > 0:
        warm = [replace(r, arrival_s=0.0, output_tokens=min(r.output_tokens, 16)) for r in workload.requests[:warmup]]
        _run(
            engine,
            Workload(tuple(warm), "warm-up"),
            keep_itl=False,
            on_step=None,
            tag="warm-up",
            prompt_ids=None if prompt_ids is None else prompt_ids[:warmup],
        )
    return _run(
        engine,
        workload,
        keep_itl=keep_itl,
        on_step=on_step,
        tag="",
        max_concurrency=max_concurrency,
        prompt_ids=prompt_ids,
    )


def _requests(
    workload: Workload, block_size: int, tag: str, prompt_ids: Sequence[Sequence[int]] | None
) -> tuple[list[Request], list[RequestResult]]:
    """The scheduler's request for each of the workload's, and its result as the client will fill it in."""
    reqs: list[Request] = []
    results: list[RequestResult] = []
    for i, r in enumerate(workload.requests):
        if prompt_ids is not None:
            n = len(prompt_ids[i])
            hashes = block_hashes(prompt_ids[i], block_size)
        else:
            n = prompt_length(r)
            # one stand-in per block: block size 1 for the hashes
            hashes = block_hashes(prompt_blocks(f"{tag}{i}", n, r.prefix_group, r.prefix_tokens, block_size), 1)
        reqs.append(Request(f"{tag}{i}", n, max(1, r.output_tokens), r.arrival_s, hashes))
        results.append(
            RequestResult(
                index=i,
                scheduled_s=r.arrival_s,
                sent_s=r.arrival_s,
                success=False,
                prompt_tokens=n,
                expected_output_tokens=r.output_tokens,
            )
        )
    return reqs, results


def _run(
    engine: SimEngine,
    workload: Workload,
    *,
    keep_itl: bool,
    on_step: Callable[[float, int], None] | None,
    tag: str,
    max_concurrency: int | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
) -> list[RequestResult]:
    sched = engine.scheduler
    arrivals = [(r.arrival_s, i) for i, r in enumerate(workload.requests)]
    heapq.heapify(arrivals)
    reqs, results = _requests(workload, engine.config.block_size, tag, prompt_ids)
    last = [0.0] * len(reqs)  # each request's time of its latest token, from its send
    held: deque[int] = deque()  # arrived while max_concurrency requests were in flight
    in_flight = 0
    # V0 streams each token in a chunk of its own; V1 merges a request's tokens between the API server's yields
    fe = engine.front_end.reset(merge=engine.config.era != "v0") if engine.front_end is not None else None
    admits: list[tuple[float, int]] = []  # (when the API server hands it to the engine, request)

    def send(i: int, at: float) -> None:
        nonlocal in_flight
        reqs[i].arrival_s = results[i].sent_s = at
        if reqs[i].prompt_len > engine.config.max_model_len:
            results[i].error = "prompt longer than max_model_len"  # vLLM answers 400
            return
        in_flight += 1
        if fe is None:
            sched.add(reqs[i])
        else:
            fe.arrive(at, i, reqs[i].prompt_len)

    def record(tokens: list[tuple[tuple[int, int, bool], float]], now: float) -> None:
        """Each (request, its n-th token, whether its last) with when its client has it."""
        nonlocal in_flight
        freed: list[float] = []  # when a finished request's last token reached its client
        for (i, n, finished), at in tokens:
            res = results[i]
            t = at - reqs[i].arrival_s
            if n == 1:
                res.ttft = t
            elif keep_itl:
                res.itl.append(t - last[i])
            last[i] = t
            if finished:
                res.success = True
                res.e2e = res.elapsed = t
                res.output_tokens = n
                in_flight -= 1
                freed.append(at)
        freed.sort()
        while held and in_flight < (max_concurrency or 0):
            send(held.popleft(), freed.pop(0) if freed else now)

    def run_front_end(fe: FrontEnd, known: float) -> None:
        """The API server as far as ``known``: the requests it hands the engine, the tokens it sends."""
        admitted, sent = fe.run(known)
        for at, i in admitted:
            heapq.heappush(admits, (at, cast(int, i)))
        record(sent, now)

    now = 0.0
    while arrivals or admits or sched.has_work or (fe is not None and fe.pending):
        while arrivals and arrivals[0][0] <= now:
            t, i = heapq.heappop(arrivals)
            if max_concurrency is not None and (held or in_flight >= max_concurrency):
                held.append(i)
            else:
                send(i, t)
        if fe is not None:
            run_front_end(fe, now)
        while admits and admits[0][0] <= now:
            sched.add(reqs[heapq.heappop(admits)[1]])
        if not sched.has_work:
            # the engine waits for the API server: run it until it hands the engine a request (whose first step's
            # outputs it must then take its turns with) or a request arrives
            if fe is not None:
                horizon = arrivals[0][0] if arrivals else math.inf
                while not admits and (at := fe.next_at) <= horizon and at != math.inf:
                    run_front_end(fe, at)
            if arrivals or admits:
                now = max(now, min(q[0][0] for q in (arrivals, admits) if q))
            continue
        plan = sched.schedule(now)
        if not plan:
            raise RuntimeError("the scheduler can make no progress: a request needs more KV blocks than exist")
        now += engine.step_model.step_seconds(plan)
        if on_step is not None:
            on_step(now, plan.num_tokens)
        produced = [(int(req.id[len(tag) :]), req.num_output, req.finished) for req in sched.finish_step(plan)]
        if fe is None:
            record([(token, now) for token in produced], now)
        else:
            fe.deliver(now, [(token[0], token) for token in produced])
    return results


def capacity(
    start: Callable[[], SimEngine],
    workload_at: Callable[[float], Workload],
    slos: list[SLO],
    *,
    lo: float = 0.25,
    hi: float = 64.0,
    resolution: float = 1.02,
) -> tuple[float, float]:
    """(highest load factor where every SLO holds, its request rate), by bisection on the load.

    Assumes that a config meeting its SLOs at some load meets them at every lower one: true of
    queueing latency, and what a load ladder assumes too. 0 when even ``lo`` misses.
    """

    def holds(load: float) -> tuple[bool, float]:
        w = workload_at(load)
        s = summarize(simulate(start(), w), slos)
        return s.failed == 0 and all(v.holds for v in s.verdicts(slos)), w.rate

    ok, rate = holds(lo)
    if not ok:
        return 0.0, 0.0
    best = (lo, rate)
    ok, rate = holds(hi)
    if ok:
        return hi, rate
    a, b = lo, hi
    while b / a > resolution:
        mid = (a * b) ** 0.5
        ok, rate = holds(mid)
        if ok:
            a, best = mid, (mid, rate)
        else:
            b = mid
    return best
