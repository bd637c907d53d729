"""The study's trial lines and footer text: each outcome said in our words, with the numbers that prove it."""

import re

from optuna.trial import TrialState

from autotune.console import Progress
from autotune.study.lines import trial_line
from autotune.study.records import StudyResult, TrialRecord


def record(number, state, attrs, params=None, value=0.0):
    return TrialRecord(number, state, params or {"max_num_seqs": 64}, (value,), attrs)


DEFAULTS = record(0, TrialState.COMPLETE, {"baseline": "vllm-defaults", "constraints": [-0.1], "capacity_rps": 4.0,
                                           "capacity_output_tok_s": 500.0, "trial_wall_s": 125.0,
                                           "chosen_because": "baseline vllm-defaults"}, value=4.0)


def test_a_measured_trial_says_its_capacity_and_gain_over_the_reference():
    r = record(3, TrialState.COMPLETE, {"constraints": [-0.2], "capacity_rps": 5.0, "capacity_output_tok_s": 640.0,
                                        "trial_wall_s": 61.0, "chosen_because": "TPE: the most expected improvement"},
               {"max_num_seqs": 128}, value=5.0)
    assert trial_line(r, DEFAULTS) == ("trial 3 (TPE: the most expected improvement) max_num_seqs=128 -> 5.00 req/s "
                                       "within the SLOs (640 output tok/s), +25% vs vllm-defaults [1m01s]")
    assert trial_line(DEFAULTS, DEFAULTS).endswith("-> 4.00 req/s within the SLOs (500 output tok/s) [2m05s]")


def test_a_trial_that_held_every_load_says_at_least_and_no_gain_is_computed_over_it():
    held = [{"load": 1.0, "rate": 4.0, "passed": True}, {"load": 2.0, "rate": 8.0, "passed": True}]
    r = record(5, TrialState.COMPLETE, {"constraints": [-0.2], "capacity_rps": 8.0, "capacity_output_tok_s": 900.0,
                                        "steps": held}, value=8.0)
    assert trial_line(r, DEFAULTS) == ("trial 5 (sampled) max_num_seqs=64 -> at least 8.00 req/s within the SLOs "
                                       "(900 output tok/s; it held every load offered), at least +100% vs "
                                       "vllm-defaults")
    floor = record(0, TrialState.COMPLETE, {**DEFAULTS.attrs, "steps": held}, value=4.0)
    missed = [*held, {"load": 4.0, "rate": 16.0, "passed": False}]
    r = record(6, TrialState.COMPLETE, {"constraints": [-0.2], "capacity_rps": 8.0, "capacity_output_tok_s": 900.0,
                                        "steps": missed}, value=8.0)
    assert trial_line(r, floor) == "trial 6 (sampled) max_num_seqs=64 -> 8.00 req/s within the SLOs (900 output tok/s)"


def test_a_failure_says_its_class_and_the_line_that_proves_it():
    r = record(4, TrialState.PRUNED, {"failure_class": "oom", "constraints": [1000.0],
                                      "failure": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"})
    assert trial_line(r, DEFAULTS) == ("trial 4 (sampled) max_num_seqs=64 -> oom: torch.OutOfMemoryError: CUDA out of "
                                       "memory. Tried to allocate 2.00 GiB")


def test_no_load_meeting_the_slos_says_how_the_lowest_load_missed():
    r = record(2, TrialState.COMPLETE, {"constraints": [0.5], "steps": [
        {"load": 2.0, "rate": 4.0, "failed": 0, "passed": False, "slos": []},
        {"load": 1.0, "rate": 2.0, "failed": 0, "passed": False, "slos": [
            {"slo": "p95:ttft<800ms", "key": "p95_ttft", "target": 0.8, "measured": 1.2, "holds": False},
            {"slo": "rps>5", "key": "rps", "target": 5, "measured": 2.0, "holds": False}]}]})
    assert trial_line(r, None).endswith("-> no load met the SLOs (at 2.00 req/s: p95:ttft<800ms measured 1200 ms, "
                                        "rps>5 measured 2.00)")


def test_the_footer_counts_finished_trials_and_extrapolates_what_is_left():
    pruned = record(1, TrialState.PRUNED, {"failure_class": "oom", "trial_wall_s": 35.0, "engine_gpus": 2,
                                           "engine_args": {"values": {"tensor_parallel_size": 2}, "env": {}}})
    result = StudyResult([DEFAULTS, pruned], pareto=False, remeasurement=None, best_number=0)
    p = Progress.of(result, budget=6, gpu=True)
    assert (p.done, p.engine_s) == (2, 125.0 + 2 * 35.0)  # the pruned trial held two GPUs
    assert p.left_s == 4 * p.engine_s / 2
    assert p.text() == "2/6 trials; best 4.00 req/s (trial 0); GPU time 3m15s, about 6m30s left"
    # the re-measurement after the last trial is time left too: 6/6 trials is not "0s left" (issue 55)
    ahead = Progress.of(result, budget=2, gpu=True, remeasure_runs=3)
    assert ahead.left_s == 3 * ahead.engine_s / 2
    assert ahead.text().endswith("about 4m52s left with at most 3 re-measurement runs"), ahead.text()


def test_the_comparison_says_the_best_configs_gain_over_each_baseline(monkeypatch):
    """A baseline's row shows how much more the best config holds than it does, and says whose gain that is."""
    from rich.console import Console

    import autotune.console as console
    from autotune.study.outputs import Row

    monkeypatch.setattr(console, "out", Console(record=True, width=200))
    console.print_comparison([Row("best (trial 2)", 2, 30.0, 3000.0, 150.0, True, "complete"),
                              Row("vllm-defaults", 0, 10.0, 1000.0, 90.0, True, "complete")], None)
    text = console.out.export_text()
    header = next(line for line in text.splitlines() if "config" in line and "trial" in line)
    assert "best's gain" in header
    assert re.search(r"vllm-defaults .* \+200% ", text), text
