"""``autotune daemon --check``: everything the daemon will need, checked before it runs.

A daemon config can load (every key of the right kind) and still fail at 3 a.m.: production's
YAML missing, a restart command that is not installed, a staging study without a tokenizer,
production not answering. Each check here is one such fact, reported as one line saying what to
fix; none of them changes anything (no restart, no write outside a temporary file).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import httpx

from autotune.daemon.config import DaemonConfig, bind_test
from autotune.daemon.exporter import PHASE_METRIC
from autotune.daemon.production import build_target, daemon_root
from autotune.engine.health import probe
from autotune.errors import AutotuneError

__all__ = ["check_daemon"]


def _runnable(argv0: str) -> bool:
    found = shutil.which(argv0)
    return found is not None or (os.sep in argv0 and os.access(argv0, os.X_OK) and Path(argv0).is_file())


def _production_answers(cfg: DaemonConfig) -> str | None:
    url = f"{cfg.production.url}/health"
    h = probe(cfg.production.url)
    if h.status is None:
        return f"production does not answer at {url} ({h.error}): start it, or fix [production].url"
    if not h.ok:
        return f"production answers {url} with HTTP {h.status}, not 200: is it healthy?"
    return _proxy(cfg)


def _production_config(cfg: DaemonConfig) -> str | None:
    target = build_target(cfg)
    deployed = target.deployed()  # a YAML that does not parse is a ConfigError naming the file
    if deployed is None:
        where = cfg.production.settings.get("config") or getattr(
            getattr(target, "live", lambda: None)(), "name", "the target"
        )
        return (
            f"there is no production config to start from ({where}): "
            "write the one production runs now (the daemon compares every tuning with it)"
        )
    return None


def _restart_command(cfg: DaemonConfig) -> str | None:
    restart = cfg.production.settings.get("restart")
    commands = [("[production].restart", restart)] if isinstance(restart, list) and restart else []
    target = build_target(cfg)
    commands += getattr(target, "commands", lambda: [])()  # blue/green: each color's start/stop, the proxy's
    problems = [
        f"{key}: {argv[0]!r} is not an executable on PATH or a path to one"
        for key, argv in commands
        if not _runnable(argv[0])
    ]
    return "; ".join(problems) or None


def _proxy(cfg: DaemonConfig) -> str | None:
    """Blue/green: the proxy answers, through the color its upstream file names, and that color serves."""
    target = build_target(cfg)
    live = getattr(target, "live", None)
    if live is None:
        return None
    color = live()  # a file naming neither color is a PublishError saying what to write
    h = probe(color.url)
    if h.status is None:
        return (
            f"{color.name} ({color.url}), the color the proxy's upstream file names, does not answer "
            f"({h.error}): start it, or point the file at the color that serves"
        )
    if not h.ok:
        return f"{color.name} ({color.url}), the color the proxy names, answers /health with {h.status}"
    return None


def _proxy_config(cfg: DaemonConfig) -> str | None:
    """Blue/green: the proxy's config test passes (``nginx -t`` unless [production.proxy].test says otherwise): a
    broken config would otherwise surface at the next switch, as a failed publish."""
    proxy = getattr(build_target(cfg), "proxy", None)
    if proxy is not None:
        proxy.check()  # its PublishError names the command and nginx's own words
    return None


def _arrivals_log(cfg: DaemonConfig) -> str | None:
    """[watch].arrivals_log, where set, is a file the daemon's user can read: the proxy writes it."""
    path = cfg.arrivals_log
    if path is None:
        return None
    if not path.is_file():
        return (
            f"[watch].arrivals_log: {path} does not exist: the proxy writes it (systemd/nginx-autotune.conf's "
            "access_log line, then reload nginx), or remove the key to count demand from /metrics alone"
        )
    if not os.access(path, os.R_OK):
        return (
            f"[watch].arrivals_log: {path} is not readable by this user: let nginx create it 0644 "
            "(systemd/logrotate-autotune keeps it so)"
        )
    return None


def _staging_study(cfg: DaemonConfig) -> str | None:
    from autotune.study.definition import load_study

    d = load_study(cfg.staging_study)
    problems = []
    if d.workload.tokenizer is None:
        problems.append(
            f"the staging study {cfg.staging_study} names no tokenizer that exists here: set "
            "[workload].tokenizer (or a local model directory) so tunings can build production-like prompts"
        )
    if d.command.command and not _runnable(d.command.command[0]):
        problems.append(
            f"the staging study's engine command {d.command.command[0]!r} is not an executable on PATH or a path to one"
        )
    return "; ".join(problems) or None


def _state_dir(cfg: DaemonConfig) -> str | None:
    root = daemon_root(cfg)
    probe = root if root.exists() else next((p for p in root.parents if p.exists()), Path("/"))
    try:
        with tempfile.NamedTemporaryFile(dir=probe):
            pass
    except OSError as e:
        return f"the daemon cannot write its state under {probe} ({e.strerror}): set state_dir, or fix its owner"
    return None


def _metrics_port(cfg: DaemonConfig) -> str | None:
    """The metrics port is free, or a running autotune daemon serves its metrics there (a check beside the
    daemon it checks)."""
    if cfg.metrics_listen is None:
        return None
    host, port = cfg.metrics_listen
    try:
        bind_test(host, port, "[metrics].listen")
    except AutotuneError:
        if not _daemon_metrics_at(host, port):
            raise
    return None


def _daemon_metrics_at(host: str, port: int) -> bool:
    """Does an autotune daemon answer /metrics at host:port?"""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        r = httpx.get(f"http://{netloc}/metrics", timeout=2.0, trust_env=False)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and PHASE_METRIC in r.text


CHECKS: tuple[tuple[str, Callable[[DaemonConfig], str | None]], ...] = (
    ("production answers", _production_answers),
    ("production config", _production_config),
    ("restart command", _restart_command),
    ("proxy config", _proxy_config),
    ("arrivals log", _arrivals_log),
    ("staging study", _staging_study),
    ("state directory", _state_dir),
    ("metrics port", _metrics_port),
)


def check_daemon(cfg: DaemonConfig) -> list[tuple[str, str | None]]:
    """Each check's name and its problem (None: it passes). A check that raises our error is a problem too."""
    out: list[tuple[str, str | None]] = []
    for name, check in CHECKS:
        try:
            out.append((name, check(cfg)))
        except AutotuneError as e:
            out.append((name, str(e)))
    return out
