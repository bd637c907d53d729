"""Engine arguments as typed values, and the one place they become an argv.

``EngineArgs.values`` maps the engine's option names in snake case (``max_num_seqs``) to typed
values (any spelling given, ``max-num-seqs`` or ``--max-num-seqs``, is stored under that name);
booleans render as ``--x`` / ``--no-x``. Before anything is launched, ``EngineCommand.argv``
checks the flags against the engine's table (flags.check_args), so a flag that does not exist
is an error at load time, not a wasted trial, then reads the whole command line through the
table for what the study must allow (``--trust-remote-code`` in any spelling, the engine
command's own words included). The command line itself is the engine kind's
(kind.py): ``EngineCommand.kind`` names it, or it is recognized from the command.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from autotune.engine.flags import FlagTable, check_args, dest_of, flag_of
from autotune.engine.kind import EngineKind, get_kind, kind_for_command
from autotune.engine.launcher import LaunchSpec
from autotune.engine.secrets import redact, reveal
from autotune.errors import ConfigError

__all__ = ["EngineArgs", "EngineCommand", "Value", "TRUST_REMOTE_CODE"]

Value = bool | int | float | str

TRUST_REMOTE_CODE = "--trust-remote-code"  # runs the model repository's code: only with the study's leave


@dataclass(frozen=True)
class EngineArgs:
    values: Mapping[str, Value] = field(default_factory=dict)  # snake_case name -> value
    env: Mapping[str, str] = field(default_factory=dict)  # environment for the engine (VLLM_CPU_KVCACHE_SPACE, ...)

    def __post_init__(self) -> None:  # one name per option, so that no spelling escapes a check
        object.__setattr__(self, "values", {dest_of(k): v for k, v in self.values.items()})

    def to_args(self) -> list[str]:
        out: list[str] = []
        for name, value in self.values.items():
            flag = flag_of(name)
            if isinstance(value, bool):
                out.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, (dict, list)):
                out += [flag, json.dumps(value, separators=(",", ":"))]
            else:
                out += [flag, str(value)]
        return out

    def merged(self, other: EngineArgs) -> EngineArgs:
        """``other`` wins where both set a value."""
        return EngineArgs({**self.values, **other.values}, {**self.env, **other.env})

    @classmethod
    def from_cli(cls, tokens: list[str], table: FlagTable, env: Mapping[str, str] | None = None) -> EngineArgs:
        """Typed values from a user's ``--flag value`` list, checked against ``table``."""
        values: dict[str, Value] = {}
        for flag, spelling, raw in check_args(tokens, table):
            name = dest_of(flag.name)
            if flag.kind == "bool":
                values[name] = not spelling.startswith("--no-")
            elif flag.kind == "switch":
                values[name] = True
            else:
                values[name] = _typed(flag.type, raw)
        return cls(values, dict(env or {}))

    def to_json(self) -> dict[str, object]:
        return {"values": dict(self.values), "env": dict(self.env)}

    def redacted(self, secret_env: Iterable[str] = ()) -> EngineArgs:
        """These args as they may be shown or stored: secret environment values redacted (engine/secrets.py)."""
        return EngineArgs(self.values, redact(self.env, secret_env))

    def revealed(self, real_env: Mapping[str, str]) -> EngineArgs:
        """Redacted args made runnable again: secret values taken back from ``real_env``."""
        return EngineArgs(self.values, reveal(self.env, real_env))


def _typed(kind: str, raw: str | None) -> Value:
    assert raw is not None
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    return raw


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

    def argv(self, args: EngineArgs, table: FlagTable) -> list[str]:
        flags = args.to_args()
        check_args(flags, table)
        argv = self.engine_kind.argv(self.command, self.model, self.host, self.port, flags)
        self._check_policy(argv, table)
        return argv

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

    def launch_spec(self, args: EngineArgs, table: FlagTable, log_dir: Path, startup_timeout: float) -> LaunchSpec:
        """Everything the launcher needs to run ``args``, the flags checked first."""
        return LaunchSpec(
            argv=self.argv(args, table),
            port=self.port,
            host=self.host,
            env=dict(args.env),
            log_dir=log_dir,
            startup_timeout=startup_timeout,
            nice=self.nice,
            failure_patterns=list(self.engine_kind.failure_patterns),
        )
