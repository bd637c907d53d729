"""The GPUs a study may use, and the slots its trials run on: each trial a set of free GPUs of its size, side by side.

A study names its GPUs (``[engine] gpus = "0-7"``, ``--gpus 0-7``, NVML's indices); by default they are every GPU
NVML sees. Where the study says ``gpus = "inherit"`` (the daemon's tunings beside production, unless the staging
study names its GPUs), this process or the study's [engine.env] already sets CUDA_VISIBLE_DEVICES, or there is no
GPU, there is one slot that sets nothing: the engine sees what it would see without autotune, one trial at a time.

A trial of n GPUs (tensor x pipeline parallel) takes an aligned block of n GPUs of the list, in its order (of
"0-7", GPUs 0-3 or 4-7 for n = 4): hosts whose GPUs are linked in pairs or fours (NVLink bridges, PCIe switches)
number them so, and aligned blocks pack (two TP-2 trials on 0-3 leave 4-7 whole for a TP-4 one). Two trials never
share a GPU, so ``gpu_memory_utilization`` keeps its meaning: a share of a whole GPU. Trials are served in the
order they ask, so a wide trial is not starved by narrow ones. Each slot has its own port (the study's port plus
the block's first position in the list) and the environment that shows the engine its GPUs by NVML's numbering.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from autotune.engine import gpu

__all__ = ["Slot", "Slots", "parse_gpu_ids", "study_gpus", "INHERIT", "VISIBLE"]

VISIBLE = "CUDA_VISIBLE_DEVICES"


INHERIT = "inherit"


def parse_gpu_ids(text: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> (0, 1, 2, 3, 6): NVML indices, each once, in the order given; ``"inherit"`` -> () (one slot that
    sets nothing). ValueError, saying what is wrong."""
    if str(text).strip() == INHERIT:
        return ()
    ids: list[int] = []
    for part in (p.strip() for p in str(text).split(",")):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(
                f'{part!r} is not a GPU index or a range of them: write e.g. "0-7" or "0,2,4-5" (or "{INHERIT}")'
            )
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"{part!r} runs backwards: write the lower index first")
        ids += range(first, last + 1)
    if len(set(ids)) != len(ids):
        raise ValueError(f"{text!r} names a GPU twice")
    return tuple(ids)


def study_gpus(given: Sequence[int] | None, engine_env: Mapping[str, str]) -> tuple[int, ...] | None:
    """The GPUs a study's trials are placed on: ``given``, else every GPU NVML sees; None (one slot that sets
    nothing) where ``given`` is () ("inherit"), CUDA_VISIBLE_DEVICES already says which, in this process or the
    engine's environment, or NVML sees none."""
    if given is not None:
        return tuple(given) or None
    if VISIBLE in engine_env or VISIBLE in os.environ:
        return None
    return tuple(g.index for g in gpu.devices()) or None


@dataclass(frozen=True)
class Slot:
    """Where one engine runs: its GPUs (NVML indices; () for the one slot that sets nothing) and its port."""

    gpus: tuple[int, ...]
    port: int

    @property
    def env(self) -> dict[str, str]:
        """What the engine's environment gets: CUDA numbers devices fastest first unless told PCI order, NVML's."""
        if not self.gpus:
            return {}
        return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", VISIBLE: ",".join(map(str, self.gpus))}

    @property
    def label(self) -> str:
        if not self.gpus:
            return "the host's GPUs"
        return ("GPU " if len(self.gpus) == 1 else "GPUs ") + ",".join(map(str, self.gpus))


class Slots:
    """The study's GPUs (``gpus``; None: one slot that sets nothing), taken and given back by trials, thread-safe."""

    def __init__(self, gpus: Sequence[int] | None, port: int) -> None:
        self.gpus = tuple(gpus) if gpus else ()
        self.port = port
        self._busy = [False] * max(len(self.gpus), 1)
        self._cond = threading.Condition()
        self._queue: list[int] = []  # tickets of the trials waiting, in the order they asked
        self._tickets = 0

    def concurrency(self, smallest: int = 1) -> int:
        """How many trials of ``smallest`` GPUs run at once on these GPUs."""
        return max(len(self.gpus) // max(smallest, 1), 1) if self.gpus else 1

    def unfit(self, n: int) -> str | None:
        """Why a trial of ``n`` GPUs can never run here (None: it can)."""
        if self.gpus and n > len(self.gpus):
            return f"it needs {n} GPUs and the study has {len(self.gpus)} ({','.join(map(str, self.gpus))})"
        return None

    def _free_block(self, n: int) -> int | None:
        if not self.gpus:
            return None if self._busy[0] else 0
        for start in range(0, len(self.gpus) - n + 1, n):
            if not any(self._busy[start : start + n]):
                return start
        return None

    def take(self, n: int, check: Callable[[], None] = lambda: None) -> Slot:
        """Block until ``n`` GPUs are free for this caller (first come, first served) and take them. ``check`` runs
        while it waits: what it raises (a stop signal) ends the wait."""
        if (why := self.unfit(n)) is not None:
            raise ValueError(why)
        with self._cond:
            ticket = self._tickets
            self._tickets += 1
            self._queue.append(ticket)
            try:
                while self._queue[0] != ticket or (slot := self.try_take(n)) is None:
                    self._cond.wait(0.25)
                    check()
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
        return slot

    def try_take(self, n: int) -> Slot | None:
        """``n`` free GPUs taken now, or None."""
        size = n if self.gpus else 1
        with self._cond:
            start = self._free_block(size)
            if start is None:
                return None
            self._busy[start : start + size] = [True] * size
        return Slot(self.gpus[start : start + size], self.port + start)

    def give(self, slot: Slot) -> None:
        start = self.gpus.index(slot.gpus[0]) if slot.gpus else 0
        with self._cond:
            self._busy[start : start + max(len(slot.gpus), 1)] = [False] * max(len(slot.gpus), 1)
            self._cond.notify_all()

    @contextlib.contextmanager
    def held(self, n: int, check: Callable[[], None] = lambda: None) -> Iterator[Slot]:
        slot = self.take(n, check)
        try:
            yield slot
        finally:
            self.give(slot)
