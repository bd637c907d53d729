"""Secrets in the engine's environment: which names hold one, and their values kept out of every output.

A name holds a secret when it contains TOKEN, KEY, SECRET or PASSWORD (any case), or when the
study names it (``[engine] secret_env = ["NAME", ...]``, ``StudyDefinition.secret_env``).

The engine gets the real values (``LaunchSpec.env``). What autotune writes about a run goes
through ``redact``: ``--json`` results, trial user attrs (so the dashboard and the report),
``--dry-run`` lines, best.json and the best config's header. ``reveal`` puts the real values back
where a redacted record is run again (re-measurement, best-command.sh, which is written 0600).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

__all__ = ["REDACTED", "is_secret", "redact", "reveal"]

REDACTED = "<redacted>"

_NAMES = re.compile("TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)


def is_secret(name: str, named: Iterable[str] = ()) -> bool:
    """``name`` holds a secret by its name, or because the study lists it (case-insensitive)."""
    return bool(_NAMES.search(name)) or name.upper() in {n.upper() for n in named}


def redact(env: Mapping[str, str], named: Iterable[str] = ()) -> dict[str, str]:
    """``env`` with every secret's value replaced by REDACTED: what may be shown or stored."""
    named = tuple(named)
    return {k: REDACTED if is_secret(k, named) else v for k, v in env.items()}


def reveal(env: Mapping[str, str], real: Mapping[str, str]) -> dict[str, str]:
    """``env`` with redacted values taken back from ``real`` (the study's own environment) where it has them."""
    return {k: real.get(k, v) if v == REDACTED else v for k, v in env.items()}
