"""Where a run's workload comes from: a trace file or a synthetic scenario, as one spec.

The CLI builds a WorkloadSpec from its flags (the study file will build one from TOML);
``load`` reads or synthesizes the requests and gives every one its text, built with the
model's tokenizer where the workload only has token counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from autotune.errors import ConfigError
from autotune.workload.prompts import PromptBuilder, load_tokenizer, materialize
from autotune.workload.synth import SCENARIOS, synthesize
from autotune.workload.trace import Workload, read_workload

__all__ = ["WorkloadSpec", "load", "parse_range"]


@dataclass(frozen=True)
class WorkloadSpec:
    trace: Path | None = None  # a trace file; or
    scenario: str | None = None  # a synthetic scenario
    rate: float | None = None  # requests/s: synthetic arrivals, or arrivals for files without them
    num_requests: int = 200
    burstiness: float = 1.0
    seed: int = 0
    overrides: dict[str, object] = field(default_factory=dict)  # scenario ranges, e.g. prompt_tokens=(64, 256)
    api: str | None = None  # force chat or completion
    output_tokens: int | None = None  # fix every output length
    tokenizer: Path | None = None  # a model directory or tokenizer.json


def parse_range(text: str, what: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64-256' -> (64, 256)."""
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ConfigError(f"{what} must be a number or a range like 64-256, got {text!r}") from None
    if a > b or a < 0:
        raise ConfigError(f"{what} range {text!r} must be low-high with 0 <= low <= high")
    return a, b


def load(spec: WorkloadSpec) -> Workload:
    if (spec.trace is None) == (spec.scenario is None):
        raise ConfigError("give a workload: either a trace file (--workload FILE) or a scenario (--scenario chat)")
    tokenizer = load_tokenizer(spec.tokenizer) if spec.tokenizer is not None else None
    if spec.trace is not None:
        workload = read_workload(
            spec.trace, rate=spec.rate, burstiness=spec.burstiness, seed=spec.seed,
            count_tokens=tokenizer.count if tokenizer else None, output_tokens=spec.output_tokens,
            api=spec.api, limit=spec.num_requests if spec.num_requests else None,
        )
    else:
        if spec.scenario not in SCENARIOS:
            raise ConfigError(f"unknown scenario {spec.scenario!r}; choose one of {', '.join(SCENARIOS)}")
        if spec.rate is None:
            raise ConfigError("a synthetic workload needs a request rate, e.g. --rate 4")
        overrides = dict(spec.overrides)
        if spec.api is not None:
            overrides["api"] = spec.api
        if spec.output_tokens is not None:
            overrides["output_tokens"] = (spec.output_tokens, spec.output_tokens)
        scenario = SCENARIOS[spec.scenario].with_overrides(**overrides)
        workload = synthesize(scenario, rate=spec.rate, num_requests=spec.num_requests,
                              burstiness=spec.burstiness, seed=spec.seed)
    if all(r.has_text for r in workload.requests):
        return workload
    if tokenizer is None:
        raise ConfigError("this workload gives prompt lengths in tokens; the prompts are built with the model's "
                          "tokenizer: pass --tokenizer DIR (a directory with tokenizer.json)")
    return materialize(workload, PromptBuilder(tokenizer), seed=spec.seed)
