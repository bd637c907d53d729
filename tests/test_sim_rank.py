"""The simulator's ranking of a study's space (sim/rank.py): configs its load grid ties are ordered by how close each
came to holding the next load, and that order is the one a finer grid of the same simulator finds."""

import math

import pytest

from autotune.measure.slo import parse_slos
from autotune.sim import rank
from autotune.sim.profiles import gpu_profile, model_shape
from autotune.sim.rank import SpaceSimulator, between
from autotune.workload.source import LoadSteps
from autotune.workload.synth import SCENARIOS, synthesize


def test_between_is_where_the_worst_violation_crosses_zero():
    assert between(-0.2, 0.2) == pytest.approx(0.5)
    assert between(-0.1, 0.3) == pytest.approx(0.25)
    assert between(0.0, 0.5) == 0.0  # held with no margin: no way towards the next load
    assert between(-0.3, math.inf) == 0.0  # a request failed at the next load: nothing to interpolate
    assert between(None, 0.2) == between(-0.2, None) == 0.0  # unknown (the top of the grid)


def _simulator() -> SpaceSimulator:
    """vllm-sim's shipped A10 with Llama-3.1-8B on chat requests, 150 at load 1 (a small, fast step)."""
    base = synthesize(SCENARIOS["chat"], rate=4.0, num_requests=150, seed=0)
    steps = LoadSteps.of(base, 30.0)
    return SpaceSimulator(model_shape("llama-3.1-8b"), gpu_profile("a10-24gb"),
                          lambda load: steps.repeated(load, max_requests=150), base.rate,
                          parse_slos(["ttft<500ms", "tpot<60ms"]))


CONFIGS = [{"max_num_seqs": s, "max_num_batched_tokens": b, "gpu_memory_utilization": 0.9, "max_model_len": 8192}
           for s in (16, 24, 32, 48, 128) for b in (512, 2048)]


def test_the_rank_lands_where_a_four_times_finer_grid_puts_the_capacity(monkeypatch):
    """Each config predicted on the study's grid (9 % steps), then again on a grid 4x finer (2.2 %): the rank lies
    in the coarse bracket and nearer the fine capacity than the coarse floor does, and among the configs the
    coarse grid ties it orders them as the fine grid does, more often than not."""
    from autotune.sim.fit import spearman

    coarse = [_simulator().one(c) for c in CONFIGS]
    monkeypatch.setattr(rank, "GRID", 4 * rank.GRID)
    monkeypatch.setattr(rank, "LOWEST", 4 * rank.LOWEST)
    monkeypatch.setattr(rank, "HIGHEST", 4 * rank.HIGHEST)
    fine = [_simulator().one(c).capacity_rps for c in CONFIGS]
    monkeypatch.undo()

    step = 2 ** (1 / rank.GRID)
    held = [(p.capacity_rps, p.rank_rps, f) for p, f in zip(coarse, fine, strict=True) if p.capacity_rps]
    assert len(held) == len(CONFIGS)  # every one starts and holds some load
    for c, r, f in held:
        assert c <= r <= c * step * (1 + 1e-9) and c * (1 - 1e-9) <= f < c * step * (1 + 1e-9), (c, r, f)
    moved = [(c, r, f) for c, r, f in held if r > c]
    assert moved, "no config came any way towards its next load"
    # nearer the fine grid's capacity than the floor, over the configs
    assert sum(abs(math.log(r / f)) for _, r, f in held) < sum(abs(math.log(c / f)) for c, _, f in held)
    ties: dict[float, list[tuple[float, float]]] = {}
    for c, r, f in held:
        ties.setdefault(round(c, 9), []).append((r, f))
    broken = [t for t in ties.values() if len({f for _, f in t}) > 1]
    assert broken, "the coarse grid tied no configs the fine grid tells apart: nothing to check"
    assert all(spearman([r for r, _ in t], [f for _, f in t]) > 0 for t in broken), broken
