"""Production's traffic between two snapshots, and the SLOs it met.

``Window.between(prev, cur)`` is the traffic between two snapshots (prometheus.py): counter and
histogram deltas, from which it derives the request rate (served, and arrived: ``arrival_rate``,
``saturated``), prompt/output lengths, the prefix-cache hit rate, latency quantiles
(``histogram_quantile``'s interpolation, so estimates: see ``Histogram.quantile``) and SLO
estimates (``SLOEstimate``). Pure: no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from autotune.daemon.prometheus import METRICS, Histogram, Snapshot
from autotune.measure.slo import SLO

__all__ = ["SLOEstimate", "Window", "level_change", "moved_from"]

LEVEL_EVIDENCE = 10.0  # log-likelihood ratio a change of the arrival rate's level must reach (odds of e^10 to 1)
LEVEL_RATIO = 1.25  # and the rates either side must differ by this factor: smaller changes are no drift anyway
# log-likelihood ratio past which the newest scrapes arrived at another rate than a fingerprint's (odds of e^2 to 1:
# a false alarm only defers a tuning by a scrape interval)
MOVED_EVIDENCE = 2.0


@dataclass(frozen=True)
class SLOEstimate:
    """One SLO judged from a window's histograms and counters.

    ``holds`` is None when /metrics cannot say (goodput needs per-request joint latencies; a
    latency SLO with no requests in the window). ``bucket`` is the histogram bucket the
    percentile falls in (``value`` is interpolated inside it): a latency SLO is called missed only
    when the bucket's lower bound misses it, so a target inside the bucket holds (``certain`` False).
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
    gauges_start: dict[str, float] = field(default_factory=dict)  # at the start of the window
    waiting_min: float | None = None  # the fewest requests waiting at any scrape of the window
    scrapes: int = 2  # snapshots the window was read from, its ends included
    proxy_arrived: int | None = None  # users' requests the proxy logged in the window (arrivals.py), where it is read
    proxy_failed: int | None = None  # ... and those of them that failed: 5xx, timeouts, users who gave up

    @classmethod
    def between(cls, prev: Snapshot, cur: Snapshot, inside: Sequence[Snapshot] = ()) -> Window:
        """The traffic from ``prev`` to ``cur``; ``inside`` are the scrapes between them, which only the
        queue's low-water mark (``waiting_min``) reads."""
        # A restarted vLLM starts every counter at 0; a delta across the restart would be negative.
        # Counting cur's totals as the window's traffic undercounts (what came before the restart
        # is lost) but never invents traffic, which is what Prometheus' rate() does too.
        reset = any(cur.counters.get(k, 0.0) < v for k, v in prev.counters.items()) or any(
            k not in cur.histograms
            or cur.histograms[k].count < h.count
            or {le for le, _ in cur.histograms[k].buckets} != {le for le, _ in h.buckets}
            for k, h in prev.histograms.items()
        )
        if reset:
            counters = dict(cur.counters)
            histograms = dict(cur.histograms)
            # the restarted process began empty: nothing running or waiting
            start = {"running": 0.0, "waiting": 0.0}
            seen = [cur]
        else:
            counters = {k: v - prev.counters.get(k, 0.0) for k, v in cur.counters.items()}
            histograms = {
                k: h.minus(prev.histograms[k]) if k in prev.histograms else h for k, h in cur.histograms.items()
            }
            start = dict(prev.gauges)
            seen = [prev, *inside, cur]
        queue = [s.gauges["waiting"] for s in seen if "waiting" in s.gauges]
        # the proxy's totals are the daemon's own count, so they hold across a production restart
        proxy = (
            (cur.proxy.arrived - prev.proxy.arrived, cur.proxy.failed - prev.proxy.failed)
            if cur.proxy is not None and prev.proxy is not None
            else (None, None)
        )
        return cls(
            prev.t,
            cur.t,
            counters,
            histograms,
            dict(cur.gauges),
            reset,
            start,
            min(queue) if len(queue) == len(seen) else None,
            len(seen),
            *proxy,
        )

    @property
    def dt(self) -> float:
        return self.t1 - self.t0

    def _per_second(self, key: str) -> float | None:
        if self.dt <= 0 or key not in self.counters:
            return None
        return self.counters[key] / self.dt

    @property
    def requests(self) -> int:
        """Requests that finished in the window (vLLM counts no aborted one: see ``arrivals``)."""
        return round(self.counters.get("requests", 0.0))

    @property
    def request_rate(self) -> float | None:
        """Finished requests per second: what production served. Not its demand when it is saturated (see
        ``arrival_rate``)."""
        return self._per_second("requests")

    @property
    def backlog_growth(self) -> float | None:
        """How many more requests were in the engine (running + waiting) at the end of the window than at its
        start; None when /metrics has no such gauges."""
        keys = ("running", "waiting")
        if not all(k in self.gauges and k in self.gauges_start for k in keys):
            return None
        return sum(self.gauges[k] - self.gauges_start[k] for k in keys)

    @property
    def offered(self) -> bool:
        """Whether ``arrivals`` is every request users sent (the proxy's log), not a lower bound read from /metrics."""
        return self.proxy_arrived is not None

    @property
    def arrivals(self) -> int:
        """Requests that arrived in the window: those that ended, plus the growth of what is still in the engine
        (what arrives either ends or is still there).

        Where the proxy's log is read, "ended" is every user's request it logged: served, failed, or given up,
        which vLLM aborts and counts nowhere. Otherwise it is what finished, as vLLM counts it: no aborted
        request is in ``request_success_total`` (vllm-project/vllm#31503, #55634), so under saturation, when
        clients give up while they wait, what finished is what the engine could serve, not what users sent;
        requests abandoned in the queue stay invisible, and this is a lower bound. The backlog's growth counts
        the requests of a surge still queued: the proxy logs a request only when it ends."""
        ended = self.proxy_arrived if self.proxy_arrived is not None else self.requests
        growth = self.backlog_growth
        return max(ended + round(growth), 0) if growth is not None else ended

    @property
    def arrival_rate(self) -> float | None:
        """Arrived requests per second: the demand production was offered (without the proxy's log, a lower
        bound when saturated)."""
        if self.dt <= 0 or ("requests" not in self.counters and self.proxy_arrived is None):
            return None
        return self.arrivals / self.dt

    @property
    def saturated(self) -> bool:
        """Production served all it could and users wanted more: requests waited at every scrape of the window
        (three at least), or the backlog grew by more than a tenth of what arrived (three requests at least),
        or the proxy logged that a twentieth of users' requests failed (three at least: timeouts, users who
        gave up, 5xx). Either way its TTFT grows with the queue, and what finished understates demand."""
        if self.waiting_min is not None and self.scrapes >= 3 and self.waiting_min >= 1:
            return True
        if self.proxy_failed is not None and self.proxy_failed >= max(3.0, 0.05 * self.arrivals):
            return True
        growth = self.backlog_growth
        return growth is not None and growth >= max(3.0, 0.1 * self.arrivals)

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
            holds = slo.holds(value)
            notes = []
            if bucket is not None and not holds and slo.holds(bucket[0]):
                # the percentile is somewhere in its bucket: interpolation put it over the target, but the true
                # value may lie under it (a p95 TPOT read as 48.75 ms in a 25-50 ms bucket can be 33 ms as the
                # clients measure it). A breach is called only when the whole bucket misses: no false alarm.
                holds = True
                notes.append(
                    f"p{slo.percentile:g} lies in {bucket[0] * 1000:g}-{bucket[1] * 1000:g} ms, across "
                    "the target: not called a breach"
                )
            if slo.metric == "itl":
                # our ITL SLO is per request (each request's own percentile of its gaps); vLLM pools
                # every gap of every request, so long requests weigh more here
                notes.append("vLLM pools the gaps of all requests; the SLO takes each request's own percentile")
            return SLOEstimate(slo, value, holds, n, bucket, "; ".join(notes))
        requests = self.requests
        if slo.metric == "goodput":
            return SLOEstimate(
                slo,
                None,
                None,
                requests,
                note="goodput needs each request's latencies together; /metrics has only histograms",
            )
        if slo.metric == "throughput":
            value = self._per_second("generation_tokens")
        else:  # rps: requests served, not aborted or failed
            served = self.counters.get("requests", 0.0) - self.counters.get("requests_failed", 0.0)
            value = served / self.dt if self.dt > 0 and "requests" in self.counters else None
        # In production a rate is what the traffic asked for, not what the engine can do: a quiet
        # hour "misses" a throughput floor without anything being wrong. The daemon decides.
        return SLOEstimate(
            slo,
            value,
            None if value is None else slo.holds(value),
            requests,
            note="a production rate is bounded by demand, not only by the engine",
        )


