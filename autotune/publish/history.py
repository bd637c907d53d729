"""A numbered history of what production ran, and why it changed.

One JSON file per entry (``0001.json``, ...), written atomically, never rewritten except to
settle a ``pending`` or ``proposed`` entry: a crash between writing the config and verifying
it leaves a ``pending`` entry, which the next start resolves (verify again or roll back).

Outcomes:
    adopted      the config found in production when autotune first looked (the first good one)
    proposed     a study's winner waiting for ``autotune publish --approve``
    pending      being published: written, restarting or under the canary (blue/green: ``switch``
                 names the step, see transaction.py)
    published    verified: health and canary passed
    rolled-back  failed (reason), production restored to the entry named in ``restored``; or abandoned
                 before production served it (``reached_production`` is false: nothing was rolled back)
    rejected     a proposal a person declined, or one made stale by a newer one
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError
from autotune.locations import atomic_write

__all__ = ["Entry", "History", "GOOD", "NOT_DEPLOYED"]

GOOD = ("adopted", "published")
NOT_DEPLOYED = "interrupted before it was deployed"  # the reason of a publish a crash cut before its config was written


@dataclass(frozen=True)
class Entry:
    number: int
    outcome: str
    values: dict[str, Any]
    time: float = 0.0
    source: dict[str, Any] = field(default_factory=dict)  # study, trial, capacity, trigger
    reason: str = ""
    restored: int | None = None  # after a rollback: the entry production went back to
    canary: dict[str, Any] | None = None  # the canary's summary and verdicts
    # a blue/green publish: {"from": color, "to": color, "step": ...}, the step written before it starts
    switch: dict[str, Any] | None = None

    @property
    def good(self) -> bool:
        return self.outcome in GOOD

    @property
    def reached_production(self) -> bool:
        """Did production serve this entry's config? Not when a crash came before it was written, nor when a
        blue/green publish was abandoned before the switch (its canary failed, or a crash came first)."""
        return self.reason != NOT_DEPLOYED and (self.switch or {}).get("step") != "abandoned"


class History:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def entries(self) -> list[Entry]:
        if not self.root.is_dir():
            return []
        out = [_read(p) for p in sorted(self.root.glob("[0-9][0-9][0-9][0-9]*.json"))]
        return sorted(out, key=lambda e: e.number)

    def get(self, number: int) -> Entry | None:
        """Entry ``number``; None when there is none."""
        p = self._path(number)
        return _read(p) if number >= 1 and p.is_file() else None

    def add(self, outcome: str, values: dict[str, Any], **kw: Any) -> Entry:
        entries = self.entries()
        e = Entry(
            number=(entries[-1].number + 1) if entries else 1,
            outcome=outcome,
            values=dict(values),
            time=time.time(),
            **kw,
        )
        self._write(e)
        return e

    def settle(self, entry: Entry, outcome: str, **kw: Any) -> Entry:
        e = replace(entry, outcome=outcome, **kw)
        self._write(e)
        return e

    def last_good(self, before: int | None = None) -> Entry | None:
        good = [e for e in self.entries() if e.good and (before is None or e.number < before)]
        return good[-1] if good else None

    def open_entry(self) -> Entry | None:
        """The entry a crash left ``pending``, if any."""
        pending = [e for e in self.entries() if e.outcome == "pending"]
        return pending[-1] if pending else None

    def proposal(self) -> Entry | None:
        proposed = [e for e in self.entries() if e.outcome == "proposed"]
        return proposed[-1] if proposed else None

    def _path(self, number: int) -> Path:
        return self.root / f"{number:04d}.json"

    def _write(self, e: Entry) -> None:
        atomic_write(self._path(e.number), json.dumps(asdict(e), indent=1) + "\n")


def _read(p: Path) -> Entry:
    try:
        return Entry(**json.loads(p.read_text(encoding="utf-8")))
    except (ValueError, TypeError) as e:  # not JSON or not UTF-8 (both ValueErrors), or not an entry's fields
        raise ConfigError(f"{p} is not a history entry ({e}); move it out of {p.parent}") from e
