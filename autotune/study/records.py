"""What a study stores, read and written through one set of types.

A trial's facts live in Optuna as user attrs (so the dashboard shows them without our code);
``Attr`` names every key once (Optuna's own habit: one constant per stored key), the runner
writes through it, and everyone else reads a ``TrialRecord``. The study's verdict lives in the
study's user attrs as a ``Remeasurement``. ``StudyResult`` is what a finished study means:
its records, its winner (the re-measured one if the verdict is fresh, else Optuna's best with
the constraints respected), its Pareto front. The CLI, the report and the daemon read only this.

Feasible means: the trial completed and every constraint (SLO violation) is <= 0. A trial
with no constraints recorded never measured anything and is not feasible.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.engine.args import EngineArgs
from autotune.measure.session import StepRecord
from autotune.study.baselines import BaselinePoint
from autotune.study.posterior import Bracket, Posterior
from autotune.study.scoring import CONFIDENCE, REMEASURE_RESOLUTION

__all__ = [
    "Attr",
    "NO_MEASUREMENT",
    "TrialRecord",
    "RaceRecord",
    "StepRecord",
    "Candidate",
    "Remeasurement",
    "StudyResult",
    "constraints_of",
    "held_every_load",
    "judge",
    "step_share",
]

NO_MEASUREMENT = 1000.0  # the constraint value of a trial that never got to measure (1000x over target)


class Attr:
    """The user-attr keys of a trial, and of a study (those marked "study attr")."""

    ARGV = "argv"  # the exact command line that ran
    ENV = "env"  # the engine's environment (names and values)
    ENGINE_ARGS = "engine_args"  # EngineArgs.to_json(): what ran, the space's rules applied
    ENGINE_GPUS = "engine_gpus"  # the GPUs the engine held (EngineKind.gpus_per_engine)
    HOST = "host"
    WORKER = "worker"  # host:pid of the worker that ran it (several hosts share a study)
    GPUS = "gpus"
    SLOT = "slot"  # where the engine ran beside other trials: {"gpus": NVML indices, "port": its port}
    BASELINE = "baseline"  # the baseline's name; absent for a sampled trial
    BASELINE_ARGS = "baseline_args"  # a baseline's values for knobs the space does not search
    BASELINE_NOTES = "baseline_notes"
    CHOSEN_BECAUSE = "chosen_because"  # why this config was tried: a baseline, TPE's start-up, TPE, a rerun
    PRECHECK = "precheck"  # why the pre-check pruned it, before launch
    FAILURE_CLASS = "failure_class"  # oom, crashed, startup-timeout, ...
    FAILURE = "failure"  # the line that proves it
    FAILURE_EXCERPT = "failure_excerpt"
    FAILURE_ENGINE_SECONDS = "failure_engine_seconds"
    CONSTRAINTS = "constraints"  # one value per SLO, <= 0 where it holds (what the sampler sees)
    CAPACITY_RPS = "capacity_rps"
    CAPACITY_OUTPUT_TOK_S = "capacity_output_tok_s"
    STEPS = "steps"  # every load step's metrics and verdicts
    ENGINE_START_S = "engine_start_s"
    ENGINE_STOP_S = "engine_stop_s"
    REPLAY_S = "replay_s"
    TRIAL_WALL_S = "trial_wall_s"
    PREDICTED_CAPACITY_RPS = "predicted_capacity_rps"  # the simulator's prediction, where a study made one
    UTILIZATION = "utilization"  # a sampled trial's gpu_memory_utilization moved to the highest that starts
    RACE = "race"  # a sampled trial raced the incumbent: which, at what rate it started, whether it lost there
    LADDER_START_RPS = "ladder_start_rps"  # a trial whose load ladder started at the simulator's prediction
    SAME_CONFIG_AS = "same_config_as"  # a sampled trial whose engine args an earlier trial measured: not run again
    REMEASURE = "remeasure"  # study attr: the Remeasurement's JSON
    SIM_PREDICTIONS = "sim_predictions"  # study attr: each point the simulator scored, and what it predicted
    SIM_PICKS = "sim_picks"  # study attr: the predicted best, queued first
    SIM_QUEUED = "sim_picks_queued"  # study attr: the picks are queued (an older study kept them for later)
    SIM_STOPPED = "sim_stopped"  # study attr: why the advisor stopped choosing trials (the sampler chooses)
    UTILIZATION_CEILING = "utilization_ceiling"  # study attr: below a memory fraction that failed to start for real


@dataclass(frozen=True)
class RaceRecord:
    """A sampled trial's race against the incumbent (``Attr.RACE``): who, from which load, and how it ended."""

    incumbent: int  # the trial raced: the feasible one with the best capacity when this one started
    incumbent_rps: float
    start_load: float  # the incumbent's capacity as a multiple of the workload's rate: where the race starts
    lost: bool | None = None  # None while it runs
    missed_at_rps: float | None = None  # where a lost race missed the SLOs

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RaceRecord:
        return cls(
            int(raw["incumbent"]),
            float(raw["incumbent_rps"]),
            float(raw["start_load"]),
            raw.get("lost"),
            None if raw.get("missed_at_rps") is None else float(raw["missed_at_rps"]),
        )

    def ended(self, lost: bool, missed_at_rps: float | None = None) -> RaceRecord:
        return replace(self, lost=lost, missed_at_rps=missed_at_rps)


