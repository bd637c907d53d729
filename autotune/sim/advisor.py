"""vllm-sim as a study's advisor: the study's space scored in virtual time before any engine starts, and refitted
to this host's measured trials as they come (sim/calibrate.py fits; this module picks the profile for the
study's hardware and keeps each fit in the state directory, where the next study on this host finds it).

The engine kinds name these (``EngineKind.advisor``): real vLLM's study learns from each trial
(``learning_simulator``), a study of vllm-sim itself only predicts (``simulator_only``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import optuna

from autotune.engine.gpu import GpuInfo
from autotune.errors import ConfigError
from autotune.locations import state_dir
from autotune.measure.session import StepRecord
from autotune.sim import calibrate as cal
from autotune.sim.config import not_modelled
from autotune.sim.perf import API_SERVER
from autotune.sim.profiles import GPUS, GpuProfile, gpu_profile
from autotune.sim.rank import SpaceSimulator
from autotune.study.advisor import Advisor, AdvisorTarget, Prediction
from autotune.study.records import Attr

__all__ = [
    "SimulatorAdvisor",
    "learning_simulator",
    "simulator_only",
    "simulator",
    "recalibrate",
    "measured_steps",
    "profile_key",
    "devices_of_profile",
    "MIN_TRIALS",
]

MIN_TRIALS = 3  # fewer measured configs cannot separate the constants from one another
MAX_REQUESTS = 60  # a step's requests in the fit's replays: enough for its p95s, cheap enough for 150 rounds
REFIT_EVALUATIONS = 40  # after each trial of a study, from the last fit: a small step, seconds of CPU
# ... and none at all while the last fit already says every measured step to within ~10 % (log error below
# ln(1.1)^2): the load ladder states a capacity to within 25 %, so a closer fit seldom changes a decision, and
# 40 simulations of every step so far grow with each trial (minutes of CPU by the tenth, on a long workload)
REFIT_GOOD_ENOUGH = math.log(1.1) ** 2
# ... on the latest measured steps only: the warm start carries what the earlier ones taught, and a refit's CPU
# time is time the study holds its GPU idle (scripts/bench_search.py counts it)
REFIT_STEPS = 12
FINAL_EVALUATIONS = 100  # the end-of-study fit, from the last one: the best data this host will have
PREDICT_REQUESTS = 400  # a predicted step's requests: a steady state in a fraction of a second of CPU per load


class SimulatorAdvisor(Advisor):
    """Predicts with vllm-sim (sim/rank.SpaceSimulator); where ``learns``, refits it after each measured trial."""

    predicts = True

    def __init__(self, target: AdvisorTarget, sim: SpaceSimulator, describe: str, learns: bool) -> None:
        self.target, self.sim, self.describe, self.learns = target, sim, describe, learns

    def predict(self, points: Sequence[Mapping[str, Any]]) -> list[Prediction]:
        return list(self.sim(points))

    def startup_failure(self, values: Mapping[str, Any]) -> str | None:
        return self.sim.startup_failure(values)

    def learn(self, study: optuna.Study) -> str | None:
        """Fit again on the latest measured steps (from the last fit) and predict with the new fit from then on;
        no refit while the last fit already says every step to within ~10 %."""
        fitted = recalibrate(
            self.target, study, evaluations=REFIT_EVALUATIONS, good_enough=REFIT_GOOD_ENOUGH, latest=REFIT_STEPS
        )
        if fitted is None:
            return None
        if fitted.loss_before <= REFIT_GOOD_ENOUGH:
            return (
                f"vllm-sim still fits this host's {fitted.steps} measured steps "
                f"(log error {fitted.loss_before:.3f}): no refit"
            )
        sim, _ = simulator(self.target)
        if sim is None:
            return None
        self.sim = sim
        return f"vllm-sim refitted to this host: {fitted.describe()}"

    def finish(self, study: optuna.Study) -> str | None:
        fitted = recalibrate(self.target, study, evaluations=FINAL_EVALUATIONS)
        return (
            None if fitted is None else f"vllm-sim refitted to this host at the end of the study: {fitted.describe()}"
        )


def learning_simulator(target: AdvisorTarget) -> tuple[Advisor, str | None]:
    """Real vLLM's advisor: vllm-sim where it models the hardware, learning from every measured trial."""
    return _advisor(target, learns=True)


def simulator_only(target: AdvisorTarget) -> tuple[Advisor, str | None]:
    """vllm-sim's own advisor: it predicts; a simulator measured by itself has nothing to learn."""
    return _advisor(target, learns=False)


def _advisor(target: AdvisorTarget, learns: bool) -> tuple[Advisor, str | None]:
    sim, what = simulator(target)
    if sim is None:
        return Advisor(), what
    return SimulatorAdvisor(target, sim, what, learns), None


