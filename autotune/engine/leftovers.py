"""Records of running engines, so that none outlives the autotune process that started it.

A launcher writes ``engine-<port>.json`` (the engine's pid, process group and start time,
and its own) before it waits for readiness, and removes it after a clean stop. A launcher
killed with SIGKILL cannot clean up; the next launch on the host reads the record, sees the
owner is gone, and kills the leftover group first. Start times guard against reused pids.
Each engine reaped is reported in one line (a logging warning: stderr unless logging is set up).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from autotune.locations import atomic_write

__all__ = ["EngineRecord", "write_record", "remove_record", "reap_leftovers", "kill_group", "group_members"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineRecord:
    pid: int
    pgid: int
    create_time: float
    owner_pid: int
    owner_create_time: float
    port: int
    argv: list[str]


def _alive(pid: int, create_time: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - create_time) < 0.01
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _path(state_dir: Path, port: int) -> Path:
    return state_dir / "engines" / f"engine-{port}.json"


def write_record(state_dir: Path, rec: EngineRecord) -> Path:
    path = _path(state_dir, rec.port)
    atomic_write(path, json.dumps(asdict(rec)))  # 0600, like all autotune's state
    return path


def remove_record(state_dir: Path, port: int) -> None:
    _path(state_dir, port).unlink(missing_ok=True)


def group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                members.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return members


def kill_group(pgid: int, grace: float, extra: Sequence[psutil.Process] = ()) -> None:
    """SIGTERM the group (and ``extra`` processes that left it), SIGKILL what is left after ``grace``."""
    targets = {p.pid: p for p in [*group_members(pgid), *extra]}
    if not targets:
        return
    for p in targets.values():
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(list(targets.values()), timeout=grace)
    for p in alive + [p for p in group_members(pgid) if p.pid not in targets]:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


def reap_leftovers(state_dir: Path, grace: float = 10.0, running: Collection[int] = ()) -> list[EngineRecord]:
    """Kill the engines whose launcher died, or that this process launched and no longer runs (``running``: the
    pids of the engines it does run, side by side in a parallel study). Returns the records it acted on."""
    reaped: list[EngineRecord] = []
    folder = state_dir / "engines"
    if not folder.is_dir():
        return reaped
    me = psutil.Process()
    for path in sorted(folder.glob("engine-*.json")):
        try:
            rec = EngineRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            path.unlink(missing_ok=True)  # a torn record protects nothing
            continue
        owner_is_me = rec.owner_pid == me.pid and abs(rec.owner_create_time - me.create_time()) < 0.01
        if _alive(rec.owner_pid, rec.owner_create_time) and not owner_is_me:
            continue  # another live autotune owns it
        if owner_is_me and rec.pid in running:
            continue  # one of ours, serving a trial beside the one starting
        alive = _alive(rec.pid, rec.create_time) or bool(group_members(rec.pgid))
        if alive:
            kill_group(rec.pgid, grace)
            deadline = time.monotonic() + grace
            while group_members(rec.pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
        _log.warning(
            "autotune: reaped %s: pid %d, port %d, left behind by autotune pid %d",
            "a leftover engine" if alive else "the record of a leftover engine that had exited",
            rec.pid,
            rec.port,
            rec.owner_pid,
        )
        path.unlink(missing_ok=True)
        reaped.append(rec)
    return reaped
