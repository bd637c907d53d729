"""scripts/search_scores.py: the search benchmark's scores (the declared share at a budget, the restricted mean
GPU-hours to 95 %) and their bootstrap intervals, on constructed runs whose answers are known."""

import pytest

from tests.conftest import script


@pytest.fixture(scope="module")
def scores():
    return script("search_scores")


def run(curve, strategy="a", seed=0, scenario="s"):
    return {"scenario": scenario, "seed": seed, "strategy": strategy, "curve": curve}


def test_the_declared_share_at_a_budget_is_what_the_user_would_hold_had_the_run_stopped_there(scores):
    curve = [(0.5, 0.6), (1.0, 0.97), (3.0, 0.9), (3.5, 0.9)]
    assert scores.share_at(curve, 0.25) == 0.0  # nothing declared yet
    assert [scores.share_at(curve, h) for h in (0.5, 0.9, 1.0, 2.9, 3.0, 10.0)] == [0.6, 0.6, 0.97, 0.97, 0.9, 0.9]
    # on a 4-GPU engine a budget of 0.25 GPU-hours per GPU is one GPU-hour of the curve
    assert scores.RunScore.of(run(curve), gpus=4).shares == (0.97, 0.97, 0.9, 0.9)


def test_the_restricted_mean_counts_a_run_that_never_gets_there_at_the_cap(scores):
    runs = [
        run([(0.5, 0.96), (1.0, 0.96)]),  # within 95 % from 0.5 GPU-h on
        run([(0.5, 0.96), (1.0, 0.8), (1.2, 0.99), (1.5, 0.99)]),  # there for good only from 1.2
        run([(0.4, 0.9), (0.6, 0.9)]),  # ended short of 95 %: never gets there
        run([(3.0, 1.0), (3.1, 1.0)]),
    ]  # got there past the cap
    assert [scores.hours_to_target(r["curve"]) for r in runs] == [0.5, 1.2, None, 3.0]
    mine = [scores.RunScore.of(r, gpus=1) for r in runs]
    assert [s.to_target for s in mine] == [0.5, 1.2, scores.CAP, scores.CAP]
    assert scores.bootstrap([[s.to_target for s in mine]], scores.mean).value == pytest.approx((0.5 + 1.2 + 4) / 4)
    assert scores.RunScore.of(runs[1], gpus=2).to_target == pytest.approx(0.6)  # per GPU


def test_a_paired_comparison_is_on_the_same_truths_and_its_interval_tells_a_difference_from_luck(scores):
    import numpy as np

    rng = np.random.default_rng(1)
    base = rng.uniform(0.6, 0.9, 40)  # 40 truths, each its own difficulty
    ours = [scores.RunScore("s", i, "ours", (b + 0.05,) * 4, 1.0) for i, b in enumerate(base)]
    theirs = [scores.RunScore("s", i, "theirs", (b,) * 4, 2.0) for i, b in enumerate(base)]
    luck = [scores.RunScore("s", i, "luck", (b + rng.normal(0, 0.05),) * 4, 1.0) for i, b in enumerate(base)]
    rows = {
        r[1]: r for r in scores.comparison_rows(ours + theirs + luck, "ours", ["ours", "theirs", "luck"]) if r[0] == "s"
    }
    # a constant +5 points on every truth: an interval of zero width, whatever the truths' spread
    assert rows["ours vs theirs"][2] == "+5% [+5%, +5%]" and rows["ours vs theirs"][4] == "0.50 [0.50, 0.50]"
    pairs = scores.paired(ours + luck, "ours", "luck", lambda s: s.shares[1], ["s"])
    interval = scores.bootstrap([[a - b for a, b in pairs[0]]], scores.mean)
    assert interval.low < interval.value < interval.high and interval.high - interval.low > 0.01
    # unpaired, the same runs would not tell +5 points from the truths' own spread of 30
    unpaired = scores.bootstrap([[s.shares[1] for s in ours]], scores.mean)
    assert unpaired.high - unpaired.low > 0.05
