"""Production as a vLLM YAML config (`vllm serve --config FILE`) and a restart command.

The file's format is the vLLM engine kind's (engine/vllm/config.py). Publishing here means: check the args against vLLM's flags, write the file atomically, run the restart
command (an argv, never a shell line: ``["systemctl", "restart", "vllm@production"]``), and
wait until ``/health`` answers 200 and the model is served.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from autotune.engine.args import EngineArgs
from autotune.engine.flags import FlagTable, check_args
from autotune.engine.vllm.config import parse, production_values, render
from autotune.errors import ConfigError, PublishError
from autotune.locations import atomic_write

__all__ = ["VllmConfigTarget", "wait_healthy"]

def wait_healthy(url: str, timeout_s: float, interval_s: float = 1.0) -> float:
    """Seconds until GET /health is 200 and /v1/models lists a model; PublishError at the deadline."""
    t0 = time.monotonic()
    last = "no answer"
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() - t0 < timeout_s:
            try:
                h = client.get(f"{url}/health")
                if h.status_code == 200:
                    m = client.get(f"{url}/v1/models")
                    if m.status_code == 200 and m.json().get("data"):
                        return time.monotonic() - t0
                last = f"/health {h.status_code}"
            except httpx.HTTPError as e:
                last = type(e).__name__
            time.sleep(interval_s)
    raise PublishError(f"{url} not healthy after {timeout_s:.0f} s (last: {last})")


@dataclass
class VllmConfigTarget:
    config_path: Path  # what `vllm serve --config` reads, e.g. /etc/vllm/production.yaml
    model: str
    restart: tuple[str, ...]  # argv run after writing, e.g. systemctl restart vllm@production
    url: str  # production's base URL: health and the canary
    table: FlagTable  # the production vLLM's flags: nothing it would refuse gets written
    health_timeout_s: float = 900.0
    # systemd's restart of a Type=exec unit with a /health ExecStartPost returns once the engine
    # serves: as long as a model load (systemd/vllm@.service allows 15 min) plus the old one's stop
    restart_timeout_s: float = 1020.0
    name: str = "vllm-config"

    def deployed(self) -> dict[str, Any] | None:
        """The engine args in the config file now (None when there is no file yet)."""
        if not self.config_path.is_file():
            return None
        return parse(self.config_path.read_text())[1]

    def validate(self, values: Mapping[str, Any]) -> None:
        check_args(EngineArgs(dict(values)).to_args(), self.table)
        for managed in ("host", "port", "config"):
            if managed in values:
                raise ConfigError(f"{managed} belongs to the production unit, not to a tuned config")

    def deploy(self, values: Mapping[str, Any], header: Sequence[str] = ()) -> None:
        values = production_values(values)
        self.validate(values)
        atomic_write(self.config_path, render(self.model, values, header))
        try:
            r = subprocess.run(list(self.restart), capture_output=True, text=True, timeout=self.restart_timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PublishError(f"restart command {list(self.restart)} failed: {e}") from e
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            raise PublishError(f"restart command {list(self.restart)} exited {r.returncode}: {' | '.join(tail)}")
        wait_healthy(self.url, self.health_timeout_s)

    def endpoint(self) -> str:
        return self.url