def baseline_attrs(b: BaselinePoint) -> dict[str, Any]:
    """A baseline trial's user attrs, set when it is queued."""
    return {Attr.BASELINE: b.name, Attr.BASELINE_ARGS: b.extra_args, Attr.BASELINE_NOTES: list(b.notes)}


def held_every_load(steps: Sequence[StepRecord]) -> bool:
    """Did a ladder find no load that missed above its capacity? Then the capacity is where the ladder stopped
    climbing: the config serves at least that much, how much more is unknown, and no gain is computed from it. A
    step the load generator could not offer in time (``client_kept_up`` false) bounds nothing."""
    passed = [s.load for s in steps if s.passed]
    return bool(passed) and not any(not s.passed and s.client_kept_up and s.load > max(passed) for s in steps)


def constraints_of(trial: FrozenTrial) -> list[float]:
    """The sampler's constraints_func: a trial that never measured is as infeasible as it gets."""
    return list(trial.user_attrs.get(Attr.CONSTRAINTS, [NO_MEASUREMENT]))


@dataclass(frozen=True)
class TrialRecord:
    number: int
    state: TrialState
    params: dict[str, Any]
    values: tuple[float, ...]
    attrs: dict[str, Any] = field(repr=False)

    @classmethod
    def of(cls, t: FrozenTrial) -> TrialRecord:
        return cls(t.number, t.state, dict(t.params), tuple(t.values or ()), dict(t.user_attrs))

    @property
    def baseline(self) -> str | None:
        return self.attrs.get(Attr.BASELINE) or None

    @property
    def label(self) -> str:
        return self.baseline or "sampled"

    @property
    def constraints(self) -> list[float]:
        return list(self.attrs.get(Attr.CONSTRAINTS, [NO_MEASUREMENT]))

    @property
    def feasible(self) -> bool:
        return self.state == TrialState.COMPLETE and all(c <= 0 for c in self.constraints)

    @property
    def capacity_rps(self) -> float:
        return float(self.attrs.get(Attr.CAPACITY_RPS, 0.0))

    @property
    def capacity_at_least(self) -> bool:
        """Every load its ladder offered held: ``capacity_rps`` is a floor, not a measured capacity."""
        return held_every_load(self.steps)

    @property
    def capacity_output_tok_s(self) -> float:
        return float(self.attrs.get(Attr.CAPACITY_OUTPUT_TOK_S, 0.0))

    @property
    def steps(self) -> list[StepRecord]:
        return [StepRecord.from_json(s) for s in self.attrs.get(Attr.STEPS, [])]

    @property
    def capacity_step(self) -> StepRecord | None:
        """The highest-load step that passed."""
        passed = [s for s in self.steps if s.passed]
        return max(passed, key=lambda s: s.load) if passed else None

    @property
    def capacity_bracket(self) -> tuple[float, float | None]:
        """Where the trial's capacity lies, in req/s: (the highest load that held, the lowest above it that
        missed; None: none missed, the capacity is a floor). A ladder resolves it to its step, no finer."""
        b = bracket_of(self.steps, self.capacity_rps)
        return b.low, b.high

    @property
    def failure_class(self) -> str | None:
        return self.attrs.get(Attr.FAILURE_CLASS) or None

    @property
    def failure(self) -> str:
        """The line that proves the failure (the engine's own words, or the pre-check's)."""
        return str(self.attrs.get(Attr.FAILURE, ""))

    @property
    def chosen_because(self) -> str:
        return str(self.attrs.get(Attr.CHOSEN_BECAUSE) or (f"baseline {self.baseline}" if self.baseline else "sampled"))

    @property
    def race(self) -> RaceRecord | None:
        """The incumbent this trial raced, and whether it lost there."""
        raw = self.attrs.get(Attr.RACE)
        return None if raw is None else RaceRecord.from_json(raw)

    @property
    def same_config_as(self) -> int | None:
        """The earlier trial that measured this trial's engine args (this one took its result, no engine ran)."""
        return self.attrs.get(Attr.SAME_CONFIG_AS)

    @property
    def predicted_capacity_rps(self) -> float | None:
        p = self.attrs.get(Attr.PREDICTED_CAPACITY_RPS)
        return None if p is None else float(p)

    @property
    def wall_s(self) -> float:
        return float(self.attrs.get(Attr.TRIAL_WALL_S, 0.0))

    @property
    def gpu_s(self) -> float:
        """GPU time the trial held: its wall time on each GPU of the engine (one where a study did not record it)."""
        return self.wall_s * int(self.attrs.get(Attr.ENGINE_GPUS, 1))

    @property
    def argv(self) -> list[str]:
        return list(self.attrs.get(Attr.ARGV, []))

    @property
    def config(self) -> dict[str, Any]:
        """The searched knobs as the engine ran them: Optuna's params, overridden by what was really passed
        (a baseline's own values, the space's rules) and stepped floats in decimal."""
        ran = self.attrs.get(Attr.ENGINE_ARGS) or {}
        passed = {**ran.get("env", {}), **ran.get("values", {})}
        keys = [*self.params, *(k for k in self.attrs.get(Attr.BASELINE_ARGS) or {} if k not in self.params)]
        out = {k: passed.get(k, self.params.get(k)) for k in keys}
        return {k: round(v, 10) if isinstance(v, float) else v for k, v in out.items()}

    @property
    def engine_args(self) -> EngineArgs:
        a = self.attrs[Attr.ENGINE_ARGS]
        return EngineArgs(dict(a["values"]), dict(a["env"]))


