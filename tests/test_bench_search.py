"""scripts/bench_search.py keeps the truth apart from the guide (issue 10, item 5).

The search benchmark's truth is vllm-sim with constants drawn per seed, not the shipped ones the search
simulates with; a strategy learns the truth only through measurements. These tests check that separation and
that a measurement on the truth says what the truth table says. Pure and in virtual time (a second or two).
"""

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from autotune.measure.profiles import Ladder
from autotune.sim.perf import API_SERVER
from autotune.sim.profiles import gpu_profile

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_search", ROOT / "scripts" / "bench_search.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_search"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_truth_is_drawn_per_seed_within_the_fidelity_tables_error(bench):
    sc = next(s for s in bench.SCENARIOS if s.gpu == "h100-80gb")
    shipped = gpu_profile(sc.gpu)
    a, fa = bench.truth_constants(sc, 0)
    assert (a, fa) == bench.truth_constants(sc, 0)  # reproducible: the cache and every strategy see one truth
    b, _ = bench.truth_constants(sc, 1)
    moved = [k for k in bench.GPU_DRAWN if getattr(shipped, k) and getattr(a, k) != getattr(shipped, k)]
    assert set(moved) == {k for k in bench.GPU_DRAWN if getattr(shipped, k)}  # every nonzero constant is drawn
    assert any(getattr(a, k) != getattr(b, k) for k in moved)  # another seed, another truth
    for k in moved:
        ratio = getattr(a, k) / getattr(shipped, k)
        assert math.exp(-2 * bench.SIGMA) - 1e-9 <= ratio <= math.exp(2 * bench.SIGMA) + 1e-9 or (
            k in bench._SHARES and getattr(a, k) == 0.95), (k, ratio)
    assert any(getattr(fa, k) != getattr(API_SERVER, k) for k in bench.FRONT_DRAWN if getattr(API_SERVER, k))
    # each config has its own noise on top of the seed's truth
    k1, k2 = bench.grid_keys(sc)[:2]
    one, two = bench.config_constants(sc, 0, k1)[0], bench.config_constants(sc, 0, k2)[0]
    assert one.compute_efficiency != two.compute_efficiency


def test_a_measured_config_is_its_nearest_grid_point_and_vllms_rules_hold(bench):
    sc = next(s for s in bench.SCENARIOS if s.max_model_len == 16384)
    key = json.loads(bench.key_of(sc, {"gpu_memory_utilization": 0.93, "max_num_seqs": 100,
                                       "max_num_batched_tokens": 3000, "enable_chunked_prefill": True}))
    assert (key["gpu_memory_utilization"], key["max_num_seqs"], key["max_num_batched_tokens"]) == (0.95, 128, 4096)
    legacy = json.loads(bench.key_of(sc, {"gpu_memory_utilization": 0.7, "enable_chunked_prefill": False}))
    assert legacy["gpu_memory_utilization"] == 0.7  # a baseline below the grid keeps its own row
    assert legacy["max_num_batched_tokens"] >= sc.max_model_len  # no chunked prefill: a whole prompt per step
    assert bench.defaults_key(sc) in bench.grid_keys(sc)


def test_a_measurement_on_the_truth_agrees_with_its_table_and_costs_gpu_time(bench):
    sc = next(s for s in bench.SCENARIOS if s.name.startswith("long-docs"))
    key = bench.defaults_key(sc)
    row = bench.true_capacity((sc, 3, key))
    assert row["starts"] and row["capacity"] > 0
    gpu = bench.TruthGpu(sc, 3, {key: row})
    out = gpu.measure(None, bench.EngineArgs(json.loads(key)), None, None, gpu.slos,
                      Ladder(row["capacity"] / sc.rate / 1.5, 4, 1.1))
    assert out.failure is None and out.steps
    for step in out.steps:  # below the true capacity every step holds; well above it none does
        if step.rate <= row["capacity"] * 0.999:
            assert step.passed, (step.rate, row["capacity"])
        elif step.rate >= row["capacity"] * 1.1:
            assert not step.passed, (step.rate, row["capacity"])
    [trial] = gpu.trials
    assert trial.capacity == row["capacity"]
    assert trial.gpu_s == pytest.approx(row["start_s"] + len(out.steps) * bench.STEP_S + bench.STOP_S)


def test_a_config_that_cannot_start_fails_with_vllms_text_and_costs_its_start_up(bench):
    sc = next(s for s in bench.SCENARIOS if s.name.startswith("long-docs"))
    key = bench.key_of(sc, {"gpu_memory_utilization": 0.3})  # 32B weights alone fill 30 % of an H100
    gpu = bench.TruthGpu(sc, 0, {})
    out = gpu.measure(None, bench.EngineArgs(json.loads(key)), None, None, gpu.slos, Ladder(1.0))
    assert out.failure is not None and out.failure.failure_class.value == "oom", out.failure
    assert not out.steps and gpu.trials[0].capacity == 0.0 and gpu.trials[0].gpu_s > bench.STOP_S


def test_the_time_to_target_counts_every_trial_until_the_first_near_optimal_one(bench):
    trials = [bench.Trial("a", 0.0, 600.0), bench.Trial("b", 5.0, 1200.0), bench.Trial("c", 9.6, 1800.0)]
    assert bench.to_target(trials, 10.0) == (3, 1.0)
    assert bench.to_target(trials[:2], 10.0) == (None, None)
    assert dataclasses.fields(bench.Trial)


