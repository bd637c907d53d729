"""Engine kinds: everything autotune knows about one inference engine, behind one small base class.

An engine kind answers, for the rest of autotune:

    what it accepts     flag_table(command)            the flags of the installed engine (UnknownFlagError
                                                        for anything else, before any launch)
    how to run it       default_command, argv(...)     a command line, never a shell string
    how it fails        failure_patterns               log texts that prove oom / invalid-args / ...
    what to search      default_space(...)             as a study's [space] table would write it
                        block_sizes(platform)          values the platform's kernels accept
                        apply_rules(flags, mml)        move a point into what the engine accepts
                        unsupported(key, value, ...)   a value the platform cannot run (a baseline's)
                        out_of_range(key, value)       a value the engine never takes (checked at study load)
                        precheck(shape, args, ...)     provably does not fit: prune at 0 engine seconds
    what to beat        baselines                      named configs every study measures first
    how to publish      render_config / parse_config   the engine's own config file format
                        staging_only                   values a staging engine may run, production never
    what it reports     metrics                        its Prometheus names, under our short keys
    what it serves      frontend_args                  its API server's options (not the engine's)

Kinds are found by name in a registry of ``"module:Class"`` strings, so adding one is a new
module (or package) and one ``register`` call; ``kind_for_command`` picks the kind whose
``matches`` accepts a command line, vLLM when none does. vLLM is engine/vllm/, vllm-sim's
kind (vLLM's knowledge, the simulator's flag table) is sim/kind.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from autotune.engine.args import EngineArgs
from autotune.engine.failures import COMMON_PATTERNS, Patterns
from autotune.engine.flags import FlagTable
from autotune.engine.gpu import GpuInfo
from autotune.engine.model import ModelShape, locate
from autotune.errors import ConfigError

__all__ = ["EngineKind", "MetricSpec", "register", "get_kind", "kind_for_command", "kind_names"]


@dataclass(frozen=True)
class MetricSpec:
    """One metric of an engine's /metrics that autotune reads, under a short key of ours."""

    name: str  # the sample name the engine exposes (counters with their _total)
    kind: Literal["counter", "histogram", "gauge"]
    # Only samples whose label has one of these values count (None: every sample).
    label: tuple[str, frozenset[str]] | None = None
    # How to combine a gauge over several engines: a KV-cache fraction is averaged, queue lengths add up.
    combine: Literal["sum", "mean"] = "sum"


