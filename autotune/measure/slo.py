"""Service-level objectives: the grammar of ``--slo`` and how a measurement is judged.

    ttft<800ms            p95 of time to first token under 800 ms (latency SLOs are p95 unless said)
    p99:ttft<1s           another percentile; also mean:tpot<40ms, p50:e2e<10s
    tpot<50ms  itl<...  e2e<...
    throughput>2000tok/s  output tokens per second over the run
    rps>5                 completed requests per second; goodput>4 counts only requests meeting every SLO
    latency, e2el         other names of e2e (vllm bench serve's), as tput is of throughput and qps of rps

Latency targets are stored in seconds. A request "meets" the latency SLOs when its own
TTFT, TPOT and E2E are under every target (ITL: the request's own percentile of its gaps),
which is how ``vllm bench serve`` counts goodput.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NoReturn

from autotune.errors import SLOSyntaxError

__all__ = ["SLO", "parse_slo", "parse_slos", "LATENCY_METRICS", "RATE_METRICS", "DEFAULT_PERCENTILE"]

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
RATE_METRICS = ("throughput", "rps", "goodput")
DEFAULT_PERCENTILE = 95.0

_LATENCY_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6, "µs": 1e-6}
_RATE_UNITS = {
    "throughput": {"": 1.0, "tok/s": 1.0, "tokens/s": 1.0},
    "rps": {"": 1.0, "req/s": 1.0, "/s": 1.0},
    "goodput": {"": 1.0, "req/s": 1.0, "/s": 1.0},
}
_ALIASES = {"e2el": "e2e", "latency": "e2e", "tput": "throughput", "qps": "rps"}

_SLO_RE = re.compile(
    r"""^\s*
    (?:(?P<stat>p\d+(?:\.\d+)?|mean|median)\s*:\s*)?
    (?P<metric>[a-z_0-9]+)\s*
    (?P<op><=|>=|<|>)\s*
    (?P<value>\d+(?:\.\d*)?|\.\d+)\s*
    (?P<unit>[a-zµ/]*)\s*$""",
    re.VERBOSE | re.IGNORECASE,
)
_EXAMPLE = "--slo 'ttft<800ms'"


@dataclass(frozen=True)
class SLO:
    metric: str  # one of LATENCY_METRICS or RATE_METRICS
    upper_bound: bool  # True for "<": the measured value must stay below target
    target: float  # seconds for latency; tok/s or req/s for rates
    percentile: float | None  # latency: 0 < p <= 100, or None for the mean; rates: None
    text: str  # as the user wrote it, normalised

    @property
    def is_latency(self) -> bool:
        return self.metric in LATENCY_METRICS

    @property
    def key(self) -> str:
        """A stable name for this SLO, usable as an Optuna constraint or a metric label."""
        if not self.is_latency:
            return self.metric
        stat = "mean" if self.percentile is None else f"p{_fmt_number(self.percentile)}"
        return f"{stat}_{self.metric}"

    def holds(self, value: float | None) -> bool:
        if value is None or math.isnan(value):
            return False
        return value < self.target if self.upper_bound else value > self.target

    def violation(self, value: float | None) -> float:
        """How far a measured value misses, relative to the target: <= 0 means it holds.

        Relative, so SLOs in ms and in tok/s can be compared and summed (Optuna constraints).
        """
        if value is None or math.isnan(value):
            return math.inf
        if self.upper_bound:
            return (value - self.target) / self.target
        return (self.target - value) / self.target

    def __str__(self) -> str:
        return self.text


def _fmt_number(x: float) -> str:
    return f"{x:g}"


def parse_slo(text: str) -> SLO:
    raw = text.strip()
    if not raw:
        raise SLOSyntaxError(f"empty SLO; write one like {_EXAMPLE}")
    m = _SLO_RE.match(raw)
    if m is None:
        _explain_no_match(raw)
    stat, metric, op, value, unit = (m["stat"], m["metric"].lower(), m["op"], float(m["value"]), m["unit"].lower())
    metric = _ALIASES.get(metric, metric)
    if metric not in LATENCY_METRICS + RATE_METRICS:
        raise SLOSyntaxError(
            f"unknown SLO metric {m['metric']!r} in {raw!r}; use one of {', '.join(LATENCY_METRICS + RATE_METRICS)}"
        )
    upper = op.startswith("<")
    if metric in LATENCY_METRICS:
        if not upper:
            raise SLOSyntaxError(
                f"{raw!r} asks {metric} to stay above a bound; latency SLOs use '<', e.g. --slo '{metric}<800ms'"
            )
        if unit == "":
            raise SLOSyntaxError(f"{raw!r} has no unit; write e.g. '{metric}<{value:g}ms' or '{metric}<{value:g}s'")
        if unit not in _LATENCY_UNITS:
            raise SLOSyntaxError(f"unknown unit {unit!r} in {raw!r}; use ms, s or us")
        percentile = _parse_stat(stat, raw)
        target = value * _LATENCY_UNITS[unit]
        if target <= 0:
            raise SLOSyntaxError(f"{raw!r}: a latency target must be above zero")
        stat_text = "mean" if percentile is None else f"p{_fmt_number(percentile)}"
        text = f"{stat_text}:{metric}<{value:g}{unit}"
        return SLO(metric, True, target, percentile, text)
    if stat is not None:
        raise SLOSyntaxError(
            f"{raw!r}: {metric} is a rate over the whole run and has no percentile; write '{metric}>{value:g}'"
        )
    if upper:
        raise SLOSyntaxError(f"{raw!r} caps {metric} from above; rate SLOs are floors: --slo '{metric}>{value:g}'")
    units = _RATE_UNITS[metric]
    if unit not in units:
        allowed = ", ".join(u for u in units if u)
        raise SLOSyntaxError(f"unknown unit {unit!r} in {raw!r}; {metric} takes {allowed} (or none)")
    shown = {"throughput": "tok/s", "rps": "req/s", "goodput": "req/s"}[metric]
    return SLO(metric, False, value * units[unit], None, f"{metric}>{value:g}{shown}")


def _parse_stat(stat: str | None, raw: str) -> float | None:
    if stat is None:
        return DEFAULT_PERCENTILE
    stat = stat.lower()
    if stat == "mean":
        return None
    if stat == "median":
        return 50.0
    p = float(stat[1:])
    if not 0 < p <= 100:
        raise SLOSyntaxError(f"percentile {stat} in {raw!r} must be between p0 and p100, e.g. p99")
    return p


def _explain_no_match(raw: str) -> NoReturn:
    if not re.search(r"[<>]", raw):
        # 'ttft' (the shell ate '<800ms') or 'ttft800ms' (the '<' alone went missing): the metric, and its target
        # where one was given, with the comparison its kind takes (latencies below, rates above)
        stat, _, last = raw.rpartition(":")
        said = re.fullmatch(r"(?P<name>[A-Za-z_]+?)\s*(?P<target>\d[\d.]*\s*[a-zµ/]*)?", last.strip())
        name = said["name"] if said else last.strip()
        rate = _ALIASES.get(name.lower(), name.lower()) in RATE_METRICS
        target = said["target"] if said and said["target"] else ("5" if rate else "800ms")
        fixed = f"{stat + ':' if stat and not rate else ''}{name}{'>' if rate else '<'}{target}"
        raise SLOSyntaxError(
            f"SLO {raw!r} has no comparison; quote it: --slo '{fixed}' "
            "(unquoted, the shell reads < as a redirection and drops the rest)"
        )
    if re.search(r"[<>]\s*$", raw):
        raise SLOSyntaxError(f"SLO {raw!r} has no target value; write e.g. {_EXAMPLE}")
    raise SLOSyntaxError(
        f"cannot read SLO {raw!r}; the form is [pNN:]metric<value unit, e.g. {_EXAMPLE}, "
        "--slo 'p99:tpot<50ms', --slo 'throughput>2000tok/s'"
    )


def parse_slos(texts: list[str] | tuple[str, ...]) -> list[SLO]:
    slos = [parse_slo(t) for t in texts]
    seen: dict[str, str] = {}
    for slo in slos:
        if slo.key in seen:
            raise SLOSyntaxError(f"SLO {slo.text!r} repeats {seen[slo.key]!r}; give each metric one target")
        seen[slo.key] = slo.text
    return slos


@dataclass(frozen=True)
class Verdict:
    """One SLO against the value measured for it."""

    slo: SLO
    measured: float | None

    @property
    def holds(self) -> bool:
        return self.slo.holds(self.measured)

    @property
    def violation(self) -> float:
        return self.slo.violation(self.measured)

    def to_json(self) -> dict[str, object]:
        return {
            "slo": self.slo.text,
            "key": self.slo.key,
            "target": self.slo.target,
            "measured": self.measured,
            "holds": self.holds,
            "violation": None if math.isinf(self.violation) else self.violation,
        }
