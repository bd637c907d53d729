"""Measuring an engine: replay over HTTP, latency metrics, SLO verdicts, load profiles, one session function."""

from autotune.measure.metrics import RequestResult, Summary, summarize
from autotune.measure.profiles import FixedLoad, Ladder, LoadProfile
from autotune.measure.replay import Replay, ReplayOptions, run_replay
from autotune.measure.session import Outcome, Step, measure_engine, measure_url
from autotune.measure.slo import SLO, Verdict, parse_slo, parse_slos

__all__ = [
    "RequestResult",
    "Summary",
    "summarize",
    "FixedLoad",
    "Ladder",
    "LoadProfile",
    "Replay",
    "ReplayOptions",
    "run_replay",
    "Outcome",
    "Step",
    "measure_engine",
    "measure_url",
    "SLO",
    "Verdict",
    "parse_slo",
    "parse_slos",
]
