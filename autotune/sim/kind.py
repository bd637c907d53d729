"""vllm-sim as an engine kind: vLLM's knowledge, with the flag table of the vLLM it simulates.

Its Python may hold another vLLM (the CPU wheel is 0.32), so its flags are never read from
an installed parser: the simulator takes vLLM 0.33's command line (sim/cli.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from autotune.engine.flags import FlagTable
from autotune.engine.gpu import GpuInfo
from autotune.engine.model import ModelShape
from autotune.engine.vllm import VllmKind
from autotune.engine.vllm.flags import bundled_table

__all__ = ["VllmSimKind", "SIMULATED_VLLM"]

# The vLLM whose command line vllm-sim accepts.
SIMULATED_VLLM = "0.33"


class VllmSimKind(VllmKind):
    name = "vllm-sim"
    default_command = ("vllm-sim", "serve")
    advisor = "autotune.sim.advisor:simulator_only"  # a simulator measured by itself: nothing to learn

    def matches(self, command: Sequence[str]) -> bool:
        return bool(command) and (os.path.basename(command[0]) == "vllm-sim" or "autotune.sim.cli" in command[:3])

    def flag_table(self, command: Sequence[str], version: str | None = None) -> FlagTable:
        return bundled_table(SIMULATED_VLLM)

    def devices(self, command: Sequence[str]) -> tuple[GpuInfo, ...]:
        """The simulated GPU its ``--gpu`` names (h100-80gb by default), of ``--gpu-total-memory`` where given, as
        NVML would report it."""
        from autotune.engine.model import parse_bytes
        from autotune.sim.profiles import gpu_profile

        given = {"--gpu": "h100-80gb", "--gpu-total-memory": ""}
        for i, word in enumerate(command):
            key, eq, value = word.partition("=")
            if key in given:
                given[key] = value if eq else (command[i + 1] if i + 1 < len(command) else "")
        try:
            gpu = gpu_profile(given["--gpu"])
            total = parse_bytes(given["--gpu-total-memory"]) if given["--gpu-total-memory"] else gpu.memory_bytes
        except (KeyError, ValueError):
            return ()  # vllm-sim itself refuses it at start, saying what it takes
        return (GpuInfo(0, gpu.name, total, total),)

    def shape(self, model: str) -> ModelShape | None:
        """The sim's named profiles (meta-llama/Llama-3.1-8B-Instruct, ...) or a directory with config.json."""
        from autotune.sim.profiles import model_shape

        try:
            return model_shape(model)
        except KeyError:
            return None
