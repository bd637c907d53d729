"""`autotune daemon --check`: a config that loads can still not work; each missing piece is one line.

Production is vllm-sim, serving for real (the conftest fixture); the staging study is the repo's
vllm-sim study, so its engine command and tokenizer are the ones the tests use.
"""

import os
import subprocess
import sys
from pathlib import Path

import tomli_w

from tests.conftest import example_study, free_port

ROOT = Path(__file__).resolve().parents[1]


def write_config(tmp_path, url, *, yaml=True, restart=("true",), study=None, tiny_model=None, metrics_port=None,
                 watch=None):
    if yaml:
        (tmp_path / "p.yaml").write_text("model: llama-3.1-8b\nmax-num-seqs: 64\n")
    data = {
        "slos": ["ttft<1s"],
        "state_dir": str(tmp_path / "state"),
        "production": {"url": url, "config": str(tmp_path / "p.yaml"), "model": "llama-3.1-8b",
                       "restart": list(restart)},
        "staging": {"study": str(study or example_study("sim-h100-8b-chat", tiny_model, tmp_path))},
        "metrics": {"listen": f"127.0.0.1:{metrics_port or free_port()}"},
        **({"watch": watch} if watch else {}),
    }
    p = tmp_path / "d.toml"
    p.write_text(tomli_w.dumps(data))
    return p


def check(path):
    return subprocess.run([sys.executable, "-m", "autotune", "daemon", "--check", "--config", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "AUTOTUNE_STATE_DIR": str(path.parent / "env-state")})


def test_a_config_with_everything_in_place_passes(tmp_path, vllm_sim, tiny_model):
    r = check(write_config(tmp_path, vllm_sim, tiny_model=tiny_model))
    assert r.returncode == 0, r.stderr
    assert "all 8 checks pass" in r.stdout and r.stderr == ""
    assert not (tmp_path / "state").exists()  # a check writes nothing


def test_each_missing_piece_is_one_line_and_a_failing_exit(tmp_path):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    study = tmp_path / "staging.toml"
    shipped = (ROOT / "studies" / "sim-h100-8b-chat.toml").read_text()
    # both strings must be in the shipped file: a replace that matches nothing would leave a tokenizer that
    # exists wherever models/ was built, and the test would pass only where it was not
    assert 'tokenizer = "./models/tiny-llama"' in shipped and 'command = ".venv/bin/vllm-sim' in shipped
    study.write_text(shipped.replace('tokenizer = "./models/tiny-llama"', 'tokenizer = "no/such/tokenizer"')
                     .replace('command = ".venv/bin/vllm-sim', 'command = "/no/such/vllm-sim'))
    r = check(write_config(tmp_path, down, yaml=False, restart=("no-such-restart-tool", "vllm@production"),
                           study=study, watch={"arrivals_log": str(tmp_path / "no-such-arrivals.log")}))
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 5, lines
    by_check = {line.split(": ")[2]: line for line in lines}
    assert "does not answer at " + down + "/health" in by_check["production answers"]
    assert "there is no production config to start from" in by_check["production config"]
    assert "'no-such-restart-tool' is not an executable" in by_check["restart command"]
    assert "no-such-arrivals.log does not exist: the proxy writes it" in by_check["arrivals log"]
    staging = by_check["staging study"]
    assert "names no tokenizer that exists here" in staging and "'/no/such/vllm-sim' is not an executable" in staging


def test_a_production_yaml_that_does_not_parse_is_named(tmp_path, vllm_sim, tiny_model):
    path = write_config(tmp_path, vllm_sim, tiny_model=tiny_model)
    (tmp_path / "p.yaml").write_text("model: [unclosed\n")
    r = check(path)
    assert r.returncode == 1 and "production config: " in r.stderr and "p.yaml" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_check_beside_the_running_daemon_passes_and_a_port_taken_by_something_else_fails(tmp_path, vllm_sim,
                                                                                          tiny_model):
    import socket

    from autotune.daemon.exporter import DaemonMetrics

    port = free_port()
    DaemonMetrics().serve("127.0.0.1", port)  # the daemon being checked, running: its metrics hold the port
    r = check(write_config(tmp_path, vllm_sim, tiny_model=tiny_model, metrics_port=port))
    assert r.returncode == 0 and "all 8 checks pass" in r.stdout, r.stderr

    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    try:
        r = check(write_config(tmp_path, vllm_sim, tiny_model=tiny_model, metrics_port=other.getsockname()[1]))
    finally:
        other.close()
    assert r.returncode == 1 and "metrics port: [metrics].listen: cannot listen on" in r.stderr, r.stderr
