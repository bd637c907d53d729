"""What the daemon's phases (tuning_phase.py, publishing.py) need of the daemon that runs them.

The loop (loop.py) is the one implementation; a phase changes the daemon's state only through ``enter``
(a phase change), ``decided`` (a phase change that is a decision, kept for ``autotune status``), ``note``
and ``keep`` (the same phase, a new note or fields), each saved and journaled by the loop.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from autotune.daemon.config import DaemonConfig
from autotune.daemon.exporter import DaemonMetrics
from autotune.daemon.fingerprint import Fingerprint
from autotune.daemon.state import DaemonState, Phase, StateStore
from autotune.publish.history import Entry, History
from autotune.publish.target import Target
from autotune.study.definition import StudyDefinition
from autotune.study.records import StudyResult

# (storage URL, study name) -> the study as it stands: StudyResult.load; tests hand the daemon results they built
ResultReader = Callable[[str, str], StudyResult]

__all__ = ["PhaseHost", "ResultReader", "say"]


def say(text: str) -> None:
    """A line for the journal's error stream (stderr under systemd): what an operator must see, once."""
    print(f"autotune: {text}", file=sys.stderr, flush=True)


class PhaseHost(Protocol):
    cfg: DaemonConfig
    root: Path  # the daemon's state directory
    store: StateStore
    history: History
    target: Target
    metrics: DaemonMetrics
    state: DaemonState
    fingerprint: Fingerprint | None  # the traffic of the last full window (None: none since the last publish)
    study: StudyDefinition  # the staging study, the template of every tuning
    autotune: list[str]  # how to run `autotune` (the tuning's child process)
    read_result: ResultReader  # how a tuning's study is read back from its storage

    def enter(self, phase: Phase, **changes: Any) -> None: ...

    def decided(self, phase: Phase, note: str, **changes: Any) -> None: ...

    def note(self, text: str, **changes: Any) -> None: ...

    def keep(self, **changes: Any) -> None: ...

    def history_metrics(self, entries: list[Entry] | None = None) -> None: ...
