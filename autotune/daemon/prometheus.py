"""Production's vLLM ``/metrics``, read into snapshots.

- ``scrape(url)`` is the only network call: one ``GET /metrics``, parsed into a ``Snapshot`` of
  the few vLLM metrics the daemon uses (``METRICS``, named by the vLLM engine kind), summed
  over labels (``model_name``, ``engine``, ``finished_reason``).
- ``parse_metrics(text)`` is the pure part: a Prometheus text exposition -> ``Snapshot``.

Histograms only know bucket counts, so quantiles are estimates: exact at bucket bounds, linearly
interpolated inside a bucket. vLLM's token-count buckets are 1-2-5 steps (..., 200, 500, 1000,
...), so a prompt-length p50 can be off by a good part of a bucket; means (sum/count) are exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from autotune.daemon.arrivals import ArrivalCount
from autotune.engine.kind import MetricSpec, get_kind

__all__ = ["Histogram", "Snapshot", "parse_metrics", "scrape", "METRICS"]

# production serves through vLLM (a vLLM config, blue/green colors, Xinference's vLLM engine): its kind names them
METRICS: Mapping[str, MetricSpec] = get_kind("vllm").metrics


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram: cumulative counts per upper bound (the last bound is +Inf)."""

    buckets: tuple[tuple[float, float], ...]  # (le, cumulative count), le ascending
    count: float
    sum: float

    def minus(self, older: Histogram) -> Histogram:
        """The observations made since ``older`` (same bucket layout)."""
        theirs = dict(older.buckets)
        return Histogram(
            tuple((le, c - theirs.get(le, 0.0)) for le, c in self.buckets),
            self.count - older.count,
            self.sum - older.sum,
        )

    def quantile(self, q: float) -> float | None:
        """Prometheus' ``histogram_quantile``: linear interpolation inside the bucket holding rank q*count.

        None without observations. A quantile that lands in the +Inf bucket is the highest finite
        bound (all Prometheus can say); the first bucket interpolates from 0 (latencies and token
        counts are never negative).
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be within [0, 1], got {q}")
        located = self._locate(q)
        if located is None:
            return None
        lo, hi, below, inside, rank = located
        if math.isinf(hi):
            return lo
        if inside <= 0:
            return hi
        return lo + (hi - lo) * (rank - below) / inside

    def bucket_of(self, q: float) -> tuple[float, float] | None:
        """The bucket (lower, upper bound) the q-quantile falls in: the range the true value lies in."""
        located = self._locate(q)
        return None if located is None else (located[0], located[1])

    def _locate(self, q: float) -> tuple[float, float, float, float, float] | None:
        total = self.buckets[-1][1] if self.buckets else 0.0
        if total <= 0:
            return None
        rank = q * total
        prev_le, prev_c = 0.0, 0.0
        for le, c in self.buckets:
            # Prometheus picks the first bucket whose cumulative count reaches the rank; q=0 would pick
            # an empty first bucket, so ask for a non-empty one then.
            if c >= rank and c > prev_c:
                return prev_le, le, prev_c, c - prev_c, rank
            prev_le, prev_c = (le if le > 0 else 0.0), c
        return prev_le, math.inf, prev_c, 0.0, rank  # unreachable with a +Inf bucket; a defensive answer

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


@dataclass(frozen=True)
class Snapshot:
    """The watched metrics at one moment, summed over labels."""

    t: float  # time.monotonic() when the scrape answered
    counters: dict[str, float]
    histograms: dict[str, Histogram]
    gauges: dict[str, float]
    wall: float = 0.0  # time.time(), for logs and reports
    proxy: ArrivalCount | None = None  # users' requests the proxy had logged by then (arrivals.py), where one is read


def parse_metrics(text: str, t: float | None = None, wall: float | None = None) -> Snapshot:
    """A Prometheus text exposition -> Snapshot of the metrics in METRICS (missing ones are left out).

    Matches on sample names, not family names: the parser's family naming of counters (with or
    without ``_total``) differs between exposition formats, the samples' names do not. ``_created``
    samples (prometheus_client's series, which vllm-sim exposes as gauges of their own) never match.
    """
    counters: dict[str, float] = {}
    gauges: dict[str, list[float]] = {}
    hist_buckets: dict[str, dict[float, float]] = {}
    hist_count: dict[str, float] = {}
    hist_sum: dict[str, float] = {}
    by_sample: dict[str, list[tuple[str, MetricSpec, str]]] = {}
    for key, spec in METRICS.items():
        if spec.kind == "histogram":
            for suffix in ("_bucket", "_count", "_sum"):
                by_sample.setdefault(spec.name + suffix, []).append((key, spec, suffix))
        else:
            by_sample.setdefault(spec.name, []).append((key, spec, ""))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, spec, suffix in by_sample.get(sample.name, ()):
                if spec.label is not None and sample.labels.get(spec.label[0]) not in spec.label[1]:
                    continue
                v = float(sample.value)
                if spec.kind == "counter":
                    counters[key] = counters.get(key, 0.0) + v
                elif spec.kind == "gauge":
                    gauges.setdefault(key, []).append(v)
                elif suffix == "_bucket":
                    le = float(sample.labels["le"])
                    b = hist_buckets.setdefault(key, {})
                    b[le] = b.get(le, 0.0) + v
                elif suffix == "_count":
                    hist_count[key] = hist_count.get(key, 0.0) + v
                else:
                    hist_sum[key] = hist_sum.get(key, 0.0) + v
    histograms = {
        key: Histogram(tuple(sorted(b.items())), hist_count.get(key, b.get(math.inf, 0.0)), hist_sum.get(key, 0.0))
        for key, b in hist_buckets.items()
    }
    gauge_values = {
        key: (sum(vs) / len(vs) if METRICS[key].combine == "mean" else sum(vs)) for key, vs in gauges.items()
    }
    return Snapshot(
        time.monotonic() if t is None else t, counters, histograms, gauge_values, time.time() if wall is None else wall
    )


def scrape(url: str, client: httpx.Client | None = None, timeout: float = 5.0) -> Snapshot:
    """GET {url}/metrics and parse it. Raises httpx.HTTPError (network, non-2xx) or ValueError (not metrics)."""
    target = url.rstrip("/") + "/metrics"
    if client is None:
        # trust_env=False: an HTTP proxy from the environment must not sit between us and production
        with httpx.Client(timeout=timeout, trust_env=False) as own:
            resp = own.get(target)
    else:
        try:
            resp = client.get(target, timeout=timeout)
        except httpx.RemoteProtocolError:
            # a kept-alive connection the server closed as this GET went out (vLLM's uvicorn closes idle ones after
            # 5 s, late on a busy event loop): the GET is idempotent, so once more, on a new connection
            resp = client.get(target, timeout=timeout)
    resp.raise_for_status()
    t, wall = time.monotonic(), time.time()
    snap = parse_metrics(resp.text, t, wall)
    if not snap.counters and not snap.histograms:
        raise ValueError(f"{target} answered, but with none of vLLM's metrics (is this a vLLM server?)")
    return snap
