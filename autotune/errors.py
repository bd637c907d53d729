"""The exceptions autotune raises, in one tree.

    AutotuneError
    ├── ConfigError            bad input from the user: exit code 2, one line that says what to do
    │   ├── SLOSyntaxError        an --slo that does not parse
    │   ├── TraceFormatError      a workload file that does not read
    │   └── UnknownFlagError      an engine flag the target vLLM does not accept
    ├── EngineFailure          the engine did not come up, or died (carries its FailureClass)
    ├── MeasurementError       a replay that could not measure anything (server gone, no model)
    └── PublishError           production could not be brought to a config (write, restart, health, canary)

Outside exceptions (httpx, subprocess, vLLM's exit codes and log lines) are turned
into these at one boundary each, with ``raise ... from``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotune.engine.failures import Failure

__all__ = [
    "AutotuneError",
    "ConfigError",
    "SLOSyntaxError",
    "TraceFormatError",
    "UnknownFlagError",
    "EngineFailure",
    "MeasurementError",
    "PublishError",
]


class AutotuneError(Exception):
    """Root of every error autotune raises on purpose."""


class ConfigError(AutotuneError):
    """The user's input is wrong. The message is one line: what is wrong, what to do."""

    exit_code = 2


class SLOSyntaxError(ConfigError):
    pass


class TraceFormatError(ConfigError):
    pass


class UnknownFlagError(ConfigError):
    def __init__(self, flag: str, hint: str) -> None:
        self.flag = flag
        self.hint = hint
        super().__init__(f"engine flag {flag} is not accepted by the target vLLM: {hint}")


class EngineFailure(AutotuneError):
    """The engine failed to start or died; ``failure`` says how, with the log lines that prove it."""

    def __init__(self, failure: Failure) -> None:
        self.failure = failure
        super().__init__(f"engine failed ({failure.failure_class.value}): {failure.summary}")


class MeasurementError(AutotuneError):
    pass


class PublishError(AutotuneError):
    """Production could not be brought to a config (write, restart, health or canary failed)."""
