"""What a study needs of measurement, and the real one: a staging engine started per measurement.

A study asks its ``Measurer`` two things, in this order for every config it runs:

    check(args)            the config's command line, built and checked once (ConfigError for a flag the
                           engine does not have, or trust_remote_code the study does not allow): the study
                           records it, and a bad space stops the study before any engine starts
    measure(config, ...)   start an engine with it, step the load ``profile`` picks, stop it; the Outcome
                           (measure/session.py) says what happened, engine failures included, never raised

``on_step`` hears the outcome after each load step and may answer True to stop there (Optuna's pruner);
``cut_lost_steps`` lets a step end as soon as it cannot pass; ``slot`` is where the engine runs (its GPUs and
port, study/slots.py), for a study that runs trials side by side. ``EngineMeasurer`` is the real one; a
benchmark or a test that cannot start engines implements the same two methods (scripts/bench_search.py
measures on a simulated truth, tests/measurers.py answers with set outcomes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from autotune.engine.args import EngineArgs
from autotune.engine.command import CheckedArgs, EngineCommand
from autotune.engine.flags import FlagTable
from autotune.measure.profiles import LoadProfile
from autotune.measure.replay import ReplayOptions
from autotune.measure.session import OnPhase, Outcome, measure_engine
from autotune.measure.slo import SLO
from autotune.study.slots import Slot
from autotune.workload.trace import Workload

__all__ = ["Measurer", "EngineMeasurer", "OnStep"]

OnStep = Callable[[Outcome], bool]  # True: stop after this step


class Measurer(Protocol):
    def check(self, args: EngineArgs) -> CheckedArgs: ...

    def measure(
        self,
        config: CheckedArgs,
        profile: LoadProfile,
        *,
        log_dir: Path,
        on_phase: OnPhase = ...,
        on_step: OnStep = ...,
        cut_lost_steps: bool = ...,
        slot: Slot | None = ...,
    ) -> Outcome: ...


@dataclass(frozen=True)
class EngineMeasurer:
    """Measures on the real engine: ``command`` started with each config, its flags checked against ``table``;
    each measurement's logs and per-request results in its ``log_dir``."""

    command: EngineCommand
    table: FlagTable
    workload_at: Callable[[float], Workload]  # the requests of one load step (workload.source.LoadSteps.at)
    slos: list[SLO]
    startup_timeout: float = 900.0
    replay: ReplayOptions = field(default_factory=ReplayOptions)

    def check(self, args: EngineArgs) -> CheckedArgs:
        return self.command.check(args, self.table)

    def measure(
        self,
        config: CheckedArgs,
        profile: LoadProfile,
        *,
        log_dir: Path,
        on_phase: OnPhase = lambda _: None,
        on_step: OnStep = lambda _: False,
        cut_lost_steps: bool = False,
        slot: Slot | None = None,
    ) -> Outcome:
        command = self.command
        if slot is not None and (slot.env or slot.port != command.port):  # the argv names the port: built again
            command = replace(command, port=slot.port)
            config = command.check(EngineArgs(config.args.values, {**config.args.env, **slot.env}), self.table)
        return measure_engine(
            command,
            config,
            self.workload_at,
            self.slos,
            profile,
            log_dir=log_dir,
            startup_timeout=self.startup_timeout,
            replay=self.replay,
            requests_file=log_dir / "requests.jsonl",
            on_phase=on_phase,
            on_step=on_step,
            cut_lost_steps=cut_lost_steps,
        )
