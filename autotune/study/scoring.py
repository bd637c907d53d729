"""How a trial's measurement becomes what Optuna optimizes: one class per objective kind.

    capacity   maximize the highest load at which every SLO holds (req/s); the load ladder climbs
               until it knows, each step an intermediate value for the pruner
    pareto     maximize output throughput, minimize p95 TTFT, at one load: a front, not a winner
               (Optuna's pruners do not work for several objectives, and there is nothing to re-measure)

A study file names one with ``[objective].kind``; adding a kind is one subclass and one line in KINDS.
"""

from __future__ import annotations

import math

from autotune.measure.profiles import Ladder, LoadProfile
from autotune.measure.session import Outcome

__all__ = ["Scoring", "Capacity", "Pareto", "KINDS", "REMEASURE_RESOLUTION", "scoring_for"]

# A re-measurement orders finalists that the trials' ladder (1.25x) could not tell apart: configs 5-20 % apart
# measure alike on a shared 1.25x grid, so the median of repeats cannot order them (bench/README.md, issue 25).
REMEASURE_RESOLUTION = 1.05
CONFIDENCE = 0.9  # the probability a gain must reach before the study deploys it ([remeasure] confidence)


class Scoring:
    """Base class: what Optuna is asked to do with a trial's Outcome."""

    directions: tuple[str, ...] = ("maximize",)
    prunable = True  # may Optuna's pruner stop a trial between load steps?
    remeasured = True  # is there one winner to re-measure?
    cuts_lost_steps = True  # is a step's pass or fail all its value needs (so a lost step may stop early)?

    def __init__(self, start_load: float = 1.0, max_steps: int = 4, resolution: float = 1.25) -> None:
        self.start_load, self.max_steps, self.resolution = start_load, max_steps, resolution

    def profile(self) -> LoadProfile:
        """The loads a trial of this kind steps through."""
        return Ladder(self.start_load, self.max_steps, self.resolution)

    def remeasure_profile(self, trial_load: float) -> LoadProfile:
        """The loads a re-measurement of a config whose trial held ``trial_load`` at most steps through. The
        trial's ladder put the capacity between that load and the resolution times it, so it starts in the middle
        of that bracket and gallops at ``REMEASURE_RESOLUTION``, which bisects the bracket down to about that
        resolution in four steps. Two steps more than a trial's let a run whose trial was far off (a stall of the
        host or the GPU during the trial) still find a load it misses: the gallop squares its stride, so six steps
        try 4.5x the start; a run that held every load is a floor, and no gain over a floor can be stated."""
        start = trial_load * math.sqrt(self.resolution) if trial_load > 0 else self.start_load
        return Ladder(start, self.max_steps + 2, REMEASURE_RESOLUTION, gallop=True)

    def value(self, out: Outcome) -> float | tuple[float, ...]:
        raise NotImplementedError


class Capacity(Scoring):
    def value(self, out: Outcome) -> float:
        return out.capacity_rps


class Pareto(Scoring):
    directions = ("maximize", "minimize")
    prunable = False
    remeasured = False
    cuts_lost_steps = False  # its values are the step's throughput and p95 TTFT, which a cut step would truncate

    def profile(self) -> LoadProfile:
        return Ladder(self.start_load, 1, self.resolution)

    def value(self, out: Outcome) -> tuple[float, float]:
        step = out.judged_step()
        assert step is not None  # a trial that reaches its value measured a step (a failed start raised before)
        s = step.summary
        return s.output_throughput, (s.ttft.p95 if s.ttft.p95 is not None else math.inf)


KINDS: dict[str, type[Scoring]] = {"capacity": Capacity, "pareto": Pareto}


def scoring_for(kind: str, start_load: float = 1.0, max_steps: int = 4, resolution: float = 1.25) -> Scoring:
    return KINDS[kind](start_load, max_steps, resolution)
