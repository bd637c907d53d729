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


def test_the_table_pairs_each_host_with_one_engine_on_the_same_truths(par):
    def run(seed, gpus, wall, gpu_h):
        return par.ParallelRun("chat-8b-l20", seed, "TPE", gpus, gpus, wall, gpu_h, wall, wall / 2, gpu_h, 0.96, [])

    runs = [run(0, 1, 1.0, 1.0), run(1, 1, 0.5, 0.5), run(0, 4, 0.25, 1.2), run(1, 4, 0.25, 0.6)]
    one, four = par.rows(runs)
    assert one[3] == "2/2" and one[6].startswith("1.00x")
    assert four[2] == "4 (4 at once)" and four[6].startswith("0.33x")  # (0.25 + 0.25) / (1.0 + 0.5)
    assert four[7].startswith("1.20x")  # (1.2 + 0.6) / (1.0 + 0.5)
