"""The search space: typed parameters, each mapped to an engine flag or an environment variable.

A Space turns an Optuna trial (or a baseline's values) into EngineArgs. The engine's own rules
are kept by construction, so no trial is lost to ``invalid-args``: the engine kind moves a
point into what the engine accepts (``EngineKind.apply_rules``; for vLLM, the batched-tokens
rules) and names the block sizes the platform takes; a conditional parameter
(``when = "enable_chunked_prefill"``) is only sampled when its switch is on, and never passed
to the engine otherwise.

Where a rule moves a sampled value, the moved value is what runs (the trial records the exact
argv); Optuna keeps the sampled one, so the search space stays fixed across trials.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from autotune.configfile import Table, show
from autotune.engine.args import EngineArgs, Value
from autotune.engine.kind import EngineKind, get_kind
from autotune.errors import ConfigError

__all__ = ["Param", "Space", "default_space", "Suggest", "check_range"]

_KINDS = ("int", "float", "bool", "categorical")


class Suggest(Protocol):
    """What a Space needs from an Optuna trial (optuna.Trial satisfies it)."""

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int: ...
    def suggest_float(
        self, name: str, low: float, high: float, *, step: float | None = None, log: bool = False
    ) -> float: ...
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
    origin: str = field(default="", compare=False, repr=False)  # how messages name it: "s.toml [space].x"

    def __post_init__(self) -> None:
        where = self.origin or f"space parameter {self.name!r}"
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

    @classmethod
    def from_table(cls, name: str, spec: Any, where: str, engine: EngineKind | None = None) -> Param:
        """A parameter from a study's ``[space]`` entry: ``{ type = "int", low = 8, high = 256, default = 128 }``.

        With ``engine``, each value written is checked against its ranges too (``EngineKind.out_of_range``).
        """
        if not isinstance(spec, dict):
            raise ConfigError(f'{where} must be a table like {{ type = "int", low = 8, high = 256, default = 128 }}')
        t = Table(spec, where, see="see 'Writing a study' in docs/study-file.md")
        t.only(("type", "default", "low", "high", "step", "log", "choices", "env", "when"))
        kind = t.string("type", choices=_KINDS)
        default = t.value("default")
        if kind == "int":
            low, high, step = t.integer("low", None), t.integer("high", None), t.integer("step", None, at_least=1)
        else:
            low, high, step = t.number("low", None), t.number("high", None), t.number("step", None, above=0)
        choices = t.value("choices", [])
        if not isinstance(choices, list) or not all(isinstance(c, (str, int, float)) for c in choices):
            raise t.wrong("choices", "a list of strings, numbers or booleans")
        p = cls(
            name=name,
            kind=kind,
            default=default,
            low=low,
            high=high,
            step=step,
            log=t.boolean("log", False),
            choices=tuple(choices),
            env=t.boolean("env", False),
            when=t.string("when", None),
            origin=where,
        )
        try:
            p.check(p.default)
        except ConfigError as e:
            raise ConfigError(f"{t.name('default')}: {e}") from None
        if engine is not None:
            given = [(key, spec[key]) for key in ("low", "high", "default") if key in spec]
            for label, value in [*given, *(("choices", c) for c in choices)]:
                check_range(engine, name, value, t.name(label))
        return p

    def _bounds(self) -> tuple[float, float]:
        """(low, high) of an int or float parameter, which __post_init__ made sure are both given."""
        assert self.low is not None and self.high is not None
        return self.low, self.high

    def sample(self, trial: Suggest) -> Value:
        if self.kind == "int":
            low, high = self._bounds()
            return trial.suggest_int(self.name, int(low), int(high), step=int(self.step or 1), log=self.log)
        if self.kind == "float":
            low, high = self._bounds()
            value = trial.suggest_float(self.name, float(low), float(high), step=self.step, log=self.log)
            # Optuna's stepped floats are low + k * step in binary (0.8700000000000001): the value the engine,
            # the console and a published config see is the decimal the step means
            return round(value, 10) if self.step else value
        if self.kind == "bool":
            return trial.suggest_categorical(self.name, (False, True))
        return trial.suggest_categorical(self.name, self.choices)

    def grid_values(self, points: int = 4) -> tuple[Value, ...]:
        """A few values spanning the parameter (its choices; a range's ends, evenly spaced on its scale, and the
        default), for scoring a space point by point without a sampler."""
        if self.kind == "bool":
            return (False, True)
        if self.kind == "categorical":
            return tuple(self.choices)
        low, high = self._bounds()
        lo, hi = float(low), float(high)
        ts = [i / (points - 1) for i in range(points)] if points > 1 else [0.0]
        raw = [lo * (hi / lo) ** t if self.log else lo + (hi - lo) * t for t in ts]
        if isinstance(self.default, (int, float)) and not isinstance(self.default, bool) and lo <= self.default <= hi:
            raw.append(float(self.default))
        out: list[Value] = []
        for x in sorted(raw):
            if self.step:
                x = lo + round((x - lo) / self.step) * self.step
            v = round(x) if self.kind == "int" else round(x, 10)
            if lo <= v <= hi and v not in out:
                out.append(v)
        return tuple(out)

    def expects(self, value: Any) -> str | None:
        """What a value of this parameter is, when ``value`` is not of its type (None: it is)."""
        if self.kind == "bool":
            return None if isinstance(value, bool) else "true or false"
        if self.kind in ("int", "float") and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return "a number"
        return None

    def check(self, value: Value) -> Value:
        """A given value (a baseline's), checked against the parameter's type and range."""
        where = f"value {value!r} for {self.name!r}"
        if (expected := self.expects(value)) is not None:
            raise ConfigError(f"{where}: expected {expected}")
        if self.kind == "bool":
            return value
        if self.kind == "categorical":
            if value not in self.choices:
                raise ConfigError(f"{where}: not one of {list(self.choices)}")
            return value
        assert isinstance(value, (int, float))  # expects() said so, for an int or float parameter
        low, high = self._bounds()
        if not low <= value <= high:
            raise ConfigError(f"{where}: outside {self.low}..{self.high}")
        return int(value) if self.kind == "int" else float(value)


@dataclass(frozen=True)
class Space:
    params: tuple[Param, ...]
    platform: str = "cuda"
    fixed: EngineArgs = field(default_factory=EngineArgs)  # every trial's args (max_model_len, dtype, ...)
    max_model_len: int | None = None  # the model's context when not fixed: for the chunked-prefill rule
    engine: EngineKind = field(default_factory=lambda: get_kind("vllm"))  # whose rules and block sizes apply

    def __post_init__(self) -> None:
        names = {p.name for p in self.params}
        for p in self.params:
            if p.when is not None:
                dep = next((q for q in self.params if q.name == p.when), None)
                if dep is None or dep.kind != "bool":
                    raise ConfigError(f"space parameter {p.name!r}: when = {p.when!r} must name a bool parameter")
            why = self.engine.unsupported_choices(p.name, p.choices, self.platform) if p.kind == "categorical" else None
            if why is not None:
                raise ConfigError(why)
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
        flags = self.engine.apply_rules({**self.fixed.values, **flags, **(extra or {})}, self.max_model_len)
        return EngineArgs(flags, {**self.fixed.env, **env})

    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def candidates(self, limit: int = 48, seed: int = 0) -> list[dict[str, Value]]:
        """The space as a grid of points (``Param.grid_values``; a parameter switched off by its ``when`` is left
        out), or ``limit`` of them drawn without replacement when the grid is larger: what a study scores in
        virtual time before it measures anything."""
        import random

        points: list[dict[str, Value]] = [{}]
        for p in self.params:  # declaration order: a switch comes before what depends on it
            grown = []
            for point in points:
                if p.when is not None and not point.get(p.when, False):
                    grown.append(point)
                    continue
                grown.extend({**point, p.name: v} for v in p.grid_values())
            points = grown
        if len(points) > limit:
            points = random.Random(seed).sample(points, limit)
        return points

    def with_fixed(self, fixed: EngineArgs, max_model_len: int | None) -> Space:
        return replace(self, fixed=fixed, max_model_len=max_model_len)


def default_space(
    engine: EngineKind, platform: str, gpu_memory_gib: float = 0.0, gpu_name: str = ""
) -> tuple[Param, ...]:
    """The engine kind's default space for the platform and GPU (each default the engine's own)."""
    table = engine.default_space(platform, gpu_memory_gib, gpu_name)
    return tuple(
        Param.from_table(name, spec, f"{engine.name} default space: {name}", engine) for name, spec in table.items()
    )


def check_range(engine: EngineKind, key: str, value: Any, where: str) -> None:
    """A ConfigError naming ``where`` when ``value`` is one ``engine`` never takes for ``key``."""
    expected = engine.out_of_range(key, value)
    if expected is not None:
        raise ConfigError(f"{where} must be {expected}, got {show(value)}")
