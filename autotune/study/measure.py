"""One trial's measurement: start the engine once, replay the workload at rising loads, stop.

``workload_at(load)`` gives the requests of one step (source.LoadSteps: the same duration at
every load, so each step measures a steady state rather than a burst).

Throughput only means something at saturation, so a trial's score is its *capacity*: the
highest load (the workload's arrival rate, scaled) at which every SLO still holds. The load
ladder doubles while the SLOs hold, halves while they miss, then bisects between the last pass
and the first miss, at most ``max_steps`` replays. After each step ``on_step`` sees the outcome
so far and may answer True to stop there (Optuna's pruner does, for a hopeless trial).

This module knows the engine and the workload; the Optuna side lives in runner.py.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autotune.engine.args import EngineArgs, EngineCommand
from autotune.engine.failures import Failure
from autotune.engine.flags import FlagTable
from autotune.bench import replay_on
from autotune.engine.launcher import Engine
from autotune.errors import EngineFailure
from autotune.workload.metrics import RequestResult, Summary, summarize
from autotune.workload.replay import ReplayOptions
from autotune.workload.slo import SLO, Verdict
from autotune.workload.trace import Workload

__all__ = ["Step", "Outcome", "next_load", "measure_config", "MIN_OFFERED_SHARE"]

# A step only counts when the client really offered its load: if the replay itself fell behind
# its schedule (sends spread over a longer span than scheduled), the engine was not tested at
# that load. A brief stall that the client makes up for does not matter: TTFT is timed from the
# actual send.
MIN_OFFERED_SHARE = 0.95


@dataclass
class Step:
    load: float  # multiple of the workload's rate
    rate: float  # requests/s offered
    summary: Summary
    verdicts: list[Verdict]
    replay_s: float
    results: list[RequestResult] = field(repr=False, default_factory=list)

    @property
    def offered_share(self) -> float:
        """Offered rate over scheduled rate: 1.0 when every request left on time."""
        if len(self.results) < 2:
            return 1.0
        sent = [r.sent_s for r in self.results]
        due = [r.scheduled_s for r in self.results]
        sent_span, due_span = max(sent) - min(sent), max(due) - min(due)
        if sent_span <= 0:
            return 1.0
        return min(due_span / sent_span, 1.0)

    @property
    def client_kept_up(self) -> bool:
        return self.offered_share >= MIN_OFFERED_SHARE

    @property
    def passed(self) -> bool:
        return all(v.holds for v in self.verdicts) and self.summary.failed == 0 and self.client_kept_up

    def to_json(self) -> dict[str, Any]:
        s = self.summary
        return {
            "load": self.load, "rate": self.rate, "passed": self.passed, "client_kept_up": self.client_kept_up,
            "offered_share": self.offered_share,
            "replay_s": self.replay_s,
            "completed": s.completed, "failed": s.failed, "request_throughput": s.request_throughput,
            "output_throughput": s.output_throughput, "goodput": s.goodput, "slo_attainment": s.slo_attainment,
            "ttft_p95": s.ttft.p95, "tpot_p95": s.tpot.p95, "e2e_p95": s.e2e.p95, "send_lag_p99": s.send_lag.p99,
            "slos": [v.to_json() for v in self.verdicts],
        }


@dataclass
class Outcome:
    argv: list[str]
    env: dict[str, str]
    failure: Failure | None = None
    engine_start_s: float = 0.0  # launch to healthy, or to the failure when it failed to start
    engine_stop_s: float = 0.0
    steps: list[Step] = field(default_factory=list)
    wall_s: float = 0.0
    log_paths: dict[str, Path] = field(default_factory=dict)
    stopped_early: bool = False  # on_step asked to stop (the pruner)
    requests_path: Path | None = None  # every step's per-request results (JSONL)

    @property
    def replay_s(self) -> float:
        return sum(s.replay_s for s in self.steps)

    @property
    def capacity(self) -> Step | None:
        """The highest-load step that met every SLO."""
        passed = [s for s in self.steps if s.passed]
        return max(passed, key=lambda s: s.load) if passed else None

    @property
    def capacity_rps(self) -> float:
        c = self.capacity
        return c.rate if c is not None else 0.0

    def judged_step(self) -> Step | None:
        """The step whose SLO verdicts stand for the trial: the capacity, else the lowest load tried."""
        if self.capacity is not None:
            return self.capacity
        return min(self.steps, key=lambda s: s.load) if self.steps else None


def next_load(steps: list[Step], start: float, max_steps: int, resolution: float) -> float | None:
    """The next load to try, or None when the capacity is known well enough (pure: testable)."""
    if len(steps) >= max_steps:
        return None
    if not steps:
        return start
    passed = [s.load for s in steps if s.passed]
    failed = [s.load for s in steps if not s.passed]
    hi_pass = max(passed) if passed else None
    lo_fail = min(failed) if failed else None
    if lo_fail is None:
        return hi_pass * 2
    if hi_pass is None:
        return lo_fail / 2
    if lo_fail / hi_pass <= resolution:
        return None
    return math.sqrt(hi_pass * lo_fail)


def measure_config(command: EngineCommand, args: EngineArgs, table: FlagTable,
                   workload_at: Callable[[float], Workload], slos: list[SLO], *, log_dir: Path,
                   startup_timeout: float, start_load: float = 1.0, max_steps: int = 4, resolution: float = 1.25,
                   replay: ReplayOptions = ReplayOptions(),
                   on_phase: Callable[[str], None] = lambda _: None,
                   on_step: Callable[[Outcome], bool] = lambda _: False) -> Outcome:
    """Start, step the load, stop. Engine failures are outcomes, not exceptions."""
    t0 = time.monotonic()
    spec = command.launch_spec(args, table, log_dir, startup_timeout)
    out = Outcome(argv=spec.argv, env=spec.env)
    engine = Engine(spec)
    out.log_paths = engine.log_paths
    try:
        on_phase("starting")
        try:
            engine.start()
        except EngineFailure as e:
            out.failure = e.failure
            out.engine_start_s = engine.failed_after_s or 0.0  # the engine's own time to fail
            return out
        out.engine_start_s = engine.ready_s or 0.0
        while (load := next_load(out.steps, start_load, max_steps, resolution)) is not None:
            workload = workload_at(load)
            on_phase(f"load step {len(out.steps) + 1}: {workload.rate:.2f} req/s")
            t = time.monotonic()
            options = replay if not out.steps else replace(replay, warmup_requests=0)  # warm once per engine
            rep, out.failure = replay_on(engine, workload, options)
            if rep is not None:
                summary = summarize(rep.results, slos)
                out.steps.append(Step(load, workload.rate, summary, summary.verdicts(slos), time.monotonic() - t,
                                      rep.results))
            if out.failure is not None:
                return out
            if on_step(out):
                out.stopped_early = True
                break
        return out
    finally:
        on_phase("stopping")
        engine.stop()
        out.engine_stop_s = engine.stop_s or 0.0
        out.wall_s = time.monotonic() - t0
        if out.steps:
            out.requests_path = log_dir / "requests.jsonl"
            with open(out.requests_path, "w") as f:
                for step in out.steps:
                    for r in step.results:
                        f.write(json.dumps({"load": step.load, **r.to_json()}) + "\n")
