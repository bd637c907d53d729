"""vLLM as an engine kind: its flags, failure texts, defaults and rules, config file and metric names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.engine.args import EngineArgs
from autotune.engine.flags import FlagTable
from autotune.engine.kind import EngineKind
from autotune.engine.model import ModelShape
from autotune.engine.vllm import config, defaults, failures, flags, metrics, precheck

__all__ = ["VllmKind"]


class VllmKind(EngineKind):
    name = "vllm"
    title = "vLLM"
    config_file = "best.yaml"
    config_usage = "vllm serve --config"
    default_command = ("vllm", "serve")
    failure_patterns = failures.PATTERNS
    staging_only = config.STAGING_ONLY
    metrics = metrics.METRICS
    frontend_args = flags.FRONTEND_ARGS
    baselines = defaults.BASELINES
    memory_fraction = "gpu_memory_utilization"
    context_length = "max_model_len"
    tokenizer_arg = "tokenizer"
    revision_arg = "revision"
    advisor = "autotune.sim.advisor:learning_simulator"  # vllm-sim, refitted to this host as trials measure

    def matches(self, command: Sequence[str]) -> bool:
        return True  # the default: any command line that is no other kind's is taken to be `vllm serve`

    def flag_table(self, command: Sequence[str], version: str | None = None) -> FlagTable:
        return flags.table_for_command(list(command), version)

    def block_sizes(self, platform: str) -> tuple[int, ...] | None:
        return defaults.BLOCK_SIZES.get(platform)

    def default_space(
        self, platform: str, gpu_memory_gib: float = 0.0, gpu_name: str = ""
    ) -> dict[str, dict[str, Any]]:
        return defaults.default_space(platform, gpu_memory_gib, gpu_name)

    def apply_rules(self, values: dict[str, Any], max_model_len: int | None) -> dict[str, Any]:
        return defaults.apply_rules(values, max_model_len)

    def gpus_per_engine(self, values: Mapping[str, Any]) -> int:
        return int(values.get("tensor_parallel_size") or 1) * int(values.get("pipeline_parallel_size") or 1)

    def unsupported(self, key: str, value: Any, platform: str) -> str | None:
        if key == "gpu_memory_utilization" and platform == "cpu":
            return "gpu_memory_utilization has no meaning on a CPU host"
        return super().unsupported(key, value, platform)

    def out_of_range(self, key: str, value: Any) -> str | None:
        # CacheConfig: the share of the device's memory vLLM may take, 0 < x <= 1
        if key == "gpu_memory_utilization" and isinstance(value, (int, float)) and not 0 < value <= 1:
            return "a fraction of the GPU's memory, > 0 and <= 1"
        return None

    def precheck(
        self, shape: ModelShape, args: EngineArgs, platform: str, device_memory_bytes: int | None = None
    ) -> str | None:
        return precheck.precheck(shape, args, platform, device_memory_bytes)

    def render_config(self, model: str, values: Mapping[str, Any], header: Sequence[str] = ()) -> str:
        return config.render(model, values, header)

    def parse_config(self, text: str, source: str = "") -> tuple[str | None, dict[str, Any]]:
        return config.parse(text, source)

    def container_line(self, model: str, config_path: Path, env: Mapping[str, str], version: str | None) -> str:
        return config.container_line(model, config_path, env, version)
