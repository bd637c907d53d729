"""A test-only second engine kind: proof that an engine is one package plus one ``register`` call.

The toy engine (server.py) is a fixed-timing OpenAI server with its own command line: no model
positional, ``--itl-ms`` / ``--ttft-ms`` / ``--memory-gb``, and its own out-of-memory text.
``ToyKind`` tells autotune exactly that, through the EngineKind hooks only:

    from autotune.engine.kind import register
    register("toy", "tests.toy_engine:ToyKind")
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from autotune.engine.failures import COMMON_PATTERNS, FailureClass, Patterns
from autotune.engine.flags import FlagTable
from autotune.engine.kind import EngineKind

__all__ = ["ToyKind", "FLAGS", "MODULE", "OOM_PATTERN", "USAGE_PATTERN"]

MODULE = "tests.toy_engine.server"

# The toy's own flag dump, in the shape FlagTable.from_dump reads (what dump_flags makes for vLLM).
FLAGS: dict[str, Any] = {
    "version": "1.0",
    "flags": [
        {"name": "--itl-ms", "kind": "value", "type": "float"},
        {"name": "--ttft-ms", "kind": "value", "type": "float"},
        {"name": "--memory-gb", "kind": "value", "type": "int"},
    ],
}
MANAGED = {
    "--host": "autotune binds the engine itself: set [engine].host",
    "--port": "autotune picks the engine port: set [engine].port",
}

OOM_PATTERN = re.compile(r"out of toy memory")
USAGE_PATTERN = re.compile(r"^toy-engine: error: ")  # argparse's line, before its exit code 2


class ToyKind(EngineKind):
    name = "toy"
    default_command = ("python", "-m", MODULE)
    failure_patterns: Patterns = [(FailureClass.OOM, OOM_PATTERN), *COMMON_PATTERNS,
                                  (FailureClass.INVALID_ARGS, USAGE_PATTERN)]
    baselines = {"toy-defaults": {}}  # every searched knob at the toy's default

    def matches(self, command: Sequence[str]) -> bool:
        return MODULE in command[:3]

    def flag_table(self, command: Sequence[str], version: str | None = None) -> FlagTable:
        return FlagTable.from_dump(FLAGS, source="toy", managed=MANAGED, engine="the toy engine",
                                   help_command="`python -m tests.toy_engine.server --help`")

    def argv(self, command: Sequence[str], model: str, host: str, port: int, flags: Sequence[str]) -> list[str]:
        return [*command, "--host", host, "--port", str(port), *flags]  # the toy serves no model by name

    def default_space(self, platform: str, gpu_memory_gib: float = 0.0, gpu_name: str = "") -> dict[str, dict[str, Any]]:
        return {
            "itl_ms": {"type": "float", "low": 1.0, "high": 30.0, "default": 2.0},
            "memory_gb": {"type": "int", "low": 1, "high": 16, "default": 4},
        }
