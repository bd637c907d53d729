"""Our config files (study files, daemon files) read strictly: each key against what it must be.

A value is taken as written: a string is never a bool or a number, a bool never an integer, so
``approval = "false"`` and ``port = true`` are errors, not ``True`` and ``--port True``. Every
error is a ConfigError of one line that names the file, the key and what it expects:

    study.toml [engine].port must be an integer from 1 to 65535, got true

A file that does not exist, cannot be read, is not UTF-8 or is not TOML is one too. A reader asks
a ``Table`` for each key with the type it must have (``eng.integer("port", 8100, at_least=1)``),
then calls ``done()``: a key nobody asked for is a typo, and is named (``only(keys)`` says the
same up front, for a table whose keys are read in several places).
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError
from autotune.units import parse_duration

__all__ = ["Table", "REQUIRED", "read_text", "read_toml", "show"]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # as a default: the key must be given


def read_text(path: str | Path, what: str) -> str:
    """A config file's text, or a ConfigError naming the file (missing, unreadable, not UTF-8)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} does not exist")
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot be read: {e.strerror}") from None


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """A TOML file's tables, or a ConfigError that names the file and what is wrong."""
    p = Path(path)
    try:
        return tomllib.loads(read_text(p, what))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None


def show(value: Any) -> str:
    """A value as the file writes it (true, "one", [800]), for messages."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = str(value)  # TOML dates and times
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, float) and math.isfinite(v)) or _is_int(v)


def _range(at_least: float | None, above: float | None, at_most: float | None, unit: str = "") -> str:
    """ " from 1 to 65535", " > 0", " >= 1s": the bounds a value must keep, as a message says them."""
    if at_least is not None and at_most is not None:
        return f" from {at_least:g}{unit} to {at_most:g}{unit}"
    parts = [f"{op} {x:g}{unit}" for op, x in ((">=", at_least), (">", above), ("<=", at_most)) if x is not None]
    return " " + " and ".join(parts) if parts else ""


def _within(v: float, at_least: float | None, above: float | None, at_most: float | None) -> bool:
    return (at_least is None or v >= at_least) and (above is None or v > above) and (at_most is None or v <= at_most)


class Table:
    """One table of a config file: each key read with what it must be, the unread ones named by ``done``.

    ``where`` is how messages name the table: the file's name for its top level (``top=True``),
    ``"study.toml [engine]"`` for a table, ``"study.toml [space].max_num_seqs"`` for an inline
    one. ``see`` ends the message about unknown keys (where the format is written down).
    """

    def __init__(self, data: Any, where: str, *, see: str = "", top: bool = False) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where} must be a table, got {show(data)}")
        self.data: dict[str, Any] = dict(data)
        self.where, self.see, self.top = where, see, top
        self.seen: set[str] = set()

    @classmethod
    def of_file(cls, path: str | Path, what: str, *, see: str = "") -> Table:
        """The top level of a TOML file (``what``, e.g. "study file", names it when it does not exist)."""
        p = Path(path)
        return cls(read_toml(p, what), p.name, see=see, top=True)

    def name(self, key: str) -> str:
        """How messages name ``key``: "study.toml seed", "study.toml [engine].port"."""
        return f"{self.where} {key}" if self.top else f"{self.where}.{key}"

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def keys(self) -> list[str]:
        return list(self.data)

    def __iter__(self) -> Iterator[str]:
        """The keys as written, as ``keys()`` lists them (reading values meanwhile is fine)."""
        return iter(self.keys())

    def wrong(self, key: str, expected: str) -> ConfigError:
        """The error for a value of ``key`` that is not ``expected`` ("an integer >= 1")."""
        return ConfigError(f"{self.name(key)} must be {expected}, got {show(self.data[key])}")

    def _take(self, key: str, default: Any) -> tuple[bool, Any]:
        """(given, value): the value as written, or the default when the key is absent."""
        self.seen.add(key)
        if key in self.data:
            return True, self.data[key]
        if default is REQUIRED:
            raise ConfigError(f"{self.name(key)} is missing")
        return False, default

    # -- one method per kind of value ----------------------------------------------------------

    def value(self, key: str, default: Any = REQUIRED) -> Any:
        """Any value, unchecked (engine args, whose types the engine's flag table checks)."""
        return self._take(key, default)[1]

    def string(self, key: str, default: Any = REQUIRED, *, choices: Collection[str] = ()) -> Any:
        given, v = self._take(key, default)
        if given and not isinstance(v, str):
            raise self.wrong(key, _one_of(choices) if choices else "a string")
        if given and choices and v not in choices:
            raise self.wrong(key, _one_of(choices))
        return v

    def text(self, key: str, default: Any = REQUIRED) -> Any:
        """A string, or a number written as one (environment values)."""
        given, v = self._take(key, default)
        if given and not (isinstance(v, str) or _is_number(v)):
            raise self.wrong(key, "a string or a number")
        return str(v) if given else v

    def boolean(self, key: str, default: Any = REQUIRED) -> Any:
        given, v = self._take(key, default)
        if given and not isinstance(v, bool):
            raise self.wrong(key, "true or false")
        return v

    def integer(
        self, key: str, default: Any = REQUIRED, *, at_least: int | None = None, at_most: int | None = None
    ) -> Any:
        given, v = self._take(key, default)
        if given and not (_is_int(v) and _within(v, at_least, None, at_most)):
            raise self.wrong(key, "an integer" + _range(at_least, None, at_most))
        return v

    def number(
        self,
        key: str,
        default: Any = REQUIRED,
        *,
        at_least: float | None = None,
        above: float | None = None,
        at_most: float | None = None,
    ) -> Any:
        """An integer or a float, as a float."""
        given, v = self._take(key, default)
        if given and not (_is_number(v) and _within(v, at_least, above, at_most)):
            raise self.wrong(key, "a number" + _range(at_least, above, at_most))
        return float(v) if given else v

    def strings(self, key: str, default: Any = REQUIRED) -> Any:
        given, v = self._take(key, default)
        if given and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise self.wrong(key, "a list of strings")
        return list(v) if given else v

    def duration(
        self,
        key: str,
        default: Any = REQUIRED,
        *,
        at_least: float | None = None,
        above: float | None = None,
        days: bool = False,
    ) -> Any:
        """Seconds, from "90s", "30m", "2h" (and "7d" with ``days``) or a number of seconds."""
        given, v = self._take(key, default)
        if not given:
            return v
        if not (isinstance(v, str) or _is_number(v)):
            raise self.wrong(key, "a duration like 90s, 30m or 2h" + (" (or 7d)" if days else ""))
        if days and isinstance(v, str) and v.strip().endswith("d"):
            try:
                seconds = float(v.strip()[:-1]) * 86400
            except ValueError:
                raise self.wrong(key, "a duration like 7d, 6h or 30m") from None
        else:
            seconds = parse_duration(v, self.name(key))
        if not _within(seconds, at_least, above, None):
            raise self.wrong(key, "a duration" + _range(at_least, above, None, "s"))
        return seconds

    def table(self, key: str, *, required: bool = False) -> Table:
        """A table inside this one (empty when absent and not required)."""
        v = self._take(key, REQUIRED if required else {})[1]
        if self.top:
            where = f"{self.where} [{key}]"
        elif self.where.endswith("]"):
            where = f"{self.where[:-1]}.{key}]"
        else:
            where = f"{self.where}.{key}"
        return Table(v, where, see=self.see)

    # -- keys nobody asked for -----------------------------------------------------------------

    def only(self, keys: Collection[str]) -> None:
        """A ConfigError naming every key outside ``keys``."""
        extra = set(self.data) - set(keys)
        if extra:
            raise ConfigError(
                f"{self.where}: unknown key(s) {', '.join(sorted(extra))}" + (f"; {self.see}" if self.see else "")
            )

    def done(self) -> None:
        """A ConfigError naming every key that no method above has read."""
        self.only(self.seen)


def _one_of(choices: Collection[str]) -> str:
    names = [repr(c) for c in choices]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
