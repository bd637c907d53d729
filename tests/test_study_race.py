"""Racing the incumbent inside a trial (issue 10, item 3): a sampled trial's load ladder starts at the best
capacity so far and stops at once if it misses the SLOs there; baselines and the re-measurement climb in full.

The profile is pure (tests here drive it with made-up steps); the study runs against vllm-sim, where one
sequence at a time is far below sixty-four, so the races' outcomes are known in advance: a trial with 64
beats an incumbent with 1, a trial with 1 loses to an incumbent with 64.
"""

import os
import subprocess
import sys

import optuna
import pytest
from optuna.trial import TrialState

from autotune.measure.profiles import Ladder, Race
from autotune.study.advice import Advice
from autotune.study.advisor import Advisor
from autotune.study.records import Attr
from tests.conftest import free_port
from tests.measurers import SetOutcomes
from tests.test_study_sim import STUDY


class StubAdvisor(Advisor):
    """A stand-in for the simulator (named as such): ``capacity`` maps a point to its predicted capacity,
    ``startup`` a point to its start-up failure; ``predict`` raises ``fails`` and ``learn`` ``learn_fails``, where
    given; ``learn`` counts its calls."""

    predicts = True

    def __init__(self, capacity=lambda p: None, startup=lambda p: None, learns=False, fails=None, learn_fails=None):
        self.capacity, self.startup, self.learns, self.fails = capacity, startup, learns, fails
        self.learn_fails = learn_fails
        self.learned = []

    def predict(self, points):
        if self.fails is not None:
            raise self.fails
        return [_prediction(*c) if isinstance(c := self.capacity(p), tuple) else _prediction(c) for p in points]

    def startup_failure(self, values):
        return self.startup(values)

    def learn(self, study):
        self.learned.append(study)
        if self.learn_fails is not None:
            raise self.learn_fails


def advise(run, advisor):
    """The run asks ``advisor`` from now on (as if the CLI had built it with the run)."""
    run.advice = Advice(advisor, run.space, run.steps, seed=run.d.seed, budget=run.d.budget.trials, notice=run._notice)
    return advisor


def test_a_race_starts_at_the_incumbent_and_ends_at_its_first_miss():
    race = Race(3.0, max_steps=4, resolution=1.25)
    assert race.next_load([]) == 3.0
    assert race.next_load([(3.0, False)]) is None and Race.lost([(3.0, False)])  # missed where the incumbent holds
    # held: gallops on, one resolution up, again, then the stride squared (a challenger is seldom far above the
    # incumbent)
    assert race.next_load([(3.0, True)]) == pytest.approx(3.75) and not Race.lost([(3.0, True)])
    assert race.next_load([(3.0, True), (3.75, False)]) is None  # bracketed to the resolution in two steps
    assert race.next_load([(3.0, True), (3.75, True)]) == pytest.approx(3.75 * 1.25)
    assert race.next_load([(3.0, True), (3.75, True), (4.6875, False)]) is None  # 1.25-1.56x above: three
    assert race.next_load([(3.0, True), (3.75, True), (4.6875, True)]) == pytest.approx(4.6875 * 1.25 ** 2)
    assert race.next_load([(3.0, True), (3.75, True), (5.86, True), (14.3, True)]) is None  # max_steps
    # what the ladder would have done from the bottom, for the same config: several steps below the incumbent
    assert Ladder(1.0).next_load([(1.0, True)]) == 2.0