def level_change(snapshots: Sequence[Snapshot], min_span_s: float) -> int | None:
    """Where the arrival rate changed level among ``snapshots`` (oldest first): the index of the snapshot the new
    level starts at, or None when one level explains them all.

    The split is the most likely one for arrivals at one Poisson rate before it and another after, each side
    spanning ``min_span_s`` at least; it counts only when its log-likelihood ratio over a single rate reaches
    LEVEL_EVIDENCE and the two rates differ by LEVEL_RATIO. A window's mean after a jump is a blend of the two
    levels (after a jump to 10x, half a window reads 5.5x); what follows the change is the traffic now."""
    cuts = [Window.between(a, b) for a, b in itertools.pairwise(snapshots)]
    if len(cuts) < 2 or any(c.reset for c in cuts):
        return None
    counts = [float(c.arrivals) for c in cuts]
    spans = [c.dt for c in cuts]
    total_n, total_t = sum(counts), sum(spans)

    def loglik(n: float, t: float) -> float:  # a Poisson count's log-likelihood at its own rate, less terms that cancel
        return n * math.log(n / t) if n > 0 and t > 0 else 0.0

    best, at = 0.0, None
    n1 = t1 = 0.0
    for k in range(1, len(cuts)):
        n1, t1 = n1 + counts[k - 1], t1 + spans[k - 1]
        n2, t2 = total_n - n1, total_t - t1
        if t1 < min_span_s or t2 < min_span_s:
            continue
        lo, hi = sorted((n1 / t1, n2 / t2))
        if hi < LEVEL_RATIO * lo or hi == 0:
            continue
        evidence = loglik(n1, t1) + loglik(n2, t2) - loglik(total_n, total_t)
        if evidence > best:
            best, at = evidence, k
    return at if best >= LEVEL_EVIDENCE else None


def moved_from(recent: Window, rate: float) -> bool:
    """Whether the requests that arrived in ``recent`` (the newest scrapes) surely came at another rate than ``rate``
    (req/s): LEVEL_RATIO apart at least, with a Poisson log-likelihood ratio of MOVED_EVIDENCE. Early in a change of
    level the window's rate is a blend that ``level_change`` cannot split yet, and the newest scrapes already say
    the traffic is elsewhere."""
    n, mu = float(recent.arrivals), rate * recent.dt
    if recent.dt <= 0 or recent.reset or mu <= 0:
        return False
    if 1 / LEVEL_RATIO < n / mu < LEVEL_RATIO:
        return False
    return (n * math.log(n / mu) if n > 0 else 0.0) - (n - mu) >= MOVED_EVIDENCE
