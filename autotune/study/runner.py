"""A study, on Optuna: baselines, trials, constraints, artifacts, re-measurement (its storage and sampler:
study/storage.py; its advisor's part: study/advice.py).

What Optuna is told, per failure class:

    measured, SLOs hold at some load   COMPLETE, value = capacity (req/s), constraints <= 0
    measured, no load met the SLOs     COMPLETE, value = 0, constraints = how far the lowest load missed
    oom (engine, or the pre-check)     PRUNED: TPE treats pruned trials as a bad region; constraints = +1000
    crashed, startup-timeout           PRUNED, likewise (the config is the likely cause)
    stopped by the pruner              PRUNED, with the capacity reached so far as its last value
    invalid-args                       FAIL, and the study stops: a bug in the space, not a bad config
    port-in-use                        FAIL (TrialFailed): not the config's fault; samplers ignore FAIL trials
    a stop signal came meanwhile       FAIL (Interrupted), whatever the measurement made of it: a resumed
                                       study runs the trial's baseline again (``prepare``)

A stop (``autotune daemon`` stopping its tuning, systemd signalling the whole cgroup) may reach the
engine before it reaches us: the engine then reads as crashed, and a crashed baseline (PRUNED) counts
as done, so production's own config would never be measured again on resume. ``_raise_if_stopped``
after every measurement makes such a trial what it is: interrupted.

The capacity of a trial that meets no SLO is 0, below every trial that does, so optuna-dashboard's
"best" cannot pick it either.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import optuna
from optuna.artifacts import FileSystemArtifactStore, upload_artifact
from optuna.study import MaxTrialsCallback
from optuna.trial import FrozenTrial, TrialState

from autotune.engine import gpu, launcher
from autotune.engine.args import EngineArgs
from autotune.engine.command import CheckedArgs
from autotune.engine.failures import FailureClass
from autotune.engine.flags import FlagTable
from autotune.errors import ConfigError, Interrupted, TrialFailed
from autotune.measure.profiles import Ladder, LoadProfile, Race
from autotune.measure.replay import ReplayOptions
from autotune.measure.session import Outcome
from autotune.study.advice import Advice
from autotune.study.advisor import Advisor, AdvisorTarget, advisor_for
from autotune.study.baselines import BaselinePoint, baseline_points
from autotune.study.definition import StudyDefinition
from autotune.study.measurer import EngineMeasurer, Measurer
from autotune.study.notes import save_notes
from autotune.study.posterior import Posterior
from autotune.study.records import (
    NO_MEASUREMENT,
    Attr,
    Candidate,
    RaceRecord,
    Remeasurement,
    TrialRecord,
    baseline_attrs,
    config_evidence,
    judge,
    posterior_of,
)
from autotune.study.scoring import REMEASURE_RESOLUTION
from autotune.study.sidebyside import side_by_side_trials
from autotune.study.slots import Slots, study_gpus
from autotune.study.space import Space, default_space
from autotune.study.storage import TPE_STARTUP_TRIALS, shared_storage
from autotune.workload.source import LoadSteps

__all__ = ["StudyRun", "build_space", "devices_of", "advisor_target", "study_advisor"]

_PRUNED_CLASSES = {FailureClass.OOM, FailureClass.CRASHED, FailureClass.STARTUP_TIMEOUT}


def _raise_if_stopped() -> None:
    """Raise Interrupted when a stop signal came during the measurement that just ended: pending (an event
    loop ran when it came), or already raised once and lost on the way out of the measurement."""
    launcher.raise_if_interrupted()
    received = launcher.stop_received()
    if received is not None:
        raise Interrupted(received)


def devices_of(d: StudyDefinition) -> list[gpu.GpuInfo]:
    """The engine's GPUs: as the study declares them ([engine.gpu]), else as its command says (vllm-sim's
    --gpu), else what NVML sees here."""
    if d.gpus is not None:
        return list(d.gpus)
    declared = d.command.engine_kind.devices(d.command.command)
    return list(declared) if declared is not None else gpu.devices()


def build_space(d: StudyDefinition) -> Space:
    devices = devices_of(d)
    mem = devices[0].total_bytes / (1 << 30) if devices else 0.0
    kind = d.command.engine_kind
    params = (
        d.params if d.params is not None else default_space(kind, d.platform, mem, devices[0].name if devices else "")
    )
    shape = kind.shape(d.command.model)
    mml = d.fixed.values.get(kind.context_length) if kind.context_length else None
    return Space(params, d.platform, d.fixed, int(mml) if mml else (shape.max_position if shape else None), kind)


def advisor_target(d: StudyDefinition, steps: LoadSteps) -> AdvisorTarget:
    """What the study's advisor advises on: its model, hardware, load steps and SLOs."""
    kind = d.command.engine_kind
    return AdvisorTarget(
        d.command.model,
        kind.shape(d.command.model),
        d.platform,
        devices_of(d),
        steps,
        d.slos,
        d.name,
        fixed=dict(d.fixed.values),
        varied=frozenset(p.name for p in d.params or ()),
        study_file=d.source,
    )