class EngineKind:
    """Base class of engine kinds. Override ``flag_table``; every other hook has a neutral default.

    Hooks are called at study load (flag_table, default_space, block_sizes), per trial before
    launch (apply_rules, argv) and by the launcher while the engine starts (failure_patterns).
    None of them may start processes except ``flag_table``, which may run the engine's own
    parser once (and should cache it).
    """

    name: str = ""
    title: str = ""  # how messages name the engine ("vLLM"); the name when empty
    default_command: tuple[str, ...] = ()
    failure_patterns: Patterns = COMMON_PATTERNS
    staging_only: Mapping[str, Any] = {}
    metrics: Mapping[str, MetricSpec] = {}
    # options of the engine's own API server, not of the engine: an engine embedded in another server drops them
    frontend_args: frozenset[str] = frozenset()
    # name -> values; "<kind>-defaults" ({}: every searched knob at its default) is the usual first
    baselines: Mapping[str, Mapping[str, Any]] = {}
    # the arg that sets the fraction of device memory the engine may take: sampled trials run at the highest of
    # the space that the advisor says starts (study/advice.py); None where the engine has no such arg
    memory_fraction: str | None = None
    # the arg that caps a request's tokens, prompt and answer (synthesized workloads fit it); None: no such arg
    context_length: str | None = None
    tokenizer_arg: str | None = None  # the arg naming a tokenizer other than the model's
    revision_arg: str | None = None  # the arg naming the model's revision
    # "module:function" building a study's advisor for this engine (study/advisor.py), imported on first use as a
    # kind is; None: no advisor, and every trial runs as the sampler chose it
    advisor: str | None = None

    def matches(self, command: Sequence[str]) -> bool:
        """Is ``command`` (an argv prefix) this kind's engine? Used to pick a kind from a command line."""
        return False

    def flag_table(self, command: Sequence[str], version: str | None = None) -> FlagTable:
        raise NotImplementedError

    def argv(self, command: Sequence[str], model: str, host: str, port: int, flags: Sequence[str]) -> list[str]:
        return [*command, model, "--host", host, "--port", str(port), *flags]

    def devices(self, command: Sequence[str]) -> tuple[GpuInfo, ...] | None:
        """The GPUs the engine runs on when its command line says so (a simulator's ``--gpu``); None: ask NVML."""
        return None

    def shape(self, model: str) -> ModelShape | None:
        """The model's shape (pre-check, default max_model_len); None when it cannot be known here."""
        return ModelShape.from_dir(locate(model).directory)

    def block_sizes(self, platform: str) -> tuple[int, ...] | None:
        """The KV block sizes the platform accepts; None: no constraint."""
        return None

    def default_space(
        self, platform: str, gpu_memory_gib: float = 0.0, gpu_name: str = ""
    ) -> dict[str, dict[str, Any]]:
        return {}

    def apply_rules(self, flags: dict[str, Any], max_model_len: int | None) -> dict[str, Any]:
        return flags

    def revision(self, values: Mapping[str, Any]) -> str | None:
        """The model revision these args ask for (a Hugging Face id resolves there); None: the default one."""
        value = values.get(self.revision_arg) if self.revision_arg else None
        return None if value is None else str(value)  # a string, as the command line gives it to the engine

    def tokenizer(self, values: Mapping[str, Any]) -> str | None:
        """The tokenizer these args name, where it is not the model's; None: the model's."""
        value = values.get(self.tokenizer_arg) if self.tokenizer_arg else None
        return None if value is None else str(value)

    def unsupported_choices(self, key: str, choices: Sequence[Any], platform: str) -> str | None:
        """Why a search over these ``choices`` of ``key`` cannot run on ``platform`` (None: it can)."""
        sizes = self.block_sizes(platform)
        if key != "block_size" or sizes is None:
            return None
        bad = [c for c in choices if c not in sizes]
        return f"block_size {bad} is not supported on {platform}; use {list(sizes)}" if bad else None

    def gpus_per_engine(self, values: Mapping[str, Any]) -> int:
        """The GPUs one engine started with these args holds: a study's GPU time counts each."""
        return 1

    def unsupported(self, key: str, value: Any, platform: str) -> str | None:
        """Why ``key = value`` cannot run on ``platform`` (None: it can)."""
        sizes = self.block_sizes(platform)
        if key == "block_size" and sizes is not None and value not in sizes:
            return f"block_size {value} is not supported on {platform}"
        return None

    def out_of_range(self, key: str, value: Any) -> str | None:
        """What values of ``key`` must be, when ``value`` is not one of them on any platform (None: it may be).

        Called at study load for fixed engine args, search bounds and baseline values, so a value the
        engine always refuses is an error naming the key ("must be <this>, got 1.2"), not a failed trial.
        """
        return None

    def precheck(
        self, shape: ModelShape, args: EngineArgs, platform: str, device_memory_bytes: int | None = None
    ) -> str | None:
        """The reason a candidate provably cannot start (None: it may). Only what is certain."""
        return None

    # the file render_config writes and how to run the engine from it; None: the engine has no config file
    config_file: str | None = None
    config_usage: str = ""

    @property
    def display_name(self) -> str:
        return self.title or self.name

    def render_config(self, model: str, values: Mapping[str, Any], header: Sequence[str] = ()) -> str:
        """The engine's config file for ``values`` (only called when ``config_file`` is set)."""
        raise ConfigError(f"engine kind {self.name!r} has no config file format to publish")

    def parse_config(self, text: str, source: str = "") -> tuple[str | None, dict[str, Any]]:
        """(model, values) from a config file's text; ``source`` names the file in errors."""
        raise ConfigError(f"engine kind {self.name!r} has no config file format to read")

    def container_line(self, model: str, config_path: Path, env: Mapping[str, str], version: str | None) -> str | None:
        """A shell line running the engine's official container on ``config_path``; None: the kind has none."""
        return None

    def production_values(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` without what only a staging engine may run."""
        return {k: v for k, v in values.items() if self.staging_only.get(k, object()) != v}


_REGISTRY: dict[str, str | Callable[[], EngineKind]] = {
    "vllm": "autotune.engine.vllm:VllmKind",
    "vllm-sim": "autotune.sim.kind:VllmSimKind",
}
_DEFAULT = "vllm"
_LOADED: dict[str, EngineKind] = {}


def register(name: str, factory: str | Callable[[], EngineKind]) -> None:
    """Add (or replace) a kind: ``"module:Class"`` is imported on first use."""
    _REGISTRY[name] = factory
    _LOADED.pop(name, None)


def kind_names() -> list[str]:
    return list(_REGISTRY)


def get_kind(name: str) -> EngineKind:
    if name not in _LOADED:
        factory = _REGISTRY.get(name)
        if factory is None:
            raise ConfigError(f"unknown engine kind {name!r}; known: {', '.join(_REGISTRY)}")
        if isinstance(factory, str):
            module, _, attr = factory.partition(":")
            factory = getattr(importlib.import_module(module), attr)
        _LOADED[name] = factory()
    return _LOADED[name]


def kind_for_command(command: Sequence[str]) -> EngineKind:
    """The kind whose ``matches`` accepts ``command``; vLLM when none does."""
    for name in _REGISTRY:
        if name != _DEFAULT and get_kind(name).matches(command):
            return get_kind(name)
    return get_kind(_DEFAULT)
