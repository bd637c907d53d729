"""vLLM as an engine kind: its flags, failure texts, defaults and rules, config file and metric names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autotune.engine.flags import FlagTable
from autotune.engine.kind import EngineKind
from autotune.engine.vllm import config, defaults, failures, flags, metrics

__all__ = ["VllmKind"]


class VllmKind(EngineKind):
    name = "vllm"
    default_command = ("vllm", "serve")
    failure_patterns = failures.PATTERNS
    staging_only = config.STAGING_ONLY
    metrics = metrics.METRICS

    def matches(self, command: Sequence[str]) -> bool:
        return True  # the default: any command line that is no other kind's is taken to be `vllm serve`

    def flag_table(self, command: Sequence[str], version: str | None = None) -> FlagTable:
        return flags.table_for_command(list(command), version)

    def block_sizes(self, platform: str) -> tuple[int, ...] | None:
        return defaults.BLOCK_SIZES.get(platform)

    def default_space(self, platform: str, gpu_memory_gib: float = 0.0, gpu_name: str = "") -> dict[str, dict[str, Any]]:
        return defaults.default_space(platform, gpu_memory_gib, gpu_name)

    def apply_rules(self, values: dict[str, Any], max_model_len: int | None) -> dict[str, Any]:
        return defaults.apply_rules(values, max_model_len)

    def render_config(self, model: str, values: Mapping[str, Any], header: Sequence[str] = ()) -> str:
        return config.render(model, values, header)

    def parse_config(self, text: str) -> tuple[str | None, dict[str, Any]]:
        return config.parse(text)
