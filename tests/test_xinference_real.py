"""The Xinference publish target against a real Xinference 4.1 (CPU, Transformers engine, auth on).

Needs the Xinference venv: bash scripts/install_xinference.sh (or XINFERENCE_VENV=...). Xinference's
vLLM engine refuses to start without a GPU, so the model is the tiny local Llama registered as a
custom LLM and served by its Transformers engine; the REST calls, auth, replace and read-back are
the same as for vLLM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from autotune.errors import XinferenceDeployError
from autotune.publish.xinference import XinferenceAuth, XinferenceTarget, setup_token_from_log
from tests.conftest import ROOT, free_port

pytestmark = pytest.mark.xinference

MODEL_NAME = "autotune-tiny"  # "tiny-llama" is taken by a built-in family
LAUNCH_FIELDS = {"model_format": "pytorch", "model_size_in_billions": "0_01", "quantization": "none"}


@dataclass
class Server:
    url: str
    log: Path
    home: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def xinference(tmp_path: Path) -> Iterator[Server]:
    """A real `xinference-local` in its own process group, on a free port, auth on, home in tmp_path."""
    venv = Path(os.environ.get("XINFERENCE_VENV", ROOT / ".venv-xinference"))
    exe = venv / "bin" / "xinference-local"
    if not exe.exists():
        pytest.fail(f"Xinference is not installed at {venv}: run scripts/install_xinference.sh")
    port = free_port()
    home, tmp = tmp_path / "xinference-home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("XINFERENCE_")}
    env.update(XINFERENCE_HOME=str(home), TMPDIR=str(tmp), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS="2")  # auth is on by default (XINFERENCE_AUTH_ADVANCED unset)
    log = tmp_path / "xinference.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(exe), "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", log, home)
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"xinference-local exited {proc.returncode}:\n{server.log_text()[-3000:]}")
            try:
                if httpx.get(f"{server.url}/v1/admin/setup/status", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"xinference-local not up after 240 s:\n{server.log_text()[-3000:]}")
            time.sleep(1)
        yield server
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the whole group (supervisor, worker, model subprocesses), SIGKILL what is left after 20 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def _register(target: XinferenceTarget, model: Path) -> None:
    """The tiny model as a custom LLM (POST /v1/model_registrations/LLM, the JSON as a string, not persisted)."""
    registration = {
        "version": 2, "model_name": MODEL_NAME, "model_lang": ["en"], "model_ability": ["generate", "chat"],
        "model_family": "llama-2", "context_length": 2048,
        "model_specs": [{**{k: LAUNCH_FIELDS[k] for k in ("model_format", "model_size_in_billions", "quantization")},
                         "model_uri": f"file://{model}"}],
        "chat_template": (model / "chat_template.jinja").read_text(), "stop_token_ids": [1], "stop": ["</s>"],
    }
    r = httpx.post(f"{target.url}/v1/model_registrations/LLM", headers=target.headers(), timeout=60,
                   json={"model": json.dumps(registration), "persist": False})
    assert r.status_code == 200, r.text


def _launch_args_on_disk(server: Server, uid: str) -> dict:
    """What Xinference's worker persisted for recovery: the launch kwargs it really used."""
    for path in server.home.glob("worker_recovery/*/models.json"):
        data = json.loads(path.read_text())
        for key, args in (data.items() if isinstance(data, dict) else []):
            if key.startswith(uid):
                return args
    return {}


def test_deploy_replace_read_back_and_terminate_on_real_xinference(xinference: Server, tiny_model: Path):
    from openai import OpenAI

    token = setup_token_from_log(xinference.log_text())
    assert token, "no setup token in the log: is auth on?"
    auth = XinferenceAuth("autotune", "autotune-test-pw", setup_token=token)
    uid = "autotune-prod"
    with XinferenceTarget(xinference.url, uid, MODEL_NAME, "transformers", LAUNCH_FIELDS, auth,
                          poll_interval=0.5) as target:
        assert httpx.get(f"{target.url}/v1/models", timeout=10).status_code == 401  # auth really is on
        _register(target, tiny_model)
        assert target.deployed() is None

        first = {"max_num_seqs": 4, "torch_dtype": "float32"}
        target.deploy(first, timeout=300)
        assert target.deployed() == first
        created = target.deployment().created_ts
        client = OpenAI(base_url=target.openai_base_url(), api_key=target.api_key(), max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=uid, messages=[{"role": "user", "content": "hello"}],
                                               max_tokens=8)
        assert reply.choices and reply.usage.completion_tokens > 0

        second = {"max_num_seqs": 2, "torch_dtype": "bfloat16"}
        target.deploy(second, timeout=300)  # replaces the running instance
        assert target.deployed() == second
        assert target.deployment().created_ts >= created
        persisted = _launch_args_on_disk(xinference, uid)
        assert persisted.get("max_num_seqs") == 2 and persisted.get("torch_dtype") == "bfloat16", persisted
        assert "engine_config" not in persisted
        reply = client.chat.completions.create(model=uid, messages=[{"role": "user", "content": "again"}],
                                               max_tokens=4)
        assert reply.choices

        with pytest.raises(XinferenceDeployError, match="has no attribute 'no_such_dtype'"):
            target.deploy({"max_num_seqs": 2, "torch_dtype": "no_such_dtype"}, timeout=300)
        assert target.deployed() is None  # the old instance was replaced, the new one failed

        target.deploy(first, timeout=300)
        assert target.terminate() is True
        assert target.deployed() is None
        assert target.terminate() is False
