"""Outside exceptions turned into ours at the command boundary: no input reaches the user as a traceback.

``autotune.cli.main`` runs every command inside ``input_errors()``. An exception that the standard
library or a library raises because of what the user gave (a file, a storage URL, a command line,
an address) becomes a ConfigError there: exit 2, one line that says what is wrong and what to do,
with ``raise ... from`` keeping the original for a debugger. Most specific first:

    UnicodeDecodeError                        a file that is not UTF-8 text
    json.JSONDecodeError                      a JSON file that does not parse
    sqlalchemy NoSuchModuleError              a storage URL naming a database sqlalchemy has no dialect for
    sqlalchemy ArgumentError                  a storage URL that does not parse
    ImportError from optuna's storages        a storage URL whose database driver is not installed
    sqlalchemy OperationalError               a database that cannot be opened or reached
    sqlalchemy DatabaseError                  a database that refused (a file that is not one)
    KeyError from optuna's storages           a study that is not in its storage
    yaml YAMLError                            a YAML file that does not parse
    ValueError from shlex                     a command line with a quote left open
    OSError from subprocess                   a program that does not exist or may not be run
    OSError and its kinds                     a path or an address the system refused, and why

Nothing else: an exception this map cannot name as caused by input (a TypeError in our own code)
passes through with its traceback, as a bug should. "From" a module means raised by that module's
own code (the innermost frame of the traceback), not merely passing through it. A library is looked
up in ``sys.modules``: one never imported raised nothing, and ``autotune --help`` imports none.
Modules that know more convert their own errors first (the trace reader names the file and the
line, the tokenizer wrapper the file); this map is the net under them.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from autotune.errors import AutotuneError, ConfigError

__all__ = ["input_errors", "one_line"]


def one_line(text: str) -> str:
    """A message on one line (library messages carry newlines: sqlalchemy's link to its docs, YAML's marks)."""
    return " ".join(text.split())


Match = Callable[[Exception], bool]


def _kind(cls: type[BaseException]) -> Match:
    return lambda e: isinstance(e, cls)


def _library(module: str, name: str) -> Match:
    """A library's exception class, looked up when it matters: a library never imported raised nothing."""
    return lambda e: isinstance(e, getattr(sys.modules.get(module), name, ()))


def _from(cls: type[BaseException], package: str) -> Match:
    """An exception of ``cls`` raised by the code of ``package`` (the innermost frame of its traceback)."""

    def match(e: Exception) -> bool:
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
        return isinstance(e, cls) and (module == package or module.startswith(package + "."))

    return match


def _orig(e: Exception) -> object:
    """What the database itself said (sqlalchemy wraps it, with a link to its docs)."""
    return getattr(e, "orig", None) or e


def _yaml(e: Exception) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"a YAML file does not parse ({getattr(e, 'problem', None) or e}{where}); fix it or write it anew"


# what to do, by the kind of OSError (the system's own words say what is wrong)
_OS_HINTS: tuple[tuple[type[OSError], str], ...] = (
    (FileNotFoundError, "check the path"),
    (IsADirectoryError, "give a file, not a directory"),
    (NotADirectoryError, "a part of the path is a file, not a directory"),
    (FileExistsError, "remove it or pick another path"),
    (PermissionError, "check its permissions, or run as a user allowed to"),
    (socket.gaierror, "check the host name"),
    (ConnectionError, "check the address, and that something listens there"),
)


def _reason(e: OSError) -> str:
    return (e.strerror or str(e)).rstrip(".")


def _os(e: OSError) -> str:
    hint = next((h for kind, h in _OS_HINTS if isinstance(e, kind)), "")
    what = f"{e.filename}: {_reason(e).lower()}" if e.filename is not None else _reason(e)
    return what + (f" ({hint})" if hint else "")


# most specific first: the first match says it
_MAP: tuple[tuple[Match, Callable[[Any], str]], ...] = (
    (
        _kind(UnicodeDecodeError),
        lambda e: (
            f"a file is not UTF-8 text (byte {e.object[e.start : e.start + 1]!r} at offset {e.start}); save it as UTF-8"
        ),
    ),
    (
        _kind(json.JSONDecodeError),
        lambda e: f"a JSON file does not parse ({e.msg} at line {e.lineno}); fix it or write it anew",
    ),
    (
        _library("sqlalchemy.exc", "NoSuchModuleError"),
        lambda e: (
            f"the storage URL names a database sqlalchemy has no dialect for ({e}); "
            "use sqlite:///FILE or postgresql://USER@HOST/DB"
        ),
    ),
    (
        _library("sqlalchemy.exc", "ArgumentError"),
        lambda e: f"the storage URL does not parse ({e}); write e.g. sqlite:///runs/studies.db",
    ),
    (
        _from(ImportError, "optuna.storages"),
        lambda e: (
            f"the storage URL's database driver is not installed ({e.__cause__ or e}); install it "
            "(PostgreSQL: pip install 'autotune[postgres]') or use sqlite:///FILE"
        ),
    ),
    (
        _library("sqlalchemy.exc", "OperationalError"),
        lambda e: (
            f"cannot open the study storage ({_orig(e)}); for sqlite:///PATH the directory of PATH must "
            "exist, for a server it must be up and the URL's user allowed in"
        ),
    ),
    (
        _library("sqlalchemy.exc", "DatabaseError"),
        lambda e: f"the study storage refused ({_orig(e)}); is the URL a study database?",
    ),
    (
        _from(KeyError, "optuna.storages"),
        lambda e: (
            f"the study is not in its storage ({e.args[0] if e.args else 'not found'}): run "
            "`autotune study FILE` to make it, or name another with --study-name"
        ),
    ),
    (_library("yaml", "YAMLError"), _yaml),
    (
        _from(ValueError, "shlex"),
        lambda e: f"a command line does not split like a shell's ({e}): close the quote, or escape it with a backslash",
    ),
    (
        _from(OSError, "subprocess"),
        lambda e: f"cannot run {e.filename}: {_reason(e).lower()}; install it, or give its full path",
    ),
    (_kind(OSError), _os),
)


@contextmanager
def input_errors() -> Iterator[None]:
    """Run a command; outside exceptions caused by input leave it as ConfigError, everything else untouched."""
    try:
        yield
    except AutotuneError:
        raise
    except Exception as e:
        for matches, message in _MAP:
            if matches(e):
                raise ConfigError(one_line(message(e))) from e
        raise
