"""Workloads (traces, synthetic scenarios), their replay over HTTP, and how it is measured and judged."""

from autotune.workload.metrics import RequestResult, Summary, summarize
from autotune.workload.replay import Replay, ReplayOptions, run_replay
from autotune.workload.slo import SLO, Verdict, parse_slo, parse_slos
from autotune.workload.source import WorkloadSpec, load
from autotune.workload.trace import Request, Workload, read_workload, write_trace

__all__ = [
    "Request", "Workload", "read_workload", "write_trace", "WorkloadSpec", "load",
    "Replay", "ReplayOptions", "run_replay", "RequestResult", "Summary", "summarize",
    "SLO", "Verdict", "parse_slo", "parse_slos",
]
