"""scripts/bench_search.py keeps the truth apart from the guide (issues 10 and 25).

The search benchmark's truth is vllm-sim with constants drawn per seed and terms of its own (a form the guide
does not have); every measurement draws its own noise; a strategy is scored on the expected capacity of the
config it declares best. These tests check that separation, the noise and the score. Pure and in virtual time.
"""

import json
import math

import pytest

from autotune.measure.profiles import Ladder
from autotune.sim.profiles import gpu_profile


def test_the_truth_is_drawn_per_seed_and_differs_from_the_guide_in_form(bench):
    sc = next(s for s in bench.SCENARIOS if s.gpu == "h100-80gb")
    shipped = gpu_profile(sc.gpu)
    a, fa = bench.truth_constants(sc, 0)
    assert (a, fa) == bench.truth_constants(sc, 0)  # reproducible: the cache and every strategy see one truth
    assert bench.draw_form(sc, 0) == bench.draw_form(sc, 0)
    assert bench.draw_form(sc, 0) != bench.draw_form(sc, 1)  # another seed, another truth
    moved = [k for k in bench.GPU_DRAWN if getattr(shipped, k) and getattr(a, k) != getattr(shipped, k)]
    assert set(moved) == {k for k in bench.GPU_DRAWN if getattr(shipped, k)}  # every nonzero constant is drawn
    for k in moved:
        ratio = getattr(a, k) / getattr(shipped, k)
        assert math.exp(-2 * bench.SIGMA) - 1e-9 <= ratio <= math.exp(2 * bench.SIGMA) + 1e-9 or (
            k in bench._SHARES and getattr(a, k) == 0.95), (k, ratio)
    # the form: each knob has a term of its own sign, the same for every config sharing the knob's value
    form = bench.draw_form(sc, 0)
    slopes = [f["1024"] - f["32"] for f in [form.knobs["max_num_seqs"]]] + [
        form.knobs[k]["True"] - form.knobs[k]["False"] for k in ("enable_chunked_prefill", "enable_prefix_caching")]
    assert all(s != 0 for s in slopes)
    signs = {math.copysign(1, bench.draw_form(sc, seed).knobs["max_num_seqs"]["1024"]) for seed in range(8)}
    assert signs == {-1.0, 1.0}  # not one direction the guide could have learned
    assert bench.REQUEST_S[0] <= form.request_s <= bench.REQUEST_S[1]


def test_the_truths_memory_plan_starts_configs_the_guide_says_fail_and_fails_some_it_says_start(bench):
    from autotune.sim.config import SimConfig
    from autotune.sim.profiles import model_shape
    from autotune.sim.startup import plan_startup

    guide_only = truth_only = 0
    for sc in bench.SCENARIOS:
        shape, gpu = model_shape(sc.model), gpu_profile(sc.gpu)
        keys = bench.grid_keys(sc)
        guide = {k: plan_startup(shape, gpu, SimConfig.from_args(json.loads(k), gpu, shape)).plan is not None
                 for k in keys}
        for seed in range(3):
            truth = bench.truth_of(sc, seed)
            for k in keys:
                starts = truth.start(k)[1].plan is not None
                guide_only += guide[k] and not starts
                truth_only += starts and not guide[k]
    assert guide_only > 0 and truth_only > 0, (guide_only, truth_only)


def test_an_adversarial_truth_reverses_the_knob_the_guide_says_matters_most(bench):
    sc = next(s for s in bench.SCENARIOS if s.gpu == "h100-80gb")

    def key(seqs, chunked):
        return json.dumps({"max_num_seqs": seqs, "enable_chunked_prefill": chunked}, sort_keys=True)

    # the guide: twice the capacity at 256 sequences than at 32, chunked prefill hardly matters; 0 is left out
    guide = {key(32, False): 1.0, key(32, True): 1.1, key(256, False): 2.0, key(256, True): 2.1, key(64, True): 0.0}
    knob, effect = bench.guide_effects(guide)
    assert knob == "max_num_seqs" and set(effect) == {"32", "256"}
    assert effect["256"] - effect["32"] == pytest.approx(math.log(2.0 / 1.0 * 2.1 / 1.1) / 2)
    plain, adversarial = bench.draw_form(sc, bench.ADVERSARIAL), bench.draw_form(sc, bench.ADVERSARIAL, guide)
    assert plain.flipped == "" and adversarial.flipped == "max_num_seqs"
    # the truth's step at 256 sequences is slower than at 32 by FLIP times the guide's effect, on top of its own
    moved = {v: adversarial.knobs[knob][v] - plain.knobs[knob][v] for v in ("32", "256")}
    assert moved == pytest.approx({v: bench.FLIP * effect[v] for v in ("32", "256")})
    assert adversarial.log_step({"max_num_seqs": 256}) > plain.log_step({"max_num_seqs": 256})
    assert bench.draw_form(sc, 0, guide).flipped == ""  # below ADVERSARIAL a seed is never adversarial
    tied = dict.fromkeys(guide, 1.0)  # a guide that ties every config has no direction to reverse
    assert bench.guide_effects(tied) == ("", {}) and bench.draw_form(sc, bench.ADVERSARIAL, tied) == plain


