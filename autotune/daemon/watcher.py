"""The production watcher: what production's vLLM serves, read from its ``/metrics``.

Pure functions at the core, I/O at the edge:

- ``scrape(url)`` is the only network call: one ``GET /metrics``, parsed into a ``Snapshot`` of
  the few vLLM metrics the daemon uses (``METRICS``, named by the vLLM engine kind), summed
  over labels (``model_name``, ``engine``, ``finished_reason``).
- ``Window.between(prev, cur)`` is the traffic between two snapshots: counter and histogram
  deltas, from which it derives the request rate, prompt/output lengths, the prefix-cache hit
  rate, latency quantiles (``histogram_quantile``'s interpolation) and SLO estimates.
- ``Fingerprint`` is a window boiled down to the features that decide which engine config is
  best (rate, length distributions, prefix sharing); ``drift(a, b)`` compares two of them with
  one scale-free number, and ``workload_from(fp)`` synthesizes traffic that looks like it, for
  a re-tuning study to replay.
- ``Watcher`` keeps a ring of snapshots and turns each ``poll()`` into the latest window. It
  has no thread and no timer: the daemon calls ``poll()`` on its own schedule.

Histograms only know bucket counts, so quantiles are estimates: exact at bucket bounds, linearly
interpolated inside a bucket. vLLM's token-count buckets are 1-2-5 steps (..., 200, 500, 1000,
...), so a prompt-length p50 can be off by a good part of a bucket; means (sum/count) are exact.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Literal, Self

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from autotune.engine.kind import MetricSpec
from autotune.engine.vllm.metrics import METRICS
from autotune.errors import ConfigError
from autotune.measure.slo import SLO
from autotune.workload.trace import Request, Workload, gamma_arrivals

__all__ = [
    "DRIFT_FEATURES",
    "METRICS",
    "Fingerprint",
    "Histogram",
    "MetricSpec",
    "SLOEstimate",
    "Snapshot",
    "Watcher",
    "Window",
    "drift",
    "drift_features",
    "parse_metrics",
    "scrape",
    "workload_from",
]

# --- snapshots ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram: cumulative counts per upper bound (the last bound is +Inf)."""

    buckets: tuple[tuple[float, float], ...]  # (le, cumulative count), le ascending
    count: float
    sum: float

    def minus(self, older: Histogram) -> Histogram:
        """The observations made since ``older`` (same bucket layout)."""
        theirs = dict(older.buckets)
        return Histogram(tuple((le, c - theirs.get(le, 0.0)) for le, c in self.buckets),
                         self.count - older.count, self.sum - older.sum)

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
    gauge_values = {key: (sum(vs) / len(vs) if METRICS[key].combine == "mean" else sum(vs))
                    for key, vs in gauges.items()}
    return Snapshot(time.monotonic() if t is None else t, counters, histograms, gauge_values,
                    time.time() if wall is None else wall)


def scrape(url: str, client: httpx.Client | None = None, timeout: float = 5.0) -> Snapshot:
    """GET {url}/metrics and parse it. Raises httpx.HTTPError (network, non-2xx) or ValueError (not metrics)."""
    target = url.rstrip("/") + "/metrics"
    if client is None:
        # trust_env=False: an HTTP proxy from the environment must not sit between us and production
        with httpx.Client(timeout=timeout, trust_env=False) as own:
            resp = own.get(target)
    else:
        resp = client.get(target, timeout=timeout)
    resp.raise_for_status()
    t, wall = time.monotonic(), time.time()
    snap = parse_metrics(resp.text, t, wall)
    if not snap.counters and not snap.histograms:
        raise ValueError(f"{target} answered, but with none of vLLM's metrics (is this a vLLM server?)")
    return snap


# --- windows --------------------------------------------------------------------------------------

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


# --- fingerprints and drift -----------------------------------------------------------------------

@dataclass(frozen=True)
class Fingerprint:
    """What production's traffic looks like over a window: the features engine configs are sensitive to.

    None where the window cannot tell (no finished requests, prefix caching off).
    """

    request_rate: float | None
    prompt_tokens_mean: float | None
    prompt_tokens_p50: float | None
    prompt_tokens_p90: float | None
    output_tokens_mean: float | None
    output_tokens_p50: float | None
    output_tokens_p90: float | None
    prefix_cache_hit_rate: float | None
    window_s: float
    requests: int = 0  # how many finished requests the window saw: how far to trust the rest

    @classmethod
    def of(cls, window: Window) -> Fingerprint:
        return cls(
            request_rate=window.request_rate,
            prompt_tokens_mean=window.prompt_tokens_mean,
            prompt_tokens_p50=window.prompt_tokens_p50,
            prompt_tokens_p90=window.prompt_tokens_p90,
            output_tokens_mean=window.output_tokens_mean,
            output_tokens_p50=window.output_tokens_p50,
            output_tokens_p90=window.output_tokens_p90,
            prefix_cache_hit_rate=window.prefix_cache_hit_rate,
            window_s=window.dt,
            requests=window.requests,
        )

    def to_json(self) -> dict[str, float | int | None]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, object] | str) -> Fingerprint:
        d = json.loads(data) if isinstance(data, str) else dict(data)
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown fingerprint field(s): {', '.join(sorted(unknown))}")
        return cls(**d)  # type: ignore[arg-type]


