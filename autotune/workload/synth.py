"""Synthetic workloads for the scenarios operators tune for (shared/seeds/ describes them).

    chat              a few long shared system prompts (1k-4k tokens) + short user turns; chat API
    long-docs         long documents (1k-8k tokens) with short answers; nothing shared
    high-concurrency  many short prompts and answers at a high rate

Lengths are drawn uniformly from each range; arrivals are gamma (burstiness 1 = Poisson).
Every range can be overridden, e.g. to fit the tiny CPU model's context. The result has
token counts only; ``prompts.materialize`` turns them into text with the model's tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from autotune.errors import ConfigError
from autotune.workload.trace import Api, Request, Workload, gamma_arrivals

__all__ = ["Scenario", "SCENARIOS", "synthesize"]

Range = tuple[int, int]


@dataclass(frozen=True)
class Scenario:
    name: str
    prompt_tokens: Range  # the request's own part (after any shared prefix)
    output_tokens: Range
    prefix_tokens: Range = (0, 0)  # shared prefix length per group; (0, 0): none
    prefix_groups: int = 0
    api: Api = "completion"
    description: str = ""

    def with_overrides(self, **kw: object) -> Scenario:
        known = {f.name for f in fields(self)}
        bad = set(kw) - known
        if bad:
            raise ConfigError(f"scenario {self.name!r} has no setting {', '.join(sorted(bad))}")
        given: dict[str, Any] = {k: v for k, v in kw.items() if v is not None}  # as written: checked below
        new = replace(self, **given)
        for name in ("prompt_tokens", "output_tokens", "prefix_tokens"):
            lo, hi = getattr(new, name)
            if lo > hi or lo < 0 or (name != "prefix_tokens" and lo < 1):
                raise ConfigError(f"scenario {new.name!r}: {name} range {lo}-{hi} is not a valid range")
        return new


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "chat",
            prompt_tokens=(50, 400),
            output_tokens=(100, 400),
            prefix_tokens=(1024, 4096),
            prefix_groups=4,
            api="chat",
            description="assistants with long shared system prompts: prefix caching pays",
        ),
        Scenario(
            "long-docs",
            prompt_tokens=(1024, 8192),
            output_tokens=(100, 500),
            description="summarising or asking about long documents: prefill-heavy, chunked prefill matters",
        ),
        Scenario(
            "high-concurrency",
            prompt_tokens=(32, 256),
            output_tokens=(32, 256),
            description="many short requests at once: max_num_seqs and batching matter",
        ),
    )
}


def _draw(rng: np.random.Generator, r: Range) -> int:
    return int(rng.integers(r[0], r[1] + 1))


def synthesize(
    scenario: Scenario | str, *, rate: float, num_requests: int, burstiness: float = 1.0, seed: int = 0
) -> Workload:
    if isinstance(scenario, str):
        if scenario not in SCENARIOS:
            raise ConfigError(f"unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}")
        scenario = SCENARIOS[scenario]
    if num_requests < 1:
        raise ConfigError("a synthetic workload needs at least one request")
    if not rate > 0:
        raise ConfigError(f"request rate must be positive, got {rate}")
    rng = np.random.default_rng(seed)
    groups = (
        [(f"{scenario.name}-system-{g}", _draw(rng, scenario.prefix_tokens)) for g in range(scenario.prefix_groups)]
        if scenario.prefix_tokens[1] > 0
        else []
    )
    times = gamma_arrivals(num_requests, rate, burstiness, seed)
    reqs = []
    for t in times:
        own = _draw(rng, scenario.prompt_tokens)
        group, prefix = groups[int(rng.integers(len(groups)))] if groups else (None, 0)
        reqs.append(
            Request(
                arrival_s=t,
                output_tokens=_draw(rng, scenario.output_tokens),
                prompt_tokens=own + prefix,
                prefix_group=group,
                prefix_tokens=prefix,
                api=scenario.api,
            )
        )
    return Workload(tuple(reqs), scenario.name)