@dataclass
class Candidate:
    """A config being re-measured: its capacity in each interleaved run."""

    label: str
    trial_number: int
    args: EngineArgs
    capacities: list[float] = field(default_factory=list)
    runs: list[list[StepRecord]] = field(default_factory=list)  # each run's load steps
    trial_load: float = 0.0  # the load its trial held last (its capacity / the base rate): where re-measuring starts
    evidence: list[Bracket] = field(default_factory=list)  # what the search measured of this config

    def brackets(self, resolution: float) -> list[Bracket]:
        """Every measurement of the config (``measured_brackets``)."""
        return measured_brackets(self.evidence, self.runs, self.capacities, resolution)

    @property
    def median(self) -> float:
        return statistics.median(self.capacities) if self.capacities else 0.0

    @property
    def spread(self) -> float:
        """Twice the median absolute deviation of its runs: the range of two runs or of three evenly spread ones,
        which one stalled run does not widen (the range did: a VM's stall handed the baseline back, issue 25)."""
        if not self.capacities:
            return 0.0
        m = self.median
        return 2 * statistics.median(abs(c - m) for c in self.capacities)

    @property
    def at_least(self) -> bool:
        """A run held every load it was offered: its median is no measured capacity."""
        return any(held_every_load(run) for run in self.runs)


