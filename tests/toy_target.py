"""A test-only publish target: the toy engine (tests/toy_engine) as a process this target restarts.

It shows that a publish target is one module and one ``register`` line: it parses its own
``[production]`` keys (``state``: a directory for its config and pid, ``port``), keeps its
deployed config as JSON, and deploys by restarting the toy server with the config's flags.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.engine.flags import flag_of
from autotune.errors import ConfigError, PublishError
from autotune.locations import atomic_write
from autotune.publish.target import CanaryClient, Target, wait_healthy

ROOT = Path(__file__).resolve().parents[1]


class ToyTarget:
    name = "toy"

    def __init__(self, url: str, state: Path, port: int) -> None:
        self.url, self.state, self.port = url, state, port
        self.config = state / "config.json"
        self.pid_file = state / "pid"

    @classmethod
    def check_settings(cls, table: Mapping[str, Any], where: str) -> None:
        extra = set(table) - {"state", "port"}
        if extra or not isinstance(table.get("port"), int) or not isinstance(table.get("state"), str):
            raise ConfigError(f"{where}: kind toy takes state = DIR and port = N")

    @classmethod
    def from_settings(cls, url: str, table: Mapping[str, Any], where: str) -> Target:
        cls.check_settings(table, where)
        return cls(url, Path(table["state"]), table["port"])

    def deployed(self) -> dict[str, Any] | None:
        return json.loads(self.config.read_text()) if self.config.is_file() else None

    def deploy(self, values: Mapping[str, Any]) -> None:
        atomic_write(self.config, json.dumps(dict(values)))
        self.stop()
        flags = [x for k, v in values.items() for x in (flag_of(k), str(v))]
        log = open(self.state / "engine.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "tests.toy_engine.server", "--port", str(self.port), *flags],
                                cwd=ROOT, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid_file.write_text(str(proc.pid))
        try:
            wait_healthy(self.url, 10.0, interval_s=0.1)
        except PublishError:
            code = proc.poll()
            raise PublishError(f"toy engine not healthy (exit {code})") from None

    def stop(self) -> None:
        if self.pid_file.is_file():
            try:
                os.killpg(int(self.pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.pid_file.unlink()

    def endpoint(self) -> str:
        return self.url

    def canary_client(self) -> CanaryClient:
        return CanaryClient("completion")

    def production_values(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return dict(values)
