"""``autotune calibrate STUDY.toml``: vllm-sim fitted to a study's measured trials, for this host's predictions.

The fitting is sim/calibrate.py's; this module reads the study (its trials' load steps and engine args), picks
the simulator's profile for the study's hardware, and keeps the fit in the state directory, where the next
study on this host finds it (``simulator_for``, which ``autotune study`` uses to simulate first).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from autotune.cli import EXIT_OK
from autotune.errors import ConfigError

__all__ = ["add_parser", "cmd_calibrate", "measured_steps", "simulator_for", "recalibrate", "refitter"]

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


def add_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="fit vllm-sim to a study's measured trials, so later studies here simulate first",
        description="Fit vllm-sim's time constants (compute and bandwidth fractions, host overhead per step and "
        "per sequence, eager launches, the API server's floor and per-token cost) to every measured load step "
        "of a study's trials, and keep the fit for this host's GPU (or CPU) and the study's model. Later studies "
        "with the same hardware and model rank their space with it before starting any engine.",
    )
    p.add_argument("file", type=Path, help="the study definition the trials ran under")
    p.add_argument("--storage", help="Optuna storage URL (default: the study's)")
    p.add_argument("--study-name")
    p.add_argument(
        "--trials", dest="only", help="fit on these trial numbers only, e.g. 0,2,5 (default: every measured trial)"
    )
    p.add_argument(
        "--evaluations", type=int, default=150, help="simulations of the whole set the fit may spend (default 150)"
    )


def measured_steps(trials, only: set[int] | None = None) -> list:
    """Every load step a trial measured cleanly (no failed request, no engine failure), as MeasuredSteps."""
    from autotune.sim.calibrate import METRICS, MeasuredStep
    from autotune.study.records import Attr

    out = []
    for t in trials:
        if only is not None and t.number not in only:
            continue
        a = t.user_attrs
        if Attr.FAILURE_CLASS in a or not a.get(Attr.STEPS) or Attr.ENGINE_ARGS not in a:
            continue
        args = a[Attr.ENGINE_ARGS]
        values: dict[str, Any] = {**args.get("env", {}), **args.get("values", {})}
        for st in a[Attr.STEPS]:
            if st.get("failed") or st.get("cut") or (st.get("completed") or 0) < 2:  # a cut step's first requests only
                continue
            measured = {k: float(st[k]) for k in METRICS if st.get(k)}
            if measured:
                out.append(MeasuredStep(t.number, values, float(st["load"]), measured))
    return out


def _profile_key(d, devices) -> str | None:
    """vllm-sim's profile key for the study's hardware (the CPU, or the first GPU by its NVML name), or None."""
    from autotune.sim.profiles import GPUS

    if d.platform == "cpu":
        return "cpu"
    name = devices[0].name if devices else None
    return next((k for k, g in GPUS.items() if g.name == name and g.platform == "cuda"), None)


def _inputs(d, steps=None):
    """(profile key, model shape, workload at a load) for the study ``d``, replaying ``steps`` (the study's load
    steps, where the caller has them: their workload is built once) or the study's workload."""
    from autotune.sim.profiles import GPUS
    from autotune.study.runner import devices_of
    from autotune.workload.source import LoadSteps

    devices = devices_of(d)
    key = _profile_key(d, devices)
    if key is None:
        raise ConfigError(
            f"vllm-sim has no profile for the GPU {devices[0].name if devices else '(none seen)'}; "
            f"the ones it knows: {', '.join(g.name for g in GPUS.values() if g.platform == 'cuda')}"
        )
    shape = d.command.engine_kind.shape(d.command.model)
    if shape is None:
        raise ConfigError(f"cannot read the model's shape from {d.command.model} (its config.json): vllm-sim needs it")
    steps = steps if steps is not None else LoadSteps(d.workload, d.objective.step_seconds)
    return key, shape, lambda load: steps.repeated(load, max_requests=MAX_REQUESTS)


def recalibrate(
    d,
    study,
    *,
    only: set[int] | None = None,
    evaluations: int = 150,
    warm: bool = True,
    steps=None,
    good_enough: float = 0.0,
    latest: int | None = None,
):
    """Fit the study's profile to its measured trials (their ``latest`` measured steps, where given) and keep the
    fit; the Calibration, or None when the study measured fewer than MIN_TRIALS configs. ``steps``: the study's
    LoadSteps, where the caller has them."""
    from autotune.locations import state_dir
    from autotune.sim import calibrate as cal

    profile, shape, workload_at = _inputs(d, steps)
    steps = measured_steps(study.get_trials(deepcopy=False), only)
    if len({s.trial for s in steps}) < MIN_TRIALS:
        return None
    steps = steps[-latest:] if latest else steps
    start = cal.load(state_dir(), profile, d.command.model) if warm else None
    fitted = cal.calibrate(
        shape,
        profile,
        d.command.model,
        steps,
        workload_at,
        start=start,
        evaluations=evaluations,
        study=d.name,
        good_enough=good_enough,
    )
    cal.save(fitted, state_dir())
    return fitted