# Each feature, and the floor that keeps its log ratio finite: below the floor, values count as equal
# to it (an idle window has rate 0; 0.01 req/s is "idle" too).
DRIFT_FEATURES: dict[str, float] = {
    "request_rate": 0.01,
    "prompt_tokens_mean": 1.0,
    "prompt_tokens_p50": 1.0,
    "prompt_tokens_p90": 1.0,
    "output_tokens_mean": 1.0,
    "output_tokens_p50": 1.0,
    "output_tokens_p90": 1.0,
}


def drift_features(a: Fingerprint, b: Fingerprint) -> dict[str, float]:
    """Each feature's change between two fingerprints (see ``drift``); features either side lacks are left out."""
    out: dict[str, float] = {}
    for name, floor in DRIFT_FEATURES.items():
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            continue
        out[name] = abs(math.log(max(x, floor) / max(y, floor)))
    x, y = a.prefix_cache_hit_rate, b.prefix_cache_hit_rate
    if x is not None and y is not None:
        out["prefix_cache_hit_rate"] = abs(x - y)
    return out


def drift(a: Fingerprint, b: Fingerprint) -> float:
    """How far apart two fingerprints are: the largest change of any one feature.

    Rate and lengths change by ``|log(a/b)|`` (scale-free and symmetric: doubling and halving
    both read log 2 = 0.69; a change of x % reads about x/100 for small x, exactly log(1 + x/100)),
    the prefix-cache hit rate by its absolute difference (0.2 = twenty points). So a threshold
    reads as "some feature moved by this much": 0.22 = 25 % more or 20 % less load or length.
    The max, not a sum, so that a threshold does not depend on how many features there are and
    one real change is not diluted by the features that stayed put. 0 for identical fingerprints.
    """
    return max(drift_features(a, b).values(), default=0.0)


# --- a workload like production's -----------------------------------------------------------------

_Z90 = 1.2815515655446004  # the standard normal's 90th percentile


def _lognormal(rng: np.random.Generator, n: int, mean: float, p50: float | None, p90: float | None) -> np.ndarray:
    """n lengths with the given mean (exact in expectation) and a spread from p90/p50.

    A log-normal: lengths are positive and right-skewed, as prompts and answers are. The mean is
    what /metrics knows exactly (sum/count); the percentiles come from coarse buckets, so only
    their ratio is used, for the spread.
    """
    sigma = 0.0
    if p50 and p90 and p90 > p50 > 0:
        sigma = min(math.log(p90 / p50) / _Z90, 2.0)  # capped: beyond that the tail is all noise
    mu = math.log(mean) - sigma * sigma / 2
    return np.exp(rng.normal(mu, sigma, size=n)) if sigma > 0 else np.full(n, mean)


def _prefix_lengths(lengths: np.ndarray, share: float, groups: int) -> tuple[list[int], np.ndarray]:
    """Per-group prefix lengths and each request's group (-1: none), so that prefixes cover ``share`` of all tokens.

    A prefix must be shorter than its request's prompt, so one prefix length for everybody cannot
    reach a high share when lengths vary. Groups take prefix lengths at quantiles of the prompt
    lengths, scaled by a factor found by bisection; each request joins the group with the longest
    prefix it can hold.
    """
    total = float(lengths.sum())
    qs = np.quantile(lengths, (np.arange(groups) + 0.5) / groups)

    def plan(scale: float) -> tuple[list[int], np.ndarray, float]:
        plens = sorted({max(1, round(scale * q)) for q in qs})
        bounds = np.asarray(plens)
        # the longest prefix strictly shorter than the prompt (a request needs one token of its own)
        idx = np.searchsorted(bounds, lengths, side="left") - 1
        got = np.where(idx >= 0, bounds[np.clip(idx, 0, None)], 0)
        return plens, idx, float(got.sum()) / total

    lo, hi = 0.0, 1.0
    best = plan(hi)
    if best[2] > share:
        for _ in range(40):
            mid = (lo + hi) / 2
            p = plan(mid)
            if p[2] < share:
                lo = mid
            else:
                hi, best = mid, p
    return best[0], best[1]


