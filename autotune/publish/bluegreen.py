"""Production as two vLLM instances, blue and green, behind a reverse proxy: a publish is a switch.

    [production]
    kind = "blue-green"
    url = "http://127.0.0.1:8000"          # the proxy: what clients (and the watcher) use
    model = "/srv/models/Llama-3.1-8B-Instruct"
    health_timeout = "15m"                 # for a color to come up
    verify_window = "2m"                   # production's /metrics watched after the switch

    [production.blue]                      # and [production.green], alike
    config = "/etc/vllm/blue.yaml"         # what `vllm serve --config` of this color reads
    url = "http://127.0.0.1:8001"          # the color itself, as the proxy reaches it
    start = ["systemctl", "--no-ask-password", "restart", "vllm@blue.service"]
    stop = ["systemctl", "--no-ask-password", "stop", "vllm@blue.service"]

    [production.proxy]
    kind = "nginx"
    upstream_file = "/etc/nginx/autotune/vllm-upstream.conf"
    test = []                              # systemd/nginx-reload-tested.conf runs nginx -t on reload
    reload = ["systemctl", "--no-ask-password", "reload", "nginx.service"]

With ``gpus = "1"`` on each color (its unit's CUDA_VISIBLE_DEVICES), the idle color's GPUs are the
staging engine's between publishes: the daemon runs each tuning there, and a rollback by hand during
a tuning pauses it (the study is interrupted, resumable) while the rollback needs those GPUs.

Which color is live is what the proxy's upstream file says, nothing else: after any crash, the
file is the truth and the transaction (transaction.py) makes the rest agree with it. The idle
color runs only during a publish (and, for a few minutes after the switch, the old color, still
up and drained, so that a failed verification switches back in seconds).

A publish, driven by transaction.publish (each step written to the history before it starts):
start the idle color with the new config (real weights: the YAML is the production config), wait
for health, run the canary against it before any user reaches it, switch the proxy, verify
production's SLOs over ``verify_window``, stop the old color.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from autotune.configfile import Table
from autotune.engine.kind import get_kind
from autotune.errors import ConfigError, PublishError
from autotune.publish.proxy import Proxy, create_proxy
from autotune.publish.target import CanaryClient
from autotune.publish.vllm_config import VllmConfigTarget

__all__ = ["BlueGreenTarget", "Color", "COLORS"]

COLORS = ("blue", "green")
_IN_FLIGHT = {get_kind("vllm").metrics[k].name for k in ("running", "waiting")}  # what a color holds while draining
_KEYS = ("model", "health_timeout", "verify_window", "blue", "green", "proxy")


@dataclass
class Color:
    name: str
    server: VllmConfigTarget  # its YAML, its start command (the ``restart`` there) and its own URL
    stop_argv: tuple[str, ...]
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES of its unit: staging runs there while it is idle

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def backend(self) -> str:
        """host:port, as the proxy's upstream names it."""
        u = urlsplit(self.url)
        return f"{u.hostname}:{u.port or (443 if u.scheme == 'https' else 80)}"

    def stop(self) -> None:
        try:
            r = subprocess.run(list(self.stop_argv), capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PublishError(f"stop command of {self.name} {list(self.stop_argv)} failed: {e}") from e
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-2:]
            raise PublishError(
                f"stop command of {self.name} {list(self.stop_argv)} exited {r.returncode}: {' | '.join(tail)}"
            )


