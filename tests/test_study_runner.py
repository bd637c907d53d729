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


def test_a_gain_within_the_spread_is_no_gain():
    v = judge([_cand("trial 4", [12.0, 9.0, 11.0], 4), _cand("baseline vllm-defaults", [10.0, 10.5, 9.5])])
    assert v.winner == "trial 4" and v.gain_rps == pytest.approx(1.0)
    assert v.noise_rps == pytest.approx(2.0) and not v.significant  # 2 x MAD of 12, 9, 11


def test_a_gain_beyond_the_spread_is_significant():
    v = judge([_cand("trial 4", [15.0, 14.0], 4), _cand("baseline vllm-defaults", [10.0, 10.5])])
    assert v.winner_trial == 4 and v.significant and v.gain_rps == pytest.approx(4.25)


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
