"""scripts/bench_parallel.py: the study side by side in virtual time, on the hand-written truth file (a lookup, so
the runs take seconds). One engine is the sequential study, trial for trial; more engines overlap their trials,
count every GPU they hold, and the wall clock is the virtual host's."""

from pathlib import Path

import pytest

from tests.conftest import script

HAND = Path(__file__).resolve().parent.parent / "bench" / "truths" / "hand-interaction-chat-8b-l20.jsonl"


@pytest.fixture(scope="module")
def par():
    return script("bench_parallel")


@pytest.fixture(scope="module")
def hand(par):
    truth = par.bench.FileTruth.read(HAND)
    return truth, {k: truth.expected(k) for k in par.bench.grid_keys(truth.sc)}


def test_one_engine_in_virtual_time_is_the_sequential_study(par, hand):
    truth, table = hand
    one = par.one(truth, "TPE", 1, 6, table)
    seq = par.bench.one_run(truth, "TPE", 6, table, lambda _: None)
    assert one.trials == [t.key for t in seq.trials] and one.engines == 1
    assert one.wall_h == pytest.approx(one.gpu_h) == pytest.approx(sum(t.gpu_s for t in seq.trials) / 3600)


def test_side_by_side_trials_share_the_wall_clock_and_count_every_gpu(par, hand):
    truth, table = hand
    clock = par.Clock()
    gpu = par.ClockedGpu(truth, table)
    gpu.clock = clock
    par.bench.run_study(truth.sc, gpu, "TPE", truth.seed, 8, lambda _: None, gpus=4, drive=par.drive(clock, gpu))
    search = clock.spans[: len(clock.spans) - sum(t.confirms for t in gpu.trials)]  # the re-measurement's last
    at_once = max(sum(a <= start < b for a, b, _ in search) for start, _, _ in search)
    assert at_once == 4  # four engines, each on a GPU of its own
    assert clock.gpu_hours(clock.now) == pytest.approx(sum(t.gpu_s for t in gpu.trials) / 3600)
    assert clock.now < sum(t.gpu_s for t in gpu.trials)  # the wall clock is shorter than the GPU time
    stamps = [at for at, _ in clock.declared]
    assert stamps == sorted(stamps) and stamps[-1] == clock.now  # the verdict last, after the re-measurement
