"""One measurement session: (start the engine,) replay the workload at the loads a profile picks, (stop).

Every measurement autotune makes is one of these: ``autotune bench`` (an engine, one load),
a study trial and its re-measurement (an engine, the load ladder), ``autotune replay`` and
the publish canary (a server someone else runs, one load).

``workload_at(load)`` gives the requests of one step (workload.source.LoadSteps gives the
same duration at every load, so each step measures a steady state rather than a burst).
After each step ``on_step`` sees the outcome so far and may answer True to stop there
(Optuna's pruner does, for a hopeless trial). Engine failures are outcomes, never raises:
the caller decides what a failure means.

Throughput only means something at saturation, so the score of a session is its
*capacity*: the highest load at which every SLO held (``Outcome.capacity``).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from autotune import __version__
from autotune.engine.command import CheckedArgs, EngineCommand
from autotune.engine.failures import Failure
from autotune.engine.launcher import Engine, raise_if_stopping, stop_received
from autotune.errors import EngineFailure, MeasurementError
from autotune.measure.metrics import RequestResult, Summary, lost_already, summarize
from autotune.measure.profiles import FixedLoad, LoadProfile
from autotune.measure.replay import CLIENT_LAG_S, GiveUp, Replay, ReplayOptions, keep_workers, run_replay
from autotune.measure.slo import SLO, Verdict
from autotune.workload.trace import Workload

__all__ = [
    "Step",
    "StepRecord",
    "Outcome",
    "measure_engine",
    "measure_url",
    "replay_on",
    "MIN_OFFERED_SHARE",
    "client_lag_bound",
    "OnPhase",
]

OnPhase = Callable[[str], None]  # hears "starting", "load step N: R req/s", "stopping"
OnResult = Callable[[RequestResult], None]

# A step only counts when the client really offered its load: if the replay itself fell behind
# its schedule (sends spread over a longer span than scheduled), the engine was not tested at
# that load. A brief stall that the client makes up for does not matter: TTFT is timed from the
# actual send.
MIN_OFFERED_SHARE = 0.95
# A miss only bounds a capacity when the client timed the server, not itself: its event loops' lag (p99) within
# CLIENT_LAG_S, or within this share of the tightest target a late read moves, where that is looser.
LAG_SHARE_OF_TARGET = 0.1
# A read late by L moves a TTFT, an E2E or a gap between tokens by L; a TPOT by L / (tokens - 1), and a rate
# hardly at all (a late send shows in Step.offered_share instead).
_MOVED_BY_LAG = ("ttft", "e2e", "itl")


def client_lag_bound(slos: list[SLO]) -> float:
    """The client lag (s, p99) past which a step's outcome is partly the client's own (``Step.client_bound``):
    none (infinite) where no SLO is one a late read moves."""
    targets = [s.target for s in slos if s.metric in _MOVED_BY_LAG]
    return max(CLIENT_LAG_S, LAG_SHARE_OF_TARGET * min(targets)) if targets else math.inf


# the defaults of measure_engine() and measure_url() (frozen, so one instance serves every call)
_DEFAULT_REPLAY = ReplayOptions()
_ONE_LOAD = FixedLoad()


@dataclass
class Step:
    load: float  # multiple of the workload's rate
    rate: float  # requests/s offered
    summary: Summary
    verdicts: list[Verdict]
    replay_s: float
    results: list[RequestResult] = field(repr=False, default_factory=list)
    model: str = ""  # the served model name the replay used
    warmup_s: float = 0.0
    measured_s: float = 0.0  # the replay's own duration, warm-up excluded
    cut: str = ""  # why the step was stopped before its last request: it had already failed (metrics.lost_already)
    client_lag_p99: float | None = None  # how late the replay's event loops ran (Replay.loop_lag), seconds
    client_lag_bound: float = CLIENT_LAG_S  # client_lag_bound(the step's SLOs)
    workers: int = 1  # the replay's worker processes

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
        """The client offered the load on time and timed it without lag of its own: a miss here is the server's."""
        return self.offered_share >= MIN_OFFERED_SHARE and not self.client_bound

    @property
    def client_bound(self) -> bool:
        """The client's own lag was past its bound: latencies it measured are partly its own, so a miss bounds
        nothing (a pass still counts: the server's own latencies were lower still)."""
        return (self.client_lag_p99 or 0.0) > self.client_lag_bound

    @property
    def slos_hold(self) -> bool:
        return all(v.holds for v in self.verdicts)

    @property
    def passed(self) -> bool:
        """The step counts toward capacity: every SLO held, no request failed, the load was really offered."""
        return self.slos_hold and self.summary.failed == 0 and self.offered_share >= MIN_OFFERED_SHARE

    def record(self) -> StepRecord:
        s = self.summary
        return StepRecord(
            load=self.load,
            rate=self.rate,
            passed=self.passed,
            client_kept_up=self.client_kept_up,
            offered_share=self.offered_share,
            replay_s=self.replay_s,
            cut=self.cut,
            completed=s.completed,
            failed=s.failed,
            request_throughput=s.request_throughput,
            output_throughput=s.output_throughput,
            goodput=s.goodput,
            slo_attainment=s.slo_attainment,
            ttft_p95=s.ttft.p95,
            tpot_p95=s.tpot.p95,
            e2e_p95=s.e2e.p95,
            send_lag_p99=s.send_lag.p99,
            client_lag_p99=self.client_lag_p99,
            slos=[v.to_json() for v in self.verdicts],
        )

    def to_json(self) -> dict[str, Any]:
        return self.record().to_json()


