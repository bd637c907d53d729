"""The search benchmark's scores and their uncertainty (scripts/bench_search.py's runs, as its --json writes them).

A run is scored on the config it declares to a user after each trial: its *curve*, (GPU-hours so far, the declared
config's expected capacity as a share of the truth's optimum) after each declaration, and a last point at the run's
total GPU-hours. From it:

- **the declared share at a budget** (GPU-hours per GPU of the engine): what the user would hold had the run been
  stopped there (0 before the first declaration; a run that ended before the budget keeps its last declaration);
- **the restricted mean GPU-hours to 95 %**: the mean over runs of the GPU-hours per GPU until the declared config is
  within 95 % of the optimum and stays there, where a run that never gets there (or gets there past the cap) counts
  at the cap. It is the area under the Kaplan-Meier curve of "not there yet" up to the cap, with every run that ends
  short of 95 % held at the cap: a run that has ended hands its user what it declared, it never gets there later.

Every figure has a bootstrap 95 % interval over the truths; two strategies are compared on the same truths (paired:
one resample of truths serves both), within a scenario and pooled over scenarios (truths resampled within each).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

TARGET = 0.95
BUDGETS = (0.25, 0.5, 1.0, 2.0)  # GPU-hours per GPU of the engine
CAP = BUDGETS[-1]  # the restricted mean's horizon
RESAMPLES = 2000


def share_at(curve: Sequence[Sequence[float]], hours: float) -> float:
    """The declared config's share of the optimum once ``hours`` are spent (the curve's hours, not per GPU)."""
    return next((share for h, share in reversed(curve) if h <= hours + 1e-9), 0.0)


def hours_to_target(curve: Sequence[Sequence[float]]) -> float | None:
    """The GPU-hours from which the declared config is within TARGET of the optimum to the run's end; None: it is
    not at the end."""
    at = None
    for hours, share in curve:
        at = (hours if at is None else at) if share >= TARGET else None
    return at


def restricted(hours: float | None, gpus: int, cap: float = CAP) -> float:
    """One run's contribution to the restricted mean: its GPU-hours per GPU to TARGET, at most ``cap``."""
    return cap if hours is None else min(hours / gpus, cap)


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float

    def excludes(self, x: float) -> bool:
        return not self.low <= x <= self.high

    def show(self, fmt: str = "{:.2f}") -> str:
        return f"{fmt.format(self.value)} [{fmt.format(self.low)}, {fmt.format(self.high)}]"


def bootstrap(
    groups: Sequence[Sequence[Any]], stat: Callable[[list[Any]], float], *, seed: int = 0, resamples: int = RESAMPLES
) -> Interval:
    """``stat`` of the pooled items of ``groups`` and its percentile 95 % interval, resampling items with replacement
    within each group (a group: one scenario's truths; an item: whatever ``stat`` reads of one truth)."""
    pooled = [x for g in groups for x in g]
    value = stat(pooled)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        sample = [g[i] for g in groups if g for i in rng.integers(0, len(g), len(g))]
        draws.append(stat(sample))
    finite = [d for d in draws if math.isfinite(d)]
    if not finite:
        return Interval(value, math.nan, math.nan)
    low, high = np.percentile(finite, [2.5, 97.5])
    return Interval(value, float(low), float(high))


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def ratio_of_means(pairs: list[tuple[float, float]]) -> float:
    below = sum(b for _, b in pairs)
    return sum(a for a, _ in pairs) / below if below > 0 else math.nan


@dataclass(frozen=True)
class RunScore:
    """What the tables read of one run."""

    scenario: str
    truth: int  # the seed: the same truth for every strategy
    strategy: str
    shares: tuple[float, ...]  # the declared share at each of BUDGETS
    to_target: float  # restricted GPU-hours per GPU to TARGET

    @classmethod
    def of(cls, run: dict[str, Any], gpus: int) -> RunScore:
        curve = run["curve"]
        return cls(
            run["scenario"],
            run["seed"],
            run["strategy"],
            tuple(share_at(curve, b * gpus) for b in BUDGETS),
            restricted(hours_to_target(curve), gpus),
        )


def by_truth(scores: list[RunScore], strategy: str) -> dict[tuple[str, int], RunScore]:
    return {(s.scenario, s.truth): s for s in scores if s.strategy == strategy}


def paired(
    scores: list[RunScore], a: str, b: str, read: Callable[[RunScore], float], scenarios: Sequence[str]
) -> list[list[tuple[float, float]]]:
    """Per scenario, (a's value, b's value) on each truth both ran."""
    mine, theirs = by_truth(scores, a), by_truth(scores, b)
    return [
        [(read(mine[k]), read(theirs[k])) for k in sorted(mine) if k in theirs and k[0] == name] for name in scenarios
    ]


