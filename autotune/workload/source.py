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
from autotune.workload.prompts import PromptBuilder, Tokenizer, load_tokenizer, materialize
from autotune.workload.synth import SCENARIOS, synthesize
from autotune.workload.trace import MAX_TOKENS, Api, Request, Workload, read_workload

__all__ = ["WorkloadSpec", "load", "read", "check", "parse_range", "length_flags", "LoadSteps"]


@dataclass(frozen=True)
class WorkloadSpec:
    trace: Path | None = None  # a trace file; or
    scenario: str | None = None  # a synthetic scenario
    rate: float | None = None  # requests/s: synthetic arrivals, or arrivals for files without them
    num_requests: int = 200
    burstiness: float = 1.0
    seed: int = 0
    overrides: dict[str, object] = field(default_factory=dict)  # scenario ranges, e.g. prompt_tokens=(64, 256)
    api: Api | None = None  # force chat or completion
    output_tokens: int | None = None  # fix every output length
    tokenizer: Path | None = None  # a model directory or tokenizer.json
    # what to do when prompts need a tokenizer and there is none, said for where the spec came from
    no_tokenizer: str = "pass --tokenizer DIR (a directory with tokenizer.json)"

    def __post_init__(self) -> None:
        """Numbers no workload can be made with are errors here, before anything is read or started.

        The messages name the command-line flag and the study file's key: a spec comes from either.
        """
        if self.rate is not None and not self.rate > 0:  # inf is allowed: every request at once
            raise ConfigError(f"the request rate (--rate, [workload].rate) must be positive, got {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ConfigError(
                "burstiness (--burstiness, [workload].burstiness) must be a positive number "
                f"(1: Poisson arrivals, below 1: burstier), got {self.burstiness}"
            )
        if self.num_requests < 0:
            raise ConfigError(f"the number of requests must be 0 (all of a trace) or more, got {self.num_requests}")
        if self.seed < 0:
            raise ConfigError(f"the seed (--seed, [workload].seed) must be 0 or more, got {self.seed}")
        if self.scenario is not None and self.scenario not in SCENARIOS:
            raise ConfigError(f"unknown scenario {self.scenario!r}; choose one of {', '.join(SCENARIOS)}")
        if self.output_tokens is not None and not 1 <= self.output_tokens <= MAX_TOKENS:
            raise ConfigError(f"a fixed output length must be from 1 to {MAX_TOKENS} tokens, got {self.output_tokens}")
        for name, value in self.overrides.items():
            if isinstance(value, tuple) and any(x > MAX_TOKENS for x in value):
                raise ConfigError(f"the workload's {name} go up to {MAX_TOKENS} tokens, got {value[0]}-{value[1]}")


