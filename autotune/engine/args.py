"""Engine arguments as typed values (the command line they become: engine/command.py).

``EngineArgs.values`` maps the engine's option names in snake case (``max_num_seqs``) to typed
values (any spelling given, ``max-num-seqs`` or ``--max-num-seqs``, is stored under that name);
booleans render as ``--x`` / ``--no-x``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from autotune.engine.flags import FlagTable, check_args, dest_of, flag_of
from autotune.engine.secrets import redact, reveal

__all__ = ["EngineArgs", "Value"]

Value = bool | int | float | str


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
