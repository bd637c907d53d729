"""The daemon's own Prometheus metrics, over HTTP, from ``autotune daemon`` itself.

Every other daemon test turns the listener off (``[metrics] listen = ""``) and reads the registry in process;
this one runs the real command with ``listen = "127.0.0.1:PORT"`` and scrapes it as Prometheus would. No engine
runs: production's URL answers nothing (so the daemon counts failed scrapes) and its YAML config is adopted
as history entry 1 (so production's config is exported), which is enough for samples whose values the test
knows in advance.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port, stop_group
from tests.test_daemon import STAGING

DAEMON = """
name = "prod"
state_dir = "state"
slos = ["ttft<500ms"]

[production]
url = "http://127.0.0.1:{prod_port}"
config = "{root}/etc/production.yaml"
model = "llama-3.1-8b"
restart = {restart}

[staging]
study = "{root}/staging.toml"

[watch]
scrape_interval = "1s"
window = "60s"

[triggers]
every = "0"

[metrics]
listen = "127.0.0.1:{port}"
"""


def _samples(text: str) -> dict:
    """(name, sorted labels) -> value, for every sample of the exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _scrape(url: str, proc: subprocess.Popen, until, timeout: float = 30.0) -> dict:
    """GET ``url`` until ``until(samples)`` holds; fails saying why when the daemon exits or it never does."""
    deadline, last = time.monotonic() + timeout, "no answer"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"autotune daemon exited with {proc.returncode}: {proc.stderr.read()[-2000:]}"
        try:
            r = httpx.get(url, timeout=2)
            r.raise_for_status()
            samples = _samples(r.text)
            if until(samples):
                return samples
            last = r.text
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.2)
    raise AssertionError(f"{url} never showed what was expected within {timeout} s; last: {last[-3000:]}")


def _scrape_errors(samples: dict) -> float:
    return samples.get(("autotune_production_scrape_errors_total", ()), 0.0)


def test_the_daemon_serves_its_metrics_over_http_on_loopback_only(tmp_path, tiny_model):
    prod_port, port = free_port(), free_port()  # nothing listens on production's port: every scrape fails
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "production.yaml").write_text(
        f"model: llama-3.1-8b\nmax-model-len: 8192\nmax-num-seqs: 7\ntokenizer: {tiny_model}\n")
    (tmp_path / "staging.toml").write_text(STAGING.format(root=tmp_path, python=sys.executable, port=free_port(),
                                                          model=tiny_model))
    cfg = tmp_path / "daemon.toml"
    cfg.write_text(DAEMON.format(prod_port=prod_port, root=tmp_path, port=port, restart=json.dumps(["/bin/true"])))
    proc = subprocess.Popen([sys.executable, "-m", "autotune", "daemon", "--config", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "AUTOTUNE_STATE_DIR": str(tmp_path / "state")})
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        first = _scrape(url, proc, lambda s: _scrape_errors(s) >= 1)
        # the loop goes on ticking: the counter a scrape later is higher, served live from the same listener
        later = _scrape(url, proc, lambda s: _scrape_errors(s) > _scrape_errors(first))

        phase = {dict(k[1])["autotune_daemon_phase"]: v for k, v in later.items() if k[0] == "autotune_daemon_phase"}
        assert phase["watching"] == 1.0 and sum(phase.values()) == 1.0, phase
        info = [dict(labels) for (name, labels), v in later.items() if name == "autotune_production_config_info"]
        assert len(info) == 1, info
        # production's YAML, adopted as history entry 1, exported as what production runs
        assert info[0]["entry"] == "1" and info[0]["max_num_seqs"] == "7", info
        # the daemon's own registry only: no process or garbage-collector metrics from the default one
        assert all(name.startswith("autotune_") for name, _ in later), sorted({n for n, _ in later})

        # bound to 127.0.0.1 and nothing else: the one listening socket on the port is the loopback address
        me = psutil.Process(proc.pid)
        listening = [c.laddr for c in me.net_connections("inet") if c.status == psutil.CONN_LISTEN
                     and c.laddr.port == port]
        assert [a.ip for a in listening] == ["127.0.0.1"], listening
        # and another loopback address (an interface address, were it 0.0.0.0) is refused
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex(("127.0.0.2", port)) != 0

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "daemon stopped by SIGTERM" in proc.stderr.read()
    finally:
        stop_group(proc, grace=5.0)
