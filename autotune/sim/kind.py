"""vllm-sim as an engine kind: vLLM's knowledge, with the flag table of the vLLM it simulates.

Its Python may hold another vLLM (the CPU wheel is 0.32), so its flags are never read from
an installed parser: the simulator takes vLLM 0.33's command line (sim/cli.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from autotune.engine.flags import FlagTable
from autotune.engine.vllm import VllmKind
from autotune.engine.vllm.flags import bundled_table

__all__ = ["VllmSimKind", "SIMULATED_VLLM"]

# The vLLM whose command line vllm-sim accepts.
SIMULATED_VLLM = "0.33"


class VllmSimKind(VllmKind):
    name = "vllm-sim"
    default_command = ("vllm-sim", "serve")

    def matches(self, command: Sequence[str]) -> bool:
        return bool(command) and (os.path.basename(command[0]) == "vllm-sim" or "autotune.sim.cli" in command[:3])

    def flag_table(self, command: Sequence[str], version: str | None = None) -> FlagTable:
        return bundled_table(SIMULATED_VLLM)
