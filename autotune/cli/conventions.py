"""What every ``autotune`` subcommand shares: exit statuses, the parser whose usage errors are one line and exit 2,
argument types, the SLO help, the line a stop signal leaves, and the default engine command."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from autotune.boundary import one_line
from autotune.errors import Interrupted

__all__ = [
    "EXIT_OK",
    "EXIT_SLO_MISS",
    "EXIT_USAGE",
    "SLO_HELP",
    "Parser",
    "whole_number",
    "port",
    "trial_count",
    "default_engine_command",
    "stopped",
    "invoked",
]

EXIT_OK, EXIT_SLO_MISS, EXIT_USAGE = 0, 1, 2

SLO_HELP = (
    "an SLO, repeatable; quote it (the shell reads < as a redirection): 'ttft<800ms' (p95 unless a "
    "percentile is given), 'p99:ttft<1s', 'mean:tpot<50ms', 'itl<...', 'e2e<...', 'throughput>2000tok/s', 'rps>5'"
)


def invoked() -> str:
    """``autotune`` as the user can type it again from where they stand, for the next commands a command prints:
    the path they ran (``.venv/bin/autotune``) when ``autotune`` on the PATH is not that program, else
    ``autotune``."""
    ran = Path(sys.argv[0])
    if ran.name != "autotune" or ran.parent == Path():  # `python -m autotune`, a test, or the PATH's own
        return "autotune"
    on_path = shutil.which("autotune")
    if on_path is not None and Path(on_path).resolve() == ran.resolve():
        return "autotune"
    return str(ran)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line and exit 2, like every usage error here
        self.exit(EXIT_USAGE, f"autotune: {one_line(message)} (see {self.prog} --help)\n")


def whole_number(text: str, low: int, high: int | None = None) -> int | None:
    """``text`` as a whole number from ``low`` to ``high`` (ASCII digits only: int() also reads '١٢'), else None."""
    if not (text.isascii() and text.isdigit()) or int(text) < low or (high is not None and int(text) > high):
        return None
    return int(text)


def _whole_numbers(low: int, high: int | None, what: str) -> Callable[[str], int]:
    """An argparse type: a whole number in a range; else a usage error saying what is expected."""

    def parse(text: str) -> int:
        n = whole_number(text, low, high)
        if n is None:
            raise argparse.ArgumentTypeError(f"{what}, not {text!r}")
        return n

    return parse


port = _whole_numbers(1, 65535, "a port is a number from 1 to 65535")
trial_count = _whole_numbers(1, None, "the number of trials to print is 1 or more")


def default_engine_command() -> str:
    """`vllm serve` from PATH, else the vllm beside this Python (the CPU installer's venv)."""
    if shutil.which("vllm"):
        return "vllm serve"
    beside = Path(sys.executable).parent / "vllm"
    return f"{beside} serve" if beside.exists() else "vllm serve"


def stopped(e: Interrupted, rest: str) -> int:
    """The one line of a command a signal stopped; its exit code is 128 + the signal (130 for Ctrl-C, as ever)."""
    said = "interrupted" if e.signum == signal.SIGINT else f"stopped by {e.name}"
    print(f"autotune: {said}{rest}", file=sys.stderr)
    return e.exit_code
