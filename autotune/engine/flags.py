"""Command-line flags as data: a table of the flags an engine accepts, and checking an argv against it.

An engine kind (engine/kind.py) says where its table comes from; ``check_args`` walks an argv
against a table before any launch, so a flag that does not exist is an ``UnknownFlagError``
naming the flag and what to use instead (the kind's ``removed`` hints, else the closest real
flags), and a flag autotune sets itself (``managed``) is refused. A spelling is read as vLLM's
parser reads it: ``--max_num_seqs`` is ``--max-num-seqs`` (``normalize``), aliases and ``--no-x``
lead to their flag (``FlagTable.resolve``).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from autotune.errors import ConfigError, UnknownFlagError

__all__ = ["Flag", "FlagTable", "check_args", "dest_of", "flag_of", "normalize"]


@dataclass(frozen=True)
class Flag:
    name: str  # the long form, e.g. --max-num-seqs
    kind: str  # "bool" (--x / --no-x), "switch" (--x only), or "value"
    type: str  # int, float, str, json, bool
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class FlagTable:
    version: str
    source: str  # "parser" (vLLM's own) or "bundled"
    flags: dict[str, Flag]  # every spelling (long, alias, --no-x) -> Flag
    removed: Mapping[str, str] = field(default_factory=dict)  # gone or mythical flags -> what to do instead
    managed: Mapping[str, str] = field(default_factory=dict)  # flags autotune sets itself -> why
    engine: str = "the engine"  # for messages: "vLLM 0.33.0 has no such flag"
    help_command: str = "the engine's --help"

    def lookup(self, spelling: str) -> Flag | None:
        return self.flags.get(spelling) or self.flags.get(normalize(spelling))

    def resolve(self, word: str) -> tuple[str, bool] | None:
        """The flag a command-line word sets, by its long name, and whether it turns it on:
        ``--no_trust_remote_code`` -> ("--trust-remote-code", False); None for a word that is not a flag."""
        if not word.startswith("-"):
            return None
        spelling = normalize(word.partition("=")[0])
        flag = self.lookup(spelling)
        name = flag.name if flag is not None else spelling
        return name, not (spelling.startswith("--no-") and spelling != name)

    @classmethod
    def from_dump(
        cls,
        dump: dict,
        source: str,
        removed: Mapping[str, str] = {},
        managed: Mapping[str, str] = {},
        engine: str = "the engine",
        help_command: str = "the engine's --help",
    ) -> FlagTable:
        flags: dict[str, Flag] = {}
        for row in dump["flags"]:
            f = Flag(
                row["name"], row["kind"], row["type"], tuple(row.get("choices") or ()), tuple(row.get("aliases") or ())
            )
            for s in (f.name, *f.aliases):
                flags[s] = f
            if f.kind == "bool":
                flags["--no-" + f.name[2:]] = f
        return cls(dump["version"], source, flags, dict(removed), dict(managed), engine, help_command)


def normalize(spelling: str) -> str:
    """--max_num_seqs -> --max-num-seqs, as vLLM's parser reads a long flag; short aliases stay as they are."""
    return "--" + spelling[2:].replace("_", "-") if spelling.startswith("--") else spelling


def dest_of(flag: str) -> str:
    """--max-num-seqs -> max_num_seqs (the name autotune and Optuna use)."""
    return flag.lstrip("-").replace("-", "_")


def flag_of(dest: str) -> str:
    return "--" + dest.replace("_", "-")


# --- checking an argv ----------------------------------------------------------------------


def _hint(spelling: str, table: FlagTable) -> str:
    if spelling in table.removed:
        return table.removed[spelling]
    close = difflib.get_close_matches(spelling, [s for s in table.flags if s.startswith("--")], n=3, cutoff=0.75)
    if close:
        return "did you mean " + " or ".join(close) + "?"
    return f"{table.engine} {table.version} has no such flag; see {table.help_command}"


def check_args(args: list[str], table: FlagTable) -> list[tuple[Flag, str, str | None]]:
    """Check engine args (no model, no host/port) against ``table``.

    Returns (flag, spelling, value) per flag; raises UnknownFlagError or ConfigError on the first problem.
    """
    out: list[tuple[Flag, str, str | None]] = []
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("-") or tok == "-":
            raise ConfigError(
                f"unexpected engine argument {tok!r}: engine args are --flag [value] pairs; "
                "the model is given separately"
            )
        spelling, eq, inline = tok.partition("=")
        flag = table.lookup(spelling)
        managed = table.managed.get(flag.name if flag else normalize(spelling)) or table.managed.get(spelling)
        if managed is not None:
            raise ConfigError(f"engine flag {spelling} is not allowed here: {managed}")
        if flag is None:
            raise UnknownFlagError(spelling, _hint(spelling, table), table.engine)
        value: str | None = inline if eq else None
        if flag.kind == "value" and not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"engine flag {spelling} needs a value")
            value = args[i + 1]
            i += 1
        elif flag.kind != "value" and eq:
            raise ConfigError(
                f"engine flag {spelling} is a switch and takes no value; "
                f"write {spelling}" + (f" or --no-{flag.name[2:]}" if flag.kind == "bool" else "")
            )
        if value is not None:
            _check_value(flag, spelling, value)
        out.append((flag, spelling, value))
        i += 1
    return out


def _check_value(flag: Flag, spelling: str, value: str) -> None:
    if flag.choices and value not in flag.choices:
        raise ConfigError(f"engine flag {spelling} {value!r} is not one of: {', '.join(flag.choices)}")
    try:
        if flag.type == "int":
            int(value)
        elif flag.type == "float":
            float(value)
        elif flag.type == "json" and value.lstrip().startswith("{"):
            json.loads(value)
    except ValueError as e:
        raise ConfigError(f"engine flag {spelling} expects {flag.type}, got {value!r}") from e