def simulator_for(d, devices, shape, steps):
    """The study's simulator (sim/rank.SpaceSimulator) and a line saying what it is, or (None, why not): a GPU
    vllm-sim has a profile for, with this host's calibration where there is one; a CPU host only once
    calibrated, since no public figure describes it."""
    from autotune.locations import state_dir
    from autotune.sim import calibrate as cal
    from autotune.sim.perf import API_SERVER
    from autotune.sim.profiles import GPUS
    from autotune.sim.rank import SpaceSimulator

    if shape is None:
        return None, "no model shape"
    key = _profile_key(d, devices)
    if key is None:
        return None, "vllm-sim has no profile for this GPU"
    fit = cal.load(state_dir(), key, d.command.model)
    if fit is None and key == "cpu":
        return None, f"this CPU is not calibrated yet (autotune calibrate {d.name}'s study file, once it has trials)"
    gpu, front = (fit.gpu(), fit.front_end()) if fit else (GPUS[key], API_SERVER)
    # the step's requests are the base workload's, repeated (no prompt is built: only token counts matter to the
    # simulator), and 400 at most: a steady state in a fraction of a second of CPU per load
    sim = SpaceSimulator(
        shape, gpu, lambda load: steps.repeated(load, max_requests=400), steps.base.rate, d.slos, front_end=front
    )
    return sim, (
        f"vllm-sim's {key} profile, {fit.describe()}"
        if fit
        else f"vllm-sim's {key} profile (public figures; `autotune calibrate` fits it to this host)"
    )


def refitter(d, run, steps, notice):
    """The study's ``refit`` hook (study/runner.py ``_learn``): after a measured trial, fit the simulator again on
    every trial so far (from the last fit) and predict with the new fit from then on."""

    def refit(study) -> None:
        fitted = recalibrate(
            d, study, evaluations=REFIT_EVALUATIONS, steps=steps, good_enough=REFIT_GOOD_ENOUGH, latest=REFIT_STEPS
        )
        if fitted is None:
            return
        if fitted.loss_before <= REFIT_GOOD_ENOUGH:
            notice(
                f"vllm-sim still fits this host's {fitted.steps} measured steps "
                f"(log error {fitted.loss_before:.3f}): no refit"
            )
            return
        sim, _ = simulator_for(d, run.devices, run.shape, steps)
        if sim is not None:
            run.predictor = sim
            notice(f"vllm-sim refitted to this host: {fitted.describe()}")

    return refit


def cmd_calibrate(a: argparse.Namespace) -> int:
    import optuna

    from autotune.cli.study import _definition, _require_study
    from autotune.locations import state_dir
    from autotune.sim.calibrate import FITTED, path_for

    if a.evaluations < 1:
        raise ConfigError("--evaluations must be at least 1")
    only = None
    if a.only:
        try:
            only = {int(x) for x in a.only.split(",") if x.strip()}
        except ValueError:
            raise ConfigError(f"--trials takes trial numbers separated by commas, e.g. 0,2,5; got {a.only!r}") from None
    d = _definition(a)
    _require_study(d, a.file)
    study = optuna.load_study(study_name=d.name, storage=d.storage)
    fitted = recalibrate(d, study, only=only, evaluations=a.evaluations, warm=False)
    if fitted is None:
        n = len({s.trial for s in measured_steps(study.get_trials(deepcopy=False), only)})
        raise ConfigError(
            f"study {d.name} has {n} cleanly measured trial(s) to fit on; calibrating needs "
            f"{MIN_TRIALS} at least: run more trials (autotune study {a.file}), with "
            "[objective] cut_lost_steps = false where the study is meant for calibrating (a step "
            "stopped once it could not pass is left out of a fit)"
        )
    print(f"{fitted.describe()}")
    for k in FITTED:
        print(f"  {k:22} {fitted.constants[k]:.4g}")
    print(
        f"kept in {path_for(state_dir(), fitted.profile, fitted.model)}; studies of {fitted.model} on this "
        f"host's {fitted.profile} now simulate with it",
        file=sys.stderr,
    )
    return EXIT_OK