@dataclass(frozen=True)
class Remeasurement:
    """The verdict of re-measuring the top candidates and the best baseline, interleaved."""

    candidates: list[dict[str, Any]]  # label, trial, capacities, median, spread, runs
    winner: str
    winner_trial: int
    baseline: str
    gain_rps: float
    noise_rps: float
    significant: bool
    trials_seen: int = 0  # trials in the study when it was made: a later trial makes it stale
    baseline_at_least: bool = False  # the baseline held every load of a run: no gain over it can be stated
    resolution: float = 1.0  # the re-measurement ladder's step: the noise is never less than the baseline's step
    # the posterior's (study/posterior.py); None in a verdict stored before verdicts were probabilities
    p_better: float | None = None  # P(the winner's capacity is above the baseline's)
    p_within: float | None = None  # P(the recommended config is within WITHIN of the best candidate)
    confidence: float | None = None  # the probability a gain must reach to be deployed

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Remeasurement:
        return cls(**d)

    def candidate(self, trial: int) -> dict[str, Any] | None:
        return next((c for c in self.candidates if c["trial"] == trial), None)

    @property
    def baseline_trial(self) -> int:
        return self.candidates[-1]["trial"]

    @property
    def recommended_trial(self) -> int:
        """The config to deploy: the winner when its gain beat the noise, else the baseline it was measured against."""
        return self.winner_trial if self.significant else self.baseline_trial

    @property
    def leader_not_recommended(self) -> int | None:
        """A searched config that led on the median but not surely enough to deploy: kept, not recommended."""
        return self.winner_trial if self.winner != self.baseline and not self.significant else None

    @property
    def probability_words(self) -> str:
        return f"P = {self.p_better:.2f} that it is better, {self.confidence:g} required"

    @property
    def noise_words(self) -> str:
        """The noise and where it comes from: the spread of the runs, or the ladder's step where that is wider."""
        share = step_share(self.resolution)
        if share > 0 and self.noise_rps <= share * self.candidates[-1]["median"]:
            return f"{self.noise_rps:.2f}: the re-measurement ladder's {self.resolution:g}x step"
        return f"{self.noise_rps:.2f}: the spread of their runs"

    def sentence(self) -> str:
        """The verdict in the words the console, the report, the dashboard note and the daemon all use."""
        if self.winner == self.baseline:
            if self.p_within is None:  # a verdict stored before verdicts were probabilities
                return f"no gain: no searched config beat {self.baseline} on the median; keep {self.baseline}"
            if len(self.candidates) == 1:  # only the baseline re-measured: the probability would say nothing
                return f"no gain: no searched config beat {self.baseline}, the search's leader; keep {self.baseline}"
            return (
                f"no gain: no searched config beat {self.baseline} on the posterior median (P = {self.p_within:.2f} "
                f"that it is within {WITHIN * 100:.0f} % of the best re-measured config); keep {self.baseline}"
            )
        if self.baseline_at_least:
            return (
                f"no gain can be stated: {self.baseline} held every load the ladder offered, so its median is "
                f"where the ladder stopped, not its capacity; keep {self.baseline} (a higher [objective] "
                "max_steps finds the capacities)"
            )
        by = "at least " if (self.candidate(self.winner_trial) or {}).get("at_least") else ""
        if self.p_better is not None:
            if self.significant:
                return (
                    f"{self.winner} beats {self.baseline} by {by}{self.gain_rps:.2f} req/s "
                    f"({self.probability_words}): deploy {self.winner}"
                )
            return (
                f"no gain: {self.winner} leads {self.baseline} by {self.gain_rps:.2f} req/s, not surely "
                f"({self.probability_words}): keep {self.baseline}"
            )
        if self.significant:
            return (
                f"{self.winner} beats {self.baseline} by {by}{self.gain_rps:.2f} req/s, more than the noise "
                f"({self.noise_words}): deploy {self.winner}"
            )
        return (
            f"no gain: {self.winner} leads {self.baseline} by {self.gain_rps:.2f} req/s, within the noise "
            f"({self.noise_words}): keep {self.baseline}"
        )


def step_share(resolution: float) -> float:
    """The share of a capacity one re-measurement step spans (``resolution`` 1.05: 5 %): capacities closer than this
    may be one config (0 for a verdict stored before its step was)."""
    return resolution - 1


WITHIN = 0.95  # a config this close to the best is as good as the best


