"""Several workers on one study through a real PostgreSQL: a shared budget, and a dead worker's trial retried.

Each worker is an `autotune study` process with its own staging engine (vllm-sim, its own
port), as two GPU hosts would run. One is killed -9 in the middle of a trial: its heartbeat
stops, the trial goes stale, and the surviving worker fails it and runs it again.

The heartbeat is 3 s (a 9 s grace): two workers, their engines and PostgreSQL share 2 cores here, and
a heartbeat thread stalled past a 3 s grace would let the survivor fail a live trial.
"""

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import sqlalchemy.exc
import pytest
from optuna.trial import TrialState

from autotune.engine.leftovers import reap_leftovers
from tests.conftest import free_port

STUDY = """
name = "shared"
slos = ["ttft<500ms"]
storage = "{url}"
heartbeat = "3s"
runs_dir = "{runs}"

[engine]
command = "{python} -m autotune.sim.cli --gpu a10-24gb --time-scale 0.05 serve"
model = "llama-3.1-8b"
port = {port}
startup_timeout = "60s"

[engine.gpu]
name = "NVIDIA A10"
memory = "23028MiB"

[engine.args]
max_model_len = 8192
tokenizer = "{model}"

[space]
max_num_seqs = {{ type = "int", low = 2, high = 64, log = true, default = 64 }}

[workload]
scenario = "high-concurrency"
rate = 2
requests = 20
output_tokens = [16, 32]

[objective]
max_steps = 2
step_duration = "3s"

[budget]
trials = 6

[baselines]
builtin = ["vllm-defaults"]

[remeasure]
top = 0
repeats = 1
"""


def _pg_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))), None)
    if found is None:
        pytest.fail(f"PostgreSQL's {name} is missing: run scripts/ci_system_deps.sh")
    return found


@pytest.fixture(scope="module")
def postgres():
    """A throwaway PostgreSQL server on a free port (as the postgres user: it refuses to run as root)."""
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    data = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    if as_user:
        shutil.chown(data, "postgres")
    port = free_port()
    subprocess.run([*as_user, _pg_bin("initdb"), "-D", str(data / "db"), "-U", "autotune", "--auth=trust"],
                   check=True, capture_output=True)
    subprocess.run([*as_user, _pg_bin("pg_ctl"), "-D", str(data / "db"), "-l", str(data / "log"), "-w", "-o",
                    f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start"], check=True, capture_output=True)
    subprocess.run([*as_user, _pg_bin("createdb") if shutil.which("createdb") else "createdb", "-h", "127.0.0.1",
                    "-p", str(port), "-U", "autotune", "studies"], check=True, capture_output=True)
    yield f"postgresql+psycopg2://autotune@127.0.0.1:{port}/studies"
    subprocess.run([*as_user, _pg_bin("pg_ctl"), "-D", str(data / "db"), "-m", "immediate", "stop"],
                   capture_output=True)
    shutil.rmtree(data, ignore_errors=True)


def _worker(tmp_path, url, model, name, state):
    path = tmp_path / f"{name}.toml"
    path.write_text(STUDY.format(url=url, runs=tmp_path / name, python=sys.executable, port=free_port(), model=model))
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "autotune", "study", str(path)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "AUTOTUNE_STATE_DIR": str(state)})


def test_two_workers_share_one_study_and_a_dead_workers_trial_is_retried(tmp_path, postgres, tiny_model):
    state_a, state_b = tmp_path / "state-a", tmp_path / "state-b"
    a = _worker(tmp_path, postgres, tiny_model, "a", state_a)
    time.sleep(1.0)
    b = _worker(tmp_path, postgres, tiny_model, "b", state_b)
    try:
        # kill worker a -9 while it has a trial running
        deadline = time.monotonic() + 120
        victim = None
        while time.monotonic() < deadline and victim is None:
            time.sleep(0.5)
            try:
                study = optuna.load_study(study_name="shared", storage=postgres)
            except (KeyError, sqlalchemy.exc.SQLAlchemyError):
                continue  # not created yet, or the workers are creating Optuna's schema right now
            victim = next((t for t in study.get_trials(states=(TrialState.RUNNING,))
                           if t.user_attrs.get("worker", "").endswith(f":{a.pid}")), None)
        assert victim is not None, "worker a never ran a trial"
        os.kill(a.pid, signal.SIGKILL)
        assert b.wait(timeout=300) == 0, (tmp_path / "b.log").read_text()[-3000:]
    finally:
        for p in (a, b):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        reap_leftovers(state_a, grace=2.0)  # a's staging engine: a killed -9 launcher leaves a record
        reap_leftovers(state_b, grace=2.0)

    study = optuna.load_study(study_name="shared", storage=postgres)
    trials = study.get_trials()
    dead = study.trials[victim.number]
    assert dead.state == TrialState.FAIL  # failed by the survivor once its heartbeat went stale
    retried = [t for t in trials if t.system_attrs.get("failed_trial") == victim.number]
    assert retried and retried[0].params == victim.params and retried[0].state in (TrialState.COMPLETE,
                                                                                   TrialState.PRUNED)
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == 6  # one budget for the study, whatever the number of workers
    workers = {t.user_attrs["worker"] for t in trials if "worker" in t.user_attrs}
    assert len(workers) == 2
    measured = [t for t in trials if t.user_attrs.get("baseline") == "vllm-defaults" and t.state != TrialState.FAIL]
    assert len(measured) == 1  # enqueued by both hosts at once, measured once
