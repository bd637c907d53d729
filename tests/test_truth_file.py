"""scripts/truth_file.py and bench_search.py --truth-file: a search truth from a file, so that truths can come
from outside the simulator. The hand-written file (bench/truths/hand-interaction-chat-8b-l20.jsonl) is a family the
benchmark does not generate: two knobs whose effects depend on each other, and knobs that are inert."""

import json
import math
from pathlib import Path

import pytest

from autotune.measure.profiles import Ladder

ROOT = Path(__file__).resolve().parent.parent
HAND = ROOT / "bench" / "truths" / "hand-interaction-chat-8b-l20.jsonl"




@pytest.fixture(scope="module")
def hand(bench):
    return bench.FileTruth.read(HAND)


def write(tmp_path, *lines):
    head = json.loads(HAND.read_text().splitlines()[0])
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in (head, *lines)) + "\n")
    return path


def test_a_config_is_answered_by_the_files_nearest_and_a_knob_no_config_names_is_inert(bench, hand):
    big = {"max_num_seqs": 512, "max_num_batched_tokens": 8192, "enable_chunked_prefill": True}
    for utilization, prefix in ((0.85, False), (0.95, True)):  # neither is named by the file: they move nothing
        row = hand.start(bench.key_of(hand.sc, {**big, "gpu_memory_utilization": utilization,
                                                 "enable_prefix_caching": prefix}))
        assert row.config == big
    near = hand.start(bench.key_of(hand.sc, {"max_num_seqs": 1024, "max_num_batched_tokens": 16384}))
    assert near.config == big  # off the file's range: its nearest config
    # the interaction: many sequences pay off only with large prefill chunks
    cap = {(s, t): hand.expected(bench.key_of(hand.sc, {"max_num_seqs": s, "max_num_batched_tokens": t}))["capacity"]
           for s in (128, 512) for t in (2048, 8192)}
    assert cap[512, 8192] > cap[128, 8192] and cap[512, 2048] < cap[128, 2048]


def test_the_expected_capacity_is_where_the_interpolated_metrics_cross_an_slo(bench, hand):
    key = bench.key_of(hand.sc, {"max_num_seqs": 512, "max_num_batched_tokens": 8192})
    # its TPOT crosses 60 ms between the steps at 3 req/s (47 ms) and 4 req/s (62 ms), in log rate and log value
    crossing = 3 * (4 / 3) ** (math.log(0.060 / 0.047) / math.log(0.062 / 0.047))
    assert hand.expected(key)["capacity"] == pytest.approx(crossing, rel=2e-3)
    failed = hand.expected(bench.key_of(hand.sc, {"max_num_seqs": 512, "enable_chunked_prefill": False}))
    assert not failed["starts"] and failed["start_s"] == 61.0 and "out of memory" in failed["failure"]


def test_a_measurement_is_the_files_metrics_at_the_runs_own_speed(bench, hand):
    key = bench.key_of(hand.sc, {"max_num_seqs": 128, "max_num_batched_tokens": 8192})
    gpu = bench.TruthGpu(hand, {})
    load = 2.0 / gpu.steps.base.rate  # the file's step at 2 req/s
    out = gpu.measure(bench.EngineArgs(json.loads(key)), gpu.slos, Ladder(load, 1))
    speed = bench.measurement_speed("file", hand.file.name, key, 0)
    at = hand.start(key).metrics_at(2.0 / speed)
    assert out.steps[0].summary.ttft.p95 == pytest.approx(at["ttft"] / speed)
    assert out.steps[0].summary.value(gpu.slos[1]) == pytest.approx(at["tpot"] / speed)
    assert gpu.trials[0].expected == hand.expected(key)["capacity"]
    row = hand.start(key)
    assert row.metrics_at(2.0) == {"ttft": 0.18, "tpot": 0.045} and row.metrics_at(0.5) == row.metrics_at(1.0)


@pytest.mark.parametrize(("line", "says"), [
    ({"config": {"max_num_seqs": 8}, "starts": True, "start_s": 60,
      "steps": [{"rps": 2.0, "ttft": 0.1, "tpot": 0.02}, {"rps": 1.0, "ttft": 0.2, "tpot": 0.03}]}, "ascending"),
    ({"config": {"max_num_seqs": 8}, "starts": True, "start_s": 60, "steps": [{"rps": 2.0, "ttft": 0.1, "tpot": 0.02}]},
     "meets every SLO"),
    ({"config": {"max_num_seqs": 8}, "starts": "yes", "start_s": 60}, '"starts" (true or false)'),
    ({"config": {"max_num_seqs": 8}, "starts": False}, '"start_s"'),
])
def test_a_truth_file_that_cannot_be_read_says_where_and_what_to_change(bench, tmp_path, capsys, line, says):
    path = write(tmp_path, line)
    assert bench.main(["--truth-file", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path}:2: " in err[0] and says in err[0], err


def test_every_strategy_runs_on_a_hand_written_truth_file_end_to_end(bench, tmp_path, capsys):
    out = tmp_path / "runs.json"
    strategies = ["TPE", "random", "auto_tune grid", "bench sweep grid"]
    argv = ["--truth-file", str(HAND), "--budget", "6", "--json", str(out)]
    assert bench.main([*argv, *(x for s in strategies for x in ("--strategy", s))]) == 0
    runs = json.loads(out.read_text())
    assert [r["strategy"] for r in runs] == strategies
    truth = bench.FileTruth.read(HAND)
    optimum = max(truth.expected(k).get("capacity", 0.0) for k in bench.grid_keys(truth.sc))
    for r in runs:
        assert r["optimum"] == pytest.approx(optimum) and r["trials"] and r["curve"][-1][0] > 0
        assert all(t["expected"] <= optimum for t in r["trials"])
    printed = capsys.readouterr()
    assert "truth file 'hand-interaction-chat-8b-l20'" in printed.err and "Spearman" in printed.err
    assert "| chat-8b-l20 | TPE |" in printed.out and "restricted mean GPU-h/GPU to 95 %" in printed.out