@dataclass
class BlueGreenTarget:
    url: str  # the proxy's
    colors: dict[str, Color]
    proxy: Proxy
    verify_window_s: float = 120.0
    name: str = "blue-green"

    # -- configuration -------------------------------------------------------------------------

    @classmethod
    def check_settings(cls, table: Mapping[str, Any], where: str) -> None:
        cls._parse("http://check", table, where, build=False)

    @classmethod
    def from_settings(cls, url: str, table: Mapping[str, Any], where: str) -> BlueGreenTarget:
        return cls._parse(url, table, where, build=True)

    @classmethod
    def _parse(cls, url: str, table: Mapping[str, Any], where: str, build: bool) -> BlueGreenTarget:
        """The target, or (``build=False``, at config load) only the checks: vLLM's flag table is read
        when a target is built, not when a config file is checked."""
        t = Table(table, where)
        t.only(_KEYS)
        model = t.string("model")
        health = t.duration("health_timeout", 900.0, above=0)
        window = t.duration("verify_window", 120.0, at_least=0)
        engine = get_kind("vllm")
        flags = None
        colors: dict[str, Color] = {}
        for name in COLORS:
            c = t.table(name, required=True)
            c.only(("config", "url", "start", "stop", "gpus"))
            config, color_url = c.string("config"), c.string("url")
            gpus = c.string("gpus", None)
            if gpus is not None and not re.fullmatch(r"\d+(,\d+)*", gpus):
                raise c.wrong("gpus", 'the color\'s CUDA_VISIBLE_DEVICES, e.g. "0" or "2,3"')
            start, stop = c.strings("start"), c.strings("stop")
            for key, argv in (("start", start), ("stop", stop)):
                if not argv:
                    raise c.wrong(
                        key,
                        f'an argv such as ["systemctl", "{key if key == "stop" else "restart"}", '
                        f'"vllm@{name}.service"]',
                    )
            if urlsplit(color_url).port is None:
                raise c.wrong("url", 'the color\'s own URL with its port, e.g. "http://127.0.0.1:8001"')
            if flags is None and build:
                flags = engine.flag_table(["vllm"])
            server = VllmConfigTarget(
                Path(config),
                model,
                tuple(start),
                color_url.rstrip("/"),
                flags,  # type: ignore[arg-type]
                health_timeout_s=health,
                restart_timeout_s=health + 120,
                engine=engine,
            )
            colors[name] = Color(name, server, tuple(stop), gpus)
        if colors["blue"].backend == colors["green"].backend:
            raise ConfigError(
                f"{where}: blue and green have the same address {colors['blue'].backend}: give each "
                "its own port (and GPUs)"
            )
        proxy = create_proxy(
            url,
            t.table("proxy", required=True).data,
            f"{where[:-1]}.proxy]" if where.endswith("]") else f"{where}.proxy",
        )
        return cls(url.rstrip("/"), colors, proxy, window)

    # -- which color serves ----------------------------------------------------------------------

    def live(self) -> Color:
        """The color the proxy's upstream file names: production."""
        backend = self.proxy.backend()
        for color in self.colors.values():
            if color.backend == backend:
                return color
        have = ", ".join(f"{c.name} {c.backend}" for c in self.colors.values())
        raise PublishError(
            f"the proxy's upstream names {backend or 'no server'}, neither color ({have}): write "
            f"`server {self.colors['blue'].backend};` into it for blue, then reload the proxy"
        )

    def idle_gpus(self) -> str | None:
        """The GPUs no color serves from now: where staging runs between publishes (None: not shared)."""
        return self.other(self.live()).gpus

    def other(self, color: Color) -> Color:
        return next(c for c in self.colors.values() if c is not color)

    def color(self, name: str) -> Color:
        return self.colors[name]

    # -- the steps of a switch (transaction.py runs them in order) ------------------------------

    def stage(self, color: Color, values: Mapping[str, Any]) -> str:
        """Write ``color``'s YAML, (re)start it and wait until it serves: its URL. Stops it again on failure."""
        try:
            color.server.deploy(values)
        except PublishError as e:
            self.stop_quietly(color)
            raise PublishError(f"{color.name} did not come up with the new config: {e}") from e
        return color.url

    def switch(self, to: Color) -> None:
        """Point the proxy at ``to``: new requests go there, the old color finishes what it holds."""
        self.proxy.point_at(to.backend)

    def resync(self) -> Color:
        """After a crash: reload the proxy on what its file says (a crash between the write and the reload
        would leave nginx on the other color), and return that color."""
        live = self.live()
        self.proxy.point_at(live.backend)
        return live

    def drain(self, color: Color, timeout_s: float = 600.0) -> bool:
        """Wait until ``color`` holds no request (the proxy sends it no new ones after a switch): True when
        it drained, False at the deadline or when its /metrics cannot say (it is stopped anyway then)."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                try:
                    text = client.get(f"{color.url}/metrics").text
                    held = sum(
                        float(sample.value)
                        for family in text_string_to_metric_families(text)
                        for sample in family.samples
                        if sample.name in _IN_FLIGHT
                    )
                except (httpx.HTTPError, ValueError):
                    return False
                if held == 0:
                    return True
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.5)

    def stop_quietly(self, color: Color) -> str | None:
        try:
            color.stop()
        except PublishError as e:
            return str(e)
        return None

    # -- the Target protocol ----------------------------------------------------------------------

    def deployed(self) -> dict[str, Any] | None:
        return self.live().server.deployed()

    def deploy(self, values: Mapping[str, Any]) -> None:
        """A switch without a canary (a rollback by hand): stage the idle color, switch, stop the old one."""
        live = self.live()
        idle = self.other(live)
        self.stage(idle, values)
        try:
            self.switch(idle)
        except PublishError:
            self.stop_quietly(idle)
            raise
        self.drain(live)
        self.stop_quietly(live)

    def endpoint(self) -> str:
        return self.url

    def canary_client(self) -> CanaryClient:
        return CanaryClient("completion")

    def production_values(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return self.colors["blue"].server.production_values(values)

    def commands(self) -> list[tuple[str, tuple[str, ...]]]:
        """Every command the target runs, by config key (for ``autotune daemon --check``)."""
        out = [
            (f"[production.{c.name}].{k}", argv)
            for c in self.colors.values()
            for k, argv in (("start", c.server.restart), ("stop", c.stop_argv))
        ]
        proxy = self.proxy
        for key in ("test", "reload"):
            argv = getattr(proxy, key, ())
            if argv:
                out.append((f"[production.proxy].{key}", tuple(argv)))
        return out
