"""``[staging].trace``: a daemon told to tune with a captured trace replays that trace, not traffic synthesized
from production's fingerprint.

The daemon writes its tuning study as it does before a tuning (``TuningPhase.write_study``), with a
fingerprint whose traffic looks nothing like the trace (50 req/s, 8 output tokens each); then the study
runs as the daemon's child runs it (``autotune study FILE``) on vllm-sim, one trial of one short step, and
the requests it sent (the trial's requests.jsonl) are the trace's, in order, at the trace's times.
"""

import json
import os
import subprocess
import sys

import pytest

from autotune.daemon.config import load_daemon_config
from autotune.daemon.fingerprint import Fingerprint
from autotune.daemon.loop import Daemon
from autotune.study.definition import load_study
from autotune.workload.source import LoadSteps
from tests.conftest import ROOT, free_port
from tests.test_daemon import STAGING

DAEMON = """
name = "prod"
slos = ["ttft<500ms"]

[production]
url = "http://127.0.0.1:{prod_port}"
config = "{root}/etc/production.yaml"
model = "llama-3.1-8b"
restart = ["true"]

[staging]
study = "staging.toml"
trace = "captured.jsonl"

[metrics]
listen = ""
"""

N = 20  # requests in the captured trace
GAP_S = 0.1  # between arrivals: 10 req/s


def _output_tokens(i: int) -> int:
    return 2 + i % 5  # 2..6: a pattern no fingerprint's synthesized traffic (8 each, below) has


def test_a_tuning_replays_the_configured_trace(tmp_path, tiny_model, state_dir):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "production.yaml").write_text("model: llama-3.1-8b\nmax-num-seqs: 2\n")
    staging = STAGING.format(root=tmp_path, python=sys.executable, port=free_port(), model=tiny_model)
    for old, new in (("trials = 3", "trials = 1"), ("max_steps = 2", "max_steps = 1")):  # one trial, one step
        assert staging.count(old) == 1, f"the staging study no longer says {old}"
        staging = staging.replace(old, new)
    (tmp_path / "staging.toml").write_text(staging)
    trace = tmp_path / "captured.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": round(i * GAP_S, 3), "prompt_tokens": 16 + i,
                                         "output_tokens": _output_tokens(i)}) + "\n" for i in range(N)))
    (tmp_path / "daemon.toml").write_text(DAEMON.format(prod_port=free_port(), root=tmp_path))

    d = Daemon(load_daemon_config(tmp_path / "daemon.toml"))
    assert d.cfg.staging_trace == trace
    fp = Fingerprint(request_rate=50.0, prompt_tokens_mean=100.0, prompt_tokens_p50=100.0, prompt_tokens_p90=120.0,
                     output_tokens_mean=8.0, output_tokens_p50=8.0, output_tokens_p90=8.0,
                     prefix_cache_hit_rate=None, window_s=60.0, requests=3000)
    path = d.root / "tunings" / "prod-tune-001.toml"
    d.tuning.write_study("prod-tune-001", path, fp, d.target.deployed())

    derived = load_study(path)
    assert derived.workload.trace == trace.resolve() and derived.workload.scenario is None
    assert not path.with_suffix(".jsonl").exists()  # nothing synthesized from the fingerprint
    # the first load step as `autotune study` builds it (cli/study.py): the trace, from its start, at its times
    step = LoadSteps(derived.workload, derived.objective.step_seconds).at(derived.objective.start_load)
    assert [r.output_tokens for r in step.requests[:N]] == [_output_tokens(i) for i in range(N)]
    assert [r.arrival_s for r in step.requests[:N]] == pytest.approx([i * GAP_S for i in range(N)])
    assert [r.prompt_tokens for r in step.requests[:N]] == [16 + i for i in range(N)]

    # and the tuning, run as the daemon's child runs it, sends exactly those requests to its staging engine
    r = subprocess.run([sys.executable, "-m", "autotune", "study", str(path), "--no-remeasure"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "AUTOTUNE_STATE_DIR": str(state_dir)})
    assert r.returncode in (0, 1), r.stderr[-3000:]
    sent = sorted(derived.run_dir.glob("**/requests.jsonl"))
    assert len(sent) == 1, (sent, r.stderr[-3000:])
    rows = [json.loads(line) for line in sent[0].read_text().splitlines()]
    rows = sorted((x for x in rows if x["load"] == derived.objective.start_load), key=lambda x: x["index"])
    assert len(rows) >= N, rows
    assert [x["expected_output_tokens"] for x in rows[:N]] == [_output_tokens(i) for i in range(N)]
    assert [x["scheduled_s"] for x in rows[:N]] == pytest.approx([i * GAP_S for i in range(N)], abs=1e-6)
    assert all(x["success"] for x in rows), [x["error"] for x in rows if not x["success"]]