def test_each_measurement_draws_its_own_noise_and_re_measuring_narrows_it(bench):
    draws = [bench.measurement_speed("s", 0, "run", i) for i in range(3000)]
    assert draws[0] == bench.measurement_speed("s", 0, "run", 0)  # reproducible
    assert len(set(draws)) == len(draws)
    stalls = sum(d < 0.9 for d in draws) / len(draws)
    assert 0.02 < stalls < 0.09  # a heavy tail: a stalled run now and then, not a normal's 3 % sigma
    medians = [sorted(draws[i:i + 3])[1] for i in range(0, len(draws), 3)]

    def spread(xs):
        xs = sorted(xs)
        return xs[int(0.95 * len(xs))] - xs[int(0.05 * len(xs))]

    assert spread(medians) < 0.8 * spread(draws)


def test_a_measured_config_is_its_nearest_grid_point_and_vllms_rules_hold(bench):
    sc = next(s for s in bench.SCENARIOS if s.max_model_len == 16384)
    key = json.loads(bench.key_of(sc, {"gpu_memory_utilization": 0.93, "max_num_seqs": 100,
                                       "max_num_batched_tokens": 3000, "enable_chunked_prefill": True}))
    assert (key["gpu_memory_utilization"], key["max_num_seqs"], key["max_num_batched_tokens"]) == (0.95, 128, 4096)
    legacy = json.loads(bench.key_of(sc, {"gpu_memory_utilization": 0.7, "enable_chunked_prefill": False}))
    assert legacy["gpu_memory_utilization"] == 0.7  # a baseline below the grid keeps its own row
    assert legacy["max_num_batched_tokens"] >= sc.max_model_len  # no chunked prefill: a whole prompt per step
    assert bench.defaults_key(sc) in bench.grid_keys(sc)


def test_a_measurement_on_the_truth_is_its_expected_behaviour_at_the_runs_own_speed(bench):
    sc = next(s for s in bench.SCENARIOS if s.name.startswith("long-docs"))
    key, truth = bench.defaults_key(sc), bench.truth_of(sc, 0)
    row = bench.expected_capacity((truth, key))
    assert row["starts"] and row["capacity"] > 0
    gpu = bench.TruthGpu(truth, {key: row})
    load = row["capacity"] / gpu.steps.base.rate  # the expected capacity, in the measurement's own req/s
    assert load == pytest.approx(2 ** (round(bench.GRID * math.log2(load)) / bench.GRID))  # on the load grid
    answers = []
    for k in range(2):
        out = gpu.measure(bench.EngineArgs(json.loads(key)), gpu.slos, Ladder(load, 1))
        [step], trial = out.steps, gpu.trials[-1]
        speed = bench.measurement_speed(sc.name, 0, key, k)  # the k-th measurement of this config
        expected = truth.step(key, truth.start(key), step.load, gpu.steps, gpu.slos, speed)
        assert step.summary.tpot == expected.tpot
        assert trial.expected == row["capacity"] and trial.measured == out.capacity_rps
        assert trial.gpu_s == pytest.approx(row["start_s"] + bench.STEP_S + bench.STOP_S)
        answers.append(step.summary.tpot)
    assert answers[0] != answers[1]  # the same config measured twice: two answers


def test_every_strategy_meets_the_same_luck_on_the_same_config(bench):
    """Common random numbers: the k-th measurement of a config draws the same noise whoever measures it, and
    whatever else was measured before."""
    sc = next(s for s in bench.SCENARIOS if s.name.startswith("long-docs"))
    truth = bench.truth_of(sc, 0)
    a, b = bench.defaults_key(sc), bench.key_of(sc, {"max_num_seqs": 64})
    table = {k: bench.expected_capacity((truth, k)) for k in (a, b)}

    def tpots(order):
        gpu = bench.TruthGpu(truth, dict(table))
        out = {}
        for key in order:
            m = gpu.measure(bench.EngineArgs(json.loads(key)), gpu.slos, Ladder(0.5, 1))
            out.setdefault(key, []).append(m.steps[0].summary.tpot)
        return out

    first, second = tpots([a, a, b]), tpots([b, a, a])
    assert first == second  # the same draws, though measured in another order
    assert first[a][0] != first[a][1]


def test_a_config_that_cannot_start_fails_with_vllms_text_and_costs_its_start_up(bench):
    sc = next(s for s in bench.SCENARIOS if s.name.startswith("long-docs"))
    key = bench.key_of(sc, {"gpu_memory_utilization": 0.3})  # 32B weights alone fill 30 % of an H100
    gpu = bench.TruthGpu(bench.truth_of(sc, 0), {})
    out = gpu.measure(bench.EngineArgs(json.loads(key)), gpu.slos, Ladder(1.0))
    assert out.failure is not None and out.failure.failure_class.value == "oom", out.failure
    assert not out.steps and gpu.trials[0].measured == 0.0 and gpu.trials[0].gpu_s > bench.STOP_S


