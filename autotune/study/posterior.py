"""What a study's measurements say about the capacities of the configs it compares, as probabilities.

Each measurement of a config is a bracket: its capacity lies between the highest load that held and the lowest above
it that missed (a ladder resolves no finer; no miss: a floor; nothing held: a ceiling). A config's log capacity has a
flat prior, and a measurement reads it through noise with Student-t tails (2 degrees of freedom): mostly a few
percent, now and then far off, as a stalled run is, so one stalled run moves a capacity a little and never the
verdict on its own. The noise's scale is shared by the configs of one comparison (they ran on one host), with a
log-uniform prior over ``SIGMAS``, and marginalised on a grid. Everything here is exact on the grid except the
probabilities that compare configs, which are read off ``SAMPLES`` joint draws (seeded: the same evidence gives the
same answer).

A hand-rolled grid rather than a Gaussian process library: a comparison holds two to four configs with a handful of
interval-censored observations each, which a grid integrates exactly in milliseconds, with the heavy-tailed,
censored likelihood that a GP's Gaussian noise cannot express.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Bracket", "Posterior"]

SIGMAS = np.geomspace(0.01, 0.3, 24)  # the noise's scale on log capacity: 1 % to 30 % per measurement
POINTS = 400  # the grid over log capacity
SAMPLES = 4000
MARGIN = 4.0  # the grid spans the observed bounds / MARGIN to x MARGIN: where a floor's posterior ends


@dataclass(frozen=True)
class Bracket:
    """One measurement of a capacity (req/s): it lies in [low, high); low 0: no load held; high None: none missed."""

    low: float
    high: float | None


def _t_cdf(z: np.ndarray) -> np.ndarray:
    """Student-t's CDF with 2 degrees of freedom (closed form)."""
    return 0.5 + z / (2 * np.sqrt(2 + z * z))


@dataclass(frozen=True)
class Posterior:
    """The joint posterior of the capacities of configs 0..k-1 given their brackets."""

    grid: np.ndarray  # log capacity
    cdf: np.ndarray  # (k, POINTS): each config's marginal posterior CDF on the grid, the noise's scale integrated
    samples: np.ndarray  # (SAMPLES, k) joint draws of the capacities, req/s
    sigma: float  # the noise scale's posterior median (log capacity)

    @classmethod
    def of(cls, evidence: Sequence[Sequence[Bracket]], seed: int = 0) -> Posterior:
        bounds = [x for ev in evidence for b in ev for x in (b.low, b.high) if x]
        k = len(evidence)
        top = max(bounds, default=1.0)
        grid = np.linspace(math.log(min(bounds, default=1.0) / MARGIN), math.log(top * MARGIN), POINTS)
        scale = SIGMAS[:, None]
        loglik = np.zeros((len(SIGMAS), k, POINTS))
        for i, ev in enumerate(evidence):
            for b in ev:
                up = 1.0 if b.high is None else _t_cdf((math.log(b.high) - grid[None, :]) / scale)
                down = 0.0 if b.low <= 0 else _t_cdf((math.log(b.low) - grid[None, :]) / scale)
                loglik[:, i, :] += np.log(np.maximum(up - down, 1e-300))
        peak = loglik.max(axis=2, keepdims=True)
        weights = np.exp(loglik - peak)  # (sigma, config, grid), each config's likelihood up to a constant
        marginal = np.log(weights.sum(axis=2)) + peak[..., 0]  # per sigma and config: the evidence
        log_p = marginal.sum(axis=1)  # the prior over SIGMAS is uniform on its log-spaced grid
        p_sigma = np.exp(log_p - log_p.max())
        p_sigma /= p_sigma.sum()
        per_sigma = np.cumsum(weights, axis=2)
        per_sigma /= per_sigma[..., -1:]
        cdf = np.einsum("s,skg->kg", p_sigma, per_sigma)
        rng = np.random.default_rng(seed)
        drawn = rng.choice(len(SIGMAS), SAMPLES, p=p_sigma)
        u = rng.random((SAMPLES, k))
        step = grid[1] - grid[0]
        index = np.stack([(per_sigma[drawn, i, :] < u[:, i, None]).sum(axis=1) for i in range(k)], axis=1)
        logs = grid[np.minimum(index, POINTS - 1)] + rng.uniform(-0.5, 0.5, (SAMPLES, k)) * step
        sigma = float(SIGMAS[min(int(np.searchsorted(np.cumsum(p_sigma), 0.5)), len(SIGMAS) - 1)])
        return cls(grid, cdf, np.exp(logs), sigma)

    def quantile(self, i: int, q: float) -> float:
        """Config i's capacity at posterior quantile q (req/s), exact on the grid."""
        return float(math.exp(np.interp(q, self.cdf[i], self.grid)))

    def median(self, i: int) -> float:
        return self.quantile(i, 0.5)

    def p_better(self, i: int, j: int, margin: float = 0.0) -> float:
        """P(config i's capacity is above config j's by more than ``margin``, a share of j's)."""
        return float(np.mean(self.samples[:, i] > (1 + margin) * self.samples[:, j]))

    def p_within(self, i: int, share: float) -> float:
        """P(config i's capacity is at least ``share`` of the best of the configs compared)."""
        return float(np.mean(self.samples[:, i] >= share * self.samples.max(axis=1)))
