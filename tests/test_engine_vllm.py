"""Real vLLM (the CPU build) with the tiny model: the paths a user depends on, end to end.

Slow (tens of seconds each: real engine start-up); marked ``engine`` and run in CI.
"""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from autotune.engine.vllm.flags import table_for_command as table_for_engine
from autotune.engine.launcher import port_is_free
from autotune.engine.leftovers import group_members
from autotune.errors import UnknownFlagError
from tests.conftest import free_port

pytestmark = pytest.mark.engine


def autotune(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def no_engine_on(port):
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "--port" in cmd and str(port) in cmd:
            return False
    return True


def test_default_config_measured_end_to_end(tiny_model, vllm_command, engine_env, state_dir, tmp_path):
    port = free_port()
    out = tmp_path / "bench.json"
    reqs = tmp_path / "requests.jsonl"
    env_args = [a for k, v in engine_env.items() for a in ("--env", f"{k}={v}")]
    r = autotune("bench", "--model", str(tiny_model), "--engine-cmd", " ".join(vllm_command), "--port", str(port),
                 *env_args, "--scenario", "high-concurrency", "--rate", "8", "--requests", "30",
                 "--prompt-tokens", "32-96", "--output-tokens", "8-32", "--slo", "ttft<30s", "--slo", "e2e<60s",
                 "--json", str(out), "--requests-json", str(reqs), "--log-dir", str(tmp_path / "logs"),
                 env={"AUTOTUNE_STATE_DIR": str(state_dir)})
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert data["failure_class"] is None
    assert data["argv"][:3] == [*vllm_command, str(tiny_model)]
    assert data["engine_start_s"] > 0 and data["replay_s"] > 0
    m = data["metrics"]
    assert m["completed"] == 30 and m["failed"] == 0
    assert m["ttft"]["p50"] > 0 and m["output_throughput"] > 0 and m["e2e"]["p50"] >= m["ttft"]["p50"]
    # a short response a busy API server writes in one burst arrives in one read: a TPOT of 0, as its client saw it
    # (on a loaded CI host, half of these 8-32 token responses did); the others streamed across reads
    assert m["tpot"]["mean"] > 0, m["tpot"]
    rows = [json.loads(line) for line in reqs.read_text().splitlines()]
    # ignore_eos + max_tokens: the server generated exactly what the workload asked for
    assert all(row["output_tokens"] == row["expected_output_tokens"] for row in rows)
    assert all(32 <= row["prompt_tokens"] <= 96 + 2 for row in rows)  # built with the model's own tokenizer
    assert "Application startup complete" in (tmp_path / "logs" / "engine.stderr.log").read_text() + \
        (tmp_path / "logs" / "engine.stdout.log").read_text()
    assert no_engine_on(port) and port_is_free("127.0.0.1", port)


def test_unknown_flag_refused_by_vllms_own_parser(vllm_command, tiny_model, tmp_path):
    table = table_for_engine(vllm_command)
    assert table.source == "parser" and table.version.startswith("0.32")
    with pytest.raises(UnknownFlagError, match="--kv-offloading-size"):
        from autotune.engine.flags import check_args
        check_args(["--swap-space", "4"], table)
    r = autotune("bench", "--model", str(tiny_model), "--engine-cmd", " ".join(vllm_command), "--scenario",
                 "high-concurrency", "--rate", "1", "--requests", "1", "--log-dir", str(tmp_path / "logs"),
                 "--", "--enable-cuda-graph")
    assert r.returncode == 2
    assert "--enable-cuda-graph" in r.stderr and "--enforce-eager" in r.stderr
    assert not (tmp_path / "logs").exists()  # refused before anything was launched


def test_launcher_killed_mid_run_leaves_nothing_after_next_run(tiny_model, vllm_command, engine_env, state_dir,
                                                               tmp_path):
    port = free_port()
    env_args = [a for k, v in engine_env.items() for a in ("--env", f"{k}={v}")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune", "bench", "--model", str(tiny_model), "--engine-cmd", " ".join(vllm_command),
         "--port", str(port), *env_args, "--scenario", "high-concurrency", "--rate", "2", "--requests", "400",
         "--prompt-tokens", "16-32", "--output-tokens", "4-8", "--log-dir", str(tmp_path / "logs1"), "--", "--enforce-eager"],
        env={**os.environ, "AUTOTUNE_STATE_DIR": str(state_dir)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    record_path = state_dir / "engines" / f"engine-{port}.json"
    deadline = time.monotonic() + 300
    healthy = False
    while time.monotonic() < deadline and not healthy:  # wait until it serves: the replay is running
        time.sleep(1)
        try:
            healthy = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            pass
        assert proc.poll() is None, "the bench exited before it was killed"
    assert healthy
    time.sleep(3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    record = json.loads(record_path.read_text())
    assert psutil.pid_exists(record["pid"]) and group_members(record["pgid"])  # an orphaned engine, for now

    # The next run: vLLM rejects its scheduler args (a real invalid-args failure), but first it reaps.
    r = autotune("bench", "--model", str(tiny_model), "--engine-cmd", " ".join(vllm_command), "--port", str(free_port()),
                 *env_args, "--scenario", "high-concurrency", "--rate", "1", "--requests", "1",
                 "--log-dir", str(tmp_path / "logs2"), "--json", str(tmp_path / "next.json"),
                 "--", "--max-num-seqs", "4", "--max-num-batched-tokens", "2",
                 env={"AUTOTUNE_STATE_DIR": str(state_dir)})
    assert r.returncode == 2, r.stdout + r.stderr
    refused = [x for x in r.stderr.splitlines() if x.startswith("autotune: the engine refused its args: ")]
    assert len(refused) == 1, r.stderr  # bad usage, as the README says: one line on stderr and exit 2
    nxt = json.loads((tmp_path / "next.json").read_text())
    assert nxt["failure_class"] == "invalid-args"
    assert "max_num_seqs" in nxt["failure"]["summary"] or "max_num_seqs" in nxt["failure"]["excerpt"]
    assert group_members(record["pgid"]) == []
    assert not psutil.pid_exists(record["pid"]) or psutil.Process(record["pid"]).status() == psutil.STATUS_ZOMBIE
    assert port_is_free("127.0.0.1", port)
    assert not record_path.exists()
