"""Load profiles: which load to offer next, given the steps measured so far.

A load is a multiple of the workload's arrival rate. A profile is asked after every step
(``next_load(loads)``, with each step's load and whether it met every SLO) and answers the
next load, or None when the measurement is complete. Profiles are pure: no engine, no HTTP.

- ``FixedLoad``: one step at one load (``autotune bench``, ``autotune replay``, the canary,
  the Pareto objective's single step).
- ``Ladder``: a trial's capacity search. It doubles while the SLOs hold, halves while they
  miss, then bisects (geometrically) between the last pass and the first miss, until the two
  are within ``resolution`` of each other or ``max_steps`` steps are spent. A ladder that starts
  at a load believed to be near the capacity (the simulator's prediction) *gallops* instead:
  its first stride is the resolution itself, and each further stride in the same direction is
  the last one squared (1.25x, 1.56x, 2.44x, ...), so a start within the resolution of the
  capacity brackets it in two steps, where doubling needs four to narrow a 2x bracket to 1.25x,
  and a start far off still reaches 4.8x away within four steps (a first guess on a host the
  simulator has not seen yet can be that far off, and a ladder that never passes says nothing).
- ``Race``: a challenger's capacity search against the incumbent (the best capacity so far):
  its first step is the incumbent's load, and a miss there ends it, since a config that misses
  where the incumbent holds cannot win. Its start is a measurement, not a guess, and a
  challenger worth racing is seldom far above it, so a pass climbs by the resolution twice
  before it gallops (1.25x, 1.25x, 1.56x): a challenger 1.25-1.56x above the incumbent is
  bracketed in three steps, not four; one 1.56-2.44x above ends after four bracketed to 1.56x
  (the capacity is the highest load that held, as always).

Adding a profile (a fixed-rate sweep) is one subclass here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LoadProfile", "FixedLoad", "Ladder", "Race", "next_load"]

Tried = Sequence[tuple[float, bool]]  # (load, passed) of each step so far, in order


class LoadProfile:
    """Base class of load profiles.

    ``next_load`` is called before every step, with every step measured so far (empty before
    the first). It must be pure: the same steps give the same answer.
    """

    def next_load(self, tried: Tried) -> float | None:
        raise NotImplementedError


@dataclass(frozen=True)
class FixedLoad(LoadProfile):
    load: float = 1.0

    def next_load(self, tried: Tried) -> float | None:
        return None if tried else self.load


@dataclass(frozen=True)
class Ladder(LoadProfile):
    start: float = 1.0
    max_steps: int = 4
    resolution: float = 1.25  # stop when the failing load is within this factor of the passing one
    gallop: bool = False  # the start is a guess of the capacity: strides from the resolution up, not doubling

    def next_load(self, tried: Tried) -> float | None:
        return next_load(tried, self.start, self.max_steps, self.resolution, self.gallop)


@dataclass(frozen=True)
class Race(LoadProfile):
    incumbent: float  # the load of the best capacity so far
    max_steps: int = 4
    resolution: float = 1.25

    def next_load(self, tried: Tried) -> float | None:
        if self.lost(tried):
            return None  # missed where the incumbent holds: whatever it reaches lower, it cannot win
        return next_load(tried, self.incumbent, self.max_steps, self.resolution, gallop=True, level_strides=2)

    @staticmethod
    def lost(tried: Tried) -> bool:
        """Did the challenger miss at the incumbent's load (its first step)?"""
        return bool(tried) and not tried[0][1]


def next_load(
    tried: Tried, start: float, max_steps: int, resolution: float, gallop: bool = False, level_strides: int = 1
) -> float | None:
    """The ladder's next load, or None when the capacity is known well enough. A gallop strides by the resolution
    ``level_strides`` times before each stride squares the last."""
    if len(tried) >= max_steps:
        return None
    if not tried:
        return start
    passed = [load for load, ok in tried if ok]
    failed = [load for load, ok in tried if not ok]
    hi_pass = max(passed) if passed else None
    lo_fail = min(failed) if failed else None
    # every step so far on one side of the capacity: stride away from it, doubling or galloping
    stride = resolution ** (2 ** max(0, len(tried) - level_strides)) if gallop else 2.0
    if lo_fail is None:
        assert hi_pass is not None  # steps were tried and none failed
        return hi_pass * stride
    if hi_pass is None:
        return lo_fail / stride
    if lo_fail / hi_pass <= resolution * (1 + 1e-9):  # a gallop's stride of exactly the resolution, in floats
        return None
    return math.sqrt(hi_pass * lo_fail)