def parse_range(text: str, what: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64-256' -> (64, 256)."""
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ConfigError(f"{what} must be a number or a range like 64-256, got {text!r}") from None
    if a > b or a < 0:
        raise ConfigError(f"{what} range {text!r} must be low-high with 0 <= low <= high")
    if b > MAX_TOKENS:
        raise ConfigError(f"{what} goes up to {MAX_TOKENS} tokens, got {text!r}")
    return a, b


class LoadSteps:
    """The workload at a load factor, for a fixed duration: what one capacity step replays.

    Every step lasts as long (``duration_s``), so a higher load is a longer stream of requests
    at a higher rate (its ``offered_rate``: the base rate x the load, what the step's capacity is
    stated in, so that a higher load is never a lower rate however few requests a step holds), not
    the same few requests squeezed into a shorter burst that a big batch absorbs. Synthetic workloads
    draw fresh requests for each load (no accidental prefix-cache hits from repeats); a trace is replayed
    again from its start, shifted in time, when the step needs more requests than it holds. Built once
    per load and kept: trials reuse them.
    """

    def __init__(self, spec: WorkloadSpec, duration_s: float | None = None) -> None:
        self.spec: WorkloadSpec | None = spec
        self.base = load(spec)
        if not math.isfinite(self.base.rate):
            raise ConfigError(
                f"every request of workload {self.base.name!r} arrives at once: the load steps up from "
                "its rate, so give the requests arrival times over a span, or a finite rate"
            )
        self.duration_s = duration_s or max(self.base.span_s, 1.0)
        self._cache: dict[float, Workload] = {}

    @classmethod
    def of(cls, base: Workload, duration_s: float) -> LoadSteps:
        """The steps of a workload in hand, replayed from its own requests at every load (``repeated``): no
        tokenizer, no prompt built, for what only counts tokens (the simulator, scripts/bench_search.py)."""
        steps = cls.__new__(cls)
        steps.spec, steps.base, steps.duration_s, steps._cache = None, base, duration_s, {}
        return steps

    def at(self, load_factor: float) -> Workload:
        key = round(load_factor, 6)
        if key not in self._cache:
            self._cache[key] = self._build(load_factor)
        return self._cache[key]

    def _build(self, load_factor: float) -> Workload:
        rate = self.base.rate * load_factor
        n = max(2, math.ceil(rate * self.duration_s))
        if self.spec is not None and self.spec.scenario is not None:
            assert self.spec.rate is not None  # a scenario has a rate, or load() refused it in __init__
            drawn = load(
                replace(
                    self.spec,
                    rate=self.spec.rate * load_factor,
                    num_requests=n,
                    seed=self.spec.seed + int(load_factor * 1000),
                )
            )
            return replace(drawn, offered_rate=rate)
        return self.repeated(load_factor)

    def repeated(self, load_factor: float, max_requests: int | None = None) -> Workload:
        """The step at ``load_factor`` made of the base workload's own requests, replayed again from its start
        (shifted in time) as often as the step needs, at most ``max_requests``: a trace's steps, and a cheap
        stand-in for a synthetic one where only token counts matter (the simulator: no prompt is built)."""
        rate = self.base.rate * load_factor
        n = max(2, math.ceil(rate * self.duration_s))
        if max_requests is not None:
            n = min(n, max(2, max_requests))
        scaled = self.base.scaled(load_factor)
        period = scaled.span_s + (1.0 / rate if math.isfinite(rate) else 0.0)
        reqs: list[Request] = []
        k = 0
        while len(reqs) < n:
            reqs += [replace(r, arrival_s=r.arrival_s + k * period) for r in scaled.requests]
            k += 1
        return Workload(tuple(reqs[:n]), self.base.name, offered_rate=rate)


def length_flags(
    prompt_tokens: str | None, prefix_tokens: str | None, output_tokens: str | None, trace: bool
) -> tuple[dict[str, object], int | None]:
    """The length flags of ``autotune bench`` and ``vllm-sim predict`` (``--prompt-tokens N|LO-HI``, ...) as
    (scenario overrides, a trace's fixed output length): a trace takes one output length, not a range."""
    overrides: dict[str, object] = {}
    if prompt_tokens:
        overrides["prompt_tokens"] = parse_range(prompt_tokens, "--prompt-tokens")
    if prefix_tokens:
        overrides["prefix_tokens"] = parse_range(prefix_tokens, "--prefix-tokens")
    fixed_out = None
    if output_tokens:
        lo, hi = parse_range(output_tokens, "--output-tokens")
        if trace:
            if lo != hi:
                raise ConfigError("--output-tokens for a trace file is one fixed length, not a range")
            fixed_out = lo
        else:
            overrides["output_tokens"] = (lo, hi)
    return overrides, fixed_out


def check(spec: WorkloadSpec, *, build_prompts: bool = True) -> bool:
    """Fail as ``load`` would, cheaply: the whole trace is read and checked, a few prompts built.

    With ``build_prompts=False`` (a dry run, which prints command lines only) prompts that need a tokenizer
    there is none of are not built; returns whether every prompt the workload needs could be built."""
    small = replace(spec, num_requests=min(spec.num_requests or 4, 4))
    if build_prompts or small.tokenizer is not None:
        load(small)
        return True
    return all(r.has_text for r in _requests(small, None).requests)


def load(spec: WorkloadSpec) -> Workload:
    tokenizer = load_tokenizer(spec.tokenizer) if spec.tokenizer is not None else None
    workload = _requests(spec, tokenizer)
    if all(r.has_text for r in workload.requests):
        return workload
    if tokenizer is None:
        raise ConfigError(
            "this workload gives prompt lengths in tokens; the prompts are built with the model's "
            f"tokenizer: {spec.no_tokenizer}"
        )
    return materialize(workload, PromptBuilder(tokenizer), seed=spec.seed)


def read(spec: WorkloadSpec) -> Workload:
    """The workload as its source gives it, with no tokenizer: text where the source gives text, else token
    counts and prefix groups (what a simulator needs; ``load`` builds the prompts a real engine needs)."""
    return _requests(spec, None)


def _requests(spec: WorkloadSpec, tokenizer: Tokenizer | None) -> Workload:
    """The trace read, or the scenario synthesized: prompts as text where the source gives text, else lengths."""
    if (spec.trace is None) == (spec.scenario is None):
        raise ConfigError("give a workload: either a trace file (--workload FILE) or a scenario (--scenario chat)")
    if spec.trace is not None:
        return read_workload(
            spec.trace,
            rate=spec.rate,
            burstiness=spec.burstiness,
            seed=spec.seed,
            count_tokens=tokenizer.count if tokenizer else None,
            output_tokens=spec.output_tokens,
            api=spec.api,
            limit=spec.num_requests if spec.num_requests else None,
        )
    if spec.rate is None:
        raise ConfigError("a synthetic workload needs a request rate, e.g. --rate 4")
    overrides = dict(spec.overrides)
    if spec.api is not None:
        overrides["api"] = spec.api
    if spec.output_tokens is not None:
        overrides["output_tokens"] = (spec.output_tokens, spec.output_tokens)
    assert spec.scenario is not None  # no trace: a scenario (checked above)
    scenario = SCENARIOS[spec.scenario].with_overrides(**overrides)
    return synthesize(
        scenario, rate=spec.rate, num_requests=spec.num_requests, burstiness=spec.burstiness, seed=spec.seed
    )
