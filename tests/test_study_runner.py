"""The Optuna side of a study without an engine: pre-check pruning, baselines, resume bookkeeping."""

import optuna
import pytest
from optuna.trial import TrialState

from autotune.engine.args import EngineArgs
from autotune.engine.vllm.flags import bundled_table
from autotune.errors import ConfigError
from autotune.study.definition import load_study
from autotune.engine.kind import get_kind
from autotune.study.records import Candidate, TrialRecord, constraints_of, judge
from autotune.study.runner import StudyRun
from autotune.study.storage import open_study
from autotune.workload.source import LoadSteps

optuna.logging.set_verbosity(optuna.logging.WARNING)

STUDY = """
name = "precheck-only"
slos = ["ttft<1s"]
storage = "sqlite:///{tmp}/s.db"
runs_dir = "{tmp}/runs"

[engine]
command = "{tmp}/no-such-vllm serve"   # never launched: every candidate here is provably too small
model = "{model}"
platform = "cpu"

[engine.args]
max_model_len = 32768

[space]
kv_cache_memory_bytes = {{ type = "categorical", choices = [16777216, 33554432], default = 33554432 }}

[workload]
scenario = "high-concurrency"
rate = 4
requests = 8
prompt_tokens = [8, 16]
output_tokens = [4, 8]

[budget]
trials = 3

[baselines]
builtin = ["vllm-defaults"]
"""


@pytest.fixture
def definition(tmp_path, tiny_model):
    p = tmp_path / "s.toml"
    p.write_text(STUDY.format(tmp=tmp_path, model=tiny_model))
    return load_study(p)


def test_provably_infeasible_candidates_are_pruned_at_zero_engine_seconds(definition):
    run = StudyRun.on_engine(definition, bundled_table("0.32"), LoadSteps(definition.workload))
    study = open_study(definition)
    run.optimize(study)
    trials = study.trials
    assert len(trials) == 3 and all(t.state == TrialState.PRUNED for t in trials)
    for t in trials:
        assert t.user_attrs["failure_class"] == "oom"
        assert t.user_attrs["failure_engine_seconds"] == 0.0
        assert "KV cache" in t.user_attrs["precheck"]
        assert constraints_of(t) == [1000.0]
        assert t.system_attrs["constraints"] == [1000.0]  # the legacy list optuna-dashboard reads
        assert "--kv-cache-memory-bytes" in t.user_attrs["argv"]
    assert trials[0].user_attrs["baseline"] == "vllm-defaults"
    assert not (definition.run_dir / "trials").exists()  # nothing was launched


def test_rerun_resumes_to_the_budget_and_does_not_enqueue_baselines_twice(definition):
    run = StudyRun.on_engine(definition, bundled_table("0.32"), LoadSteps(definition.workload))
    study = open_study(definition)
    run.optimize(study)
    assert run.remaining(study) == 0
    # a trial left RUNNING by a killed process is failed on the next start, and its baseline comes back
    study2 = open_study(definition)
    study2.enqueue_trial({"kv_cache_memory_bytes": 33554432}, user_attrs={"baseline": "production"})
    stale = study2.ask()
    assert stale.user_attrs["baseline"] == "production"
    run.prepare(study2)
    assert study2.trials[-1].state == TrialState.FAIL
    waiting = [t for t in study2.trials if t.state == TrialState.WAITING]
    assert [t.user_attrs.get("baseline") for t in waiting] == []  # vllm-defaults already measured; production is not in this file


def test_a_study_made_for_another_objective_is_refused(definition, tmp_path):
    optuna.create_study(study_name="precheck-only", storage=definition.storage, directions=["maximize", "minimize"])
    with pytest.raises(ConfigError, match="another objective"):
        open_study(definition)


def test_best_config_files(tmp_path):
    import yaml

    from autotune.study.outputs import write_best

    t = optuna.trial.create_trial(value=12.5, params={}, distributions={}, user_attrs={
        "engine_args": {"values": {"max_num_seqs": 64, "enable_prefix_caching": False, "load_format": "dummy"},
                        "env": {"VLLM_CACHE_ROOT": "/var/cache/x y"}},
        "argv": ["vllm", "serve", "m", "--port", "8100", "--max-num-seqs", "64", "--load-format", "dummy"],
        "capacity_rps": 12.5})
    paths = write_best(TrialRecord.of(t), "m", get_kind("vllm"), tmp_path)
    text = paths["config"].read_text()
    # a false boolean as vLLM's serve --config reads it (it drops `key: false`, vllm-project/vllm#51401)
    assert yaml.safe_load(text) == {"model": "m", "max-num-seqs": 64, "no-enable-prefix-caching": True}
    assert "load_format dummy" in text and "VLLM_CACHE_ROOT='/var/cache/x y'" in text  # said, not configured
    cmd = paths["command"].read_text()
    assert "exec env VLLM_CACHE_ROOT='/var/cache/x y' vllm serve m --port 8100" in cmd


def _cand(label, caps, n=0):
    return Candidate(label, n, EngineArgs({}, {}), capacities=caps)


def test_the_baseline_can_win_and_is_then_no_gain():
    v = judge([_cand("trial 4", [9.0, 9.0], 4), _cand("baseline xinference-4.1", [20.0, 20.0])])
    assert v.winner == "baseline xinference-4.1" and not v.significant


