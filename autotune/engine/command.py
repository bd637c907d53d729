"""How an engine is run: its command, the model, where it listens, and the one place args become an argv.

Before anything is launched, ``EngineCommand.check`` renders the args, checks the flags against the
engine's table (flags.check_args), so a flag that does not exist is an error at load time, not a wasted
trial, then reads the whole command line through the table for what the study must allow
(``--trust-remote-code`` in any spelling, the engine command's own words included). What it returns,
``CheckedArgs``, is what a launch takes: the argv is built once. The command line itself is the engine
kind's (kind.py): ``EngineCommand.kind`` names it, or it is recognized from the command.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from autotune.engine.args import EngineArgs
from autotune.engine.flags import FlagTable, check_args
from autotune.engine.kind import EngineKind, get_kind, kind_for_command
from autotune.engine.launcher import LaunchSpec
from autotune.errors import ConfigError

__all__ = ["EngineCommand", "CheckedArgs", "TRUST_REMOTE_CODE"]

TRUST_REMOTE_CODE = "--trust-remote-code"  # runs the model repository's code: only with the study's leave


@dataclass(frozen=True)
class CheckedArgs:
    """Engine args with the whole command line they run as, checked (``EngineCommand.check``)."""

    args: EngineArgs
    argv: tuple[str, ...]


@dataclass(frozen=True)
class EngineCommand:
    """How to run the engine: an argv prefix (``vllm serve``, a path, ``vllm-sim``), the model, where it listens."""

    model: str
    command: tuple[str, ...] = ("vllm", "serve")
    host: str = "127.0.0.1"
    port: int = 8100
    allow_trust_remote_code: bool = False
    nice: int = 0  # CPU priority offset for the engine (see LaunchSpec.nice)
    kind: str = ""  # the engine kind's name; empty: recognized from the command

    @property
    def engine_kind(self) -> EngineKind:
        return get_kind(self.kind) if self.kind else kind_for_command(self.command)

    def flag_table(self, version: str | None = None) -> FlagTable:
        """The flags this command's engine accepts (its own parser where it can be run)."""
        return self.engine_kind.flag_table(self.command, version)

    @staticmethod
    def parse_command(text: str) -> tuple[str, ...]:
        """'path/to/vllm serve' -> ('path/to/vllm', 'serve'); split like a shell, never run by one."""
        parts = tuple(shlex.split(text))
        if not parts:
            raise ConfigError("the engine command is empty; e.g. --engine-cmd 'vllm serve'")
        return parts

    def check(self, args: EngineArgs, table: FlagTable) -> CheckedArgs:
        """``args`` with their command line, its flags and policy checked (ConfigError, UnknownFlagError)."""
        flags = args.to_args()
        check_args(flags, table)
        argv = self.engine_kind.argv(self.command, self.model, self.host, self.port, flags)
        self._check_policy(argv, table)
        return CheckedArgs(args, tuple(argv))

    def argv(self, args: EngineArgs, table: FlagTable) -> list[str]:
        return list(self.check(args, table).argv)

    def _check_policy(self, argv: list[str], table: FlagTable) -> None:
        """What the study must allow, read from the whole command line through the flag table: every
        spelling, alias and ``--no-`` form, in the engine args and in the engine command itself."""
        if self.allow_trust_remote_code:
            return
        if any(table.resolve(word) == (TRUST_REMOTE_CODE, True) for word in argv):
            raise ConfigError(
                "trust_remote_code runs code from the model's repository; "
                "set allow_trust_remote_code = true in the study (bench: --allow-trust-remote-code) "
                "to permit it"
            )

    def launch_spec(self, checked: CheckedArgs, log_dir: Path, startup_timeout: float) -> LaunchSpec:
        """Everything the launcher needs to run ``checked``."""
        return LaunchSpec(
            argv=list(checked.argv),
            port=self.port,
            host=self.host,
            env=dict(checked.args.env),
            log_dir=log_dir,
            startup_timeout=startup_timeout,
            nice=self.nice,
            failure_patterns=list(self.engine_kind.failure_patterns),
        )
