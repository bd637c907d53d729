"""Per-request measurements and their aggregates, defined as ``vllm bench serve`` defines them.

- TTFT: from sending the request to the first SSE chunk whose ``choices`` is non-empty.
- ITL: the gaps between successive chunks with choices.
- E2E: from sending to the last chunk with choices (the usage chunk and [DONE] do not count).
- TPOT: (E2E - TTFT) / (output_tokens - 1), for requests with more than one output token.
- output tokens: from the usage chunk (``stream_options.include_usage``).
- duration: from the first request's send to the last request's end (failed ones included);
  throughputs divide by it.
- goodput: completed requests that meet every latency SLO, per second of duration.

Percentiles use numpy's linear interpolation, like vLLM. Failed requests are counted, never
dropped: they are in ``failed`` and in the attainment's denominator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from autotune.measure.slo import SLO, Verdict

__all__ = ["RequestResult", "Distribution", "Summary", "summarize", "request_value", "lost_already", "PERCENTILES"]

PERCENTILES = (50.0, 90.0, 95.0, 99.0)


SAME_READ_S = 1e-4  # two SSE events closer than this came in one read from the socket, not 0.1 ms apart


@dataclass
class RequestResult:
    index: int  # position in the workload
    scheduled_s: float  # when it was due, seconds after the replay started
    sent_s: float  # when it left (>= scheduled_s; later when the concurrency cap held it)
    success: bool
    error: str = ""
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    expected_output_tokens: int = 0
    elapsed: float = 0.0  # send to the end of the exchange (success or not): failed requests take time too

    @property
    def tpot(self) -> float | None:
        if not self.success or self.ttft is None or self.e2e is None or self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def end_s(self) -> float:
        return self.sent_s + max(self.e2e or 0.0, self.elapsed)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in seconds; ``count`` samples (0: all None)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, samples: list[float]) -> Distribution:
        if not samples:
            return cls(0, None, None, None, None, None)
        a = np.asarray(samples, dtype=float)
        p50, p90, p95, p99 = (float(x) for x in np.percentile(a, PERCENTILES))
        return cls(len(a), float(a.mean()), p50, p90, p95, p99)


@dataclass
class Summary:
    requests: int
    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    goodput: float  # requests meeting every latency SLO / s
    slo_attainment: float  # share of all requests (failed included) meeting every latency SLO
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    send_lag: Distribution  # sent_s - scheduled_s: how late the client itself was
    errors: dict[str, int]  # error text (first line) -> count
    # share of ITL gaps under SAME_READ_S: SSE events that reached the client in one read share a timestamp, so
    # ITL (the gap between events, as `vllm bench serve` measures it too) reads ~0 for them
    itl_same_read: float = 0.0
    # raw samples, for percentiles the table does not hold (p99.9, an SLO's own p)
    samples: dict[str, list[float]] = field(default_factory=dict, repr=False)

    def value(self, slo: SLO) -> float | None:
        """The measured value an SLO is judged on."""
        if slo.metric == "throughput":
            return self.output_throughput
        if slo.metric == "rps":
            return self.request_throughput
        if slo.metric == "goodput":
            return self.goodput
        samples = self.samples.get(slo.metric) or []
        if not samples:
            return None
        if slo.percentile is None:
            return float(np.mean(samples))
        return float(np.percentile(samples, slo.percentile))

    def verdicts(self, slos: list[SLO]) -> list[Verdict]:
        return [Verdict(slo, self.value(slo)) for slo in slos]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("samples")
        return d


def request_value(slo: SLO, r: RequestResult) -> float | None:
    """One request's own value for a latency SLO (None when it has none: a failure, a 1-token output)."""
    if slo.metric == "ttft":
        return r.ttft
    if slo.metric == "e2e":
        return r.e2e
    if slo.metric == "tpot":
        # vLLM counts a 1-token request's TPOT as 0 for goodput
        return r.tpot if r.output_tokens > 1 else (0.0 if r.success else None)
    if slo.metric == "itl":
        if not r.itl:
            return 0.0 if r.success else None
        return float(np.percentile(r.itl, 100.0 if slo.percentile is None else slo.percentile))
    raise ValueError(f"{slo.metric} is not a per-request metric")


def meets_latency_slos(r: RequestResult, slos: list[SLO]) -> bool:
    if not r.success:
        return False
    return all(slo.holds(request_value(slo, r)) for slo in slos if slo.is_latency)


def summarize(results: list[RequestResult], slos: Sequence[SLO] = ()) -> Summary:
    done = [r for r in results if r.success]
    if results:
        start = min(r.sent_s for r in results)
        end = max(r.end_s for r in results)
        duration = max(end - start, 1e-9)
    else:
        duration = 0.0
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    samples = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [g for r in done for g in r.itl],
        "e2e": [r.e2e for r in done if r.e2e is not None],
        "send_lag": [r.sent_s - r.scheduled_s for r in results],
    }
    good = sum(1 for r in results if meets_latency_slos(r, list(slos)))
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            line = (r.error or "unknown error").strip().splitlines()[-1][:200]
            errors[line] = errors.get(line, 0) + 1
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return Summary(
        requests=len(results),
        completed=len(done),
        failed=len(results) - len(done),
        duration_s=duration,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        request_throughput=per_s(len(done)),
        output_throughput=per_s(output_tokens),
        total_token_throughput=per_s(prompt_tokens + output_tokens),
        goodput=per_s(good),
        slo_attainment=(good / len(results)) if results else math.nan,
        ttft=Distribution.of(samples["ttft"]),
        tpot=Distribution.of(samples["tpot"]),
        itl=Distribution.of(samples["itl"]),
        e2e=Distribution.of(samples["e2e"]),
        send_lag=Distribution.of(samples["send_lag"]),
        errors=errors,
        itl_same_read=(sum(g < SAME_READ_S for g in samples["itl"]) / len(samples["itl"])) if samples["itl"] else 0.0,
        samples=samples,
    )


def lost_already(slos: list[SLO], results: list[RequestResult], total: int, now: float) -> str | None:
    """Why a load step of ``total`` requests can no longer pass, judged on its requests so far (those sent, in
    ``results``) at ``now`` (seconds on the clock of ``sent_s``); None while it still can.

    A step passes only if no request fails and every SLO holds (session.Step.passed). So a failed request loses
    it, and so does a TTFT or E2E SLO that misses even if every request still waiting answers this instant and
    every unsent one at once: a waiting request's TTFT and E2E are at least its wait so far, and a percentile or a
    mean only grows when a value does. TPOT and ITL are left to the end: a request's future tokens are unknown."""
    failed = next((r for r in results if r.error), None)
    if failed is not None:
        return f"request {failed.index} failed ({failed.error.strip().splitlines()[-1][:120]})"
    for slo in slos:
        if slo.metric not in ("ttft", "e2e") or not slo.upper_bound:
            continue
        known = [(r.ttft if slo.metric == "ttft" else r.e2e) for r in results]
        least = [now - r.sent_s if v is None else v for v, r in zip(known, results, strict=True)]
        least += [0.0] * (total - len(results))
        if not least:
            continue
        value = float(np.mean(least)) if slo.percentile is None else float(np.percentile(least, slo.percentile))
        if not slo.holds(value):
            return f"{slo.text} missed already: {value * 1000:.0f} ms at least, with {len(results)} of {total} sent"
    return None
