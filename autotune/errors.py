"""The exceptions autotune raises, in one tree.

    AutotuneError
    ├── ConfigError            bad input from the user: exit code 2, one line that says what to do
    │   ├── SLOSyntaxError        an --slo that does not parse
    │   ├── TraceFormatError      a workload file that does not read
    │   ├── UnknownFlagError      an engine flag the target vLLM does not accept
    │   └── UnmappableEngineArgError  engine args that cannot go through a publish target (Xinference)
    ├── EngineFailure          the engine did not come up, or died (carries its FailureClass)
    ├── TrialFailed            a trial that failed through no fault of its config (Optuna records FAIL)
    ├── MeasurementError       a replay that could not measure anything (server gone, no model)
    ├── PublishError           production could not be brought to a config (write, restart, health, canary)
    │   └── XinferenceError       Xinference refused or failed a request
    │       ├── XinferenceUnavailable   it did not answer
    │       ├── XinferenceAuthError     setup, login or a token was refused
    │       └── XinferenceDeployError   the model did not come up with the new engine kwargs
    └── IllegalTransition      a lifecycle (engine, daemon phase) asked for a step it does not allow: a bug

    KeyboardInterrupt
    └── Interrupted            SIGINT, SIGTERM or SIGHUP in a command that owns an engine: exit 128 + the signal

Outside exceptions (httpx, subprocess, vLLM's exit codes and log lines) are turned
into these at one boundary each, with ``raise ... from``.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
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
    "TrialFailed",
    "XinferenceError",
    "XinferenceUnavailable",
    "XinferenceAuthError",
    "XinferenceDeployError",
    "UnmappableEngineArgError",
    "IllegalTransition",
    "Interrupted",
]


class AutotuneError(Exception):
    """Root of every error autotune raises on purpose; the CLI exits with ``exit_code``."""

    exit_code = 1


class ConfigError(AutotuneError):
    """The user's input is wrong. The message is one line: what is wrong, what to do."""

    exit_code = 2


class SLOSyntaxError(ConfigError):
    pass


class TraceFormatError(ConfigError):
    pass


class UnknownFlagError(ConfigError):
    def __init__(self, flag: str, hint: str, engine: str = "vLLM") -> None:
        self.flag = flag
        self.hint = hint
        super().__init__(f"engine flag {flag} is not accepted by the target {engine}: {hint}")


class EngineFailure(AutotuneError):
    """The engine failed to start or died; ``failure`` says how, with the log lines that prove it."""

    def __init__(self, failure: Failure) -> None:
        self.failure = failure
        super().__init__(f"engine failed ({failure.failure_class.value}): {failure.summary}")


class TrialFailed(AutotuneError):
    """A trial that failed through no fault of its config (the port was taken): FAIL, which samplers ignore.

    The study catches this one by name; any other exception from a trial stops the study.
    """


class MeasurementError(AutotuneError):
    pass


class PublishError(AutotuneError):
    """Production could not be brought to a config (write, restart, health or canary failed)."""


class XinferenceError(PublishError):
    """Xinference refused or failed a request; ``detail`` is its own error text."""

    def __init__(self, message: str, *, status: int | None = None, detail: str = "") -> None:
        self.status = status
        self.detail = detail
        super().__init__(message)


class XinferenceUnavailable(XinferenceError):
    """Xinference did not answer (refused, reset, timed out)."""


class XinferenceAuthError(XinferenceError):
    """Setup, login or a bearer token was refused."""


class XinferenceDeployError(XinferenceError):
    """The model did not come up with the new engine kwargs (the engine's error, a timeout, a cancel)."""


class UnmappableEngineArgError(ConfigError):
    """Engine args that cannot go through Xinference; ``reasons`` maps each to why."""

    def __init__(self, reasons: Mapping[str, str]) -> None:
        self.reasons = dict(reasons)
        super().__init__(
            "cannot publish through Xinference: " + "; ".join(f"{name}: {why}" for name, why in self.reasons.items())
        )


class IllegalTransition(AutotuneError):
    """A lifecycle (an engine process, the daemon's phase) was asked for a step it does not allow: a bug."""


class Interrupted(KeyboardInterrupt):
    """A stop signal (SIGINT, SIGTERM, SIGHUP), raised in the main thread the way Python raises Ctrl-C
    (engine.launcher.stop_on_signals): every clean-up written for Ctrl-C runs for it too (the engine
    stopped, the running trial failed, the study left resumable).

    A KeyboardInterrupt, not an AutotuneError: no ``except Exception`` may swallow it, and Optuna fails the
    running trial and lets it through, as it does for Ctrl-C.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(self.name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP
