"""``autotune calibrate STUDY.toml``: vllm-sim fitted to a study's measured trials, for this host's predictions.

The fitting is sim/calibrate.py's and the profile's choice sim/advisor.py's; the fit is kept in the state
directory, where the next study of this model on this host finds it when it simulates first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autotune.cli.conventions import EXIT_OK, invoked
from autotune.errors import ConfigError

__all__ = ["add_parser", "cmd_calibrate"]


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


def cmd_calibrate(a: argparse.Namespace) -> int:
    import optuna

    from autotune.cli.study import load_definition, require_study
    from autotune.locations import state_dir
    from autotune.sim.advisor import MIN_TRIALS, measured_steps, recalibrate
    from autotune.sim.calibrate import FITTED, path_for
    from autotune.study.runner import advisor_target
    from autotune.workload.source import LoadSteps

    if a.evaluations < 1:
        raise ConfigError("--evaluations must be at least 1")
    only = None
    if a.only:
        try:
            only = {int(x) for x in a.only.split(",") if x.strip()}
        except ValueError:
            raise ConfigError(f"--trials takes trial numbers separated by commas, e.g. 0,2,5; got {a.only!r}") from None
    d = load_definition(a)
    require_study(d, a.file)
    study = optuna.load_study(study_name=d.name, storage=d.storage)
    target = advisor_target(d, LoadSteps(d.workload, d.objective.step_seconds))
    fitted = recalibrate(target, study, only=only, evaluations=a.evaluations, warm=False)
    if fitted is None:
        n = len({s.trial for s in measured_steps(study.get_trials(deepcopy=False), only)})
        raise ConfigError(
            f"study {d.name} has {n} cleanly measured trial(s) to fit on; calibrating needs "
            f"{MIN_TRIALS} at least: run more trials ({invoked()} study {a.file}), with "
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