def strategy_rows(scores: list[RunScore], order: Sequence[str]) -> list[tuple[str, ...]]:
    """Per scenario and strategy: the mean declared share at each budget and the restricted mean GPU-hours per GPU
    to TARGET, each with its interval, and the truths it ran."""
    rows = []
    for name in dict.fromkeys(s.scenario for s in scores):
        for strategy in [x for x in order if any(s.strategy == x and s.scenario == name for s in scores)]:
            mine = [s for s in scores if s.scenario == name and s.strategy == strategy]
            shares = [bootstrap([[s.shares[i] for s in mine]], mean).show("{:.0%}") for i in range(len(BUDGETS))]
            rows.append(
                (name, strategy, *shares, bootstrap([[s.to_target for s in mine]], mean).show(), str(len(mine)))
            )
    return rows


def comparison_rows(scores: list[RunScore], ours: str, order: Sequence[str]) -> list[tuple[str, ...]]:
    """``ours`` against every other strategy, per scenario and pooled: the mean paired difference of the declared
    share at 0.5 and 1 GPU-hours per GPU, and the ratio of restricted mean GPU-hours to TARGET, with intervals."""
    names = list(dict.fromkeys(s.scenario for s in scores))
    rows = []
    for other in [x for x in order if x != ours and any(s.strategy == x for s in scores)]:
        for label, groups in [*((n, [n]) for n in names), ("pooled", names)]:
            cells = []
            for i in (BUDGETS.index(0.5), BUDGETS.index(1.0)):
                pairs = paired(scores, ours, other, lambda s, i=i: s.shares[i], groups)
                cells.append(bootstrap([[a - b for a, b in g] for g in pairs], mean).show("{:+.0%}"))
            pairs = paired(scores, ours, other, lambda s: s.to_target, groups)
            n = sum(map(len, pairs))
            if n:
                rows.append((label, f"{ours} vs {other}", *cells, bootstrap(pairs, ratio_of_means).show(), str(n)))
    return rows


def print_rows(header: Sequence[str], rows: list[tuple[str, ...]]) -> None:
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def print_scores(scores: list[RunScore], order: Sequence[str], ours: str = "autotune") -> None:
    budgets = [f"declared share at {b:g} GPU-h/GPU" for b in BUDGETS]
    print_rows(
        ["scenario", "strategy", *budgets, f"restricted mean GPU-h/GPU to 95 % (cap {CAP:g})", "truths"],
        strategy_rows(scores, order),
    )
    if any(s.strategy == ours for s in scores):
        print_rows(
            [
                "scenario",
                "paired",
                "share difference at 0.5 GPU-h/GPU",
                "at 1 GPU-h/GPU",
                "ratio of restricted mean GPU-h to 95 %",
                "truths",
            ],
            comparison_rows(scores, ours, order),
        )


def confirming_hours(run: dict[str, Any], budget: int) -> tuple[float, float]:
    """(GPU-hours spent confirming the winner after the search, GPU-hours in all) of one run; runs stored before
    trials said so: every trial past the search's ``budget``."""
    trials = run["trials"]
    confirms = [t.get("confirms", i >= budget) for i, t in enumerate(trials)]
    spent = [t["gpu_s"] / 3600 for t in trials]
    return sum(s for s, c in zip(spent, confirms, strict=True) if c), sum(spent)


def handed_baseline(run: dict[str, Any], baselines: set[str]) -> bool:
    """Whether the run ends declaring a baseline while it has measured (started) a config at least 1/TARGET times
    its expected capacity. Runs stored before they kept their declared keys: the last declared share is matched to
    the baselines' expected shares (the first measured config with that share)."""
    trials = [t for t in run["trials"] if t["expected"] > 0 or t["measured"] > 0]
    if not trials:
        return False
    optimum = run["optimum"]
    if "declared" in run:
        last = run["declared"][-1]
        expected = next((t["expected"] for t in run["trials"] if t["key"] == last), 0.0)
        is_baseline = last in baselines
    else:
        share = run["curve"][-1][1]
        match = next((t for t in run["trials"] if round(t["expected"] / optimum, 2) == share), None)
        if match is None:
            return False
        expected, is_baseline = match["expected"], match["key"] in baselines
    return is_baseline and any(t["expected"] * TARGET > expected and t["measured"] > 0 for t in trials)


def confirmation_rows(
    dump: list[dict[str, Any]], budget: int, baselines: Callable[[str], set[str]]
) -> list[tuple[str, ...]]:
    """Per strategy that confirms its winner: the share of its GPU-hours spent confirming, and how many runs end
    handing the user a baseline while a better config was measured."""
    rows = []
    for strategy in dict.fromkeys(d["strategy"] for d in dump if d["strategy"]):
        runs = [d for d in dump if d["strategy"] == strategy]
        hours = [confirming_hours(d, budget) for d in runs]
        confirming = [(c, t) for c, t in hours if c > 0]
        if not confirming:
            continue
        shares = [c / t for c, t in confirming]
        handed = sum(handed_baseline(d, baselines(d["scenario"])) for d in runs)
        rows.append(
            (
                strategy,
                f"{min(shares):.0%}-{max(shares):.0%} (pooled "
                f"{sum(c for c, _ in confirming) / sum(t for _, t in confirming):.0%})",
                f"{handed}/{len(runs)}",
            )
        )
    return rows
