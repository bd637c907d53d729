"""The workload and replay flags that ``autotune bench``, ``autotune replay`` and ``vllm-sim predict`` share.

One definition of the flags (``add_arguments``) and one of what they mean (``WorkloadOptions``):
both command lines fill the type from their parsed flags (``WorkloadOptions.from_args``), which
checks the numbers (``check``: one ``ConfigError`` line for the first bad one, before anything is
read or started) and builds the workload's ``WorkloadSpec`` (``spec``). The replay's numbers are
plain values here; each command hands them to its own replay (the replay client, or the
simulator's virtual one).

``vllm-sim predict`` takes ``--seed`` and ``--tokenizer`` from vLLM's own flags, and has no
request timeout (nothing runs in real time): ``add_arguments`` leaves those out when asked.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.workload.source import WorkloadSpec
    from autotune.workload.trace import Api

__all__ = ["WorkloadOptions", "add_arguments"]

SCENARIO_REQUESTS = 200  # a scenario's requests when --requests is not given
WORKLOAD_TITLE = "workload (a trace file or a synthetic scenario)"
REPLAY_TITLE = "replay"


@dataclass(frozen=True)
class WorkloadOptions:
    """The workload flags as given (lengths still text: ``N`` or ``LO-HI``) and the replay's numbers.

    An instance is checked when made (``check``): a bad number is a ConfigError here.
    """

    # the workload
    workload: Path | None = None  # a trace file; or
    scenario: str | None = None  # a synthetic scenario
    rate: float | None = None  # requests/s: synthetic arrivals, or arrivals for files without them
    requests: int | None = None  # None: SCENARIO_REQUESTS of a scenario, all of a trace file
    burstiness: float = 1.0
    seed: int = 0
    prompt_tokens: str | None = None
    output_tokens: str | None = None
    prefix_tokens: str | None = None
    api: Api | None = None  # force completion or chat
    tokenizer: Path | None = None  # --tokenizer as given; the command knows its default
    # the replay
    load: float = 1.0
    max_concurrency: int | None = None
    warmup: int = 4
    request_timeout: float = 600.0  # seconds per request
    workers: int | None = None  # replay worker processes; None: as the load's token rate needs (replay.workers_for)

    @classmethod
    def names(cls) -> frozenset[str]:
        """The fields' names, which are the flags' argparse dests."""
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def from_args(cls, ns: argparse.Namespace, **given: Any) -> WorkloadOptions:
        """The options a parsed command line holds (the flags ``add_arguments`` added), checked (``check``).

        ``given`` sets those the command reads elsewhere (``vllm-sim predict``: vLLM's ``--seed``,
        ``--tokenizer``); a field that is neither keeps its default.
        """
        names = cls.names()
        return cls(**{**{k: v for k, v in vars(ns).items() if k in names}, **given})

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse what no replay can run with, in one line naming the flag (WorkloadSpec checks the rest)."""
        from autotune.workload.source import length_flags

        length_flags(self.prompt_tokens, self.prefix_tokens, self.output_tokens, self.workload is not None)
        if self.requests is not None and self.requests < 1:
            raise ConfigError("--requests must be at least 1")
        if not (self.load > 0 and math.isfinite(self.load)):
            raise ConfigError(f"--load must be a positive number, got {self.load}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError("--max-concurrency must be at least 1")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be 0 or more requests, got {self.warmup}")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"--workers must be at least 1 process, got {self.workers}")
        if not self.request_timeout > 0:
            raise ConfigError(f"--request-timeout must be a positive number of seconds, got {self.request_timeout}")

    @property
    def num_requests(self) -> int:
        """WorkloadSpec's count: ``--requests``, else a scenario's default and all of a trace (0)."""
        if self.requests is not None:
            return self.requests
        return 0 if self.workload is not None else SCENARIO_REQUESTS

    def spec(self, tokenizer: Path | None, no_tokenizer: str | None = None) -> WorkloadSpec:
        """The workload to load: ``tokenizer`` builds the prompts (``--tokenizer``, or the command's default);
        ``no_tokenizer`` says what to do when prompts need one and there is none (default: WorkloadSpec's)."""
        from autotune.workload.source import WorkloadSpec, length_flags

        overrides, fixed_out = length_flags(
            self.prompt_tokens, self.prefix_tokens, self.output_tokens, self.workload is not None
        )
        spec = WorkloadSpec(
            trace=self.workload,
            scenario=self.scenario,
            rate=self.rate,
            num_requests=self.num_requests,
            burstiness=self.burstiness,
            seed=self.seed,
            overrides=overrides,
            api=self.api,
            output_tokens=fixed_out,
            tokenizer=tokenizer,
        )
        return spec if no_tokenizer is None else replace(spec, no_tokenizer=no_tokenizer)


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    workload_title: str = WORKLOAD_TITLE,
    replay_title: str = REPLAY_TITLE,
    seed_and_tokenizer: bool = True,
    request_timeout: bool = True,
) -> argparse._ArgumentGroup:
    """Add the workload flags and the replay flags to ``parser``, in two groups; returns the replay group.

    ``seed_and_tokenizer=False`` leaves out ``--seed`` and ``--tokenizer`` (a parser that has them
    already), ``request_timeout=False`` leaves out ``--request-timeout``.
    """
    d = WorkloadOptions  # the class: its attributes are the fields' defaults (an instance would be checked)
    g = parser.add_argument_group(workload_title)
    g.add_argument("--workload", type=Path, help="trace: autotune JSONL, vllm bench custom JSONL, or ShareGPT JSON")
    g.add_argument("--scenario", help="synthetic: chat, long-docs or high-concurrency")
    g.add_argument("--rate", type=float, help="arrival rate in requests/s (synthetic, or files without arrival times)")
    g.add_argument(
        "--requests",
        type=int,
        help=f"number of requests (default: {SCENARIO_REQUESTS} of a scenario, every request of a --workload file)",
    )
    g.add_argument(
        "--burstiness", type=float, default=d.burstiness, help="gamma shape of arrivals; 1 = Poisson (default)"
    )
    if seed_and_tokenizer:
        g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--prompt-tokens", help="override the scenario's prompt length: N or LO-HI")
    g.add_argument("--output-tokens", help="scenario output length N or LO-HI; for a file, a fixed N")
    g.add_argument("--prefix-tokens", help="override the scenario's shared prefix length: N or LO-HI")
    g.add_argument("--api", choices=("completion", "chat"), help="force the API for every request")
    if seed_and_tokenizer:
        g.add_argument("--tokenizer", type=Path, help="model directory with tokenizer.json (bench: the model's own)")
    r = parser.add_argument_group(replay_title)
    r.add_argument("--load", type=float, default=d.load, help=f"multiply the arrival rate (default {d.load:g})")
    r.add_argument("--max-concurrency", type=int, help="cap on requests in flight (default: none, open loop)")
    r.add_argument("--warmup", type=int, default=d.warmup, help=f"unmeasured warm-up requests (default {d.warmup})")
    r.add_argument(
        "--workers",
        type=int,
        help="processes that send and time the requests (default: one per 20,000 output tok/s the load needs, "
        "up to a quarter of the cores)",
    )
    if request_timeout:
        r.add_argument(
            "--request-timeout",
            type=float,
            default=d.request_timeout,
            help=f"seconds per request (default {d.request_timeout:g})",
        )
    return r