def bracket_of(run: Sequence[StepRecord], low: float | None = None) -> Bracket:
    """A run's capacity bracket: the highest load that held (``low`` where the caller knows it) and the lowest
    above it that missed (loads the client could not offer bound nothing)."""
    if low is None:
        low = max((s.rate for s in run if s.passed), default=0.0)
    above = [s.rate for s in run if not s.passed and s.client_kept_up and s.rate > low]
    return Bracket(low, min(above, default=None))


def measured_brackets(
    evidence: Sequence[Bracket], runs: Sequence[Sequence[StepRecord]], capacities: Sequence[float], resolution: float
) -> list[Bracket]:
    """Every measurement of a config: the search's (``evidence``), then each re-measured run's, from its load steps;
    a run's capacity given without them is known to the ladder's step (``resolution``)."""
    done = [bracket_of(run) for run in runs]
    given = [Bracket(c, c * resolution if c > 0 else None) for c in capacities[len(done) :]]
    return [*evidence, *done, *given]


def config_evidence(records: Sequence[TrialRecord], r: TrialRecord) -> list[Bracket]:
    """What the search measured of ``r``'s config: the ladder of each of ``records`` that ran it (a twin that took
    another trial's result measured nothing, nor did a trial with no load step)."""
    ran = r.attrs.get(Attr.ENGINE_ARGS)
    return [
        Bracket(*t.capacity_bracket)
        for t in records
        if t.steps
        and t.same_config_as is None
        and (t.number == r.number or (ran is not None and t.attrs.get(Attr.ENGINE_ARGS) == ran))
    ]


def posterior_of(cands: Sequence[Candidate], resolution: float = REMEASURE_RESOLUTION) -> Posterior:
    return Posterior.of([c.brackets(resolution) for c in cands])


def judge(
    cands: list[Candidate],
    trials_seen: int = 0,
    resolution: float = REMEASURE_RESOLUTION,
    confidence: float = CONFIDENCE,
    post: Posterior | None = None,
) -> Remeasurement:
    """The verdict; the best baseline is the last candidate. ``post``: the candidates' posterior where the caller
    has built it already (``posterior_of(cands, resolution)``).

    Every measurement of each candidate (its search's and its re-measured runs) goes into one posterior of their
    capacities (``study/posterior.py``). The winner has the highest posterior median, the baseline on a tie; its gain
    is deployed when the posterior gives it at least ``confidence`` of being better than the baseline. No gain is
    stated over a baseline that held every load it was offered: its capacity is above its median by an unknown
    amount. ``p_within`` is the probability that the config recommended is within WITHIN of the best candidate.
    """
    post = post if post is not None else posterior_of(cands, resolution)
    b = len(cands) - 1
    # a candidate that held every load it was offered is known only to be at least its floor: it ranks there
    medians = [
        min(post.median(i), max(b.low for b in c.brackets(resolution))) if c.at_least else post.median(i)
        for i, c in enumerate(cands)
    ]
    # a tie goes to the baseline: a config as good as the known one is no reason to change anything
    w = max(range(len(cands)), key=lambda i: (medians[i], i == b))
    winner, base = cands[w], cands[b]
    p_better = post.p_better(w, b) if w != b else 0.0
    # a gain over a floor is unknown (the baseline may go further); a floor over a capacity is a gain of at least
    floors = w != b and base.at_least
    significant = w != b and p_better >= confidence and not floors
    return Remeasurement(
        candidates=[
            {
                "label": c.label,
                "trial": c.trial_number,
                "capacities": c.capacities,
                "median": medians[i],
                "spread": c.spread,
                "runs": [[s.to_json() for s in run] for run in c.runs],
                "at_least": c.at_least,
            }
            for i, c in enumerate(cands)
        ],
        winner=winner.label,
        winner_trial=winner.trial_number,
        baseline=base.label,
        gain_rps=medians[w] - medians[b],
        noise_rps=post.sigma * medians[b],
        significant=significant,
        trials_seen=trials_seen,
        baseline_at_least=floors,
        resolution=resolution,
        p_better=p_better,
        p_within=post.p_within(w if significant else b, WITHIN),
        confidence=confidence,
    )


