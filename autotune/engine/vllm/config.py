"""vLLM's YAML config file (`vllm serve --config FILE`): the one format autotune writes for vLLM.

The file maps vLLM's long option names (without ``--``) to values, plus ``model``; a study's
best.yaml and production's config are both written here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from autotune.engine.flags import dest_of, flag_of
from autotune.errors import ConfigError

__all__ = ["STAGING_ONLY", "production_values", "render", "parse"]

# staging-only values: measuring with random weights is fine, serving them is not
STAGING_ONLY: dict[str, Any] = {"load_format": "dummy"}


def production_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` without what only a staging engine may run."""
    return {k: v for k, v in values.items() if STAGING_ONLY.get(k, object()) != v}


def _entry(name: str, value: Any) -> tuple[str, Any]:
    # vLLM's load_config_file turns `key: false` into --no-key only when the top-level parser owns that
    # option, which for `vllm serve` it never does: the value is silently dropped and the default (often
    # true: prefix caching) runs (vllm-project/vllm#51401; tests/test_production_vllm.py). `no-key: true`
    # becomes --no-key, which the serve parser reads: the same argv EngineArgs.to_args gives.
    flag = flag_of(name)[2:]
    return (f"no-{flag}", True) if value is False else (flag, value)


def render(model: str, values: Mapping[str, Any], header: Sequence[str] = ()) -> str:
    config = {"model": model, **dict(_entry(k, v) for k, v in production_values(values).items())}
    lines = [f"# {h}" for h in header]
    return ("\n".join(lines) + "\n" if lines else "") + yaml.safe_dump(config, sort_keys=False)


def parse(text: str, source: str = "") -> tuple[str | None, dict[str, Any]]:
    """(model, values in snake case) from a config file's text; ``source`` (the file) names it in errors."""
    where = f"{source}: " if source else ""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{where}not valid YAML: {problem}{at}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}a vLLM config file is a YAML mapping of option names to values")
    model = data.pop("model", None)
    values: dict[str, Any] = {}
    for k, v in data.items():
        key = str(k).replace("_", "-")
        if key.startswith("no-") and v is True:
            values[dest_of("--" + key[3:])] = False
        else:
            values[dest_of("--" + key)] = v
    return model, values
