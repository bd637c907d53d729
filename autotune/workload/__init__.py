"""Workloads: traces, synthetic scenarios, prompts of exact token counts, and recording production's traffic.

The names below are imported on first use: ``autotune --help`` reads workload/options.py, and nothing of it may
load numpy (source.py and trace.py do).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Request", "Workload", "read_workload", "write_trace", "WorkloadSpec", "load"]

_HOME = {"Request": "trace", "Workload": "trace", "read_workload": "trace", "write_trace": "trace",
         "WorkloadSpec": "source", "load": "source"}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'autotune.workload' has no attribute {name!r}")
    return getattr(importlib.import_module(f"autotune.workload.{_HOME[name]}"), name)
