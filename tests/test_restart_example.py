"""The example files for production: systemd/production.yaml, and scripts/restart_vllm.sh for a host
without systemd, driven by the publish target exactly as the daemon drives it.

Production is vllm-sim (it takes `vllm serve --config`): the script must block until the new
server serves, leave it running in a session of its own, and fail (exit 1, the log's last lines)
when the new config cannot start, so the daemon's publish rolls back.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from autotune.engine.kind import get_kind
from autotune.engine.flags import check_args
from autotune.engine.args import EngineArgs
from autotune.errors import PublishError
from autotune.publish.target import create_target
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "restart_vllm.sh"


def test_the_example_production_yaml_is_a_config_vllm_accepts():
    vllm = get_kind("vllm")
    model, values = vllm.parse_config((ROOT / "systemd" / "production.yaml").read_text(), "production.yaml")
    assert model == "meta-llama/Llama-3.1-8B-Instruct" and values["max_num_seqs"] == 256
    check_args(EngineArgs(values).to_args(), vllm.flag_table(["vllm"], "0.33"))  # every key a flag of vLLM 0.33


@pytest.fixture
def production(tmp_path, tiny_model):
    """The publish target a no-systemd host configures: restart = scripts/restart_vllm.sh ... -- vllm-sim serve."""
    port = free_port()
    run = tmp_path / "run"
    settings = {
        "config": str(tmp_path / "production.yaml"),
        "model": "llama-3.1-8b",
        "health_timeout": "60s",
        "restart": [str(SCRIPT), "--config", str(tmp_path / "production.yaml"), "--url", f"http://127.0.0.1:{port}",
                    "--pidfile", str(run / "vllm.pid"), "--log", str(run / "vllm.log"), "--timeout", "60",
                    "--grace", "5", "--", sys.executable, "-m", "autotune.sim.cli", "--gpu", "a10-24gb",
                    "--time-scale", "0.01", "serve", "--port", str(port), "--tokenizer", str(tiny_model)],
    }
    target = create_target("vllm-config", f"http://127.0.0.1:{port}", settings)
    yield target, run, port
    pidfile = run / "vllm.pid"
    if pidfile.exists():  # the server lives in its own session: stop all of it, whatever the test did
        try:
            os.killpg(int(pidfile.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def served_pid(run: Path) -> int:
    return int((run / "vllm.pid").read_text())


def test_a_publish_restarts_production_and_returns_once_it_serves(production):
    target, run, port = production
    target.deploy({"max_num_seqs": 16, "max_model_len": 8192, "gpu_memory_utilization": 0.9})
    first = served_pid(run)
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200  # serving on return
    assert os.getsid(first) == first  # a session of its own: it outlives the script and the daemon
    assert target.deployed()["max_num_seqs"] == 16

    target.deploy({"max_num_seqs": 32, "max_model_len": 8192, "gpu_memory_utilization": 0.9})
    second = served_pid(run)
    assert second != first and httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)  # the old server is gone, not left holding the GPU
    assert b"--config" in Path(f"/proc/{second}/cmdline").read_bytes()


def test_a_config_that_cannot_start_fails_the_restart_with_vllm_s_words(production):
    target, run, port = production
    target.deploy({"max_num_seqs": 16, "max_model_len": 8192, "gpu_memory_utilization": 0.9})
    # 8B weights (15 GiB) in 50 % of an A10: vLLM's start-up fails; the script must say so, not hang
    with pytest.raises(PublishError) as e:
        target.deploy({"max_num_seqs": 16, "max_model_len": 8192, "gpu_memory_utilization": 0.5})
    assert "exited 1" in str(e.value) and "memory" in str(e.value).lower(), str(e.value)
    # the daemon's rollback is the same call with the last good values
    target.deploy({"max_num_seqs": 16, "max_model_len": 8192, "gpu_memory_utilization": 0.9})
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200


def test_bad_usage_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([str(SCRIPT), "--config", str(tmp_path / "missing.yaml"), "--url", "http://x", "--pidfile",
                        str(tmp_path / "p"), "--log", str(tmp_path / "l"), "--", "vllm", "serve"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.strip() == f"restart_vllm.sh: cannot read the config {tmp_path}/missing.yaml"
    r = subprocess.run([str(SCRIPT), "--url", "http://x"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "needs --config FILE --url URL" in r.stderr