@dataclass(frozen=True)
class StepRecord:
    """A load step as a study stores it (a trial's ``steps``, a re-measurement's runs) and reads it back."""

    load: float  # multiple of the workload's rate
    rate: float  # requests/s offered
    passed: bool  # counts toward capacity (Step.passed)
    client_kept_up: bool = True  # False: the load was not really offered, so a miss bounds nothing
    offered_share: float = 1.0
    replay_s: float = 0.0
    cut: str = ""
    completed: int = 0
    failed: int = 0
    request_throughput: float = 0.0
    output_throughput: float = 0.0
    goodput: float = 0.0
    slo_attainment: float = 0.0
    ttft_p95: float | None = None
    tpot_p95: float | None = None
    e2e_p95: float | None = None
    send_lag_p99: float | None = None
    client_lag_p99: float | None = None  # the replay's own event-loop lag (Step.client_lag_p99)
    slos: list[dict[str, Any]] = field(default_factory=list)  # each SLO's Verdict.to_json()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> StepRecord:
        """Read back what ``to_json`` wrote; keys it does not know are left out, missing ones take defaults."""
        return cls(**{k: raw[k] for k in _STEP_KEYS if k in raw})


_STEP_KEYS = frozenset(f.name for f in fields(StepRecord))


@dataclass
class Outcome:
    url: str
    argv: list[str] = field(default_factory=list)  # empty for a server someone else runs
    env: dict[str, str] = field(default_factory=dict)  # secret-looking names redacted: what --json shows
    started_at: float = 0.0  # wall clock
    failure: Failure | None = None
    engine_ready_s: float | None = None  # launch to healthy (None: never healthy, or not ours)
    engine_failed_after_s: float | None = None  # launch to the failure, when it failed to start
    engine_stop_s: float = 0.0
    steps: list[Step] = field(default_factory=list)
    wall_s: float = 0.0
    log_paths: dict[str, Path] = field(default_factory=dict)
    stopped_early: bool = False  # on_step asked to stop (the pruner)
    requests_path: Path | None = None  # every step's per-request results (JSONL)

    @property
    def engine_start_s(self) -> float:
        """What starting the engine cost: to healthy, or to the failure."""
        return self.engine_ready_s or self.engine_failed_after_s or 0.0

    @property
    def replay_s(self) -> float:
        return sum(s.replay_s for s in self.steps)

    @property
    def last(self) -> Step | None:
        return self.steps[-1] if self.steps else None

    @property
    def slos_hold(self) -> bool:
        """A single-load session's verdict: the engine lived and every SLO held."""
        return self.failure is None and self.last is not None and self.last.slos_hold

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
        """The step whose SLO verdicts stand for the session: the capacity, else the lowest load tried."""
        if self.capacity is not None:
            return self.capacity
        return min(self.steps, key=lambda s: s.load) if self.steps else None

    def to_json(self) -> dict[str, Any]:
        """The single-load result, as ``autotune bench/replay --json`` write it."""
        last = self.last
        return {
            "autotune_version": __version__,
            "url": self.url,
            "argv": self.argv,
            "env": self.env,
            "started_at": self.started_at,
            "failure": None if self.failure is None else self.failure.to_json(),
            "failure_class": None if self.failure is None else self.failure.failure_class.value,
            "engine_start_s": self.engine_ready_s,
            "engine_stop_s": self.engine_stop_s if self.argv else None,
            "model": last.model if last else None,
            "replay_s": last.measured_s if last else None,
            "warmup_s": last.warmup_s if last else None,
            "metrics": None if last is None else last.summary.to_json(),
            "slos": [v.to_json() for v in last.verdicts] if last else [],
            "slos_hold": self.slos_hold,
        }

    def requests_json(self) -> list[dict[str, Any]]:
        return [r.to_json() for s in self.steps for r in s.results]


def _or_stopping(give_up: GiveUp | None) -> GiveUp:
    """``give_up``, and a cut as soon as a stop signal came (engine.launcher.raise_if_stopping)."""

    def ask(results: list[RequestResult], total: int, now: float) -> str | None:
        if stop_received() is not None:
            return "a stop signal came"
        return give_up(results, total, now) if give_up is not None else None

    return ask


def replay_on(
    engine: Engine,
    workload: Workload,
    options: ReplayOptions,
    on_result: OnResult | None = None,
    give_up: GiveUp | None = None,
) -> tuple[Replay | None, Failure | None]:
    """Replay against a running engine; (replay, None), or (what was measured, why the engine died)."""
    try:
        replay = run_replay(engine.url, workload, options, on_result, give_up)
    except MeasurementError:
        failure = engine.check()
        if failure is None:
            raise
        return None, failure  # the engine died: that is the result, not a measurement problem
    return replay, engine.check()  # did it die under load?


