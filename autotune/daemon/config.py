"""The daemon's configuration (``autotune daemon --config /etc/autotune/daemon.toml``).

    name = "production"                  # names the daemon's state, history and studies
    slos = ["ttft<800ms", "tpot<50ms"]

    [production]                         # the engine that serves users, and how a config reaches it
    url = "http://127.0.0.1:8000"
    kind = "vllm-config"                 # vllm-config | xinference
    config = "/etc/vllm/production.yaml" # vllm-config: the file `vllm serve --config` reads
    model = "meta-llama/Llama-3.1-8B-Instruct"
    restart = ["systemctl", "restart", "vllm@production.service"]   # an argv, never a shell line
    health_timeout = "15m"
    # kind = "xinference": xinference_url, model_uid, model_name, model_engine, username,
    # password_file (the JWT comes from /token), launch = { model_format = ..., ... }

    [staging]
    study = "/etc/autotune/staging.toml" # a study file: engine command, port, space, storage, budget;
                                         # its workload is replaced by one like production's traffic
    trace = ""                           # or a trace recorded by `autotune capture` to replay instead

    [watch]
    scrape_interval = "15s"
    window = "10m"                       # SLO compliance and the traffic fingerprint over this span

    [triggers]
    drift = 0.5                          # re-tune when the fingerprint moved this far (0.5: ~1.65x)
    breach_windows = 3                   # ... or an SLO missed in this many windows in a row
    every = "7d"                         # ... or this long since the last tuning ("0": never)
    cooldown = "6h"                      # never start a tuning sooner than this after the last one

    [tuning]
    windows = ["01:00-05:00"]            # local times of day a tuning may start; [] = any time
    canary_requests = 60                 # the canary replays this many requests like production's

    [publish]
    approval = false                     # true: a winner waits for `autotune publish --approve`

    [metrics]
    listen = "127.0.0.1:9464"            # the daemon's own Prometheus metrics; "" turns them off
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError
from autotune.publish.target import check_settings
from autotune.study.definition import read_toml
from autotune.units import parse_duration
from autotune.measure.slo import SLO, parse_slos

__all__ = ["DaemonConfig", "Production", "Triggers", "TimeWindow", "load_daemon_config"]


@dataclass(frozen=True)
class TimeWindow:
    start: dt.time
    end: dt.time

    def contains(self, t: dt.time) -> bool:
        if self.start <= self.end:
            return self.start <= t < self.end
        return t >= self.start or t < self.end  # across midnight: 22:00-04:00

    @classmethod
    def parse(cls, text: str, where: str) -> TimeWindow:
        m = re.fullmatch(r"\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*", text)
        if not m:
            raise ConfigError(f"{where}: {text!r} is not a time window; write e.g. \"01:00-05:00\"")
        h1, m1, h2, m2 = (int(x) for x in m.groups())
        if h1 > 23 or h2 > 24 or m1 > 59 or m2 > 59:
            raise ConfigError(f"{where}: {text!r} has an impossible time")
        return cls(dt.time(h1, m1), dt.time(min(h2, 23), m2 if h2 < 24 else 59))


@dataclass(frozen=True)
class Production:
    url: str
    kind: str = "vllm-config"  # a publish target kind (publish/target.py), which reads its own keys
    settings: dict[str, Any] = field(default_factory=dict)  # the [production] table as written


@dataclass(frozen=True)
class Triggers:
    drift: float = 0.5
    breach_windows: int = 3
    every_s: float = 7 * 86400.0
    cooldown_s: float = 6 * 3600.0


@dataclass(frozen=True)
class DaemonConfig:
    name: str
    slos: list[SLO]
    production: Production
    staging_study: Path
    staging_trace: Path | None = None  # a captured trace to tune with, instead of the synthesized traffic
    scrape_interval_s: float = 15.0
    window_s: float = 600.0
    triggers: Triggers = field(default_factory=Triggers)
    tuning_windows: tuple[TimeWindow, ...] = ()
    canary_requests: int = 60
    approval: bool = False
    metrics_listen: tuple[str, int] | None = ("127.0.0.1", 9464)
    source: Path | None = None

    def may_tune_at(self, now: dt.datetime) -> bool:
        return not self.tuning_windows or any(w.contains(now.time()) for w in self.tuning_windows)


def _table(data: dict, key: str, where: str) -> dict:
    t = data.get(key, {})
    if not isinstance(t, dict):
        raise ConfigError(f"{where} [{key}] must be a table")
    return t


def _known(t: dict, keys: set[str], where: str) -> None:
    extra = set(t) - keys
    if extra:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(extra))}; see autotune/daemon/config.py")


def load_daemon_config(path: str | Path) -> DaemonConfig:
    p = Path(path)
    data = read_toml(p, "daemon config")
    w = p.name
    _known(data, {"name", "slos", "production", "staging", "watch", "triggers", "tuning", "publish", "metrics"}, w)
    name = str(data.get("name", "production"))
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ConfigError(f"{w}: name {name!r} may only hold letters, digits, '.', '_' and '-'")
    slos = parse_slos(data.get("slos", []))
    if not slos:
        raise ConfigError(f"{w}: give the SLOs production must meet, e.g. slos = [\"ttft<800ms\"]")

    prod = _table(data, "production", w)
    if "url" not in prod:
        raise ConfigError(f"{w} [production].url is missing: production's base URL, e.g. http://127.0.0.1:8000")
    kind = prod.get("kind", "vllm-config")
    settings = {k: v for k, v in prod.items() if k not in ("url", "kind")}
    check_settings(kind, settings, f"{w} [production]")  # each target kind checks its own keys
    production = Production(url=str(prod["url"]).rstrip("/"), kind=kind, settings=settings)

    staging = _table(data, "staging", w)
    _known(staging, {"study", "trace"}, f"{w} [staging]")
    if "study" not in staging:
        raise ConfigError(f"{w} [staging].study is missing: the study file the staging engine is tuned with")
    study = Path(staging["study"])
    if not study.is_absolute():
        study = p.parent / study
    if not study.is_file():
        raise ConfigError(f"{w} [staging].study: {str(study)!r} does not exist")

    trace = Path(staging["trace"]) if staging.get("trace") else None
    if trace is not None and not trace.is_absolute():
        trace = p.parent / trace
    if trace is not None and not trace.is_file():
        raise ConfigError(f"{w} [staging].trace: {str(trace)!r} does not exist (record one with autotune capture)")

    watch = _table(data, "watch", w)
    _known(watch, {"scrape_interval", "window"}, f"{w} [watch]")
    trig = _table(data, "triggers", w)
    _known(trig, {"drift", "breach_windows", "every", "cooldown"}, f"{w} [triggers]")
    every = trig.get("every", "7d")
    triggers = Triggers(
        drift=float(trig.get("drift", 0.5)), breach_windows=int(trig.get("breach_windows", 3)),
        every_s=0.0 if every in ("0", 0) else _days(every, f"{w} [triggers].every"),
        cooldown_s=_days(trig.get("cooldown", "6h"), f"{w} [triggers].cooldown"),
    )
    tuning = _table(data, "tuning", w)
    _known(tuning, {"windows", "canary_requests"}, f"{w} [tuning]")
    windows = tuple(TimeWindow.parse(x, f"{w} [tuning].windows") for x in tuning.get("windows", []))
    pub = _table(data, "publish", w)
    _known(pub, {"approval"}, f"{w} [publish]")
    met = _table(data, "metrics", w)
    _known(met, {"listen"}, f"{w} [metrics]")
    listen = met.get("listen", "127.0.0.1:9464")
    addr = None
    if listen:
        host, _, port = str(listen).rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{w} [metrics].listen must be HOST:PORT, e.g. 127.0.0.1:9464")
        addr = (host, int(port))
    return DaemonConfig(
        name=name, slos=slos, production=production, staging_study=study, staging_trace=trace,
        scrape_interval_s=parse_duration(watch.get("scrape_interval", 15), f"{w} [watch].scrape_interval"),
        window_s=parse_duration(watch.get("window", 600), f"{w} [watch].window"),
        triggers=triggers, tuning_windows=windows, canary_requests=int(tuning.get("canary_requests", 60)),
        approval=bool(pub.get("approval", False)), metrics_listen=addr, source=p,
    )


def _days(text: Any, where: str) -> float:
    """Durations that may be days long: '7d' besides what parse_duration reads."""
    if isinstance(text, str) and text.strip().endswith("d"):
        try:
            return float(text.strip()[:-1]) * 86400
        except ValueError:
            raise ConfigError(f"{where}: {text!r} is not a duration; write e.g. 7d, 6h or 30m") from None
    return parse_duration(text, where)
