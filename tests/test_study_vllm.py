"""A real study on vLLM (CPU build, tiny model): baselines, a real oom, a winner, the dashboard.

Slow (several engine starts); marked ``engine`` and run in CI.
"""

import json
import os
import re
import subprocess
import sys
import time

import httpx
import optuna
import pytest
from optuna.trial import TrialState

from tests.conftest import free_port, own_core, stop_group

# the study below runs five engine starts; beside the other real study on a 2-core host that can take longer than
# the default 600 s
pytestmark = [pytest.mark.engine, pytest.mark.paired, pytest.mark.timeout(1800)]

STUDY = """
name = "tiny-real"
# TTFT with headroom: this shared 2-core VM stalls for 2-3.5 s now and then when another process wants
# its cores; queueing (the poor baseline's failure mode) grows without bound and still fails it by
# far. TPOT is loose on purpose: 128 streams on a starved core miss a tight TPOT that fewer slots
# meet, a real trade-off that would decide the test
slos = ["ttft<3s", "tpot<500ms"]
seed = 3
precheck = false        # let the 32 MiB candidate reach vLLM: a real oom, not the pre-check's
storage = "sqlite:///{runs}/studies.db"
runs_dir = "{runs}"

[engine]
command = "{vllm}"
model = "{model}"
platform = "cpu"
port = {port}
startup_timeout = "10m"

[engine.args]
max_model_len = 32768
enforce_eager = true    # faster starts for the test; the search is over batching and memory
stream_interval = 4     # fewer SSE chunks: the tiny model's speed is bound by the engine, not by HTTP

[engine.env]
VLLM_CACHE_ROOT = "{cache}"
VLLM_CPU_OMP_THREADS_BIND = "{core}"   # its own core beside the other real study (tests/conftest.py own_core)

[space]
max_num_seqs = {{ type = "int", low = 8, high = 256, log = true, default = 128 }}
kv_cache_memory_bytes = {{ type = "categorical", choices = [33554432, 268435456], default = 268435456 }}

[workload]
scenario = "high-concurrency"
rate = 24               # the ladder offers 24, 48, 96 req/s, or 12 and 6 where 24 misses
requests = 64
prompt_tokens = [32, 64]
output_tokens = [96, 128]   # long enough that requests overlap and max_num_seqs binds

[objective]
max_steps = 3

[budget]
trials = 3              # the three baselines: TPE's first sample (seed 3) here is a second oom, minutes for nothing

[baselines]
builtin = ["vllm-defaults"]
extra = [
  {{ name = "max-num-seqs-1", values = {{ max_num_seqs = 1 }} }},
  {{ name = "kv-32MiB", values = {{ kv_cache_memory_bytes = 33554432 }} }},
]

[remeasure]
top = 1
repeats = 2
"""


@pytest.fixture(scope="module")
def finished_study(tmp_path_factory, tiny_model, vllm_command, engine_env):
    runs = tmp_path_factory.mktemp("runs")
    path = runs / "tiny-real.toml"
    path.write_text(STUDY.format(runs=runs, vllm=" ".join(vllm_command), model=tiny_model, port=free_port(),
                                 cache=engine_env["VLLM_CACHE_ROOT"], core=own_core(0)))
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(path)], capture_output=True, text=True,
                       timeout=1800, env={**os.environ, "AUTOTUNE_STATE_DIR": str(runs / "state")})
    print(r.stdout[-5000:], r.stderr[-5000:])
    study = optuna.load_study(study_name="tiny-real", storage=f"sqlite:///{runs}/studies.db")
    return r, study, runs, path


