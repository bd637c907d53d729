"""What a study may ask before it measures: an advisor, and how a study gets its engine's.

An advisor knows something about configs before they run (vllm-sim's is the simulator: sim/advisor.py). A study
asks it four things (study/advice.py decides what to do with the answers):

- ``predict``: the capacity each config would reach (req/s; None where it would not start): the study ranks its
  space with it, queues the best first and starts each trial's load ladder near its prediction;
- ``startup_failure``: whether a config starts at all, cheaply, so a sampled trial runs at the highest memory
  fraction that starts;
- ``learn``: the study's trials measured so far, after each one, so it predicts this host better from then on;
- ``gives_up``: whether its predictions have kept missing what was measured, after which the sampler alone
  chooses.

The base class is the reference implementation that advises nothing: every trial runs as the sampler chose it
and climbs its ladder from the study's start load. An engine kind names its advisor (``EngineKind.advisor``,
``"module:function"``, imported on first use as kinds are), and ``advisor_for`` builds it.
"""

from __future__ import annotations

import importlib
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import optuna
from optuna.trial import TrialState

from autotune.engine.gpu import GpuInfo
from autotune.engine.kind import EngineKind
from autotune.engine.model import ModelShape
from autotune.measure.slo import SLO
from autotune.study.records import TrialRecord
from autotune.workload.source import LoadSteps

__all__ = ["Advisor", "AdvisorTarget", "Prediction", "advisor_for", "prediction_bias"]

# Predictions keep missing when 2 of the last 3 trials predicted before they ran measured a capacity more than
# 1.5x off: the load ladder itself states a capacity only to within its resolution (1.25x), and a ranking aid
# that is off by more than that twice in three tries is no longer ranking.
MISS_RATIO, MISS_WINDOW, MISSES = 1.5, 3, 2


class Prediction(Protocol):
    """One config's predicted outcome."""

    @property
    def capacity_rps(self) -> float | None: ...  # None: it would not start

    @property
    def rank_rps(self) -> float | None: ...  # what configs are ordered by: capacity_rps, or finer where it ties

    def to_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class AdvisorTarget:
    """What an advisor advises on: the model, the hardware, the workload's load steps and the SLOs."""

    model: str  # as the engine names it (a directory or a Hugging Face id)
    shape: ModelShape | None  # read from the model's config.json; None where it could not be
    platform: str  # "cuda" or "cpu"
    devices: Sequence[GpuInfo]
    steps: LoadSteps
    slos: Sequence[SLO]
    study: str  # the study's name, kept with what the advisor learns from it
    fixed: Mapping[str, Any] = field(default_factory=dict)  # engine args every trial runs with
    varied: frozenset[str] = frozenset()  # engine args the study's space chooses
    study_file: Path | None = None  # the study's file, for the commands an advisor's notes suggest


class Advisor:
    """Advises nothing (the reference implementation): subclasses override what they know."""

    describe = "no advisor"  # what the study says it simulates first with
    predicts = False  # answers ``predict`` and ``startup_failure``
    learns = False  # refits on the study's measured trials (a fit reads every step whole: none is cut short)

    def predict(self, points: Sequence[Mapping[str, Any]]) -> list[Prediction] | None:
        """Each point's predicted outcome (the engine-arg values, and the engine's environment), or None: no
        prediction. May raise: the study then goes on without this advisor's predictions."""
        return None

    def startup_failure(self, values: Mapping[str, Any]) -> str | None:
        """The line the engine would fail to start with, or None: it starts, or the advisor cannot say."""
        return None

    def learn(self, study: optuna.Study) -> str | None:
        """Learn from the study's trials measured so far; what to tell the user, or None."""
        return None

    def finish(self, study: optuna.Study) -> str | None:
        """Learn from the finished study, for the next one on this host; what to tell the user, or None."""
        return None

    def gives_up(self, records: Sequence[TrialRecord]) -> str | None:
        """Why its predictions cannot be trusted any more, or None: MISSES of the last MISS_WINDOW trials that
        measured a capacity predicted before they ran came out more than MISS_RATIO off it."""
        last = _predicted_and_measured(records)[-MISS_WINDOW:]
        off = [r for r in last if _off_by(r) > MISS_RATIO]
        if len(last) < MISS_WINDOW or len(off) < MISSES:
            return None
        said = ", ".join(
            f"trial {r.number} measured {r.capacity_rps:.2f} req/s where it predicted {r.predicted_capacity_rps:.2f}"
            for r in off
        )
        return f"{len(off)} of its last {len(last)} predictions missed by more than {MISS_RATIO}x ({said})"


def _off_by(r: TrialRecord) -> float:
    predicted = r.predicted_capacity_rps or 0.0
    return max(r.capacity_rps / predicted, predicted / r.capacity_rps)


def _predicted_and_measured(records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """The trials that measured a capacity predicted before they ran (not a copy of another's)."""
    return [
        r
        for r in records
        if r.state == TrialState.COMPLETE
        and r.capacity_rps > 0
        and r.predicted_capacity_rps
        and r.same_config_as is None
    ]


def prediction_bias(records: Sequence[TrialRecord]) -> float:
    """The median of measured / predicted capacity over the trials measured so far that had a prediction made before
    they ran (1.0 before any): an advisor off by the same factor on every config (a host slower than its profile)
    still ranks them right, and a load ladder that starts at its prediction should start where this host holds."""
    ratios = [r.capacity_rps / (r.predicted_capacity_rps or 1.0) for r in _predicted_and_measured(records)]
    return statistics.median(ratios) if ratios else 1.0


def advisor_for(kind: EngineKind, target: AdvisorTarget) -> tuple[Advisor, str | None]:
    """The engine kind's advisor for ``target``, and None; or the do-nothing advisor and why there is no other."""
    if kind.advisor is None:
        return Advisor(), f"{kind.display_name} has no advisor"
    module, _, name = kind.advisor.partition(":")
    advisor, why = getattr(importlib.import_module(module), name)(target)
    return advisor, why