def profile_key(platform: str, devices: Sequence[GpuInfo]) -> str | None:
    """vllm-sim's profile key for the hardware (the CPU, or the first GPU by its NVML name), or None."""
    if platform == "cpu":
        return "cpu"
    name = devices[0].name if devices else None
    return next((k for k, g in GPUS.items() if g.name == name and g.platform == "cuda"), None)


def devices_of_profile(key: str) -> tuple[GpuInfo, ...]:
    """One GPU of vllm-sim's profile ``key`` as NVML would report it (what ``vllm-sim --gpu KEY`` simulates)."""
    gpu: GpuProfile = gpu_profile(key)
    return (GpuInfo(0, gpu.name, gpu.memory_bytes, gpu.memory_bytes),)


def simulator(target: AdvisorTarget, calibrated: bool = True) -> tuple[SpaceSimulator | None, str]:
    """The target's simulator and a line saying what it is, or (None, why not): a GPU vllm-sim has a profile for,
    with this host's calibration where there is one (unless ``calibrated`` is false: the shipped constants); a
    CPU host only once calibrated, since no public figure describes it."""
    if target.shape is None:
        return None, "no model shape"
    missing = not_modelled(target.shape, target.fixed, target.varied)
    if missing:
        return None, f"vllm-sim does not model {missing}"
    key = profile_key(target.platform, target.devices)
    if key is None:
        return None, "vllm-sim has no profile for this GPU"
    fit = cal.load(state_dir(), key, target.model) if calibrated else None
    if fit is None and key == "cpu":
        return (
            None,
            "this CPU is not calibrated yet (`autotune calibrate "
            f"{target.study_file or 'STUDY.toml'}` fits vllm-sim to it once the study has measured trials)",
        )
    gpu, front = (fit.gpu(), fit.front_end()) if fit else (GPUS[key], API_SERVER)
    if gpu.platform == "cuda" and target.devices and target.devices[0].total_bytes != gpu.memory_bytes:
        gpu = replace(gpu, memory_bytes=target.devices[0].total_bytes)  # a card of another size (--gpu-total-memory)
    steps = target.steps
    sim = SpaceSimulator(
        target.shape,
        gpu,
        lambda load: steps.repeated(load, max_requests=PREDICT_REQUESTS),  # token counts only: no prompt is built
        steps.base.rate,
        target.slos,
        front_end=front,
    )
    return sim, (
        f"vllm-sim's {key} profile, {fit.describe()}"
        if fit
        else f"vllm-sim's {key} profile (public figures; `autotune calibrate` fits it to this host)"
    )


def measured_steps(trials: Sequence[optuna.trial.FrozenTrial], only: set[int] | None = None) -> list[cal.MeasuredStep]:
    """Every load step a trial measured cleanly (no failed request, no engine failure, not cut short)."""
    out = []
    for t in trials:
        if only is not None and t.number not in only:
            continue
        a = t.user_attrs
        if Attr.FAILURE_CLASS in a or not a.get(Attr.STEPS) or Attr.ENGINE_ARGS not in a:
            continue
        args = a[Attr.ENGINE_ARGS]
        values: dict[str, Any] = {**args.get("env", {}), **args.get("values", {})}
        for st in map(StepRecord.from_json, a[Attr.STEPS]):
            if st.failed or st.cut or st.completed < 2:  # a cut step's first requests only
                continue
            measured = {k: float(getattr(st, k)) for k in cal.METRICS if getattr(st, k)}
            if measured:
                out.append(cal.MeasuredStep(t.number, values, st.load, measured))
    return out


def recalibrate(
    target: AdvisorTarget,
    study: optuna.Study,
    *,
    only: set[int] | None = None,
    evaluations: int = 150,
    warm: bool = True,
    good_enough: float = 0.0,
    latest: int | None = None,
) -> cal.Calibration | None:
    """Fit the target's profile to the study's measured trials (their ``latest`` measured steps, where given) and
    keep the fit; the Calibration, or None when the study measured fewer than MIN_TRIALS configs."""
    key = profile_key(target.platform, target.devices)
    if key is None:
        seen = target.devices[0].name if target.devices else "(none seen)"
        known = ", ".join(g.name for g in GPUS.values() if g.platform == "cuda")
        raise ConfigError(f"vllm-sim has no profile for the GPU {seen}; the ones it knows: {known}")
    if target.shape is None:
        raise ConfigError(f"cannot read the model's shape from {target.model} (its config.json): vllm-sim needs it")
    steps = measured_steps(study.get_trials(deepcopy=False), only)
    if len({s.trial for s in steps}) < MIN_TRIALS:
        return None
    steps = steps[-latest:] if latest else steps
    start = cal.load(state_dir(), key, target.model) if warm else None
    fitted = cal.calibrate(
        target.shape,
        key,
        target.model,
        steps,
        lambda load: target.steps.repeated(load, max_requests=MAX_REQUESTS),
        start=start,
        evaluations=evaluations,
        study=target.study,
        good_enough=good_enough,
    )
    cal.save(fitted, state_dir())
    return fitted
