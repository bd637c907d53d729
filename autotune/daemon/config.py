"""The daemon's configuration (``autotune daemon --config /etc/autotune/daemon.toml``).

    name = "production"                  # names the daemon's state, history and studies
    state_dir = "/var/lib/autotune"      # where its state lives (STATE_DIR/daemon/NAME), for the daemon
                                         # and for status, retune, history, publish and rollback alike;
                                         # default: $AUTOTUNE_STATE_DIR, $STATE_DIRECTORY, ~/.local/state
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
    scrape_interval = "15s"              # at least 1s
    window = "10m"                       # SLO compliance and the traffic fingerprint over this span
    arrivals_log = ""                    # the proxy's log of users' requests (the shipped nginx snippet's
                                         # /var/log/nginx/autotune/arrivals.log): demand, served or not

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

Every value is read strictly (autotune/configfile.py): ``approval = "false"`` is an error, not true.
The daemon itself checks at start that it can listen on [metrics].listen; the commands that only
read this file (status, publish, rollback, retune) do not, as the running daemon holds that port.
"""

from __future__ import annotations

import datetime as dt
import errno
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.configfile import Table
from autotune.errors import ConfigError
from autotune.measure.slo import SLO
from autotune.publish.target import check_settings
from autotune.study.definition import read_slos

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
            raise ConfigError(f'{where}: {text!r} is not a time window; write e.g. "01:00-05:00"')
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
    arrivals_log: Path | None = None  # the proxy's log of users' requests (daemon/arrivals.py)
    scrape_interval_s: float = 15.0
    window_s: float = 600.0
    triggers: Triggers = field(default_factory=Triggers)
    tuning_windows: tuple[TimeWindow, ...] = ()
    canary_requests: int = 60
    approval: bool = False
    metrics_listen: tuple[str, int] | None = ("127.0.0.1", 9464)
    source: Path | None = None
    state_dir: Path | None = None  # where the daemon keeps its state (None: locations.state_dir())

    def may_tune_at(self, now: dt.datetime) -> bool:
        return not self.tuning_windows or any(w.contains(now.time()) for w in self.tuning_windows)

    def windows_text(self) -> str:
        """The tuning windows as written ("01:00-05:00, 13:00-14:00"); "" when any time will do."""
        return ", ".join(f"{w.start:%H:%M}-{w.end:%H:%M}" for w in self.tuning_windows)


_SEE = "see docs/daemon.md"


def _production(prod: Table, w: str) -> Production:
    """[production]: where production answers, and the publish target that restarts it."""
    if "url" not in prod:
        raise ConfigError(f"{w} [production].url is missing: production's base URL, e.g. http://127.0.0.1:8000")
    url = prod.string("url")
    if not re.match(r"https?://[^/]", url):
        raise prod.wrong("url", "production's base URL, e.g. http://127.0.0.1:8000")
    kind = prod.string("kind", "vllm-config")
    settings = {k: prod.value(k) for k in prod if k not in ("url", "kind")}
    check_settings(kind, settings, prod.where)  # each target kind checks its own keys
    production = Production(url=url.rstrip("/"), kind=kind, settings=settings)
    return production


def _staging(staging: Table, p: Path) -> tuple[Path, Path | None]:
    """[staging]: the study file the staging engine is tuned with, and a trace to tune on (relative to ``p``)."""
    w = p.name
    staging.only({"study", "trace"})
    if "study" not in staging:
        raise ConfigError(f"{w} [staging].study is missing: the study file the staging engine is tuned with")
    study = p.parent / staging.string("study")  # an absolute path stays itself
    if not study.is_file():
        raise ConfigError(f"{w} [staging].study: {str(study)!r} does not exist")
    trace = staging.string("trace", "")
    trace = p.parent / trace if trace else None
    if trace is not None and not trace.is_file():
        raise ConfigError(f"{w} [staging].trace: {str(trace)!r} does not exist (record one with autotune capture)")
    return study, trace