@dataclass(frozen=True)
class StudyResult:
    records: list[TrialRecord]
    pareto: bool
    remeasurement: Remeasurement | None  # only when fresh (no trial ran after it)
    best_number: int | None  # Optuna's best trial, constraints respected (single objective)
    front_numbers: tuple[int, ...] = ()  # Pareto mode: Optuna's non-dominated trials

    @classmethod
    def of(cls, study: optuna.Study) -> StudyResult:
        trials = study.get_trials(deepcopy=False)
        raw = study.user_attrs.get(Attr.REMEASURE)
        verdict = Remeasurement.from_json(raw) if raw and raw.get("trials_seen") == len(trials) else None
        pareto = len(study.directions) > 1
        best, front = None, tuple[int, ...]()
        if pareto:
            front = tuple(t.number for t in study.best_trials)
        else:
            try:
                best = study.best_trial.number
            except ValueError:
                best = None
        return cls([TrialRecord.of(t) for t in trials], pareto, verdict, best, front)

    @classmethod
    def load(cls, storage: str | optuna.storages.BaseStorage, name: str) -> StudyResult:
        return cls.of(optuna.load_study(study_name=name, storage=storage))

    def trial(self, number: int) -> TrialRecord:
        return self.records[number]

    @property
    def best(self) -> TrialRecord | None:
        """Optuna's best if it met the SLOs at some load; None in Pareto mode or when none did."""
        if self.best_number is None:
            return None
        t = self.trial(self.best_number)
        return t if t.feasible and t.values and t.values[0] > 0 else None

    def capacity_of(self, r: TrialRecord) -> tuple[float, str]:
        """A config's capacity, the same wherever it is shown: (req/s, in one phrase). The verdict's re-measured
        median where the verdict measured it, else its trial's, with the trial's bracket
        (``TrialRecord.capacity_bracket``)."""
        c = self.remeasurement.candidate(r.number) if self.remeasurement is not None else None
        if c is not None:
            floor, n = "at least " if c.get("at_least") else "", len(c["capacities"])
            return c[
                "median"
            ], f"{floor}{c['median']:.2f} req/s (posterior median, {n} re-measurement{'s' if n != 1 else ''})"
        low, high = r.capacity_bracket
        said = f"at least {low:.2f} req/s" if high is None else f"{low:.2f} req/s (its next load, {high:.2f}, missed)"
        return low, said

    def evidence_of(self, number: int) -> list[Bracket]:
        """Every measurement the study made of trial ``number``'s config: the ladder of each trial that ran it (a
        twin that took another's result measured nothing) and each of its re-measured runs, as brackets."""
        evidence = config_evidence(self.records, self.trial(number))
        v = self.remeasurement
        c = v.candidate(number) if v is not None else None
        if v is None or c is None:
            return evidence
        runs = [[StepRecord.from_json(s) for s in run] for run in c.get("runs", [])]
        # a verdict stored before its step was has resolution 1: its runs are still known to the ladder's step
        return measured_brackets(evidence, runs, c["capacities"], max(v.resolution, REMEASURE_RESOLUTION))

    @property
    def winner(self) -> TrialRecord | None:
        """The config the study declares best, the one written to best.yaml: when a fresh re-measurement exists,
        the config it recommends (its winner if the gain beat the noise, else the baseline), else Optuna's best."""
        if self.remeasurement is not None:
            return self.trial(self.remeasurement.recommended_trial)
        return self.best

    @property
    def leader(self) -> TrialRecord | None:
        """The searched config that led the re-measurement but not surely enough to deploy (not recommended), if any."""
        n = self.remeasurement.leader_not_recommended if self.remeasurement is not None else None
        return None if n is None else self.trial(n)

    @property
    def front(self) -> list[TrialRecord]:
        """Pareto mode: the non-dominated trials that meet every SLO."""
        return [r for r in map(self.trial, self.front_numbers) if r.feasible]

    def baselines(self) -> list[TrialRecord]:
        return [r for r in self.records if r.baseline and r.state in (TrialState.COMPLETE, TrialState.PRUNED)]

    @property
    def best_baseline(self) -> TrialRecord | None:
        """The baseline with the most capacity within the SLOs (None: no baseline met them)."""
        met = [r for r in self.baselines() if r.feasible and r.capacity_rps > 0]
        return max(met, key=lambda r: r.capacity_rps, default=None)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r.state.name.lower()] = out.get(r.state.name.lower(), 0) + 1
        return out
