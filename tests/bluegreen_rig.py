"""A blue/green production for tests: real nginx (systemd/nginx-autotune.conf, the shipped snippet) in front of
two vllm-sim instances started and stopped by tests/fixtures/sim_service.py (the stand-in for systemctl).
scripts/bench_publish.py uses it too.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from autotune.engine.vllm.flags import bundled_table
from autotune.engine.kind import get_kind
from autotune.publish.bluegreen import BlueGreenTarget, Color
from autotune.publish.proxy import NginxProxy
from autotune.publish.vllm_config import VllmConfigTarget

ROOT = Path(__file__).resolve().parent.parent
SNIPPET = ROOT / "systemd" / "nginx-autotune.conf"
ARRIVALS = "/var/log/nginx/autotune/arrivals.log"  # the snippet's arrivals log, moved under each rig's prefix
SERVICE = Path(__file__).parent / "fixtures" / "sim_service.py"
MODEL = "llama-3.1-8b"
SIM = ("--gpu", "a10-24gb", "--time-scale", "0.01")


def nginx_binary() -> str:
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise RuntimeError("nginx is not installed: bash scripts/ci_system_deps.sh installs it")
    return found


@dataclass
class Nginx:
    """A real nginx master in the foreground (daemon off), owned by the test: its own prefix, logs and port."""

    prefix: Path
    port: int
    upstream_file: Path
    proc: subprocess.Popen | None = None

    @property
    def conf(self) -> Path:
        return self.prefix / "nginx.conf"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self, *extra: str) -> list[str]:
        return [nginx_binary(), "-p", str(self.prefix), "-c", str(self.conf), *extra]

    def write_config(self) -> None:
        self.prefix.mkdir(parents=True, exist_ok=True)
        snippet = SNIPPET.read_text()
        for shipped in ("listen 127.0.0.1:8000;", "/etc/nginx/autotune/vllm-upstream.conf", ARRIVALS):
            assert shipped in snippet, shipped
        snippet = (snippet.replace("listen 127.0.0.1:8000;", f"listen 127.0.0.1:{self.port};")
                   .replace("/etc/nginx/autotune/vllm-upstream.conf", str(self.upstream_file))
                   .replace(ARRIVALS, str(self.arrivals_log)))
        (self.prefix / "autotune-vllm.conf").write_text(snippet)
        user = "user root;\n" if os.geteuid() == 0 else ""  # the test's temp dirs are not readable by nobody
        self.conf.write_text(
            f"{user}daemon off;\nworker_processes 1;\npid {self.prefix}/nginx.pid;\n"
            f"error_log {self.prefix}/error.log notice;\n"
            "events { worker_connections 512; }\n"
            "http {\n"
            f"  client_body_temp_path {self.prefix}/body; proxy_temp_path {self.prefix}/proxy;\n"
            f"  fastcgi_temp_path {self.prefix}/fastcgi; uwsgi_temp_path {self.prefix}/uwsgi;\n"
            f"  scgi_temp_path {self.prefix}/scgi;\n"
            f"  include {self.prefix}/autotune-vllm.conf;\n"
            "}\n")

    def start(self) -> None:
        self.write_config()
        log = open(self.prefix / "stderr.log", "w")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {(self.prefix / 'stderr.log').read_text()}"
                                   f"{(self.prefix / 'error.log').read_text() if (self.prefix / 'error.log').exists() else ''}")
            if (self.prefix / "nginx.pid").exists():
                try:
                    httpx.get(self.url + "/", timeout=1.0)
                    return
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        raise RuntimeError("nginx did not start listening in 15 s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    @property
    def arrivals_log(self) -> Path:
        """The shipped snippet's log (its own format, the daemon's [watch].arrivals_log), under this nginx's prefix."""
        return self.prefix / "arrivals.log"

    def access_log(self) -> list[tuple[float, int, str, str]]:
        """(time, status, upstream address, URI) per request nginx finished, from the shipped snippet's log."""
        out = []
        path = self.arrivals_log
        for line in path.read_text().splitlines() if path.exists() else []:
            t, _, status, _, uri, upstream = line.split(" ", 5)
            out.append((float(t), int(status), upstream, uri.strip('"')))
        return out


def make_target(rig: dict) -> BlueGreenTarget:
    """The BlueGreenTarget a rig description (JSON-able, see ``rig_description``) names."""
    engine = get_kind("vllm")
    table = bundled_table("0.33")  # vllm-sim serves vLLM 0.33's flags
    colors = {}
    for name in ("blue", "green"):
        c = rig[name]
        start = (sys.executable, str(SERVICE), "restart", c["state"], c["config"], str(c["port"]), *SIM)
        stop = (sys.executable, str(SERVICE), "stop", c["state"])
        server = VllmConfigTarget(Path(c["config"]), MODEL, start, f"http://127.0.0.1:{c['port']}", table,
                                  health_timeout_s=rig.get("health_timeout", 20.0), restart_timeout_s=30.0,
                                  engine=engine)
        colors[name] = Color(name, server, stop)
    proxy = NginxProxy(rig["proxy_url"], Path(rig["upstream_file"]), tuple(rig["test"]), tuple(rig["reload"]),
                       switch_timeout_s=10.0)
    return BlueGreenTarget(rig["proxy_url"], colors, proxy, verify_window_s=rig.get("verify_window", 3.0))


def rig_description(tmp: Path, nginx: Nginx, ports: dict[str, int]) -> dict:
    return {
        "proxy_url": nginx.url,
        "upstream_file": str(nginx.upstream_file),
        "test": nginx.argv("-t", "-q"),
        "reload": nginx.argv("-s", "reload"),
        **{name: {"state": str(tmp / f"svc-{name}"), "config": str(tmp / "etc" / f"{name}.yaml"), "port": port}
           for name, port in ports.items()},
    }


def color_serving(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