def test_the_utilization_rules_evidence_counts_what_the_rule_would_lose(bench):
    def key(u, seqs):
        return json.dumps({"gpu_memory_utilization": u, "max_num_seqs": seqs}, sort_keys=True)

    table = {key(0.85, 64): {"starts": True, "capacity": 10.0}, key(0.95, 64): {"starts": True, "capacity": 8.0},
             key(0.85, 32): {"starts": True, "capacity": 6.0}, key(0.95, 32): {"starts": False, "start_s": 1.0}}
    kept, (both, better, worse) = bench.utilization_rule(table)
    # at 64 the rule runs 0.95 (8 of the optimum's 10); at 32 only 0.85 starts (6)
    assert kept == pytest.approx(0.8) and (both, better, worse) == (1, 0, 1)


def test_a_table_from_several_run_files_takes_the_later_run_of_the_same_scenario_seed_and_strategy(
        bench, tmp_path, capsys):
    def run(strategy, seed, trials, hours):
        return {"scenario": "s", "seed": seed, "strategy": strategy, "optimum": 1.0, "defaults_share": 0.5,
                "trials_to_95": trials, "gpu_hours_to_95": hours, "trials": []}

    old = [run("autotune", 0, 5, 0.5), run("autotune", 1, 7, 0.7), run("TPE", 0, 3, 0.3), run("TPE", 1, None, None),
           run("TPE", 2, None, None)]
    new = [run("autotune", 0, 1, 0.1)]  # a rerun of one run
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    merged = tmp_path / "merged.json"
    assert bench.table_from([tmp_path / "old.json", tmp_path / "new.json"], merged, 15) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| s |")]
    assert rows == ["| s | 50% | autotune | 4 | 0.40 | 2/2 |",  # medians of (1, 7) and (0.1, 0.7)
                    "| s | 50% | TPE | > 15 trials | > 15 trials | 1/3 |"]  # two of three never got there
    assert len(json.loads(merged.read_text())) == 5


def row(c):
    """A truth table's row of a config that starts and holds ``c`` req/s."""
    return {"starts": True, "start_s": 60.0, "capacity": c}


def test_the_oracle_floor_counts_picks_in_noise_free_order_ties_in_random_order(bench):
    # noisy truth: optimum 10 (config d); within 95 %: c (9.6) and d
    table = {"a": row(9.0), "b": row(8.0), "c": row(9.6), "d": row(10.0), "e": row(9.0)}
    # an oracle of the constants sees a alone on top, then b, c and d tied: a misses, then the tie of three holds
    # two hits, (3 + 1) / (2 + 1) picks on average
    noise_free = {"a": row(9.5), "b": row(9.0), "c": row(9.0), "d": row(9.0), "e": row(1.0)}
    assert bench.oracle_picks(table, noise_free) == pytest.approx(1 + 4 / 3)
    # the ranking found a hit first: one pick
    assert bench.oracle_picks(table, {**noise_free, "d": row(9.9)}) == 1.0
    # nothing the oracle ranks first holds a hit: every config of every tie above the first hit is paid for
    assert bench.oracle_picks(table, {k: row(1.0) if k in "cd" else row(5.0) for k in table}) == pytest.approx(
        3 + 3 / 3)


def test_the_oracle_floors_gpu_hours_are_one_start_and_step_per_pick_and_one_more_step(bench):
    sc = next(s for s in bench.SCENARIOS if s.tp == 4)
    table = {"a": {"starts": True, "start_s": 40.0, "capacity": 1.0}, "b": {"starts": False, "start_s": 5.0}}
    one = 40.0 + bench.STEP_S + bench.STOP_S
    assert bench.oracle_gpu_hours(sc, table, 1.0) == pytest.approx(4 * (one + bench.STEP_S) / 3600)
    assert bench.oracle_gpu_hours(sc, table, 3.0) == pytest.approx(4 * (3 * one + 2 * bench.STEP_S) / 3600)


def test_the_noise_free_truth_is_the_seeds_constants_without_the_configs_own_noise(bench):
    sc = next(s for s in bench.SCENARIOS if s.gpu == "h100-80gb")
    k1, k2 = bench.grid_keys(sc)[:2]
    seed_gpu, seed_front = bench.truth_constants(sc, 0)
    assert bench.config_constants(sc, 0, k1, noise=False) == (seed_gpu, seed_front)
    assert bench.config_constants(sc, 0, k1, noise=False) == bench.config_constants(sc, 0, k2, noise=False)
    assert bench.config_constants(sc, 0, k1)[0] != seed_gpu


def test_the_shipped_simulators_best_tie_is_placed_in_the_truth(bench):
    table = {"a": row(10.0), "b": row(8.0), "c": row(9.6), "d": row(7.0)}  # hits: a, c
    noise_free = {"a": row(9.0), "b": row(9.0), "c": row(8.5), "d": row(5.0)}  # the oracle's best: a, b
    shipped = {"a": 3.0, "b": 3.0, "c": 3.0, "d": 2.9}  # the shipped best: a, b, c tied
    assert bench.shipped_tie(table, noise_free, shipped) == (3, 2, 2)
    assert bench.shipped_tie(table, noise_free, {**shipped, "d": 4.0}) == (1, 0, 0)  # a best of its own, a miss


def test_the_shipped_prediction_is_the_products_simulator_on_the_scenarios_workload(bench):
    from autotune.sim.rank import GRID

    sc = next(s for s in bench.SCENARIOS if s.name == "long-docs-70b-tp4-h100")
    capacity = bench.shipped_capacity((sc, bench.defaults_key(sc)))
    # a capacity on the simulator's load grid (9 % apart) times the workload's own rate
    k = GRID * math.log2(capacity / bench._steps(sc).base.rate)
    assert capacity > 0 and k == pytest.approx(round(k), abs=1e-6)
    assert bench.shipped_capacity((sc, bench.key_of(sc, {"gpu_memory_utilization": 0.3}))) == 0.0  # cannot start