def _step(load: float, workload: Workload, replay: Replay, slos: list[SLO], seconds: float) -> Step:
    summary = summarize(replay.results, slos)
    return Step(
        load,
        workload.load_rate,
        summary,
        summary.verdicts(slos),
        seconds,
        replay.results,
        replay.model,
        replay.warmup_s,
        replay.wall_s,
        replay.cut,
        replay.loop_lag.p99,
        client_lag_bound(slos),
        replay.workers,
    )


def _run_steps(
    out: Outcome,
    replay_at: Callable[[Workload, ReplayOptions], tuple[Replay | None, Failure | None]],
    workload_at: Callable[[float], Workload],
    slos: list[SLO],
    profile: LoadProfile,
    options: ReplayOptions,
    on_phase: OnPhase,
    on_step: Callable[[Outcome], bool],
) -> None:
    while (load := profile.next_load([(s.load, s.passed) for s in out.steps])) is not None:
        workload = workload_at(load)
        on_phase(f"load step {len(out.steps) + 1}: {workload.load_rate:.2f} req/s")
        t = time.monotonic()
        step_options = options if not out.steps else replace(options, warmup_requests=0)  # warm once per engine
        replay, out.failure = replay_at(workload, step_options)
        if replay is not None:
            out.steps.append(_step(load, workload, replay, slos, time.monotonic() - t))
        if out.failure is not None:
            return
        if on_step(out):
            out.stopped_early = True
            return


def measure_engine(
    command: EngineCommand,
    checked: CheckedArgs,
    workload_at: Callable[[float], Workload],
    slos: list[SLO],
    profile: LoadProfile,
    *,
    log_dir: Path,
    startup_timeout: float = 900.0,
    replay: ReplayOptions = _DEFAULT_REPLAY,
    requests_file: Path | None = None,
    on_phase: OnPhase = lambda _: None,
    on_step: Callable[[Outcome], bool] = lambda _: False,
    on_result: OnResult | None = None,
    cut_lost_steps: bool = False,
) -> Outcome:
    """Start the engine with ``checked`` (EngineCommand.check), step the load, stop it.

    ``cut_lost_steps``: stop a load step as soon as it cannot pass any more (a failed request, a TTFT or E2E SLO
    missed whatever the rest does: metrics.lost_already), for a search that only needs to know it failed; the
    step's numbers are then those of its requests so far, and ``Step.cut`` says why."""
    t0 = time.monotonic()
    spec = command.launch_spec(checked, log_dir, startup_timeout)
    out = Outcome(url=spec.url, argv=spec.argv, env=dict(checked.args.redacted().env), started_at=time.time())
    engine = Engine(spec)
    out.log_paths = engine.log_paths
    try:
        on_phase("starting")
        try:
            engine.start()
        except EngineFailure as e:
            out.failure = e.failure
            out.engine_failed_after_s = engine.failed_after_s or 0.0  # the engine's own time to fail
            return out
        out.engine_ready_s = engine.ready_s or 0.0
        give_up = (lambda results, total, now: lost_already(slos, results, total, now)) if cut_lost_steps else None
        if threading.current_thread() is not threading.main_thread():
            give_up = _or_stopping(give_up)

        def replay_step(w: Workload, o: ReplayOptions) -> tuple[Replay | None, Failure | None]:
            measured = replay_on(engine, w, o, on_result, give_up)
            raise_if_stopping()  # a trial beside others: its step was cut by the signal; no result from it
            return measured

        with keep_workers():  # every step's replay on the same worker processes, if it needs any
            _run_steps(out, replay_step, workload_at, slos, profile, replay, on_phase, on_step)
        return out
    finally:
        on_phase("stopping")
        engine.stop()
        out.engine_stop_s = engine.stop_s or 0.0
        out.wall_s = time.monotonic() - t0
        if out.steps and requests_file is not None:
            out.requests_path = requests_file
            with open(requests_file, "w") as f:
                for step in out.steps:
                    for r in step.results:
                        f.write(json.dumps({"load": step.load, **r.to_json()}) + "\n")


def measure_url(
    url: str,
    workload_at: Callable[[float], Workload],
    slos: list[SLO],
    options: ReplayOptions = _DEFAULT_REPLAY,
    profile: LoadProfile = _ONE_LOAD,
    *,
    on_result: OnResult | None = None,
) -> Outcome:
    """Replay against a server someone else runs (MeasurementError when nothing could be measured)."""
    t0 = time.monotonic()
    out = Outcome(url=url, started_at=time.time())
    with keep_workers():
        _run_steps(
            out,
            lambda w, o: (run_replay(url, w, o, on_result), None),
            workload_at,
            slos,
            profile,
            options,
            lambda _: None,
            lambda _: False,
        )
    out.wall_s = time.monotonic() - t0
    return out
