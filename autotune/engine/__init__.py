"""Launching vLLM (or any engine command line) and knowing why it failed."""

from autotune.engine.args import EngineArgs, EngineCommand
from autotune.engine.failures import Failure, FailureClass
from autotune.engine.flags import FlagTable, bundled_table, check_args, table_for_engine
from autotune.engine.launcher import Engine, EngineState, LaunchSpec

__all__ = [
    "EngineArgs", "EngineCommand", "Failure", "FailureClass", "FlagTable", "bundled_table", "check_args",
    "table_for_engine", "Engine", "EngineState", "LaunchSpec",
]
