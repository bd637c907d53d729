"""``autotune study --dry-run``: the exact command lines of the first trials, launching nothing; on a study with
several GPUs, each trial's GPUs and port too (placed as if trials end in the order they start)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import optuna

from autotune.engine.args import EngineArgs
from autotune.engine.flags import FlagTable
from autotune.study.baselines import baseline_points
from autotune.study.definition import StudyDefinition
from autotune.study.records import Attr
from autotune.study.runner import build_space, devices_of
from autotune.study.slots import Slot, Slots, study_gpus
from autotune.study.storage import make_sampler

__all__ = ["dry_run"]


def dry_run(d: StudyDefinition, table: FlagTable, n: int) -> Iterator[dict[str, Any]]:
    """Baselines first, then sampled trials, as the real study would order them (in-memory, no storage).

    The caller checks the workload first (:func:`check_workload`): a study that would fail at its first
    trial fails there. A dry run needs no prompts, so no tokenizer."""
    space = build_space(d)
    shape = d.command.engine_kind.shape(d.command.model)
    devices = devices_of(d)
    memory = devices[0].total_bytes if devices else None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=make_sampler(d.sampler, d.seed), direction="maximize")
    for b in baseline_points(space, d.builtin_baselines, [(x.name, x.values) for x in d.baselines]):
        study.enqueue_trial(b.params, user_attrs={Attr.BASELINE: b.name, Attr.BASELINE_ARGS: b.extra_args})
    slots = Slots(study_gpus(d.gpu_ids, d.fixed.env), d.command.port)
    held: list[Slot] = []  # the trials running, oldest first
    for _ in range(n):
        trial = study.ask()
        values = space.sample(trial)
        args = space.engine_args(values, trial.user_attrs.get(Attr.BASELINE_ARGS) or {})
        command, slot = d.command, None
        size = space.engine.gpus_per_engine(args.values)
        if slots.gpus and slots.unfit(size) is None:
            while (slot := slots.try_take(size)) is None:
                slots.give(held.pop(0))
            held.append(slot)
            command, args = replace(command, port=slot.port), args.merged(EngineArgs({}, slot.env))
        line: dict[str, Any] = {"argv": command.argv(args, table), "env": dict(args.redacted(d.secret_env).env)}
        if slot is not None:
            line["gpus"] = list(slot.gpus)
        elif (why := slots.unfit(size)) is not None:
            line["not_started"] = why
        if trial.user_attrs.get(Attr.BASELINE):
            line["baseline"] = trial.user_attrs[Attr.BASELINE]
        if (
            d.precheck
            and shape is not None
            and (reason := space.engine.precheck(shape, args, d.platform, memory)) is not None
        ):
            line["precheck"] = reason
        study.tell(trial, state=optuna.trial.TrialState.FAIL)  # sampled, not measured: teaches nothing
        yield line