def test_a_study_beats_the_poor_baseline_prunes_the_oom_and_remeasures_interleaved(finished_study):
    r, study, runs, _ = finished_study
    assert r.returncode == 0, r.stderr[-3000:]
    finished = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == 3
    by_name = {t.user_attrs.get("baseline"): t for t in study.trials if t.user_attrs.get("baseline")}
    assert {"vllm-defaults", "max-num-seqs-1", "kv-32MiB"} <= set(by_name)

    # real vLLM's own out-of-memory, read from its log and classified (the launcher's kill of what a failed start
    # leaves is checked by the end of the run: no process may outlive the suite)
    oom = by_name["kv-32MiB"]
    assert oom.state == TrialState.PRUNED
    assert oom.user_attrs["failure_class"] == "oom"
    assert "KV cache is needed, which is larger than the available KV cache memory" in oom.user_attrs["failure"]
    assert "EngineCore" in oom.user_attrs["failure_excerpt"] or "Traceback" in oom.user_attrs["failure_excerpt"]
    assert oom.user_attrs["failure_engine_seconds"] > 0  # vLLM itself ran and failed
    assert oom.system_attrs["constraints"] == [1000.0, 1000.0]  # written the legacy way, for the dashboard

    # Why this cannot flake: one slot serves one stream at a time, about 3 req/s of these requests on this host,
    # so at the ladder's loads (24, 12, 6 req/s) its queue grows through the whole step and TTFT misses by
    # seconds (seen: 2.7 s p95 already at 2.9 req/s); the defaults' 128 slots queue nothing and need only hold one
    # of those steps (seen: 46 req/s on an idle host; a 3.4 s stall at 2.9 req/s while simulated engines ran beside
    # it, which is why the real studies run after the rest, scripts/run_tests.sh; the other real study beside it
    # leaves the defaults far above 6 req/s). Eight slots made no poor baseline: at 12 req/s about
    # 8 requests are in flight, so 8 slots and 128 measured within this host's noise and 8 won once in CI (11.6
    # against 8.2). Which of two close configs wins is not asserted anywhere here: that is the re-measurement's
    # job, checked below by its mechanism.
    poor = by_name["max-num-seqs-1"].user_attrs["capacity_rps"]
    steps = [{k: s[k] for k in ("rate", "passed", "client_kept_up", "failed", "ttft_p95", "tpot_p95")}
             for s in by_name["vllm-defaults"].user_attrs["steps"]]
    assert by_name["vllm-defaults"].user_attrs["capacity_rps"] > poor, (steps, poor)

    verdict = study.user_attrs["remeasure"]
    labels = [c["label"] for c in verdict["candidates"]]
    # each run went to a candidate and was numbered in order, at most [remeasure] repeats (2) per candidate
    seen = re.findall(r"re-measured (.+?) \(run (\d+)\): [0-9.]+ req/s", r.stderr)
    assert labels[-1].startswith("baseline ") and [int(n) for _, n in seen] == list(range(1, len(seen) + 1))
    assert {label for label, _ in seen} <= set(labels) and len(seen) <= 2 * len(labels), (seen, labels)
    assert [len(c["capacities"]) for c in verdict["candidates"]] == [
        sum(label == c["label"] for label, _ in seen) for c in verdict["candidates"]]
    # the verdict follows the posterior medians (a tie goes to the baseline) and deploys a gain only when the
    # posterior gives it the confidence asked; a gain over a baseline that held every load is never stated
    medians = {c["label"]: c["median"] for c in verdict["candidates"]}
    assert medians[verdict["winner"]] == max(medians.values()) and verdict["baseline"] == labels[-1]
    assert 0.0 <= verdict["p_better"] <= 1.0 and verdict["confidence"] == 0.9
    assert verdict["significant"] == (verdict["winner"] != verdict["baseline"]
                                      and verdict["p_better"] >= verdict["confidence"]
                                      and not verdict["baseline_at_least"])
    assert verdict["winner"] == verdict["baseline"] or verdict["baseline_at_least"] or "that it is better" in r.stdout

    best = (runs / "tiny-real" / "best.yaml").read_text()
    assert "max-num-seqs:" in best and "model:" in best
    assert "capacity req/s" in r.stdout and "re-measured" in r.stdout