def study_advisor(d: StudyDefinition, steps: LoadSteps) -> tuple[Advisor, str | None]:
    """The study's advisor, its engine kind's (where the study simulates first), or the do-nothing one and why."""
    if not d.objective.simulate_first:
        return Advisor(), "simulate_first = false"
    return advisor_for(d.command.engine_kind, advisor_target(d, steps))


@dataclass
class _Running:
    """A trial measuring its config now: a twin sampled meanwhile waits for ``event``."""

    number: int
    event: threading.Event = field(default_factory=threading.Event)


class StudyRun:
    """Runs one study definition to its budget, then re-measures and names the winner. ``measurer``: how a config
    is measured (study/measurer.py); ``advisor``: what the study may ask before it measures (study/advisor.py; the
    default advises nothing)."""

    def __init__(
        self,
        d: StudyDefinition,
        measurer: Measurer,
        steps: LoadSteps,
        show: Callable[[str], None] = lambda _: None,
        notice: Callable[[str], None] | None = None,
        advisor: Advisor | None = None,
    ) -> None:
        self.d, self.measurer, self.steps = d, measurer, steps
        self.space = build_space(d)
        self.scoring = d.objective.scoring()
        self.shape = d.command.engine_kind.shape(d.command.model)
        self.show = show  # the running trial's phase (engine starting, a load step): a progress display
        self.notice = notice or show  # what a person must read (a trial failed for a dead run, nothing left to do)
        self.store = FileSystemArtifactStore(str(self.artifact_dir))
        self.host = socket.gethostname()
        self.devices = devices_of(d)
        self.callbacks: list[Callable[[optuna.Study, FrozenTrial], None]] = []
        self.advice = Advice(
            advisor or Advisor(), self.space, steps, seed=d.seed, budget=d.budget.trials, notice=self._notice
        )
        self.slots = Slots(study_gpus(d.gpu_ids, d.fixed.env), d.command.port)
        self.lock = threading.RLock()  # trials beside each other: one at a time samples, learns, records
        self._in_flight: dict[str, _Running] = {}  # engine args (as stored) -> the trial measuring them

    @classmethod
    def on_engine(cls, d: StudyDefinition, table: FlagTable, steps: LoadSteps, **kw: Any) -> StudyRun:
        """A run that measures on the study's own engine command, its flags checked against ``table``."""
        measurer = EngineMeasurer(
            d.command,
            table,
            steps.at,
            d.slos,
            startup_timeout=d.startup_timeout_s,
            replay=ReplayOptions(workers=d.objective.replay_workers),
        )
        return cls(d, measurer, steps, **kw)

    def _notice(self, line: str) -> None:
        self.notice(line)  # late-bound: the CLI sets ``notice`` after construction, once its view is up

    @property
    def artifact_dir(self) -> Path:
        p = self.d.run_dir / "artifacts"
        p.mkdir(parents=True, exist_ok=True)
        return p

    @property
    def worker(self) -> str:
        """Who runs a trial: this host and process (several hosts may share a study)."""
        return f"{self.host}:{os.getpid()}"

    def interrupted_trial(self, study: optuna.Study) -> int | None:
        """The trial this process was in when a signal stopped it (None: between trials), failed if still RUNNING.

        Optuna fails a trial that a KeyboardInterrupt leaves; one the signal caught inside Optuna's own
        bookkeeping is failed here (or by the next run's ``prepare``).
        """
        mine = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(Attr.WORKER) == self.worker]
        last = max(mine, key=lambda t: t.number, default=None)
        if last is None or last.state not in (TrialState.FAIL, TrialState.RUNNING):
            return None
        if last.state is TrialState.RUNNING:
            with contextlib.suppress(RuntimeError, ValueError):  # still RUNNING: the next run's prepare fails it
                study.tell(last.number, state=TrialState.FAIL)
        return last.number

    # -- set-up --------------------------------------------------------------------------

    def prepare(self, study: optuna.Study) -> None:
        """Fail what a dead process left RUNNING (single host), saying so, and enqueue the baselines not yet run.

        On a shared database a RUNNING trial may be another host's, alive: heartbeats decide there.
        """
        if not shared_storage(self.d):
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                study.tell(t.number, state=TrialState.FAIL)
                self.notice(f"trial {t.number} was left running by an autotune run that died; marked failed")
        live = {TrialState.COMPLETE, TrialState.PRUNED, TrialState.WAITING, TrialState.RUNNING}
        done = {t.user_attrs.get(Attr.BASELINE) for t in study.get_trials(deepcopy=False) if t.state in live}
        extra = [(b.name, b.values) for b in self.d.baselines]
        # a bad flag (or trust_remote_code by any spelling) in the space or a baseline is an error now,
        # before any engine starts, not a failed trial
        self.measurer.check(self.space.engine_args(self.space.complete({})))
        baselines = [
            b
            for b in self._distinct(baseline_points(self.space, self.d.builtin_baselines, extra))
            if b.name not in done
        ]
        for b in baselines:
            self.measurer.check(self.space.engine_args(b.params, b.extra_args))
        queued: set[str] = set()
        if self.scoring.remeasured:  # in the order of its predictions, its picks among them
            queued = self.advice.queue_first(study, baselines)
        for b in baselines:
            if b.name not in queued:
                study.enqueue_trial(b.params, user_attrs=baseline_attrs(b))
        if shared_storage(self.d):
            self._dedupe_baselines(study)
        self.advice.queue_kept_picks(study)  # a resumed study whose baselines are done: its picks, if not queued yet

    def _distinct(self, points: list[BaselinePoint]) -> list[BaselinePoint]:
        """The baselines, less a built-in one that runs the same config as an earlier baseline or as one the study
        names (production's): on a 24-48 GB GPU vLLM's defaults are what Xinference 4.1 launches (its block_size 16
        is vLLM's own on CUDA), and one config measured twice under two names is GPU time for nothing. The study's
        own baselines are never dropped."""
        own = {b.name for b in self.d.baselines}
        # a knob the space does not search, given at the engine's own default, is the default config's
        defaults = {k: spec.get("default") for k, spec in self.space.engine.default_space(self.d.platform).items()}
        keys = [
            json.dumps(
                [b.params, {k: v for k, v in b.extra_args.items() if k not in defaults or defaults[k] != v}],
                sort_keys=True,
                default=str,
            )
            for b in points
        ]
        owned = {k: b.name for b, k in zip(points, keys, strict=True) if b.name in own}
        first: dict[str, str] = {}  # config -> the first baseline that runs it
        kept = []
        for b, k in zip(points, keys, strict=True):
            twin = None if b.name in own else owned.get(k) or first.get(k)
            first.setdefault(k, b.name)
            if twin is not None:
                self.notice(f"baseline {b.name} runs the same config as baseline {twin}: measured once, as {twin}")
                continue
            kept.append(b)
        return kept

    @staticmethod
    def _dedupe_baselines(study: optuna.Study) -> None:
        """Two hosts starting at once may both enqueue a baseline: keep the first, drop later waiting copies.

        Every host applies the same rule (the lowest trial number stays), so running it twice, or on
        two hosts at the same time, drops the same copies.
        """
        first: dict[str, int] = {}
        for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
            name = t.user_attrs.get(Attr.BASELINE)
            if not name or t.state == TrialState.FAIL:
                continue
            if name not in first:
                first[name] = t.number
            elif t.state == TrialState.WAITING:
                with contextlib.suppress(RuntimeError, ValueError):  # another host got there first, or started it
                    study.tell(t.number, state=TrialState.FAIL)

    # -- the objective -------------------------------------------------------------------

    def objective(self, trial: optuna.Trial) -> float | tuple[float, ...]:
        """One trial: its config checked, taken from a twin or pruned before launch where it can be, else measured
        on a slot of the study's GPUs and judged (the table at the top of this module). Beside other trials (a
        study on several GPUs) everything but the measurement runs under the study's lock."""
        t0 = time.monotonic()
        with self.lock:
            values = self.space.sample(trial)
            if not trial.user_attrs.get(Attr.BASELINE):
                values = self.advice.highest_that_starts(trial, values)
            args = self.space.engine_args(values, trial.user_attrs.get(Attr.BASELINE_ARGS) or {})
            config = self.measurer.check(args)  # ConfigError -> the study stops: a bug in the space
            if not trial.user_attrs.get(Attr.CHOSEN_BECAUSE):  # the simulator's picks say why when they are enqueued
                trial.set_user_attr(Attr.CHOSEN_BECAUSE, self._why(trial))
            shown = args.redacted(self.d.secret_env)  # user attrs are on the dashboard: no secret values
            key = json.dumps(shown.to_json(), sort_keys=True, default=str)
            sampled = not trial.user_attrs.get(Attr.BASELINE)
            twin = self._measured_twin(trial, shown.to_json()) if sampled else None
            running = self._in_flight.get(key) if sampled and twin is None else None
            mine = self._claim(key, trial.number) if twin is None and running is None else None
        if running is not None:  # measured beside us right now: its answer, not a second engine
            twin = self._await_twin(trial, running, shown.to_json())
            if twin is None:  # it ended without one: this trial measures the config
                with self.lock:
                    mine = self._claim(key, trial.number)
        if twin is not None:
            with self.lock:
                return self._as_measured(trial, twin, list(config.argv), shown)
        assert mine is not None
        try:
            with self.lock:
                self.advice.predict_trial(trial, args)
                self._record_config(trial, config, shown)
                label = trial.user_attrs.get(Attr.BASELINE) or "sampled"
                self.show(f"trial {trial.number} ({label}): " + " ".join(f"{k}={v}" for k, v in values.items()))
                self._precheck(trial, args)
                self._fits(trial, config)
                race = self._race(trial)
                profile = self._profile(trial, race)
            with self.slots.held(self.space.engine.gpus_per_engine(config.args.values), _raise_if_stopped) as slot:
                if self.parallel:
                    trial.set_user_attr(Attr.SLOT, {"gpus": list(slot.gpus), "port": slot.port})
                    trial.set_user_attr(Attr.ENV, {**shown.env, **slot.env})
                    self.show(f"trial {trial.number}: on {slot.label}, port {slot.port}")
                out = self.measurer.measure(
                    config,
                    profile,
                    log_dir=self.d.run_dir / "trials" / f"{trial.number:04d}",
                    on_phase=lambda ph: self.show(f"trial {trial.number}: {ph}"),
                    on_step=functools.partial(self._on_step, trial),
                    cut_lost_steps=self._cut_lost_steps,
                    slot=slot,
                )
        finally:
            self._release(key, mine)
        _raise_if_stopped()  # FAIL, not crashed/PRUNED: an interrupted baseline runs again on resume
        if self.parallel and out.argv:
            trial.set_user_attr(Attr.ARGV, list(out.argv))  # exactly what ran: the slot's port
        with self.lock:
            self._record_timing(trial, out, time.monotonic() - t0)
            self._upload(trial, out)
            return self._judge(trial, out, race)

    def _claim(self, key: str, number: int) -> _Running:
        """This trial measures ``key``'s config: a twin sampled meanwhile waits for it (a baseline that runs a config
        already in flight is measured anyway, and claims nothing). Called under the lock."""
        mine = _Running(number)
        self._in_flight.setdefault(key, mine)
        return mine

    def _release(self, key: str, mine: _Running) -> None:
        with self.lock:
            if self._in_flight.get(key) is mine:
                del self._in_flight[key]
        mine.event.set()

    def _await_twin(self, trial: optuna.Trial, running: _Running, engine_args: dict[str, Any]) -> FrozenTrial | None:
        """Wait for the trial measuring these engine args beside this one, and take its result (None: it ended
        without one, failed or interrupted, and this trial measures them itself)."""
        self.show(f"trial {trial.number}: the same config as trial {running.number}, which is measuring it: waiting")
        while not running.event.wait(0.25):
            _raise_if_stopped()
        for _ in range(200):  # its objective has returned; Optuna records its state a moment later
            if next(
                t for t in trial.study.get_trials(deepcopy=False) if t.number == running.number
            ).state.is_finished():
                break
            time.sleep(0.05)
        with self.lock:
            return self._measured_twin(trial, engine_args)

    def _fits(self, trial: optuna.Trial, config: CheckedArgs) -> None:
        """Prune, at 0 engine seconds, a config that needs more GPUs than the study has."""
        why = self.slots.unfit(self.space.engine.gpus_per_engine(config.args.values))
        if why is not None:
            self._record_failure(trial, "crashed", f"not started: {why}", "", engine_seconds=0.0)
            self.show(f"trial {trial.number}: pruned before launch: {why}")
            raise optuna.TrialPruned(why)

    def _record_config(self, trial: optuna.Trial, config: CheckedArgs, shown: EngineArgs) -> None:
        """What runs, and where: the dashboard's account of the trial before it measures."""
        trial.set_user_attr(Attr.ARGV, list(config.argv))
        trial.set_user_attr(Attr.ENV, dict(shown.env))
        trial.set_user_attr(Attr.ENGINE_ARGS, shown.to_json())
        trial.set_user_attr(Attr.HOST, self.host)
        trial.set_user_attr(Attr.WORKER, self.worker)
        trial.set_user_attr(Attr.GPUS, [f"{g.index}:{g.name}" for g in self.devices])
        trial.set_user_attr(Attr.ENGINE_GPUS, self.space.engine.gpus_per_engine(config.args.values))

    def _precheck(self, trial: optuna.Trial, args: EngineArgs) -> None:
        """Prune, at 0 engine seconds, a config the engine kind proves cannot start."""
        if not self.d.precheck or self.shape is None:
            return
        mem = self.devices[0].total_bytes if self.devices else None
        reason = self.space.engine.precheck(self.shape, args, self.d.platform, mem)
        if reason is not None:
            self._record_failure(trial, "oom", f"pre-check: {reason}", "", engine_seconds=0.0)
            trial.set_user_attr(Attr.PRECHECK, reason)
            self.show(f"trial {trial.number}: pruned before launch: {reason}")
            raise optuna.TrialPruned(reason)

    def _on_step(self, trial: optuna.Trial, out: Outcome) -> bool:
        """After each load step: its record, and the pruner's word (True: stop here)."""
        self._record_steps(trial, out)
        last = out.steps[-1]
        if last.cut:
            self.show(
                f"trial {trial.number}: the step at {last.rate:.2f} req/s stopped after "
                f"{len(last.results)} requests: {last.cut}"
            )
        if not self.scoring.prunable or trial.user_attrs.get(Attr.BASELINE):
            return False  # baselines are measured in full: every result is shown as a gain over them
        trial.report(out.capacity_rps, len(out.steps) - 1)
        return trial.should_prune()

    def _profile(self, trial: optuna.Trial, race: RaceRecord | None) -> LoadProfile:
        """The loads the trial is measured at: a race from the incumbent's capacity, a ladder from the advisor's
        guess, or the objective's own (pareto: one load, no ladder to start)."""
        objective = self.d.objective
        if race is not None:
            trial.set_user_attr(Attr.RACE, race.to_json())
            self.show(
                f"trial {trial.number}: races trial {race.incumbent}, starting at its capacity "
                f"{race.incumbent_rps:.2f} req/s"
            )
            return Race(race.start_load, objective.max_steps, objective.resolution)
        guess = self.advice.ladder_start(trial) if self.scoring.remeasured else None
        if guess is None:
            return self.scoring.profile()
        trial.set_user_attr(Attr.LADDER_START_RPS, guess)
        return Ladder(guess / self.steps.base.rate, objective.max_steps, objective.resolution, gallop=True)

    def _judge(self, trial: optuna.Trial, out: Outcome, race: RaceRecord | None) -> float | tuple[float, ...]:
        """The trial's value, or the pruning or failure its measurement means."""
        if race is not None and out.failure is None and Race.lost([(st.load, st.passed) for st in out.steps]):
            lost_at = out.steps[0].rate  # its steps and constraints are recorded already, by _on_step
            trial.set_user_attr(Attr.RACE, race.ended(lost=True, missed_at_rps=lost_at).to_json())
            self.show(
                f"trial {trial.number}: lost the race: missed the SLOs at {lost_at:.2f} req/s, where trial "
                f"{race.incumbent} holds them"
            )
            raise optuna.TrialPruned(f"raced trial {race.incumbent}: missed the SLOs at {lost_at:.2f} req/s")
        if out.stopped_early:
            self.show(f"trial {trial.number}: pruned at {out.capacity_rps:.2f} req/s after {len(out.steps)} steps")
            raise optuna.TrialPruned(f"capacity {out.capacity_rps:.2f} req/s after {len(out.steps)} steps")
        if out.failure is not None:
            self._failed(trial, out)
        self._record_steps(trial, out)  # the final constraints and capacity
        if race is not None:
            trial.set_user_attr(Attr.RACE, race.ended(lost=False).to_json())
        cap = out.capacity
        trial.set_user_attr(Attr.CAPACITY_OUTPUT_TOK_S, cap.summary.output_throughput if cap else 0.0)
        self.show(f"trial {trial.number}: capacity {out.capacity_rps:.2f} req/s")
        return self.scoring.value(out)

    def _failed(self, trial: optuna.Trial, out: Outcome) -> NoReturn:
        """Record an engine failure and raise what it tells Optuna: pruned, failed, or the study stops."""
        assert out.failure is not None
        f = out.failure
        self._record_failure(trial, f.failure_class.value, f.summary, f.excerpt, out.engine_start_s)
        self.show(f"trial {trial.number}: {f.failure_class.value}: {f.summary}")
        if f.failure_class is FailureClass.INVALID_ARGS:
            engine = self.space.engine.display_name
            raise ConfigError(
                f"{engine} rejected trial {trial.number}'s args ({f.summary}); the space allows a "
                f"config {engine} refuses: fix the space (argv in the trial's user attrs)"
            )
        if f.failure_class is FailureClass.OOM:
            self.advice.ran_out_of_memory(trial)
        if f.failure_class in _PRUNED_CLASSES:
            raise optuna.TrialPruned(f"{f.failure_class.value}: {f.summary}")
        raise TrialFailed(f"{f.failure_class.value}: {f.summary}")  # FAIL: not the config's fault

    @staticmethod
    def _measured_twin(trial: optuna.Trial, engine_args: dict[str, Any]) -> FrozenTrial | None:
        """The earlier finished trial that ran exactly these engine args, or None. TPE samples values the
        utilization rule and vLLM's rules move onto a config already measured (two utilizations that both run at
        the highest that starts are one config); measuring it again is minutes of GPU for an answer the study has
        (the re-measurement, not a second trial, is what deals with noise)."""
        done = trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        return next(
            (
                t
                for t in done
                if t.user_attrs.get(Attr.ENGINE_ARGS) == engine_args and Attr.SAME_CONFIG_AS not in t.user_attrs
            ),
            None,
        )

    def _as_measured(
        self, trial: optuna.Trial, twin: FrozenTrial, argv: list[str], shown: EngineArgs
    ) -> float | tuple[float, ...]:
        """This trial takes its twin's result (no engine starts): its value, constraints and capacity, or its
        pruning, with ``same_config_as`` saying whose."""
        trial.set_user_attr(Attr.SAME_CONFIG_AS, twin.number)
        trial.set_user_attr(Attr.ARGV, argv)
        trial.set_user_attr(Attr.ENGINE_ARGS, shown.to_json())
        for key in (
            Attr.CONSTRAINTS,
            Attr.CAPACITY_RPS,
            Attr.CAPACITY_OUTPUT_TOK_S,
            Attr.FAILURE_CLASS,
            Attr.FAILURE,
            Attr.FAILURE_EXCERPT,
            Attr.PRECHECK,
        ):
            if key in twin.user_attrs:
                trial.set_user_attr(key, twin.user_attrs[key])
        if Attr.FAILURE_CLASS in twin.user_attrs:
            trial.set_user_attr(Attr.FAILURE_ENGINE_SECONDS, 0.0)  # this trial's: no engine ran
        self.show(f"trial {trial.number}: the same config as trial {twin.number}, which measured it: not run again")
        if twin.state == TrialState.PRUNED:
            raise optuna.TrialPruned(f"the same config as trial {twin.number}, pruned")
        return tuple(twin.values) if len(twin.values) > 1 else twin.values[0]

    def _race(self, trial: optuna.Trial) -> RaceRecord | None:
        """The incumbent a sampled trial races (the feasible trial with the best capacity so far, baselines
        included), or None: baselines and the first trials are measured in full, and so is every trial of a
        study with ``race = false`` or an objective with no single winner."""
        if not self.d.objective.race or not self.scoring.remeasured or trial.user_attrs.get(Attr.BASELINE):
            return None
        done = [TrialRecord.of(t) for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
        best = max(
            (r for r in done if r.feasible and r.values and r.values[0] > 0), key=lambda r: r.values[0], default=None
        )
        base_rate = self.steps.base.rate
        if best is None or not base_rate > 0:
            return None
        return RaceRecord(best.number, best.values[0], start_load=best.values[0] / base_rate)

    def _why(self, trial: optuna.Trial) -> str:
        """Why this config runs now, in the words the console and the dashboard show."""
        name = trial.user_attrs.get(Attr.BASELINE)
        if name:
            return f"baseline {name}"
        if self.d.sampler == "random":
            return "random search"
        finished = len(trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
        if self.d.sampler == "tpe" and finished < TPE_STARTUP_TRIALS:
            return f"random: TPE explores its first {TPE_STARTUP_TRIALS} trials"
        return f"{self.d.sampler.upper()}: the most expected improvement"

    def _record_steps(self, trial: optuna.Trial, out: Outcome) -> None:
        trial.set_user_attr(Attr.STEPS, [s.to_json() for s in out.steps])
        judged = out.judged_step()
        if judged is not None:
            trial.set_user_attr(
                Attr.CONSTRAINTS,
                [v.violation if math.isfinite(v.violation) else NO_MEASUREMENT for v in judged.verdicts] or [0.0],
            )
            trial.set_user_attr(Attr.CAPACITY_RPS, out.capacity_rps)

    def _record_failure(self, trial: optuna.Trial, cls: str, summary: str, excerpt: str, engine_seconds: float) -> None:
        trial.set_user_attr(Attr.FAILURE_CLASS, cls)
        trial.set_user_attr(Attr.FAILURE, summary[:2000])
        trial.set_user_attr(Attr.FAILURE_EXCERPT, excerpt[-6000:])
        trial.set_user_attr(Attr.FAILURE_ENGINE_SECONDS, engine_seconds)
        trial.set_user_attr(Attr.CONSTRAINTS, [NO_MEASUREMENT] * max(len(self.d.slos), 1))
        trial.set_user_attr(Attr.CAPACITY_RPS, 0.0)

    @property
    def _cut_lost_steps(self) -> bool:
        """Stop a load step once it cannot pass (the measurer's ``cut_lost_steps``): its failure is all a capacity
        search needs. Not where the study says so, nor where the objective reads the step's numbers (pareto), nor
        where the simulator refits to this study's steps: a cut step's numbers are its first requests only, left
        out of a fit, and the saturated steps are what a fit learns capacity from."""
        return self.d.objective.cut_lost_steps and self.scoring.cuts_lost_steps and not self.advice.learning

    def _record_timing(self, trial: optuna.Trial, out: Outcome, wall: float) -> None:
        trial.set_user_attr(Attr.ENGINE_START_S, out.engine_start_s)
        trial.set_user_attr(Attr.ENGINE_STOP_S, out.engine_stop_s)
        trial.set_user_attr(Attr.REPLAY_S, out.replay_s)
        trial.set_user_attr(Attr.TRIAL_WALL_S, wall)

    def _upload(self, trial: optuna.Trial, out: Outcome) -> None:
        for path in out.log_paths.values():
            if path.exists():
                upload_artifact(
                    study_or_trial=trial, file_path=str(path), artifact_store=self.store, mimetype="text/plain"
                )
        if out.requests_path is not None:
            upload_artifact(
                study_or_trial=trial,
                file_path=str(out.requests_path),
                artifact_store=self.store,
                mimetype="application/x-ndjson",
            )

    # -- running ---------------------------------------------------------------------------

    def remaining(self, study: optuna.Study) -> int | None:
        if self.d.budget.trials is None:
            return None
        finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        return max(self.d.budget.trials - len(finished), 0)

    def optimize(self, study: optuna.Study) -> None:
        self.prepare(study)
        n = self.remaining(study)
        if n == 0:
            self.notice(f"study {self.d.name}: budget of {self.d.budget.trials} trials already spent")
            return
        callbacks = self.trial_callbacks()
        if self.parallel:
            self.notice(
                f"up to {self.concurrency} trials at once on GPUs {','.join(map(str, self.slots.gpus))}, each on GPUs "
                "of its own"
            )
            side_by_side_trials(self, study, n, self.concurrency, self.d.budget.timeout_s, callbacks)
            return
        if self.d.budget.trials is not None:  # other hosts count too: stop when the study as a whole is done
            callbacks.append(MaxTrialsCallback(self.d.budget.trials, states=(TrialState.COMPLETE, TrialState.PRUNED)))
        study.optimize(
            self.objective, n_trials=n, timeout=self.d.budget.timeout_s, catch=(TrialFailed,), callbacks=callbacks
        )

    def trial_callbacks(self) -> list[Callable[[optuna.Study, FrozenTrial], None]]:
        """What runs after every trial: the console's trial line (``callbacks``) before what the simulator learns."""
        return [self._notes, self.advice.queue_kept_picks, *self.callbacks, self._learn]

    @functools.cached_property
    def concurrency(self) -> int:
        """How many trials run at once: as many of the space's narrowest engines as the study's GPUs hold."""
        points = [self.space.engine_args(self.space.complete(p)).values for p in self.space.candidates()]
        narrowest = min((self.space.engine.gpus_per_engine(v) for v in points), default=1)
        return min(self.slots.concurrency(narrowest), self.d.budget.trials or 1 << 30)

    @property
    def parallel(self) -> bool:
        return self.concurrency > 1

    def _phase(self, what: str, phase: str) -> None:
        self.show(f"{what}: {phase}")

    def _learn(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.advice.after_trial(study, trial, self.remaining(study))

    def _notes(self, study: optuna.Study, _: FrozenTrial) -> None:
        save_notes(study, [s.text for s in self.d.slos])

    @staticmethod
    def _next_run(post: Posterior, pick: int, measured: list[int]) -> int:
        """The candidate to run next: the recommended one (``pick``) or the challenger ``post`` gives the most
        chance of beating it, whichever has fewer measurements (the recommended one on a tie)."""
        others = [i for i in range(len(measured)) if i != pick]
        if not others:
            return pick
        challenger = max(others, key=lambda i: post.p_better(i, pick))
        return challenger if measured[challenger] < measured[pick] else pick

    @classmethod
    def _next_runs(cls, post: Posterior, pick: int, measured: list[int], width: int) -> list[int]:
        """Up to ``width`` distinct candidates to run at once: ``_next_run``'s first, then the recommended one, then
        the challengers by their chance of beating it."""
        first = cls._next_run(post, pick, measured)
        rest = sorted(
            (i for i in range(len(measured)) if i != first), key=lambda i: (i != pick, -post.p_better(i, pick))
        )
        return [first, *rest][: max(width, 1)]

    def _remeasure_run(self, c: Candidate, run: int, budget: int) -> Outcome:
        """One re-measurement run of ``c``, on a slot of the study's GPUs."""
        self.show(f"re-measuring {c.label} (run {run} of at most {budget})")
        config = self.measurer.check(c.args)
        with self.slots.held(self.space.engine.gpus_per_engine(config.args.values), _raise_if_stopped) as slot:
            out = self.measurer.measure(
                config,
                self.scoring.remeasure_profile(c.trial_load),
                log_dir=self.d.run_dir / "remeasure" / f"{c.trial_number:04d}-{len(c.capacities)}",
                on_phase=functools.partial(self._phase, f"re-measuring {c.label}"),
                cut_lost_steps=self._cut_lost_steps,
                slot=slot,
            )
        _raise_if_stopped()  # no verdict from an engine the stop killed
        return out

    def side_by_side(self, runs: Sequence[Callable[[], Outcome]]) -> list[Outcome]:
        """``runs`` at once, each in a thread of its own; their outcomes in their order. A benchmark in virtual time
        replaces it (scripts/bench_parallel.py)."""
        if len(runs) == 1:
            return [runs[0]()]
        with ThreadPoolExecutor(len(runs), thread_name_prefix="remeasure") as pool:
            return list(pool.map(lambda run: run(), runs))

    def remeasure(self, study: optuna.Study) -> Remeasurement | None:
        """Re-measure the top candidates and the best baseline until the posterior of their capacities knows the
        verdict: P(the config it recommends is within 95 % of the best) reaches [remeasure] confidence, or each has
        had ``repeats`` runs. Each run goes to the recommended config or its strongest challenger, whichever has
        fewer measurements; the recommended one is measured at least twice in all (the search picked it for a high
        measurement, which may have been luck)."""
        done = [r for r in map(TrialRecord.of, study.get_trials(deepcopy=False)) if r.feasible]
        sampled = sorted((r for r in done if not r.baseline and r.same_config_as is None), key=lambda r: -r.values[0])
        baselines = sorted((r for r in done if r.baseline), key=lambda r: -r.values[0])
        if not baselines:  # a gain is read against a baseline
            self.notice(
                "not re-measured: no baseline held the SLOs, so there is no gain to read; "
                "the best config stands on its trial's one measurement"
            )
            return None
        picks = [(f"trial {r.number}", r) for r in sampled[: self.d.remeasure_top]]
        picks.append((f"baseline {baselines[0].baseline}", baselines[0]))
        base_rate = self.steps.base.rate
        cands = [
            Candidate(
                label,
                r.number,
                r.engine_args.revealed(self.d.fixed.env),
                trial_load=r.values[0] / base_rate,
                evidence=config_evidence(done, r),
            )
            for label, r in picks
        ]
        budget = self.d.remeasure_repeats * len(cands)
        confidence = self.d.remeasure_confidence
        self.notice(
            f"re-measuring {', '.join(c.label for c in cands)}, each from its trial's capacity in steps of "
            f"{REMEASURE_RESOLUTION:g}x, until P(the config recommended is within 95 % of the best) reaches "
            f"{confidence:g}, at most {budget} runs"
        )
        n = 0  # runs so far
        while n < budget:
            post = posterior_of(cands)
            verdict = judge(cands, len(study.trials), confidence=confidence, post=post)
            pick = next(i for i, c in enumerate(cands) if c.trial_number == verdict.recommended_trial)
            measured = [len(c.brackets(REMEASURE_RESOLUTION)) for c in cands]
            if verdict.p_within is not None and verdict.p_within >= confidence and measured[pick] >= 2:
                self.notice(f"re-measured enough after {n} run{'s' if n != 1 else ''}: {verdict.sentence()}")
                break
            batch = [cands[i] for i in self._next_runs(post, pick, measured, min(self.concurrency, budget - n))]
            runs = [functools.partial(self._remeasure_run, c, n + k + 1, budget) for k, c in enumerate(batch)]
            for k, (c, out) in enumerate(zip(batch, self.side_by_side(runs), strict=True)):
                c.capacities.append(out.capacity_rps)
                c.runs.append([s.record() for s in out.steps])
                self.notice(f"re-measured {c.label} (run {n + k + 1}): {out.capacity_rps:.2f} req/s")
            n += len(batch)
        else:  # the budget ran out: the verdict reads the last run too
            verdict = judge(cands, len(study.trials), confidence=confidence)
        study.set_user_attr(Attr.REMEASURE, verdict.to_json())
        save_notes(study, [s.text for s in self.d.slos])
        return verdict