def workload_from(fp: Fingerprint, *, requests: int, seed: int, burstiness: float = 1.0,
                  prefix_groups: int = 4, api: Literal["completion", "chat"] = "completion",
                  max_model_len: int | None = None, name: str = "production") -> Workload:
    """A synthetic workload that looks like the fingerprint, for a re-tuning study to replay.

    Arrivals are gamma (Poisson unless ``burstiness``) at the fingerprint's rate; prompt and output
    lengths are log-normal with its means and the spread of its p90/p50 (the median then follows
    from those two, and may differ from the fingerprint's p50 when production's lengths are not
    log-normal); a share of the prompt tokens equal to the prefix-cache hit rate is put in shared
    prefixes (``prefix_groups`` groups, more when the share needs them; see ``_prefix_lengths``).
    The replayed hit rate comes out a little lower than that share: each group's first request
    misses, and the cache works in whole blocks. Token counts only: build the text with
    ``prompts.materialize`` (or write it with ``write_trace`` and load it as a trace).
    """
    if requests < 1:
        raise ConfigError("a workload needs at least one request")
    if not fp.request_rate or fp.request_rate <= 0:
        raise ConfigError("the fingerprint has no request rate (an idle window): nothing to imitate")
    if not fp.prompt_tokens_mean or not fp.output_tokens_mean:
        raise ConfigError("the fingerprint has no prompt/output lengths (no finished requests in its window)")
    rng = np.random.default_rng(seed)
    cap = max_model_len or 1 << 30
    prompts = np.clip(np.rint(_lognormal(rng, requests, fp.prompt_tokens_mean, fp.prompt_tokens_p50,
                                         fp.prompt_tokens_p90)), 1, max(cap - 1, 1)).astype(int)
    outputs = np.rint(_lognormal(rng, requests, fp.output_tokens_mean, fp.output_tokens_p50,
                                 fp.output_tokens_p90)).astype(int)
    outputs = np.clip(outputs, 1, np.maximum(cap - prompts, 1))
    share = fp.prefix_cache_hit_rate or 0.0
    plens: list[int] = []
    group_of = np.full(requests, -1)
    if share >= 0.01 and prefix_groups > 0:
        # A high share over widely spread lengths needs more prefix lengths than asked for: double the
        # groups until the share is met (within a point) or 64 prefixes, whichever comes first.
        groups = prefix_groups
        while True:
            plens, group_of = _prefix_lengths(prompts, min(share, 0.99), groups)
            covered = sum(plens[g] for g in group_of if g >= 0) / float(prompts.sum())
            if covered >= share - 0.01 or groups >= 64:
                break
            groups = min(groups * 2, 64)
    times = gamma_arrivals(requests, fp.request_rate, burstiness, seed)
    reqs = []
    for i, t in enumerate(times):
        g = int(group_of[i])
        reqs.append(Request(arrival_s=t, output_tokens=int(outputs[i]), prompt_tokens=int(prompts[i]),
                            prefix_group=f"{name}-prefix-{g}" if g >= 0 else None,
                            prefix_tokens=plens[g] if g >= 0 else 0, api=api))
    return Workload(tuple(reqs), name)


# --- the watcher ----------------------------------------------------------------------------------

class Watcher:
    """Scrapes production on demand and keeps a ring of snapshots to make windows from.

    ``poll()`` returns the window from the newest snapshot at least ``window_s`` old to the new
    one (or from the oldest kept, while the ring is younger than that: ``Window.dt`` tells);
    None on the first poll and on scrape errors, which are counted, never raised, so a
    production restart does not stop the daemon. After a counter reset the older snapshots
    belong to the previous process and are dropped.
    """

    def __init__(self, url: str, *, window_s: float = 300.0, keep: int = 256, timeout: float = 5.0,
                 client: httpx.Client | None = None,
                 scraper: Callable[[str, httpx.Client | None, float], Snapshot] = scrape) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.url = url
        self.window_s = window_s
        self.timeout = timeout
        self.snapshots: deque[Snapshot] = deque(maxlen=max(2, keep))
        self.errors = 0  # scrape errors since start
        self.consecutive_errors = 0
        self.last_error: str | None = None
        self.resets = 0  # production restarts seen
        # one client for every poll (a kept-alive connection); closed by close() only when it is ours
        self._owns_client = client is None
        self._client = client if client is not None else httpx.Client(timeout=timeout, trust_env=False)
        self._scraper = scraper

    def poll(self) -> Window | None:
        try:
            snap = self._scraper(self.url, self._client, self.timeout)
        except (httpx.HTTPError, ValueError, OSError) as e:
            self.errors += 1
            self.consecutive_errors += 1
            self.last_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            return None
        self.consecutive_errors = 0
        return self.add(snap)

    def add(self, snap: Snapshot) -> Window | None:
        """Take a snapshot (scraped elsewhere, or in tests) and return the latest window."""
        if self.snapshots:
            last = self.snapshots[-1]
            step = Window.between(last, snap)
            if step.reset:
                self.resets += 1
                self.snapshots.clear()
                self.snapshots.append(snap)
                return step
        self.snapshots.append(snap)
        return self.window()

    def window(self) -> Window | None:
        """The latest window over ``window_s`` from the kept snapshots (None with fewer than two)."""
        if len(self.snapshots) < 2:
            return None
        cur = self.snapshots[-1]
        start = self.snapshots[0]
        for s in reversed(self.snapshots):  # newest first: the first one old enough is the tightest fit
            if s is not cur and cur.t - s.t >= self.window_s:
                start = s
                break
        return Window.between(start, cur)

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

