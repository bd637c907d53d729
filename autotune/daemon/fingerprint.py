"""Traffic fingerprints: what production's traffic looks like, how far it drifted, and traffic like it.

- ``Fingerprint`` is a window (window.py) boiled down to the features that decide which engine
  config is best (rate, length distributions, prefix sharing).
- ``drift(a, b)`` compares two of them with one scale-free number (``drift_features``: each
  feature's change on its own).
- ``workload_from(fp)`` synthesizes traffic that looks like a fingerprint, for a re-tuning study
  to replay.

A fingerprint's lengths come from histograms, so its percentiles are bucket estimates; its means
are exact (see ``Histogram.quantile``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Literal

import numpy as np

from autotune.daemon.window import Window
from autotune.errors import ConfigError
from autotune.workload.trace import Request, Workload, gamma_arrivals

__all__ = ["DRIFT_FEATURES", "Fingerprint", "drift", "drift_features", "workload_from"]


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
    saturated: bool = False  # production could not keep up: without ``offered``, request_rate is a lower bound
    offered: bool = False  # request_rate counts every request users sent (the proxy's log), served or not

    @classmethod
    def of(cls, window: Window, recent: Window | None = None) -> Fingerprint:
        """The window's traffic; its rate from ``recent`` where given: the part since the arrival rate changed
        level (Watcher.since_change), which is the traffic now, where the window's mean blends the two levels.
        Lengths and prefix sharing stay the whole window's, which has more requests to read them from."""
        return cls(
            # demand, not what a saturated production managed to serve
            request_rate=(recent or window).arrival_rate,
            prompt_tokens_mean=window.prompt_tokens_mean,
            prompt_tokens_p50=window.prompt_tokens_p50,
            prompt_tokens_p90=window.prompt_tokens_p90,
            output_tokens_mean=window.output_tokens_mean,
            output_tokens_p50=window.output_tokens_p50,
            output_tokens_p90=window.output_tokens_p90,
            prefix_cache_hit_rate=window.prefix_cache_hit_rate,
            window_s=window.dt,
            requests=window.requests,
            saturated=window.saturated,
            offered=window.offered,
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
        return cls(**d)


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


def workload_from(
    fp: Fingerprint,
    *,
    requests: int,
    seed: int,
    burstiness: float = 1.0,
    prefix_groups: int = 4,
    api: Literal["completion", "chat"] = "completion",
    max_model_len: int | None = None,
    name: str = "production",
) -> Workload:
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
    prompts = np.clip(
        np.rint(_lognormal(rng, requests, fp.prompt_tokens_mean, fp.prompt_tokens_p50, fp.prompt_tokens_p90)),
        1,
        max(cap - 1, 1),
    ).astype(int)
    outputs = np.rint(
        _lognormal(rng, requests, fp.output_tokens_mean, fp.output_tokens_p50, fp.output_tokens_p90)
    ).astype(int)
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
        reqs.append(
            Request(
                arrival_s=t,
                output_tokens=int(outputs[i]),
                prompt_tokens=int(prompts[i]),
                prefix_group=f"{name}-prefix-{g}" if g >= 0 else None,
                prefix_tokens=plens[g] if g >= 0 else 0,
                api=api,
            )
        )
    return Workload(tuple(reqs), name)
