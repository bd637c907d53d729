"""The reverse proxy in front of a blue/green pair: which backend it sends users to, and the switch.

A proxy is what bluegreen.py needs of one:

    backend()          "host:port" the proxy's config sends traffic to now (None: not written yet)
    point_at(backend)  write the config for ``backend``, test it, reload, and return once the proxy
                       serves through it (PublishError otherwise, with the old config back in place)

nginx is the one kind today (``[production.proxy] kind = "nginx"``). Its reload is graceful: the
master starts workers on the new config and the old workers finish the requests (streams
included) they hold, so a switch cuts nothing off. What HAProxy or Envoy would need instead:

    HAProxy  the backend as a ``server`` line in a file the config includes, ``haproxy -c -f`` as the
             test, ``systemctl reload haproxy`` (master-worker mode keeps old workers to finish their
             connections); or, without a reload, ``set server`` / ``enable/disable server`` on the
             runtime API socket.
    Envoy    an EDS or CDS resource file (``path_config_source``) rewritten by rename: Envoy watches
             it and drains the old endpoint itself; no test command (Envoy rejects a bad resource
             and keeps the last good one, so check the admin ``/clusters`` output instead).

Each would be one class here with ``from_settings``, ``backend`` and ``point_at``.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from autotune.configfile import Table
from autotune.engine.health import probe
from autotune.errors import ConfigError, PublishError
from autotune.locations import atomic_write

__all__ = ["Proxy", "NginxProxy", "create_proxy", "UPSTREAM_HEADER"]

# The response header the shipped nginx snippet adds ($upstream_addr): how a switch is seen to take
# effect, and how a test tells which color served each request.
UPSTREAM_HEADER = "X-Autotune-Upstream"


class Proxy(Protocol):
    url: str

    def backend(self) -> str | None: ...
    def point_at(self, backend: str) -> None: ...


_SERVER = re.compile(r"^\s*server\s+(\S+?)\s*[ ;]", re.MULTILINE)


@dataclass
class NginxProxy:
    """nginx with an ``upstream`` block that includes ``upstream_file`` (one ``server HOST:PORT;`` line).

    ``test`` and ``reload`` are argvs (no shell). With systemd: ``test = []`` and
    ``reload = ["systemctl", "reload", "nginx"]`` with the shipped drop-in that runs ``nginx -t``
    as ExecReload's first step (systemd/nginx-reload-tested.conf: the daemon's user may not read
    nginx's logs or keys, so it cannot run ``nginx -t`` itself); without it, ``["nginx", "-t"]`` and
    ``["nginx", "-s", "reload"]``.
    """

    url: str  # the proxy's own base URL, as clients use it
    upstream_file: Path
    test: tuple[str, ...] = ("nginx", "-t", "-q")
    reload: tuple[str, ...] = ("nginx", "-s", "reload")
    switch_timeout_s: float = 30.0  # for the reload to take effect (old workers may hold long streams)
    command_timeout_s: float = 60.0

    @classmethod
    def from_settings(cls, url: str, t: Table) -> NginxProxy:
        upstream = t.string("upstream_file")
        test = t.strings("test", ["nginx", "-t", "-q"])
        reload = t.strings("reload", ["nginx", "-s", "reload"])
        if not reload:
            raise t.wrong("reload", 'a non-empty argv, e.g. ["systemctl", "reload", "nginx"]')
        timeout = t.duration("switch_timeout", 30.0, above=0)
        t.done()
        return cls(url.rstrip("/"), Path(upstream), tuple(test), tuple(reload), timeout)

    def backend(self) -> str | None:
        try:
            text = self.upstream_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as e:
            raise PublishError(f"cannot read the proxy's upstream file {self.upstream_file}: {e}") from e
        m = _SERVER.search(text)
        return m.group(1) if m else None

    def point_at(self, backend: str) -> None:
        old = self.upstream_file.read_text(encoding="utf-8") if self.upstream_file.is_file() else None
        new = (
            f"# written by autotune: the vLLM instance serving production ({time.strftime('%Y-%m-%d %H:%M:%S')})\n"
            f"server {backend} max_fails=0;\n"
        )
        # nginx reads this file as root at reload; 0644 like the rest of its config
        atomic_write(self.upstream_file, new, 0o644)
        try:
            self.check()
            self._run(self.reload, "reload")
        except PublishError:
            if old is not None:
                atomic_write(self.upstream_file, old, 0o644)
            raise
        try:
            self._wait_serving(backend)
        except PublishError:
            # the file must keep saying what serves: put the old one back and reload it (best effort)
            if old is not None:
                atomic_write(self.upstream_file, old, 0o644)
                with contextlib.suppress(PublishError):
                    self._run(self.reload, "reload")
            raise

    def check(self) -> None:
        """Run the proxy's config test (``test``; nothing when it is empty): a PublishError with its words when
        the config is broken, found now rather than at the next switch."""
        if self.test:
            self._run(self.test, "test")

    def _run(self, argv: tuple[str, ...], what: str) -> None:
        try:
            r = subprocess.run(list(argv), capture_output=True, text=True, timeout=self.command_timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PublishError(f"proxy {what} command {list(argv)} failed: {e}") from e
        if r.returncode != 0:
            lines = (r.stderr or r.stdout).strip().splitlines()
            raise PublishError(
                f"proxy {what} command {list(argv)} exited {r.returncode}: {' | '.join(lines[-2:]) or 'no output'}"
            )

    def _wait_serving(self, backend: str) -> None:
        """Until a request through the proxy is answered by ``backend`` (nginx reloads asynchronously)."""
        deadline = time.monotonic() + self.switch_timeout_s
        last, in_a_row = "no answer", 0
        while time.monotonic() < deadline:
            # a new connection each time: nginx's old workers accept for a moment after the reload
            # signal, until the master has started the new ones; several answers in a row say it is done
            h = probe(self.url, header=UPSTREAM_HEADER)
            if h.ok and h.served_by in (None, backend):
                # None: a proxy config without the header; a 200 is all it can tell
                in_a_row += 1
                if in_a_row >= 3:
                    return
                time.sleep(0.1)
                continue
            last = f"/health {h.status} from {h.served_by or 'unknown'}" if h.status is not None else h.error
            in_a_row = 0
            time.sleep(0.2)
        raise PublishError(
            f"proxy {self.url} does not serve through {backend} {self.switch_timeout_s:.0f} s after "
            f"its reload (last: {last}); is nginx running, and does it include {self.upstream_file}?"
        )


_KINDS = {"nginx": NginxProxy}


def create_proxy(url: str, table: Mapping[str, Any], where: str) -> Proxy:
    t = Table(table, where)
    kind = t.string("kind", "nginx", choices=tuple(_KINDS))
    if kind not in _KINDS:  # pragma: no cover - choices above
        raise ConfigError(f"{where}.kind must be nginx")
    return _KINDS[kind].from_settings(url, t)
