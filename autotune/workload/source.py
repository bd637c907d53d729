"""Where a run's workload comes from: a trace file or a synthetic scenario, as one spec.

The CLI builds a WorkloadSpec from its flags (the study file will build one from TOML);
``load`` reads or synthesizes the requests and gives every one its text, built with the
model's tokenizer where the workload only has token counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from autotune.errors import ConfigError
from autotune.workload.prompts import PromptBuilder, load_tokenizer, materialize
from autotune.workload.synth import SCENARIOS, synthesize
from autotune.workload.trace import Workload, read_workload

__all__ = ["WorkloadSpec", "load", "parse_range", "LoadSteps"]


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


class LoadSteps:
    """The workload at a load factor, for a fixed duration: what one capacity step replays.

    Every step lasts as long (``duration_s``), so a higher load is a longer stream of requests
    at a higher rate, not the same few requests squeezed into a shorter burst that a big batch
    absorbs. Synthetic workloads draw fresh requests for each load (no accidental prefix-cache
    hits from repeats); a trace is replayed again from its start, shifted in time, when the
    step needs more requests than it holds. Built once per load and kept: trials reuse them.
    """

    def __init__(self, spec: WorkloadSpec, duration_s: float | None = None) -> None:
        self.spec = spec
        self.base = load(spec)
        self.duration_s = duration_s or max(self.base.span_s, 1.0)
        self._cache: dict[float, Workload] = {}

    def at(self, load_factor: float) -> Workload:
        key = round(load_factor, 6)
        if key not in self._cache:
            self._cache[key] = self._build(load_factor)
        return self._cache[key]

    def _build(self, load_factor: float) -> Workload:
        rate = self.base.rate * load_factor
        n = max(2, math.ceil(rate * self.duration_s))
        if self.spec.scenario is not None:
            return load(replace(self.spec, rate=self.spec.rate * load_factor, num_requests=n,
                                seed=self.spec.seed + int(load_factor * 1000)))
        scaled = self.base.scaled(load_factor)
        period = scaled.span_s + (1.0 / rate if math.isfinite(rate) else 0.0)
        reqs = []
        k = 0
        while len(reqs) < n:
            reqs += [replace(r, arrival_s=r.arrival_s + k * period) for r in scaled.requests]
            k += 1
        return Workload(tuple(reqs[:n]), self.base.name)


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