def load_daemon_config(path: str | Path, *, serving: bool = False) -> DaemonConfig:
    """The daemon file at ``path``; ``serving``: the daemon itself is starting, so its metrics port must be free."""
    p = Path(path)
    top = Table.of_file(p, "daemon config", see=_SEE)
    top.only(
        {"name", "state_dir", "slos", "production", "staging", "watch", "triggers", "tuning", "publish", "metrics"}
    )
    w = p.name
    name = top.string("name", "production")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ConfigError(f"{w}: name {name!r} may only hold letters, digits, '.', '_' and '-'")
    # the daemon and the commands beside it (status, retune, ...) read their state here, whatever the
    # environment says: under systemd, StateDirectory=autotune is /var/lib/autotune
    state = top.string("state_dir", "")
    state_dir = p.parent / state if state else None  # an absolute path stays itself
    slos = read_slos(top)
    if not slos:
        raise ConfigError(f'{w}: give the SLOs production must meet, e.g. slos = ["ttft<800ms"]')

    production = _production(top.table("production"), w)
    study, trace = _staging(top.table("staging"), p)

    watch = top.table("watch")
    # a scrape is an HTTP request to production: more than one a second is a busy loop, not a watch
    scrape_interval = watch.duration("scrape_interval", 15.0, at_least=1)
    window = watch.duration("window", 600.0, above=0)
    arrivals = watch.string("arrivals_log", "")
    watch.done()
    trig = top.table("triggers")
    triggers = Triggers(
        drift=trig.number("drift", 0.5, above=0),
        breach_windows=trig.integer("breach_windows", 3, at_least=1),
        every_s=trig.duration("every", 7 * 86400.0, at_least=0, days=True),  # 0: never
        cooldown_s=trig.duration("cooldown", 6 * 3600.0, at_least=0, days=True),
    )
    trig.done()
    tuning = top.table("tuning")
    windows = tuple(TimeWindow.parse(x, tuning.name("windows")) for x in tuning.strings("windows", []))
    canary_requests = tuning.integer("canary_requests", 60, at_least=1)
    tuning.done()
    pub = top.table("publish")
    approval = pub.boolean("approval", False)
    pub.done()
    met = top.table("metrics")
    listen = _listen(met, serving)
    met.done()
    return DaemonConfig(
        name=name,
        slos=slos,
        production=production,
        staging_study=study,
        staging_trace=trace,
        arrivals_log=p.parent / arrivals if arrivals else None,
        scrape_interval_s=scrape_interval,
        window_s=window,
        triggers=triggers,
        tuning_windows=windows,
        canary_requests=canary_requests,
        approval=approval,
        metrics_listen=listen,
        source=p,
        state_dir=state_dir,
    )


def _listen(met: Table, serving: bool) -> tuple[str, int] | None:
    """``listen = "HOST:PORT"`` ("" turns the metrics off); when ``serving``, the port must be free now."""
    text = met.string("listen", "127.0.0.1:9464")
    if not text:
        return None
    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:9464
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise met.wrong("listen", "HOST:PORT with a port from 1 to 65535, e.g. 127.0.0.1:9464")
    if serving:
        bind_test(host, int(port), met.name("listen"))
    return host, int(port)


def bind_test(host: str, port: int, where: str) -> None:
    """Bind (and let go of) ``host:port`` as the metrics server will: a ConfigError when that cannot work."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
            0
        ]
    except socket.gaierror as e:
        raise ConfigError(f"{where}: cannot listen on {host}:{port}: {e.strerror}") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the metrics server does
        try:
            s.bind(addr)
        except OSError as e:
            why = (
                "the port is in use (another daemon?); pick another or stop it"
                if e.errno == errno.EADDRINUSE
                else e.strerror
            )
            raise ConfigError(f"{where}: cannot listen on {host}:{port}: {why}") from None
