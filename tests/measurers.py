"""A study's Measurer for tests that start no engine (study/measurer.py's protocol).

``SetOutcomes`` checks each config as the real one does (the study's engine command and flag table),
then answers each measurement with what ``answer(config, n)`` returns for the n-th one, and remembers
what it was asked. Tests of what a study records for each way a measurement ends use it: how engines
really fail is tested on real engines (tests/test_engine_vllm.py, tests/test_launcher.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.engine.args import EngineArgs
from autotune.engine.command import CheckedArgs, EngineCommand
from autotune.engine.flags import FlagTable
from autotune.measure.profiles import LoadProfile
from autotune.measure.session import Outcome


@dataclass
class SetOutcomes:
    command: EngineCommand
    table: FlagTable
    answer: Callable[[CheckedArgs, int], Outcome]
    asked: list[dict[str, Any]] = field(default_factory=list)  # each measurement's engine args, in order
    profiles: list[LoadProfile] = field(default_factory=list)

    @classmethod
    def of(cls, d: Any, answer: Callable[[CheckedArgs, int], Outcome]) -> SetOutcomes:
        """For study definition ``d``: its command, and its engine's own flag table."""
        return cls(d.command, d.command.flag_table(), answer)

    def check(self, args: EngineArgs) -> CheckedArgs:
        return self.command.check(args, self.table)

    def measure(self, config: CheckedArgs, profile: LoadProfile, *, log_dir: Path, **_: Any) -> Outcome:
        self.asked.append(dict(config.args.values))
        self.profiles.append(profile)
        return self.answer(config, len(self.asked) - 1)