def test_the_score_is_the_declared_configs_expected_capacity_until_it_stays_near_the_optimum(bench):
    sc = next(s for s in bench.SCENARIOS if s.tp == 1)
    table = {"a": row(5.0), "b": row(10.0), "c": row(9.6), "d": row(7.0)}
    gpu = bench.TruthGpu(bench.truth_of(sc, 0), table)
    # measured b high by luck first, declared it; then c; then a re-measurement handed the user d
    for key, measured in (("a", 5.0), ("b", 12.0), ("c", 9.0), ("d", 7.5)):
        gpu.trials.append(bench.Trial(key, measured, table[key]["capacity"], 1800.0))
        gpu.declare({"a": "a", "b": "b", "c": "b", "d": "b"}[key])
    assert bench.curve(gpu, table) == [(0.5, 0.5), (1.0, 1.0), (1.5, 1.0), (2.0, 1.0), (2.0, 1.0)]
    assert bench.settled(bench.curve(gpu, table), gpu.trials) == (2, 1.0)
    gpu.declare("d")  # the final verdict: d, 70 % of the optimum: never settled, whatever came before
    assert bench.settled(bench.curve(gpu, table), gpu.trials) == (None, None)
    gpu.declared[-1] = (7200.0, "c")  # c is within 95 % (96 %) too: settled since b was declared
    assert bench.settled(bench.curve(gpu, table), gpu.trials) == (2, 1.0)
    assert bench.curve(bench.TruthGpu(gpu.truth, table), table) == [(0.0, 0.0)]  # nothing measured, nothing declared


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
    check = {"spearman": 0.9, "starts_not": 1, "fails_not": 0, "first_pick": 0.97}

    def run(strategy, seed, trials, hours, share=1.0):
        return {"scenario": "s", "seed": seed, "strategy": strategy, "optimum": 1.0, "defaults_share": 0.5,
                "flipped": "", "circularity": check, "trials_to_95": trials, "gpu_hours_to_95": hours,
                "declared_share": share, "curve": [], "trials": []}

    old = [run("autotune", 0, 5, 0.5), run("autotune", 1, 7, 0.7), run("TPE", 0, 3, 0.3),
           run("TPE", 1, None, None, 0.8), run("TPE", 2, None, None, 0.9)]
    new = [run("autotune", 0, 1, 0.1)]  # a rerun of one run
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    merged = tmp_path / "merged.json"
    assert bench.table_from([tmp_path / "old.json", tmp_path / "new.json"], merged, 15) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| s |")]
    assert lines[:3] == ["| s | 50% | +0.90 | 3 / 0 | 3/3 |",  # the circularity check: one row per truth (3 seeds)
                     "| s | autotune | 0.40 | 4 | 2/2 | 100% |",  # medians of (0.1, 0.7) and (1, 7)
                     "| s | TPE | > 15 trials | > 15 trials | 1/3 | 90% |"]  # two of three never got there
    assert len(json.loads(merged.read_text())) == 5


def row(c):
    """A truth table's row of a config that starts and holds ``c`` req/s."""
    return {"starts": True, "start_s": 60.0, "capacity": c}


def test_the_shipped_prediction_is_the_products_simulator_on_the_scenarios_workload(bench):
    from autotune.sim.rank import GRID

    sc = next(s for s in bench.SCENARIOS if s.name == "long-docs-70b-tp4-h100")
    capacity = bench.shipped_prediction((sc, bench.defaults_key(sc)))[0]
    # a capacity on the simulator's load grid (9 % apart) times the workload's own rate
    k = GRID * math.log2(capacity / bench._steps(sc).base.rate)
    assert capacity > 0 and k == pytest.approx(round(k), abs=1e-6)
    assert bench.shipped_prediction((sc, bench.key_of(sc, {"gpu_memory_utilization": 0.3})))[0] == 0.0  # cannot start


def test_the_circularity_checks_first_pick_is_the_studys_by_rank(bench):
    """Two configs the guide's capacity ties: without ranks the first pick is their mean; with ranks it is the one
    the study queues first (rank_rps), and the shipped rank lies within the capacity's 9 % grid step."""
    from autotune.sim.rank import GRID

    sc = next(s for s in bench.SCENARIOS if s.name == "long-docs-70b-tp4-h100")
    a, b = bench.grid_keys(sc)[:2]
    table = {a: row(1.0), b: row(2.0)}
    guide = {a: 1.5, b: 1.5}
    assert bench.circularity(sc, table, guide).first_pick == pytest.approx(0.75)  # the tie, averaged
    assert bench.circularity(sc, table, guide, {a: 1.6, b: 1.55}).first_pick == pytest.approx(0.5)
    assert bench.circularity(sc, table, guide, {a: 1.55, b: 1.6}).first_pick == pytest.approx(1.0)
    capacity, rank = bench.shipped_prediction((sc, bench.defaults_key(sc)))
    assert capacity <= rank <= capacity * 2 ** (1 / GRID) * (1 + 1e-9)
