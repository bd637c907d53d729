"""Engines: their kinds (what autotune knows of each), launching, stopping, and knowing why one failed."""

from autotune.engine.args import EngineArgs
from autotune.engine.command import CheckedArgs, EngineCommand
from autotune.engine.failures import Failure, FailureClass
from autotune.engine.flags import FlagTable, check_args
from autotune.engine.kind import EngineKind, get_kind, kind_for_command, register
from autotune.engine.launcher import Engine, EngineState, LaunchSpec

__all__ = [
    "EngineArgs",
    "EngineCommand",
    "CheckedArgs",
    "Failure",
    "FailureClass",
    "FlagTable",
    "check_args",
    "EngineKind",
    "get_kind",
    "kind_for_command",
    "register",
    "Engine",
    "EngineState",
    "LaunchSpec",
]
