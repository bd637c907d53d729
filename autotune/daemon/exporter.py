"""The daemon's own Prometheus metrics: the one place their names are written.

Served by prometheus-client on 127.0.0.1 by default ([metrics].listen), from a private
registry so nothing else leaks in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Info, start_http_server

__all__ = ["DaemonMetrics", "PHASE_METRIC"]

PHASE_METRIC = "autotune_daemon_phase"  # also how `daemon --check` knows a port is held by a running daemon

PHASES = ["watching", "tuning", "awaiting_approval", "publishing", "verifying", "rolling_back"]
TRIAL_STATES = ["complete", "pruned", "fail", "running", "waiting"]


class _Known:
    """A gauge exported from its first value on: until then the metric is absent (unknown), never a 0 that an
    alert or a dashboard would read as a measurement."""

    def __init__(self, registry: CollectorRegistry, name: str, documentation: str) -> None:
        self.gauge = Gauge(name, documentation, registry=None)
        self.registry, self.shown = registry, False

    def set(self, value: float) -> None:
        if not self.shown:
            self.registry.register(self.gauge)
            self.shown = True
        self.gauge.set(value)


class DaemonMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.phase = Enum(PHASE_METRIC, "What the daemon is doing", states=PHASES, registry=r)
        self.trials = Gauge(
            "autotune_trials", "Trials of the current (or last) tuning study, by state", ["state"], registry=r
        )
        self.best_capacity = _Known(
            r, "autotune_best_capacity_requests_per_second", "SLO capacity of the last tuning's winner"
        )
        self.production_capacity = _Known(
            r,
            "autotune_production_capacity_requests_per_second",
            "SLO capacity of the production config, measured on staging",
        )
        self.production_config = Info(
            "autotune_production_config", "The engine args production runs (history entry)", registry=r
        )
        self.drift = _Known(
            r,
            "autotune_traffic_drift_score",
            "Distance of production's traffic fingerprint from the one its config was tuned for",
        )
        self.slo_value = Gauge(
            "autotune_production_slo_value",
            "Production's latency at the SLO's percentile over the watch window, seconds",
            ["slo"],
            registry=r,
        )
        self.slo_met = Gauge(
            "autotune_production_slo_met",
            "1 when production meets the SLO over the window, 0 when not",
            ["slo"],
            registry=r,
        )
        self.request_rate = _Known(r, "autotune_production_request_rate", "Production's finished requests per second")
        self.last_publish = Gauge("autotune_last_publish_timestamp_seconds", "When the last publish ended", registry=r)
        self.last_publish_ok = Gauge(
            "autotune_last_publish_success", "1 when the last publish was kept, 0 when it was rolled back", registry=r
        )
        self.publishes = Counter("autotune_publishes", "Publishes by outcome", ["outcome"], registry=r)
        self.rollbacks = Counter("autotune_rollbacks", "Configs rolled back (automatically or by hand)", registry=r)
        self.scrape_errors = Counter(
            "autotune_production_scrape_errors", "Failed scrapes of production's /metrics", registry=r
        )
        self.tunings = Counter("autotune_tunings", "Tunings started, by trigger kind", ["trigger"], registry=r)
        self._counted: dict[str, float] = {}  # what the counters hold from the history so far
        self._last: tuple[int, str] | None = None  # the last publish or rollback the gauges show

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def set_phase(self, phase: str) -> None:
        self.phase.state(phase)

    def set_trials(self, counts: Mapping[str, int]) -> None:
        for s in TRIAL_STATES:
            self.trials.labels(s).set(counts.get(s, 0))

    def set_production(self, entry_number: int, values: Mapping[str, Any]) -> None:
        self.production_config.info({"entry": str(entry_number), **{k: str(v) for k, v in sorted(values.items())}})

    def set_slos(self, estimates: Iterable[Any]) -> None:
        """Each SLO's latency and verdict over the window; an SLO without one (no traffic, or no longer configured
        after a reload) has no series: an alert on a removed SLO's 0 would fire forever."""
        self.slo_value.clear()
        self.slo_met.clear()
        for e in estimates:
            if e.value is not None:
                self.slo_value.labels(e.slo.text).set(e.value)
            if e.holds is not None:
                self.slo_met.labels(e.slo.text).set(1.0 if e.holds else 0.0)

    def from_history(self, entries: Iterable[Any]) -> None:
        """Publishes, rollbacks (the daemon's and those by hand, which ``autotune rollback`` records in the
        history from another process), the last publish and production's config, from the publish history:
        the same after a daemon restart as before it. Counters only go up: each call adds what is new."""
        entries = list(entries)
        publishes: dict[str, int] = {}
        rollbacks, last, production = 0, None, None
        for e in entries:
            by_hand = "rollback_to" in e.source
            if e.outcome in ("published", "rolled-back"):
                last = e
                if by_hand:
                    rollbacks += 1
                elif not e.reached_production:  # production never served it: nothing was rolled back
                    publishes["abandoned"] = publishes.get("abandoned", 0) + 1
                else:
                    failed = e.outcome == "rolled-back" and (" FAILED" in e.reason or "no earlier good" in e.reason)
                    outcome = "rollback-failed" if failed else e.outcome
                    publishes[outcome] = publishes.get(outcome, 0) + 1
                    rollbacks += e.outcome == "rolled-back"
            if e.outcome in ("adopted", "published"):
                production = e
        for outcome, n in publishes.items():
            self._count(f"publishes:{outcome}", n, self.publishes.labels(outcome))
        self._count("rollbacks", rollbacks, self.rollbacks)
        if last is not None and (last.number, last.outcome) != self._last:  # news: a restart, or another process
            self._last = (last.number, last.outcome)
            self.last_publish.set(last.time)  # when it started: the history keeps no end time
            self.last_publish_ok.set(1.0 if last.outcome == "published" else 0.0)
        if production is not None:
            self.set_production(production.number, production.values)

    def set_tunings(self, by_trigger: Mapping[str, int]) -> None:
        """Tunings started, by trigger kind, as the daemon's state counts them: the same after a restart."""
        for trigger, n in by_trigger.items():
            self._count(f"tunings:{trigger}", n, self.tunings.labels(trigger))

    def _count(self, key: str, total: float, counter: Any) -> None:
        new = total - self._counted.get(key, 0.0)
        if new > 0:
            counter.inc(new)
            self._counted[key] = total
