"""Production's traffic between two snapshots, and the SLOs it met.

``Window.between(prev, cur)`` is the traffic between two snapshots (prometheus.py): counter and
histogram deltas, from which it derives the request rate, prompt/output lengths, the prefix-cache
hit rate, latency quantiles (``histogram_quantile``'s interpolation, so estimates: see
``Histogram.quantile``) and SLO estimates (``SLOEstimate``). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from autotune.daemon.prometheus import Histogram, Snapshot
from autotune.engine.vllm.metrics import METRICS
from autotune.measure.slo import SLO

__all__ = ["SLOEstimate", "Window"]


@dataclass(frozen=True)
class SLOEstimate:
    """One SLO judged from a window's histograms and counters.

    ``holds`` is None when /metrics cannot say (goodput needs per-request joint latencies; a
    latency SLO with no requests in the window). ``bucket`` is the histogram bucket the
    percentile falls in: when the target lies inside it, the verdict rests on interpolation.
    """

    slo: SLO
    value: float | None
    holds: bool | None
    samples: int
    bucket: tuple[float, float] | None = None
    note: str = ""

    @property
    def certain(self) -> bool:
        """True when the verdict does not depend on how observations spread inside a bucket."""
        if self.holds is None or self.bucket is None:
            return self.holds is not None
        lo, hi = self.bucket
        return not lo < self.slo.target < hi


@dataclass(frozen=True)
class Window:
    """Production's traffic between two snapshots."""

    t0: float
    t1: float
    counters: dict[str, float]  # deltas
    histograms: dict[str, Histogram]  # deltas
    gauges: dict[str, float]  # at the end of the window
    reset: bool = False  # a counter went down: production restarted; the deltas are cur's totals

    @classmethod
    def between(cls, prev: Snapshot, cur: Snapshot) -> Window:
        # A restarted vLLM starts every counter at 0; a delta across the restart would be negative.
        # Counting cur's totals as the window's traffic undercounts (what came before the restart
        # is lost) but never invents traffic, which is what Prometheus' rate() does too.
        reset = any(cur.counters.get(k, 0.0) < v for k, v in prev.counters.items()) or any(
            k not in cur.histograms or cur.histograms[k].count < h.count
            or {le for le, _ in cur.histograms[k].buckets} != {le for le, _ in h.buckets}
            for k, h in prev.histograms.items())
        if reset:
            counters = dict(cur.counters)
            histograms = dict(cur.histograms)
        else:
            counters = {k: v - prev.counters.get(k, 0.0) for k, v in cur.counters.items()}
            histograms = {k: h.minus(prev.histograms[k]) if k in prev.histograms else h
                          for k, h in cur.histograms.items()}
        return cls(prev.t, cur.t, counters, histograms, dict(cur.gauges), reset)

    @property
    def dt(self) -> float:
        return self.t1 - self.t0

    def _per_second(self, key: str) -> float | None:
        if self.dt <= 0 or key not in self.counters:
            return None
        return self.counters[key] / self.dt

    @property
    def requests(self) -> int:
        """Requests that finished in the window (aborted ones included)."""
        return round(self.counters.get("requests", 0.0))

    @property
    def request_rate(self) -> float | None:
        """Finished requests per second, aborted ones included: the load production was offered."""
        return self._per_second("requests")

    @property
    def prompt_tokens_mean(self) -> float | None:
        h = self.histograms.get("request_prompt_tokens")
        return None if h is None else h.mean

    @property
    def output_tokens_mean(self) -> float | None:
        h = self.histograms.get("request_output_tokens")
        return None if h is None else h.mean

    @property
    def prompt_tokens_p50(self) -> float | None:
        return self.quantile("request_prompt_tokens", 0.5)

    @property
    def prompt_tokens_p90(self) -> float | None:
        return self.quantile("request_prompt_tokens", 0.9)

    @property
    def output_tokens_p50(self) -> float | None:
        return self.quantile("request_output_tokens", 0.5)

    @property
    def output_tokens_p90(self) -> float | None:
        return self.quantile("request_output_tokens", 0.9)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens found in the prefix cache / prompt tokens looked up (None without lookups)."""
        queries = self.counters.get("prefix_cache_queries", 0.0)
        if queries <= 0:
            return None
        return self.counters.get("prefix_cache_hits", 0.0) / queries

    def quantile(self, metric: str, q: float) -> float | None:
        """The q-quantile (0..1) of a histogram (a METRICS key: ttft, tpot, itl, e2e, request_prompt_tokens, ...)."""
        if metric not in METRICS or METRICS[metric].kind != "histogram":
            hists = ", ".join(k for k, s in METRICS.items() if s.kind == "histogram")
            raise KeyError(f"{metric!r} is not a watched histogram; one of {hists}")
        h = self.histograms.get(metric)
        return None if h is None else h.quantile(q)

    def slo_compliance(self, slos: Iterable[SLO]) -> list[SLOEstimate]:
        return [self._estimate(slo) for slo in slos]

    def _estimate(self, slo: SLO) -> SLOEstimate:
        if slo.is_latency:
            h = self.histograms.get(slo.metric)
            n = round(h.count) if h is not None else 0
            if h is None or n <= 0:
                return SLOEstimate(slo, None, None, 0, note="no requests in the window")
            if slo.percentile is None:
                value, bucket = h.mean, None
            else:
                value, bucket = h.quantile(slo.percentile / 100.0), h.bucket_of(slo.percentile / 100.0)
            note = ""
            if slo.metric == "itl":
                # our ITL SLO is per request (each request's own percentile of its gaps); vLLM pools
                # every gap of every request, so long requests weigh more here
                note = "vLLM pools the gaps of all requests; the SLO takes each request's own percentile"
            return SLOEstimate(slo, value, slo.holds(value), n, bucket, note)
        requests = self.requests
        if slo.metric == "goodput":
            return SLOEstimate(slo, None, None, requests,
                               note="goodput needs each request's latencies together; /metrics has only histograms")
        if slo.metric == "throughput":
            value = self._per_second("generation_tokens")
        else:  # rps: requests served, not aborted or failed
            served = self.counters.get("requests", 0.0) - self.counters.get("requests_failed", 0.0)
            value = served / self.dt if self.dt > 0 and "requests" in self.counters else None
        # In production a rate is what the traffic asked for, not what the engine can do: a quiet
        # hour "misses" a throughput floor without anything being wrong. The daemon decides.
        return SLOEstimate(slo, value, None if value is None else slo.holds(value), requests,
                           note="a production rate is bounded by demand, not only by the engine")