def test_every_trial_records_what_ran(finished_study, vllm_command, tiny_model):
    _, study, _, _ = finished_study
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert complete, [(t.number, t.state, t.user_attrs.get("failure")) for t in study.trials]
    for t in complete:
        # the configured engine command and model, in that order, exactly as the study file names them
        assert t.user_attrs["argv"][:3] == [*vllm_command, str(tiny_model)], t.user_attrs["argv"]
        assert t.user_attrs["engine_start_s"] > 0 and t.user_attrs["replay_s"] > 0
        assert t.user_attrs["steps"] and "constraints" in t.system_attrs
        wall = (t.datetime_complete - t.datetime_start).total_seconds()
        assert wall >= t.user_attrs["engine_start_s"] + t.user_attrs["replay_s"]


def test_rerun_resumes_without_new_trials(finished_study):
    r0, study, runs, path = finished_study
    n = len(study.trials)
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(path), "--no-remeasure"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "AUTOTUNE_STATE_DIR": str(runs / "state")})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "budget of 3 trials already spent" in r.stderr
    assert len(optuna.load_study(study_name="tiny-real", storage=f"sqlite:///{runs}/studies.db").trials) == n
    # the re-measured winner still stands: a rerun does not swap it for Optuna's single-run best
    winner = study.user_attrs["remeasure"]["winner_trial"]
    assert f"best config of trial {winner}," in (runs / "tiny-real" / "best.yaml").read_text()


def test_report_and_dashboard_show_the_study(finished_study):
    _, study, runs, path = finished_study
    winner = study.user_attrs["remeasure"]["winner_trial"]
    r = subprocess.run([sys.executable, "-m", "autotune", "report", str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    page = (runs / "tiny-real" / "report.html").read_text()
    assert "plotly" in page.lower() and 'id="verdict"' in page and f"Winner: trial {winner}" in page
    assert "Optimization History" in page and "kv-32MiB" in page

    port = free_port()
    dash = subprocess.Popen([sys.executable, "-m", "autotune", "dashboard", str(path), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        studies = None
        for _ in range(100):
            try:
                studies = httpx.get(base + "/api/studies", timeout=2).json()["study_summaries"]
                break
            except (httpx.TransportError, ValueError):
                assert dash.poll() is None, f"autotune dashboard exited with {dash.returncode} before it answered"
                time.sleep(0.2)
        assert studies is not None, f"autotune dashboard did not answer {base}/api/studies within ~20 s"
        sid = next(s["study_id"] for s in studies if s["study_name"] == "tiny-real")
        detail = httpx.get(f"{base}/api/studies/{sid}", params={"after": 0}, timeout=10).json()
        trials = detail["trials"]
        assert len(trials) == len(study.trials)
        oom = next(t for t in trials if any(a["key"] == "baseline" and "kv-32MiB" in a["value"] for a in t["user_attrs"]))
        assert oom["constraints"] == [1000.0, 1000.0]
        good = next(t for t in trials if t["state"] == "Complete" and t["constraints"] and max(t["constraints"]) <= 0)
        assert {p["name"] for p in good["params"]} == {"max_num_seqs", "kv_cache_memory_bytes"}
        keys = {a["key"] for a in good["user_attrs"]}
        assert {"argv", "env", "steps", "engine_start_s", "replay_s", "capacity_rps"} <= keys
        names = {a["filename"] for a in good["artifacts"]}
        assert {"engine.stdout.log", "engine.stderr.log", "requests.jsonl"} <= names
        art = next(a for a in good["artifacts"] if a["filename"] == "requests.jsonl")
        body = httpx.get(f"{base}/artifacts/{sid}/{good['trial_id']}/{art['artifact_id']}", timeout=10).text
        assert json.loads(body.splitlines()[0])["success"] is True
    finally:
        stop_group(dash)  # autotune dashboard and the optuna-dashboard it serves with, whatever happened above
