"""Workloads: traces, synthetic scenarios, prompts of exact token counts, and recording production's traffic."""

from autotune.workload.source import WorkloadSpec, load
from autotune.workload.trace import Request, Workload, read_workload, write_trace

__all__ = ["Request", "Workload", "read_workload", "write_trace", "WorkloadSpec", "load"]