def test_sampled_trials_race_the_incumbent_and_losers_are_pruned_where_they_missed(tmp_path, tiny_model):
    text = STUDY.format(name="race", runs=tmp_path, python=sys.executable, port=free_port(), model=tiny_model,
                        kind="capacity", trials=6)
    text = text.replace('max_num_seqs = {{ type = "int", low = 2, high = 64, log = true, default = 64 }}'.replace(
        "{{", "{").replace("}}", "}"), 'max_num_seqs = { type = "categorical", choices = [1, 64], default = 64 }')
    text = text.replace('builtin = ["vllm-defaults", "xinference-legacy"]   # legacy: 70 % of the GPU, chunked prefill off',
                        "builtin = []")
    text = text.replace('extra = [{ name = "max-num-seqs-2", values = { max_num_seqs = 2 } }]',
                        'extra = [{ name = "one-at-a-time", values = { max_num_seqs = 1, '
                        'gpu_memory_utilization = 0.92 } }]')
    # racing alone: with the simulator, its predicted best would run first and lead (test below)
    text = text.replace("[objective]\n", "[objective]\nsimulate_first = false\n")
    assert "choices = [1, 64]" in text and "one-at-a-time" in text and "builtin = []" in text
    assert "simulate_first = false" in text
    path = tmp_path / "race.toml"
    path.write_text(text)
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(path), "--no-remeasure"], capture_output=True,
                       text=True, timeout=400, env={**os.environ, "AUTOTUNE_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 0, r.stderr[-3000:]
    trials = optuna.load_study(study_name="race", storage=f"sqlite:///{tmp_path}/studies.db").trials
    first = trials[0]
    assert first.user_attrs[Attr.BASELINE] == "one-at-a-time" and Attr.RACE not in first.user_attrs
    assert len(first.user_attrs[Attr.STEPS]) >= 2  # the baseline climbed the whole ladder

    raced = [t for t in trials if Attr.RACE in t.user_attrs]
    # every later trial raced, but one TPE sampled again after an earlier trial measured it: that one took the
    # earlier result and started no engine (two configs in this space, four with the utilization)
    again = [t for t in trials[1:] if Attr.SAME_CONFIG_AS in t.user_attrs]
    assert all(Attr.RACE not in t.user_attrs and Attr.STEPS not in t.user_attrs for t in again)
    assert len(raced) == len(trials) - 1 - len(again), [(t.number, t.user_attrs.get(Attr.RACE)) for t in trials]
    outcomes = []
    for t in raced:
        race, steps = t.user_attrs[Attr.RACE], t.user_attrs[Attr.STEPS]
        # the incumbent: the best feasible capacity among the trials before it
        before = [u for u in trials[:t.number] if u.state is TrialState.COMPLETE]
        best = max(before, key=lambda u: u.value)
        assert race["incumbent"] == best.number and race["incumbent_rps"] == pytest.approx(best.value), (t.number, race)
        assert steps[0]["rate"] == pytest.approx(race["incumbent_rps"])  # no step below the incumbent
        if race["lost"]:
            assert t.state is TrialState.PRUNED and len(steps) == 1 and not steps[0]["passed"], (t.number, steps)
            assert race["missed_at_rps"] == pytest.approx(race["incumbent_rps"])
        else:
            assert t.state is TrialState.COMPLETE and t.value >= race["incumbent_rps"] * 0.999, (t.number, t.value)
        outcomes.append((t.params["max_num_seqs"], race["lost"]))
    print(f"races (max_num_seqs, lost): {outcomes}")
    # 64 beats one at a time; once 64 is the incumbent, one at a time loses at its first step
    assert (64, False) in outcomes, outcomes
    first_win = outcomes.index((64, False))
    assert all(lost for seqs, lost in outcomes[first_win:] if seqs == 1), outcomes
    for t in raced:  # the console's trial line says why a loser stopped
        if t.user_attrs[Attr.RACE]["lost"]:
            assert (f"trial {t.number} (" in r.stderr and f"lost the race to trial {t.user_attrs[Attr.RACE]['incumbent']}: "
                    "missed the SLOs at" in r.stderr), r.stderr[-3000:]


# -- simulate first (issue 10, item 1) -----------------------------------------------------------------------------

def test_a_study_scores_its_space_in_virtual_time_and_measures_the_predicted_best_first(tmp_path, tiny_model):
    """vllm-sim as the engine and as the simulator (the one that models it: a ranking that must agree), a study
    with one weak baseline: the predictions are stored in the study, the predicted best three and the baseline run in
    the order of their predictions (the baseline, predicted far below them, last), every trial carries its predicted
    capacity next to the measured one, and a trial that does not race starts its load ladder at its prediction."""
    text = STUDY.format(name="first", runs=tmp_path, python=sys.executable, port=free_port(), model=tiny_model,
                        kind="capacity", trials=4)
    text = text.replace('builtin = ["vllm-defaults", "xinference-legacy"]   # legacy: 70 % of the GPU, chunked prefill off',
                        "builtin = []")
    path = tmp_path / "first.toml"
    path.write_text(text)
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(path), "--no-remeasure"], capture_output=True,
                       text=True, timeout=400, env={**os.environ, "AUTOTUNE_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 0, r.stderr[-3000:]
    study = optuna.load_study(study_name="first", storage=f"sqlite:///{tmp_path}/studies.db")
    predictions = study.user_attrs[Attr.SIM_PREDICTIONS]
    # 4 values of max_num_seqs (2..64, log), each at the highest utilization that starts (0.92 of 0.85, 0.92):
    # the two utilizations of one max_num_seqs run as one config, predicted once
    assert len(predictions) == 4 and {p["values"]["gpu_memory_utilization"] for p in predictions} == {0.92}
    assert "simulated 4 configs in" in r.stderr, r.stderr[-2000:]
    trials = study.trials
    assert trials[3].user_attrs[Attr.BASELINE] == "max-num-seqs-2"
    picked = [t for t in trials if t.user_attrs[Attr.CHOSEN_BECAUSE].startswith("simulator: predicted")]
    assert [t.number for t in picked] == [0, 1, 2], [(t.number, t.user_attrs[Attr.CHOSEN_BECAUSE]) for t in trials]
    said = [t.user_attrs[Attr.PREDICTED_CAPACITY_RPS] for t in trials]
    assert said == sorted(said, reverse=True), said
    best = max(p["capacity_rps"] for p in predictions)
    assert picked[0].user_attrs[Attr.PREDICTED_CAPACITY_RPS] == pytest.approx(best)
    for t in trials:  # predicted and measured, side by side on every trial (the dashboard shows both)
        assert t.user_attrs[Attr.PREDICTED_CAPACITY_RPS] is not None and Attr.CAPACITY_RPS in t.user_attrs
    # the first pick and the baseline race nothing: they start at the prediction, scaled by how far off the
    # simulator was on the trials measured before them
    from autotune.study.records import TrialRecord
    from autotune.study.advisor import prediction_bias
    for t in (trials[0], trials[3]):
        assert Attr.RACE not in t.user_attrs
        bias = prediction_bias([TrialRecord.of(u) for u in trials[:t.number]])
        assert t.user_attrs[Attr.LADDER_START_RPS] == pytest.approx(t.user_attrs[Attr.PREDICTED_CAPACITY_RPS] * bias)
        assert t.user_attrs[Attr.STEPS][0]["rate"] == pytest.approx(t.user_attrs[Attr.LADDER_START_RPS])
    # the predicted best beat the predicted-weak baseline for real
    assert max(t.user_attrs[Attr.CAPACITY_RPS] for t in picked) > 2 * trials[3].user_attrs[Attr.CAPACITY_RPS]


def test_a_simulator_that_fails_is_said_once_and_the_study_goes_on(tmp_path, tiny_model):
    """The simulator is an aid: a config it cannot model must not stop the study (pure: no engine starts)."""
    from autotune.study.definition import load_study
    from autotune.study.runner import StudyRun
    from autotune.workload.source import LoadSteps

    path = tmp_path / "s.toml"
    path.write_text(STUDY.format(name="s", runs=tmp_path, python=sys.executable, port=free_port(), model=tiny_model,
                                 kind="capacity", trials=4))
    d = load_study(path)
    said = []
    run = StudyRun.on_engine(d, d.command.flag_table(), LoadSteps(d.workload, d.objective.step_seconds), notice=said.append)

    advise(run, StubAdvisor(fails=ValueError("unknown dtype 'fp4'")))
    study = optuna.create_study(direction="maximize")
    run.advice.queue_first(study)
    assert not run.advice.predicting and Attr.SIM_PREDICTIONS not in study.user_attrs and study.trials == []
    assert said == ["the simulator failed (ValueError: unknown dtype 'fp4'); the study goes on without predictions"]


def _learning_run(tmp_path, tiny_model, predict):
    """A StudyRun whose advisor predicts ``predict`` (max_num_seqs -> capacity) and counts its refits; no engine."""
    from autotune.study.definition import load_study
    from autotune.study.runner import StudyRun
    from autotune.workload.source import LoadSteps

    path = tmp_path / "s.toml"
    path.write_text(STUDY.format(name="s", runs=tmp_path, python=sys.executable, port=free_port(), model=tiny_model,
                                 kind="capacity", trials=10))
    d = load_study(path)
    said = []
    run = StudyRun.on_engine(d, d.command.flag_table(), LoadSteps(d.workload, d.objective.step_seconds), notice=said.append)
    advisor = advise(run, StubAdvisor(lambda p: predict(p["max_num_seqs"]), learns=True))
    study = optuna.create_study(direction="maximize")
    study.set_user_attr(Attr.SIM_QUEUED, True)
    study.set_user_attr(Attr.SIM_PREDICTIONS, [
        {"values": {"gpu_memory_utilization": 0.92, "max_num_seqs": n}, "capacity_rps": c}
        for n, c in ((64, 10.0), (32, 8.0), (16, 6.0), (2, 1.0))])
    return run, study, said, advisor.learned


def _measured(study, seqs: int, capacity: float, predicted: float):
    from optuna.distributions import CategoricalDistribution, IntDistribution

    t = optuna.trial.create_trial(
        params={"gpu_memory_utilization": 0.92, "max_num_seqs": seqs}, value=capacity,
        distributions={"gpu_memory_utilization": CategoricalDistribution([0.85, 0.92]),
                       "max_num_seqs": IntDistribution(2, 64, log=True)},
        user_attrs={Attr.CAPACITY_RPS: capacity, Attr.CONSTRAINTS: [-1.0, -1.0], Attr.PREDICTED_CAPACITY_RPS: predicted})
    study.add_trial(t)
    return study.trials[-1]


def test_after_a_trial_the_refitted_simulator_queues_the_config_it_now_predicts_best(tmp_path, tiny_model):
    """Refit on what was measured, predict again what it ranked best, queue the one above the
    best measured capacity; the study measures it next (a waiting trial)."""
    run, study, said, refits = _learning_run(tmp_path, tiny_model, {64: 9.5, 32: 12.0, 16: 7.0, 2: 1.0}.get)
    last = _measured(study, 64, 9.0, 10.0)
    run._learn(study, last)
    assert len(refits) == 1 and said == []
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert [t.system_attrs["fixed_params"]["max_num_seqs"] for t in waiting] == [32]
    assert waiting[0].user_attrs[Attr.CHOSEN_BECAUSE] == (f"simulator, refitted after trial {last.number}: predicted "
                                                          "12.00 req/s, above the best measured 9.00")
    run._learn(study, last)  # one pick at a time: nothing more while it waits
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 1 and len(refits) == 1


def test_a_simulator_that_predicts_nothing_better_hands_the_search_to_tpe(tmp_path, tiny_model):
    run, study, said, _ = _learning_run(tmp_path, tiny_model, {64: 9.5, 32: 8.0, 16: 7.0, 2: 1.0}.get)
    run._learn(study, _measured(study, 64, 9.0, 10.0))
    assert study.get_trials(states=(TrialState.WAITING,)) == []
    assert study.user_attrs[Attr.SIM_STOPPED] == "it predicts no config left above the best measured, 9.00 req/s"
    assert said == ["the simulator stops choosing trials: it predicts no config left above the best measured, 9.00 "
                    "req/s; TPE chooses from here on"]


def test_a_simulator_that_keeps_missing_hands_the_search_to_tpe(tmp_path, tiny_model):
    """2 of the last 3 predictions off by more than 1.5x: it stops choosing, though it still predicts better."""
    run, study, said, _ = _learning_run(tmp_path, tiny_model, {64: 30.0, 32: 30.0, 16: 30.0, 2: 30.0}.get)
    _measured(study, 2, 1.0, 1.1)  # a hit
    _measured(study, 64, 4.0, 10.0)  # 2.5x off
    run._learn(study, _measured(study, 32, 7.0, 8.0))  # a hit: one miss in the last three is not "keeps missing"
    assert Attr.SIM_STOPPED not in study.user_attrs and len(study.get_trials(states=(TrialState.WAITING,))) == 1
    study.tell(study.ask(), 0.0)  # the waiting pick, told out of the way for this pure test
    run._learn(study, _measured(study, 16, 2.0, 6.0))  # 3x off: two of the last three
    assert study.user_attrs[Attr.SIM_STOPPED].startswith("2 of its last 3 predictions missed by more than 1.5x (trial "), \
        study.user_attrs
    assert "measured 2.00 req/s where it predicted 6.00" in study.user_attrs[Attr.SIM_STOPPED]
    assert said[-1].endswith("TPE chooses from here on")


def test_a_refit_that_fails_is_said_once_and_the_study_goes_on(tmp_path, tiny_model):
    run, study, said, _ = _learning_run(tmp_path, tiny_model, {64: 9.5, 32: 12.0, 16: 7.0, 2: 1.0}.get)

    run.advice.advisor.learn_fails = RuntimeError("cmaes diverged")
    run._learn(study, _measured(study, 64, 9.0, 10.0))
    assert not run.advice.learning and run.advice.predicting
    assert study.get_trials(states=(TrialState.WAITING,)) == []
    assert said == ["the simulator's refit failed (RuntimeError: cmaes diverged); it predicts with its last fit"]


# -- use what is known: gpu_memory_utilization is the highest that starts --------------------------------------------

def test_the_utilization_ladder_runs_from_the_highest_value_down():
    from autotune.study.advice import utilization_ladder
    from autotune.study.space import Param

    assert utilization_ladder(Param("gpu_memory_utilization", "float", 0.9, low=0.85, high=0.95, step=0.05)) == [
        0.95, 0.9, 0.85]
    assert utilization_ladder(Param("gpu_memory_utilization", "categorical", 0.92, choices=(0.85, 0.92))) == [
        0.92, 0.85]
    assert utilization_ladder(Param("gpu_memory_utilization", "float", 0.9, low=0.9, high=0.92))[:3] == [
        0.92, 0.91, 0.9]


def test_a_sampled_trial_runs_at_the_highest_utilization_that_starts_and_a_real_oom_lowers_the_ceiling(
        tmp_path, tiny_model):
    """The start-up model says where the engine starts; the trial runs at the highest such utilization whatever
    was sampled (Optuna keeps the sampled value). When the engine then runs out of memory there for real, later
    trials stay below it. No engine starts: the measurement answers with vLLM's OOM."""
    from autotune.engine.failures import Failure, FailureClass
    from autotune.measure.session import Outcome
    from autotune.study import runner
    from autotune.study.definition import load_study
    from autotune.workload.source import LoadSteps

    path = tmp_path / "s.toml"
    path.write_text(STUDY.format(name="s", runs=tmp_path, python=sys.executable, port=free_port(), model=tiny_model,
                                 kind="capacity", trials=4))
    d = load_study(path)
    said, asked = [], []

    def oom(config, n):
        return Outcome(url="", failure=Failure(FailureClass.OOM, "torch.OutOfMemoryError: CUDA out of memory."),
                       engine_failed_after_s=1.0)

    measurer = SetOutcomes.of(d, oom)
    run = runner.StudyRun(d, measurer, LoadSteps(d.workload, d.objective.step_seconds), notice=said.append)

    def startup(values):
        asked.append(values["gpu_memory_utilization"])
        return None if values["max_num_seqs"] < 64 else "ValueError: No available memory for the cache blocks."

    advise(run, StubAdvisor(startup=startup))
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial({"gpu_memory_utilization": 0.85, "max_num_seqs": 8})
    with pytest.raises(optuna.TrialPruned):
        run.objective(study.ask())
    first = study.trials[0]
    assert [a["gpu_memory_utilization"] for a in measurer.asked] == [0.92] and asked == [0.92]  # not 0.85
    assert first.params["gpu_memory_utilization"] == 0.85
    assert first.user_attrs[Attr.UTILIZATION] == {"sampled": 0.85, "runs": 0.92, "ceiling": None}
    assert study.user_attrs[Attr.UTILIZATION_CEILING] == 0.85
    assert said == ["trial 0 ran out of memory at gpu_memory_utilization 0.92, which the start-up model said starts: "
                    "later trials stay at 0.85 or below"]

    study.enqueue_trial({"gpu_memory_utilization": 0.92, "max_num_seqs": 8})
    with pytest.raises(optuna.TrialPruned):
        run.objective(study.ask())
    assert measurer.asked[-1]["gpu_memory_utilization"] == 0.85 and study.trials[1].user_attrs[Attr.UTILIZATION]["ceiling"] == 0.85

    # where the model says nothing in range starts, the sampled value runs (and fails for real, as predicted)
    study.enqueue_trial({"gpu_memory_utilization": 0.92, "max_num_seqs": 64})
    with pytest.raises(optuna.TrialPruned):
        run.objective(study.ask())
    assert measurer.asked[-1]["gpu_memory_utilization"] == 0.92 and Attr.UTILIZATION not in study.trials[2].user_attrs
    # baselines run as written
    study.enqueue_trial({"gpu_memory_utilization": 0.85, "max_num_seqs": 8}, user_attrs={Attr.BASELINE: "mine"})
    with pytest.raises(optuna.TrialPruned):
        run.objective(study.ask())
    assert measurer.asked[-1]["gpu_memory_utilization"] == 0.85 and Attr.UTILIZATION not in study.trials[3].user_attrs


# -- the order of the first trials, and baselines measured once -----------------------------------------------------

def _study_run(tmp_path, tiny_model, trials, notice=None, answer=None):
    """(a StudyRun of the vllm-sim study below, its definition): nothing starts unless the test runs a trial, and
    with ``answer`` (tests/measurers.py) nothing at all: its measurements are answer's outcomes."""
    from autotune.study.definition import load_study
    from autotune.study.runner import StudyRun
    from autotune.workload.source import LoadSteps

    path = tmp_path / "s.toml"
    path.write_text(STUDY.format(name="s", runs=tmp_path, python=sys.executable, port=free_port(), model=tiny_model,
                                 kind="capacity", trials=trials))
    d = load_study(path)
    steps = LoadSteps(d.workload, d.objective.step_seconds)
    kw = {"notice": notice} if notice else {}
    run = StudyRun(d, SetOutcomes.of(d, answer), steps, **kw) if answer else StudyRun.on_engine(
        d, d.command.flag_table(), steps, **kw)
    return run, d


def _prediction(capacity, rank=None):
    """A prediction as the simulator's (sim/rank.Predicted) reads: ``rank`` orders, ``capacity`` where not given."""
    from types import SimpleNamespace

    rank = capacity if rank is None else rank
    return SimpleNamespace(capacity_rps=capacity, rank_rps=rank,
                           to_json=lambda: {"capacity_rps": capacity, "rank_rps": rank})


def test_picks_and_baselines_are_queued_in_the_order_of_their_predicted_capacity(tmp_path, tiny_model):
    """Pure (no engine): the advisor predicts max_num_seqs -> capacity (everything starts, so every candidate runs
    at utilization 0.92); the three best picks and the two baselines are queued best first, a baseline ahead of a
    pick it ties with, one predicted not to start last."""
    from autotune.study.advice import ties
    from autotune.study.baselines import BaselinePoint

    said = []
    run, _ = _study_run(tmp_path, tiny_model, trials=10, notice=said.append)
    capacity = {2: 1.0, 6: 6.0, 20: 9.0, 64: 9.0}  # the space's grid: 2, 6, 20, 64 (log) x 0.85, 0.92
    advise(run, StubAdvisor(lambda p: None if p["max_num_seqs"] == 3 else capacity.get(p["max_num_seqs"], 0.5)))
    strong = BaselinePoint("strong", {"gpu_memory_utilization": 0.85, "max_num_seqs": 6})
    broken = BaselinePoint("broken", {"gpu_memory_utilization": 0.85, "max_num_seqs": 3})
    study = optuna.create_study(direction="maximize")
    assert run.advice.queue_first(study, [broken, strong]) == {"broken", "strong"}
    waiting = study.get_trials(states=(TrialState.WAITING,))
    order = [(t.user_attrs.get(Attr.BASELINE), t.system_attrs["fixed_params"]["max_num_seqs"],
              t.user_attrs[Attr.PREDICTED_CAPACITY_RPS]) for t in waiting]
    assert sorted(seqs for _, seqs, _ in order[:2]) == [20, 64]  # the two predicted best
    assert order[2] == ("strong", 6, 6.0)  # the baseline first among the ties at 6.0 ...
    assert order[3] == (None, 6, 6.0)  # ... then the pick it ties with (at the highest utilization that starts)
    assert order[4] == ("broken", 3, None)  # predicted not to start: last
    assert len(order) == 5 and study.user_attrs[Attr.SIM_QUEUED] is True
    # the console says the simulator cannot rank the two configs it predicts at the best
    assert any("best predicted 9.00 req/s, 2 configs tied there" in line for line in said), said
    assert ties([(9.0, {}), (8.9, {})]) == ""  # a best of its own: nothing to say
    assert run.advice.queue_first(study, [broken, strong]) == set()  # once per study: a resumed run queues nothing


def test_configs_the_grid_ties_are_queued_by_how_close_each_came_to_the_next_load(tmp_path, tiny_model):
    """Pure (no engine): three configs share the best grid capacity (9.0) and differ in rank_rps; the two closest
    to the next load are the picks, best first, each stated at its grid capacity (where its ladder starts), and
    the console counts no tie; the baseline at 6.0 still runs after them."""
    from autotune.study.baselines import BaselinePoint

    said = []
    run, _ = _study_run(tmp_path, tiny_model, trials=10, notice=said.append)
    rank = {2: (9.0, 9.1), 6: (9.0, 9.6), 20: (9.0, 9.4), 64: (6.0, 6.0)}
    advise(run, StubAdvisor(lambda p: rank[p["max_num_seqs"]]))
    study = optuna.create_study(direction="maximize")
    run.advice.queue_first(study, [BaselinePoint("default", {"gpu_memory_utilization": 0.85, "max_num_seqs": 64})])
    waiting = study.get_trials(states=(TrialState.WAITING,))
    order = [(t.system_attrs["fixed_params"]["max_num_seqs"], t.user_attrs[Attr.PREDICTED_CAPACITY_RPS])
             for t in waiting]
    assert order[:3] == [(6, 9.0), (20, 9.0), (2, 9.0)] and order[-1] == (64, 6.0), order
    assert any("best predicted 9.00 req/s" in line and "tied" not in line for line in said), said
    kept = {p["values"]["max_num_seqs"]: p["rank_rps"] for p in study.user_attrs[Attr.SIM_PREDICTIONS]}
    assert kept == {2: 9.1, 6: 9.6, 20: 9.4, 64: 6.0}  # kept in the study beside each capacity


def test_a_builtin_baseline_that_runs_another_baselines_config_is_measured_once(tmp_path, tiny_model):
    from autotune.study.baselines import BaselinePoint

    said = []
    run, d = _study_run(tmp_path, tiny_model, trials=4, notice=said.append)
    own = d.baselines[0].name  # the study's own baseline (as production's would be): never dropped
    points = [BaselinePoint("vllm-defaults", {"max_num_seqs": 64}), BaselinePoint("xinference-4.1", {"max_num_seqs": 64}),
              BaselinePoint("xinference-legacy", {"max_num_seqs": 2}), BaselinePoint(own, {"max_num_seqs": 2}),
              BaselinePoint("other", {"max_num_seqs": 64}, {"block_size": 32}),
              BaselinePoint("cuda-blocks", {"max_num_seqs": 64}, {"block_size": 16})]  # vLLM's own on CUDA
    assert [b.name for b in run._distinct(points)] == ["vllm-defaults", own, "other"]
    assert said == ["baseline xinference-4.1 runs the same config as baseline vllm-defaults: measured once, as "
                    "vllm-defaults", f"baseline xinference-legacy runs the same config as baseline {own}: measured "
                    f"once, as {own}", "baseline cuda-blocks runs the same config as baseline vllm-defaults: "
                    "measured once, as vllm-defaults"]


def test_candidates_that_run_as_one_config_are_predicted_and_queued_once(tmp_path, tiny_model):
    """With the start-up model, a candidate runs at the highest utilization that starts: the two utilizations
    of each max_num_seqs are one config, so the three picks are three different configs."""
    run, _ = _study_run(tmp_path, tiny_model, trials=10)
    asked = []

    def capacity(p):
        asked.append(p)
        return {2: 1.0, 6: 3.0, 20: 6.0, 64: 9.0}[p["max_num_seqs"]]

    advise(run, StubAdvisor(capacity))  # everything starts: 0.92 is the highest
    study = optuna.create_study(direction="maximize")
    run.advice.queue_first(study)
    assert len(asked) == 4 and {p["gpu_memory_utilization"] for p in asked} == {0.92}
    waiting = [t.system_attrs["fixed_params"] for t in study.get_trials(states=(TrialState.WAITING,))]
    assert waiting == [{"gpu_memory_utilization": 0.92, "max_num_seqs": n} for n in (64, 20, 6)]


def test_a_sampled_config_an_earlier_trial_measured_takes_its_result_without_an_engine(
        tmp_path, tiny_model):
    """Two sampled utilizations that the rule runs at the same one are one config: the second trial takes the
    first one's capacity and constraints (``same_config_as``) and starts no engine; a pruned twin prunes it."""
    from autotune.engine.failures import Failure, FailureClass
    from autotune.measure.session import Outcome
    from autotune.study.records import TrialRecord
    from autotune.study.lines import trial_line

    def crash(config, n):  # (not an oom: that would lower the utilization ceiling)
        return Outcome(url="", failure=Failure(FailureClass.CRASHED, "engine exited with -11"),
                       engine_failed_after_s=1.0)

    run, _ = _study_run(tmp_path, tiny_model, trials=6, answer=crash)
    advise(run, StubAdvisor())  # everything starts
    ran = run.measurer.asked
    study = optuna.create_study(direction="maximize")
    for u in (0.85, 0.92):  # both run at 0.92
        study.enqueue_trial({"gpu_memory_utilization": u, "max_num_seqs": 8})
        trial = study.ask()
        with pytest.raises(optuna.TrialPruned):
            run.objective(trial)
        study.tell(trial, state=TrialState.PRUNED)  # what Optuna's optimize does with a TrialPruned
    first, second = study.trials
    assert len(ran) == 1  # one engine start for one config
    assert first.user_attrs[Attr.ENGINE_GPUS] == 1  # what the kind says one engine of these args holds
    assert first.user_attrs[Attr.ENGINE_ARGS] == second.user_attrs[Attr.ENGINE_ARGS]
    assert Attr.SAME_CONFIG_AS not in first.user_attrs and second.user_attrs[Attr.SAME_CONFIG_AS] == 0
    assert second.user_attrs[Attr.FAILURE_CLASS] == "crashed" and second.user_attrs[Attr.CONSTRAINTS] == \
        first.user_attrs[Attr.CONSTRAINTS]
    assert first.user_attrs[Attr.FAILURE_ENGINE_SECONDS] == 1.0 and second.user_attrs[Attr.FAILURE_ENGINE_SECONDS] == 0.0
    line = trial_line(TrialRecord.of(study.get_trials()[1]), None)
    assert "the same config as trial 0, not run again: crashed: " in line, line

    # a complete twin: its value, without an engine
    study.add_trial(optuna.trial.create_trial(
        params={"gpu_memory_utilization": 0.92, "max_num_seqs": 16}, value=4.5,
        distributions=first.distributions, user_attrs={
            Attr.ENGINE_ARGS: {**first.user_attrs[Attr.ENGINE_ARGS],
                               "values": {**first.user_attrs[Attr.ENGINE_ARGS]["values"], "max_num_seqs": 16}},
            Attr.CAPACITY_RPS: 4.5, Attr.CONSTRAINTS: [-1.0, -2.0]}))
    study.enqueue_trial({"gpu_memory_utilization": 0.85, "max_num_seqs": 16})
    trial = study.ask()
    assert run.objective(trial) == 4.5 and len(ran) == 1
    assert trial.user_attrs[Attr.SAME_CONFIG_AS] == 2 and trial.user_attrs[Attr.CAPACITY_RPS] == 4.5
    assert trial.user_attrs[Attr.CONSTRAINTS] == [-1.0, -2.0]


def test_a_ladder_starts_at_the_prediction_scaled_by_how_far_off_the_simulator_has_been_here():
    from autotune.study.advisor import prediction_bias
    from autotune.study.records import TrialRecord

    def record(number, capacity, predicted, state=TrialState.COMPLETE, **more):
        attrs = {Attr.CAPACITY_RPS: capacity, Attr.PREDICTED_CAPACITY_RPS: predicted, **more}
        return TrialRecord(number, state, {}, (capacity,), attrs)

    assert prediction_bias([]) == 1.0  # nothing measured yet: the prediction as it is
    assert prediction_bias([record(0, 8.0, 10.0), record(1, 6.0, 10.0), record(2, 12.0, 10.0)]) == pytest.approx(0.8)
    ignored = [record(3, 0.0, 10.0),  # met no SLO: says nothing about the scale
               record(4, 5.0, None),  # no prediction before it ran
               record(5, 5.0, 10.0, TrialState.PRUNED),  # a lost race or a pruned climb: a lower bound only
               record(6, 1.0, 10.0, **{Attr.SAME_CONFIG_AS: 0})]  # not measured: a copy
    assert prediction_bias([record(0, 8.0, 10.0), *ignored]) == pytest.approx(0.8)


def test_a_study_whose_baselines_all_missed_says_why_it_is_not_re_measured(tmp_path, tiny_model):
    """Pure (no engine): a sampled trial held the SLOs and the only baseline did not; the re-measurement has no
    gain to read and says so in one line instead of ending without a word."""
    said = []
    run, _ = _study_run(tmp_path, tiny_model, trials=4, notice=said.append)
    study = optuna.create_study(direction="maximize")
    _measured(study, 16, 6.0, 6.0)
    missed = _measured(study, 2, 1.0, 1.0)
    study.add_trial(optuna.trial.create_trial(
        params=missed.params, distributions=missed.distributions, value=0.0,
        user_attrs={**missed.user_attrs, Attr.BASELINE: "max-num-seqs-2", Attr.CONSTRAINTS: [0.4, -1.0]}))
    assert run.remeasure(study) is None
    assert said == ["not re-measured: no baseline held the SLOs, so there is no gain to read; the best config "
                    "stands on its trial's one measurement"], said
