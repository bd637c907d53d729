"""Durations as people write them in study and daemon files: 90s, 30m, 2h (numbers are seconds)."""

from __future__ import annotations

import re

from autotune.errors import ConfigError

__all__ = ["parse_duration"]


def parse_duration(text: str | int | float, where: str) -> float:
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|min|h)?\s*", text)
    if not m:
        raise ConfigError(f"{where}: {text!r} is not a duration; write e.g. 90s, 30m or 2h")
    return float(m[1]) * {"s": 1, None: 1, "m": 60, "min": 60, "h": 3600}[m[2]]
