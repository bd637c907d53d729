"""A study's space scored in virtual time, before any engine starts (the simulator as a study's advisor).

``SpaceSimulator(shape, gpu, workload_at, base_rate, slos, front_end)`` is what a study calls with a list of engine-arg
values (each point's ``EngineArgs.values``, the space's rules applied) and gets, for each, the capacity the
simulator predicts (the highest load at which every SLO holds, as the load ladder states it: the offered rate,
``base_rate`` x the load) or the start-up failure vLLM would print. The engine is vllm-sim's (start-up plan,
scheduler, step model, the API server's costs); the client replays the study's own load steps
(``workload_at(load)``: the same duration at every load, as the trials measure it) on a grid of loads 9 % apart,
galloped then bisected, assuming a config that holds at a load holds at every lower one. Configs the grid ties are
ordered by how close each came to holding the next load (``Predicted.rank_rps``), from the loads already simulated.

A prediction is a ranking aid, not a measurement: the study measures what it predicts and records both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autotune.engine.model import ModelShape
from autotune.measure.metrics import summarize
from autotune.measure.slo import SLO
from autotune.sim.config import SimConfig
from autotune.sim.perf import API_SERVER, FrontEnd
from autotune.sim.profiles import GpuProfile
from autotune.sim.startup import plan_startup
from autotune.sim.virtual import SimEngine, simulate
from autotune.workload.trace import Workload

__all__ = ["Predicted", "SpaceSimulator", "between"]

GRID = 8  # loads are 2 ** (k / GRID): 9 % apart, finer than the ladder's 1.25, and few enough to cache
LOWEST = -4 * GRID  # load 1/16: below it a config "holds nothing" (capacity 0)
HIGHEST = 4 * GRID  # load 16: the ladder's reach from load 1 in 4 steps is 8; above it, "at least"


@dataclass(frozen=True)
class Predicted:
    capacity_rps: float | None  # None: it would not start
    failure: str | None = None  # vLLM's start-up failure line, when it would not start
    kv_cache_tokens: int | None = None
    # how far towards the next grid load (0 to 1, in the grid's log steps) the SLOs would still hold: the worst
    # SLO's relative violation interpolated between the highest load that holds and the next, which misses.
    # Configs the grid ties (tens of them on long prompts) differ here; no load is simulated for it
    between: float = 0.0

    @property
    def rank_rps(self) -> float | None:
        """The capacity a study orders configs by: ``capacity_rps`` moved ``between`` of the way to the next grid
        load."""
        return None if self.capacity_rps is None else self.capacity_rps * 2 ** (self.between / GRID)

    def to_json(self) -> dict[str, Any]:
        return {
            "capacity_rps": self.capacity_rps,
            "failure": self.failure,
            "kv_cache_tokens": self.kv_cache_tokens,
            "rank_rps": self.rank_rps,
        }


class SpaceSimulator:
    """Predicts each point's capacity on one GPU for one workload and its SLOs (see the module docstring)."""

    def __init__(
        self,
        shape: ModelShape,
        gpu: GpuProfile,
        workload_at: Callable[[float], Workload],
        base_rate: float,
        slos: Sequence[SLO],
        front_end: FrontEnd = API_SERVER,
    ) -> None:
        self.shape, self.gpu, self.workload_at, self.base_rate = shape, gpu, workload_at, base_rate
        self.slos = list(slos)
        self.front_end = front_end

    def __call__(self, points: Sequence[Mapping[str, Any]]) -> list[Predicted]:
        return [self.one(values) for values in points]

    def startup_failure(self, values: Mapping[str, Any]) -> str | None:
        """vLLM's start-up failure line for a point, or None where it starts: the start-up model alone (memory
        arithmetic, no simulation), cheap enough to ask for every trial."""
        config = SimConfig.from_args(values, self.gpu, self.shape)
        error = config.validate()
        if error is not None:
            return f"invalid args: {error}"
        start = plan_startup(self.shape, self.gpu, config)
        return None if start.plan is not None else (start.failure or ("start-up failed",))[0][:300]

    def one(self, values: Mapping[str, Any]) -> Predicted:
        config = SimConfig.from_args(values, self.gpu, self.shape)
        error = config.validate()
        if error is not None:
            return Predicted(None, f"invalid args: {error}")
        start = plan_startup(self.shape, self.gpu, config)
        if start.plan is None:
            return Predicted(None, (start.failure or ("start-up failed",))[0][:300])
        plan = start.plan
        worst: dict[int, float] = {}  # per load simulated: the worst SLO's relative violation (inf: a request failed)

        def holds(k: int) -> bool:
            engine = SimEngine(self.shape, self.gpu, config, plan, self.front_end)
            summary = summarize(simulate(engine, self.workload_at(2 ** (k / GRID)), warmup=4), self.slos)
            verdicts = summary.verdicts(self.slos)
            worst[k] = math.inf if summary.failed else max((v.violation for v in verdicts), default=-math.inf)
            return summary.failed == 0 and all(v.holds for v in verdicts)

        k = highest_holding(holds, LOWEST, HIGHEST)
        if k is None:
            return Predicted(0.0, kv_cache_tokens=plan.kv_tokens)
        return Predicted(
            self.base_rate * 2 ** (k / GRID),
            kv_cache_tokens=plan.kv_tokens,
            between=between(worst.get(k), worst.get(k + 1)),
        )


def between(holding: float | None, missing: float | None) -> float:
    """Where the worst SLO's relative violation crosses 0 between a load that holds (``holding`` <= 0) and the next
    one, which misses (``missing`` > 0), as a share of the step. Linear: where latency climbs steeply into the next
    load it says too little (against a grid 4x finer, tests/test_sim_rank.py), but it orders configs. 0 where
    either is unknown or a request failed at the next load (nothing to interpolate)."""
    if holding is None or missing is None or not (math.isfinite(holding) and math.isfinite(missing)):
        return 0.0
    if missing <= holding:
        return 0.0
    return min(max(-holding / (missing - holding), 0.0), 1.0)


def highest_holding(holds: Callable[[int], bool], lo: int, hi: int, stride: int = GRID) -> int | None:
    """The highest k in lo..hi where ``holds(k)``, assuming it is monotone (holding at k means holding at every
    lower k, as queueing latency does); None when even ``lo`` misses. Gallops from 0 in ``stride``s, then bisects."""
    if holds(0):
        a = 0
        while a < hi and holds(min(a + stride, hi)):
            a = min(a + stride, hi)
        if a >= hi:
            return hi
        b = min(a + stride, hi)
    else:
        b = 0
        while b > lo and not holds(max(b - stride, lo)):
            b = max(b - stride, lo)
        if b <= lo:
            return None
        a = max(b - stride, lo)
    while b - a > 1:
        mid = (a + b) // 2
        a, b = (mid, b) if holds(mid) else (a, mid)
    return a
