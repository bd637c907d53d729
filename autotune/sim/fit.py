"""Fitting vllm-sim's constants to measurements: a small, dependency-free coordinate search.

The simulator is a discrete-event model (a scheduler stepping a roofline), so its predictions
are piecewise smooth in its constants at best; a gradient-free search on a log-error loss is
the honest tool. ``fit`` takes named constants with their bounds, a function that scores a
candidate (lower is better: ``log_loss`` of predicted vs measured pairs), and refines one
constant at a time on a shrinking grid until nothing moves. It is what
``scripts/bench_sim_fidelity.py --fit`` uses on the fit part of bench/sim_calibration.toml, and
what a host's self-calibration can use on its own trials.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

__all__ = ["fit", "log_loss", "spearman"]


def log_loss(pairs: Iterable[tuple[float, float]]) -> float:
    """Mean squared log ratio of (measured, predicted) pairs: symmetric in over- and under-prediction."""
    errs = [math.log(p / m) ** 2 for m, p in pairs if m > 0 and p > 0]
    return sum(errs) / len(errs) if errs else math.inf


def fit(
    loss: Callable[[dict[str, float]], float],
    start: Mapping[str, float],
    bounds: Mapping[str, tuple[float, float]],
    *,
    points: int = 7,
    rounds: int = 4,
) -> tuple[dict[str, float], float]:
    """(the constants minimising ``loss``, its value), by coordinate search on shrinking grids.

    Each round scans every constant over ``points`` values across its current window (the other
    constants held), keeps the best, and halves the window around it. Deterministic.
    """
    best = dict(start)
    best_loss = loss(best)
    window = {k: 2 * (hi - lo) for k, (lo, hi) in bounds.items()}  # the first round spans the bounds
    for _ in range(rounds):
        for k, (lo, hi) in bounds.items():
            a = max(lo, best[k] - window[k] / 2)
            b = min(hi, best[k] + window[k] / 2)
            for i in range(points):
                x = a + (b - a) * i / (points - 1)
                if math.isclose(x, best[k]):
                    continue
                cand = {**best, k: x}
                v = loss(cand)
                if v < best_loss:
                    best, best_loss = cand, v
            window[k] /= 2
    return best, best_loss


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long series, ties given their average rank; NaN where either
    series is constant (no ranking to compare)."""

    def ranks(x: Sequence[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(x):
            j = i
            while j + 1 < len(x) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in order[i : j + 1]:
                r[k] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va and vb else float("nan")
