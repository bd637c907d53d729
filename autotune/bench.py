"""One measurement of one engine configuration: start, warm up, replay, stop, judge.

This is the unit a study trial will repeat; ``autotune bench`` runs it once. ``measure``
does the same against a server someone else runs (``autotune replay``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune import __version__
from autotune.engine.args import EngineArgs, EngineCommand
from autotune.engine.failures import Failure
from autotune.engine.flags import FlagTable
from autotune.engine.launcher import Engine
from autotune.errors import EngineFailure, MeasurementError
from autotune.workload.metrics import RequestResult, Summary, summarize
from autotune.workload.replay import Replay, ReplayOptions, run_replay
from autotune.workload.slo import SLO, Verdict
from autotune.workload.trace import Workload

__all__ = ["BenchResult", "run_bench", "measure", "replay_on"]

Phase = Callable[[str], None]  # "starting", "warming up", "replaying", "stopping"


@dataclass
class BenchResult:
    url: str
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    started_at: float = 0.0  # wall clock
    failure: Failure | None = None
    engine_start_s: float | None = None
    engine_stop_s: float | None = None
    replay: Replay | None = None
    summary: Summary | None = None
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def slos_hold(self) -> bool:
        return self.failure is None and self.summary is not None and all(v.holds for v in self.verdicts)

    def to_json(self) -> dict[str, Any]:
        return {
            "autotune_version": __version__,
            "url": self.url,
            "argv": self.argv,
            "env": self.env,
            "started_at": self.started_at,
            "failure": None if self.failure is None else self.failure.to_json(),
            "failure_class": None if self.failure is None else self.failure.failure_class.value,
            "engine_start_s": self.engine_start_s,
            "engine_stop_s": self.engine_stop_s,
            "model": self.replay.model if self.replay else None,
            "replay_s": self.replay.wall_s if self.replay else None,
            "warmup_s": self.replay.warmup_s if self.replay else None,
            "metrics": None if self.summary is None else self.summary.to_json(),
            "slos": [v.to_json() for v in self.verdicts],
            "slos_hold": self.slos_hold,
        }

    def requests_json(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.replay.results] if self.replay else []


def _judge(result: BenchResult, replay: Replay, slos: list[SLO]) -> None:
    result.replay = replay
    result.summary = summarize(replay.results, slos)
    result.verdicts = result.summary.verdicts(slos)


def measure(url: str, workload: Workload, slos: list[SLO], options: ReplayOptions,
            on_result: Callable[[RequestResult], None] | None = None) -> BenchResult:
    """Replay against an already running server."""
    result = BenchResult(url=url, started_at=time.time())
    _judge(result, run_replay(url, workload, options, on_result), slos)
    return result


def replay_on(engine: Engine, workload: Workload, options: ReplayOptions,
              on_result: Callable[[RequestResult], None] | None = None) -> tuple[Replay | None, Failure | None]:
    """Replay against a running engine; (replay, None), or (what was measured, why the engine died)."""
    try:
        replay = run_replay(engine.url, workload, options, on_result)
    except MeasurementError:
        failure = engine.check()
        if failure is None:
            raise
        return None, failure  # the engine died: that is the result, not a measurement problem
    return replay, engine.check()  # did it die under load?


def run_bench(command: EngineCommand, args: EngineArgs, table: FlagTable, workload: Workload, slos: list[SLO],
              options: ReplayOptions, *, log_dir: Path, startup_timeout: float = 900.0,
              on_phase: Phase | None = None, on_result: Callable[[RequestResult], None] | None = None) -> BenchResult:
    """Start the engine with ``args``, replay ``workload``, stop it. Engine failures are results, not raises."""
    phase = on_phase or (lambda _: None)
    spec = command.launch_spec(args, table, log_dir, startup_timeout)  # checks every flag before anything starts
    result = BenchResult(url=spec.url, argv=spec.argv, env=spec.env, started_at=time.time())
    engine = Engine(spec)
    try:
        phase("starting")
        try:
            engine.start()
        except EngineFailure as e:
            result.failure = e.failure
            return result
        result.engine_start_s = engine.ready_s
        phase("replaying")
        replay, result.failure = replay_on(engine, workload, options, on_result)
        if replay is not None:
            _judge(result, replay, slos)
        return result
    finally:
        phase("stopping")
        engine.stop()
        result.engine_stop_s = engine.stop_s
