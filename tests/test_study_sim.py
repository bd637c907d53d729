"""The study code, unchanged, against vllm-sim: baselines, a real start-up oom, a winner, the Pareto mode.

vllm-sim is launched, replayed over HTTP and stopped exactly like vLLM; only the engine command
differs. An 8B model on a simulated A10 keeps the request rates (and this host's CPU) low.
"""

import os
import subprocess
import sys

import optuna
import pytest
from optuna.trial import TrialState

from tests.conftest import free_port

STUDY = """
name = "{name}"
slos = ["ttft<500ms", "tpot<60ms"]
seed = 0
precheck = false   # the engine's own start-up failure is under test here; the pre-check would catch it first
storage = "sqlite:///{runs}/studies.db"
runs_dir = "{runs}"

[engine]
command = "{python} -m autotune.sim.cli --gpu a10-24gb --time-scale 0.01 serve"
model = "llama-3.1-8b"
platform = "cuda"
port = {port}
startup_timeout = "60s"

[engine.gpu]
name = "NVIDIA A10"
memory = "23028MiB"

[engine.args]
max_model_len = 16384
tokenizer = "{model}"

[space]
gpu_memory_utilization = {{ type = "categorical", choices = [0.85, 0.92], default = 0.92 }}
max_num_seqs = {{ type = "int", low = 2, high = 64, log = true, default = 64 }}

[workload]
scenario = "high-concurrency"
rate = 2
requests = 20
prompt_tokens = [32, 128]
output_tokens = [16, 32]

[objective]
kind = "{kind}"
max_steps = 3
step_duration = "2s"

[budget]
trials = {trials}

[baselines]
builtin = ["vllm-defaults", "xinference-legacy"]   # legacy: 70 % of the GPU, chunked prefill off
extra = [{{ name = "max-num-seqs-2", values = {{ max_num_seqs = 2 }} }}]

[remeasure]
top = 1
repeats = 1
"""


def _study(tmp_path, tiny_model, kind="capacity", trials=4):
    name = f"sim-{kind}"
    path = tmp_path / f"{name}.toml"
    path.write_text(STUDY.format(name=name, runs=tmp_path, python=sys.executable, port=free_port(), model=tiny_model,
                                 kind=kind, trials=trials))
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(path)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "AUTOTUNE_STATE_DIR": str(tmp_path / "state")})
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/studies.db")
    return r, study


def test_a_complete_study_runs_against_vllm_sim(tmp_path, tiny_model):
    r, study = _study(tmp_path, tiny_model)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    by_name = {t.user_attrs.get("baseline"): t for t in study.trials if t.user_attrs.get("baseline")}
    assert {"vllm-defaults", "xinference-legacy", "max-num-seqs-2"} <= set(by_name)

    # 8B weights (15 GiB) in 70 % of an A10 leave no room for a KV cache: vllm-sim fails at
    # start-up with vLLM's text, the launcher classifies it, Optuna prunes it
    oom = by_name["xinference-legacy"]
    assert oom.state == TrialState.PRUNED and oom.user_attrs["failure_class"] == "oom"
    assert "No available memory for the cache blocks" in oom.user_attrs["failure"]

    defaults, poor = by_name["vllm-defaults"], by_name["max-num-seqs-2"]
    assert defaults.state == TrialState.COMPLETE and poor.state == TrialState.COMPLETE
    # two sequences at a time cannot keep up with what 64 can
    assert defaults.user_attrs["capacity_rps"] > poor.user_attrs["capacity_rps"] > 0
    assert study.user_attrs["remeasure"]["winner"] != "baseline max-num-seqs-2"
    assert "--gpu-memory-utilization" in defaults.user_attrs["argv"]
    assert (tmp_path / "sim-capacity" / "best.yaml").is_file()


def test_pareto_mode_gives_a_front(tmp_path, tiny_model):
    r, study = _study(tmp_path, tiny_model, kind="pareto", trials=3)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(done) == 2  # the oom baseline is pruned
    assert all(len(t.values) == 2 and t.values[0] > 0 and t.values[1] > 0 for t in done)
    front = study.best_trials
    assert front and all(t.state == TrialState.COMPLETE for t in front)
    assert "Pareto" in r.stdout or "pareto" in r.stdout.lower()


@pytest.mark.parametrize("flag", ["--enable-cuda-graph", "--swap-space"])
def test_seed_flags_are_refused_before_any_launch(tmp_path, tiny_model, flag):
    from autotune.engine.args import EngineArgs
    from autotune.engine.command import EngineCommand
    from autotune.errors import UnknownFlagError

    cmd = EngineCommand("llama-3.1-8b", (sys.executable, "-m", "autotune.sim.cli", "serve"))
    table = cmd.flag_table()
    assert table.source == "bundled:0.33"
    with pytest.raises(UnknownFlagError):
        cmd.argv(EngineArgs({flag[2:].replace("-", "_"): True}), table)
