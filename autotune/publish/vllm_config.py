"""Production as a vLLM YAML config (`vllm serve --config FILE`) and a restart command.

The file's format is the vLLM engine kind's (engine/vllm/config.py). Publishing here means:
check the args against vLLM's flags, write the file atomically, run the restart command (an
argv, never a shell line: ``["systemctl", "restart", "vllm@production"]``), and wait until
``/health`` answers 200 and the model is served.

Its ``[production]`` keys: ``config`` (the YAML file), ``model``, ``restart`` (an argv list),
``health_timeout`` (default 15 min).
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.configfile import Table, read_text
from autotune.engine.args import EngineArgs
from autotune.engine.flags import FlagTable, check_args
from autotune.engine.kind import EngineKind, get_kind
from autotune.errors import ConfigError, PublishError
from autotune.locations import atomic_write
from autotune.publish.target import CanaryClient, Target, wait_healthy
from autotune.units import parse_duration

__all__ = ["VllmConfigTarget"]


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
    engine: EngineKind = field(default_factory=lambda: get_kind("vllm"))

    @classmethod
    def check_settings(cls, table: Mapping[str, Any], where: str) -> None:
        extra = set(table) - {"config", "model", "restart", "health_timeout"}
        if extra:
            raise ConfigError(
                f"{where}: unknown key(s) {', '.join(sorted(extra))} for kind vllm-config "
                "(known: config, model, restart, health_timeout)"
            )
        if "config" not in table or "restart" not in table or "model" not in table:
            raise ConfigError(
                f"{where}: kind vllm-config needs config (the YAML file), model and "
                'restart (an argv list such as ["systemctl", "restart", "vllm@production"])'
            )
        restart = table["restart"]
        if not isinstance(restart, list) or not restart or not all(isinstance(x, str) for x in restart):
            raise ConfigError(f"{where}.restart must be a list of strings (an argv, run without a shell)")
        t = Table(table, where)  # each value of its kind: a number is no path, a bool no duration
        for key in ("config", "model"):
            t.string(key)
        t.duration("health_timeout", 900.0, above=0)

    @classmethod
    def from_settings(cls, url: str, table: Mapping[str, Any], where: str) -> Target:
        cls.check_settings(table, where)
        engine = get_kind("vllm")
        health = parse_duration(table.get("health_timeout", 900), f"{where}.health_timeout")
        return cls(
            Path(table["config"]),
            str(table["model"]),
            tuple(table["restart"]),
            url,
            engine.flag_table(["vllm"]),
            health_timeout_s=health,
            restart_timeout_s=health + 120,
            engine=engine,
        )

    def deployed(self) -> dict[str, Any] | None:
        """The engine args in the config file now (None when there is no file yet)."""
        if not self.config_path.is_file():
            return None
        return self.engine.parse_config(read_text(self.config_path, "production config"), str(self.config_path))[1]

    def validate(self, values: Mapping[str, Any]) -> None:
        check_args(EngineArgs(dict(values)).to_args(), self.table)
        for managed in ("host", "port", "config"):
            if managed in values:
                raise ConfigError(f"{managed} belongs to the production unit, not to a tuned config")

    def deploy(self, values: Mapping[str, Any], header: Sequence[str] = ()) -> None:
        values = self.production_values(values)
        self.validate(values)
        version = self.table.version if self.table is not None else None  # the image tag: the version it checks
        container = self.engine.container_line(self.model, self.config_path, {}, version)
        header = [*header, *([f"in the official container: {container}"] if container else [])]
        # 0640: the vllm unit's user reads it through group vllm (systemd/README.md)
        atomic_write(self.config_path, self.engine.render_config(self.model, values, header), 0o640)
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

    def canary_client(self) -> CanaryClient:
        return CanaryClient("completion")

    def production_values(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """What the YAML gets: staging-only values dropped, floats as a person writes them (0.86, not a
        sampler's 0.8600000000000001)."""
        return {
            k: float(f"{v:.10g}") if isinstance(v, float) else v
            for k, v in self.engine.production_values(values).items()
        }