def test_a_trial_record_shows_the_config_as_the_engine_ran_it():
    """A baseline whose own value overrides the space's (production ran --max-num-seqs 8) shows 8, not the
    space's 1024; a knob only the baseline sets is shown too; stepped floats are decimals."""
    from optuna.trial import TrialState

    from autotune.study.records import Attr, TrialRecord

    r = TrialRecord(3, TrialState.COMPLETE, {"max_num_seqs": 1024, "gpu_memory_utilization": 0.8700000000000001},
                    (1.0,), {Attr.BASELINE: "production", Attr.BASELINE_ARGS: {"block_size": 32},
                             Attr.ENGINE_ARGS: {"values": {"max_num_seqs": 8, "block_size": 32,
                                                           "gpu_memory_utilization": 0.8700000000000001},
                                                "env": {}}})
    assert r.config == {"max_num_seqs": 8, "gpu_memory_utilization": 0.87, "block_size": 32}


def test_a_tie_goes_to_the_baseline():
    """Equal medians: nothing to gain by changing the config, so the baseline stays the winner."""
    v = judge([_cand("trial 4", [10.0, 10.0], 4), _cand("trial 6", [10.0, 10.0], 6),
               _cand("baseline vllm-defaults", [10.0, 10.0])])
    assert v.winner == "baseline vllm-defaults" and v.gain_rps == 0.0 and not v.significant


@pytest.mark.parametrize(("kind", "objective", "cut"), [
    ("capacity", "", True),
    ("capacity", "cut_lost_steps = false", False),  # a study meant for `autotune calibrate`
    ("pareto", "", False),  # its values are the step's throughput and p95 TTFT: a cut step would truncate them
])
def test_a_lost_step_is_cut_only_where_pass_or_fail_is_all_the_study_reads(tmp_path, tiny_model, kind, objective, cut):
    p = tmp_path / "s.toml"
    p.write_text(STUDY.format(tmp=tmp_path, model=tiny_model) + f'\n[objective]\nkind = "{kind}"\n{objective}\n')
    d = load_study(p)
    run = StudyRun.on_engine(d, bundled_table("0.32"), LoadSteps(d.workload))
    assert run._cut_lost_steps is cut
    from tests.test_study_race import StubAdvisor, advise

    advise(run, StubAdvisor(learns=True))  # an advisor that refits on every measured step: none may be cut
    assert run._cut_lost_steps is False


def _remeasuring(tmp_path, tiny_model, capacities):
    """A StudyRun over test_report's typical study (trial 2 held 3.2 req/s, baseline vllm-defaults 2.21) whose
    n-th re-measurement of a config (by max_num_seqs) holds ``capacities[seqs][n]`` and misses 5 % above it."""
    from autotune.measure.metrics import RequestResult, summarize
    from autotune.measure.session import Outcome, Step
    from autotune.study.runner import StudyRun
    from autotune.workload.source import LoadSteps
    from tests.measurers import SetOutcomes
    from tests.test_report import SLOS, build, study_toml, typical

    def step(rate, holds):
        ttft = 0.1 if holds else 0.5
        results = [RequestResult(i, i / rate, i / rate, True, ttft=ttft, itl=[0.02] * 9, e2e=ttft + 0.18,
                                 prompt_tokens=100, output_tokens=10, expected_output_tokens=10) for i in range(20)]
        s = summarize(results, SLOS)
        return Step(rate / 8, rate, s, s.verdicts(SLOS), 20 / rate, results)

    seen: dict[int, int] = {}

    def answer(config, _):
        seqs = config.args.values["max_num_seqs"]
        k = seen[seqs] = seen.get(seqs, -1) + 1
        cap = capacities[seqs][k]
        return Outcome(url="http://127.0.0.1:1", steps=[step(cap, True), step(cap * 1.05, False)])

    import dataclasses

    d = study_toml(tmp_path)
    study = build(d, typical())
    said = []
    steps = LoadSteps(dataclasses.replace(d.workload, tokenizer=str(tiny_model)))
    run = StudyRun(d, SetOutcomes.of(d, answer), steps, show=lambda _: None, notice=said.append)
    return run, study, said


def test_re_measuring_stops_once_the_verdict_is_sure(tmp_path, tiny_model):
    run, study, said = _remeasuring(tmp_path, tiny_model, {64: [3.25] * 3, 128: [2.2] * 3})
    verdict = run.remeasure(study)
    runs = len(run.measurer.asked)
    assert verdict.significant and verdict.winner_trial == 2 and verdict.p_within >= 0.9
    assert 1 <= runs < 6, runs  # the fixed rule ran 2 candidates x 3; the winner was measured twice (trial + 1)
    assert f"re-measured enough after {runs} run{'s' * (runs != 1)}: trial 2 beats baseline vllm-defaults" in said[-1], said


def test_re_measuring_goes_on_while_the_verdict_is_unsure_and_ends_at_its_budget(tmp_path, tiny_model):
    run, study, said = _remeasuring(tmp_path, tiny_model, {64: [2.0, 2.1, 3.4], 128: [2.9, 2.0, 2.6]})
    verdict = run.remeasure(study)
    assert len(run.measurer.asked) == 6 and not any("re-measured enough" in s for s in said)
    assert verdict.p_within < 0.9 and verdict.confidence == 0.9
