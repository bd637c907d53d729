"""A real study on vLLM (CPU build, tiny model) where the simulator chooses first, learns and races (issue 10).

This host's CPU is calibrated beforehand (the fit scripts/bench_self_calibration.py made of ten real configs of
this model here: CPU_FIT below), as `autotune calibrate` would leave it; then one study shows each part in its
trials: the simulator's picks and the baseline in the order of their predicted capacity (the weak baseline last),
the first pick's and the baseline's load ladders starting at their predictions, the later picks racing the
incumbent from its capacity, a refit after them, and the next trial chosen by the refitted simulator or, where it
stopped, by TPE with the reason kept in the study. Slow (five engine starts at most); marked ``engine`` and run in
CI.
"""

import os
import subprocess
import sys

import optuna
import pytest
from optuna.trial import TrialState

from autotune.sim import calibrate as cal
from autotune.study.records import Attr, TrialRecord
from autotune.study.advisor import prediction_bias
from tests.conftest import free_port, own_core

pytestmark = [pytest.mark.engine, pytest.mark.paired, pytest.mark.timeout(1800)]

# the time constants scripts/bench_self_calibration.py fitted on all ten of its measured configs, on this
# project's 2-vCPU CI host (bench/self_calibration.json, "fit_all"): a stand-in for an earlier study's calibration
CPU_FIT = {"compute_efficiency": 0.0168, "bandwidth_efficiency": 0.206, "host_step_s": 0.00697, "host_seq_s": 4.9e-05,
           "eager_layer_s": 0.00101, "latency_s": 0.199, "output_token_s": 2.14e-05}

STUDY = """
name = "learning"
slos = ["ttft<1s", "tpot<100ms"]
seed = 1
storage = "sqlite:///{runs}/studies.db"
runs_dir = "{runs}"

[engine]
command = "{vllm}"
model = "{model}"
platform = "cpu"
port = {port}
startup_timeout = "10m"
nice = 10

[engine.args]
max_model_len = 2048
enforce_eager = true    # faster starts for the test
stream_interval = 4

[engine.env]
VLLM_CACHE_ROOT = "{cache}"
VLLM_CPU_OMP_THREADS_BIND = "{core}"   # its own core beside the other real study (tests/conftest.py own_core)
VLLM_CPU_KVCACHE_SPACE = "1"

[space]
max_num_seqs = {{ type = "int", low = 1, high = 64, log = true, default = 64 }}
max_num_batched_tokens = {{ type = "int", low = 64, high = 2048, log = true, default = 2048 }}

[workload]
scenario = "chat"
rate = 1                # one request at a time holds a step here, below load 1
requests = 8
prefix_tokens = [64, 128]
prompt_tokens = [32, 128]
output_tokens = [16, 48]  # half the calibration's answers: shorter steps, and a fit carried to a new workload

[objective]
kind = "capacity"
max_steps = 3
race = true
simulate_first = true

[budget]
trials = 5

[baselines]
builtin = []
extra = [{{ name = "one-at-a-time", values = {{ max_num_seqs = 1 }} }}]

"""


def test_a_cpu_study_simulates_first_races_and_learns_from_each_trial(tmp_path, tiny_model, vllm_command, engine_env):
    state = tmp_path / "state"
    cal.save(cal.Calibration("cpu", str(tiny_model), dict(CPU_FIT), 3.004, 0.149, 40, list(range(10)),
                             "self-calibration"), state)
    path = tmp_path / "learning.toml"
    path.write_text(STUDY.format(runs=tmp_path, vllm=" ".join(vllm_command), model=tiny_model, port=free_port(),
                                 cache=engine_env["VLLM_CACHE_ROOT"], core=own_core(-1)))
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(path), "--no-remeasure"], capture_output=True,
                       text=True, timeout=1800, env={**os.environ, "AUTOTUNE_STATE_DIR": str(state)})
    print(r.stderr[-6000:])
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("simulating first with vllm-sim's cpu profile, calibrated on 40 steps of 10 trials of study "
            "self-calibration") in r.stderr
    study = optuna.load_study(study_name="learning", storage=f"sqlite:///{tmp_path}/studies.db")
    assert len(study.user_attrs[Attr.SIM_PREDICTIONS]) > 8
    trials = study.trials
    assert len(trials) == 5 and trials[0].state is TrialState.COMPLETE
    baseline = trials[3]
    assert baseline.user_attrs[Attr.BASELINE] == "one-at-a-time"
    why = [t.user_attrs[Attr.CHOSEN_BECAUSE] for t in trials]
    assert all(w.startswith("simulator: predicted") for w in why[:3]), why
    predicted = [t.user_attrs[Attr.PREDICTED_CAPACITY_RPS] for t in trials[:4]]
    assert predicted == sorted(predicted, reverse=True), predicted  # queued in the order of their predictions
    # nothing to race yet, or a baseline: the ladder starts at the prediction, scaled by how far off the simulator
    # was on the trials measured before it
    for t in (trials[0], baseline):
        assert Attr.RACE not in t.user_attrs, t.number
        assert t.user_attrs[Attr.STEPS][0]["rate"] == pytest.approx(t.user_attrs[Attr.LADDER_START_RPS])
        bias = prediction_bias([TrialRecord.of(u) for u in trials[:t.number]])
        assert t.user_attrs[Attr.LADDER_START_RPS] == pytest.approx(t.user_attrs[Attr.PREDICTED_CAPACITY_RPS] * bias)
    for t in trials[1:3]:  # the later picks raced the incumbent, starting at its capacity
        race = t.user_attrs[Attr.RACE]
        assert t.user_attrs[Attr.STEPS][0]["rate"] == pytest.approx(race["incumbent_rps"]), (t.number, race)
        assert t.state is (TrialState.PRUNED if race["lost"] else TrialState.COMPLETE)
    assert all(Attr.PREDICTED_CAPACITY_RPS in t.user_attrs for t in trials)  # predicted before, measured after
    # the simulator's picks beat one request at a time for real
    assert max(t.user_attrs.get(Attr.CAPACITY_RPS, 0.0) for t in trials[:3]) > baseline.user_attrs[Attr.CAPACITY_RPS]
    # after the picks: a refit, then the refitted simulator's next pick, or TPE with the simulator's reason kept
    # (or the refit's check, where the last fit already says every measured step to within ~10 %)
    assert "vllm-sim refitted to this host: calibrated on" in r.stderr or "vllm-sim still fits this host's" in r.stderr
    if why[4].startswith("simulator, refitted after trial"):
        assert "sim_stopped" not in study.user_attrs
    else:
        assert study.user_attrs["sim_stopped"] and "the simulator stops choosing trials" in r.stderr, why
    kept = cal.load(state, "cpu", str(tiny_model))
    assert kept.study == "learning" and kept.steps > 0  # the end-of-study fit replaced the earlier one
