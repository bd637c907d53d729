import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny random-weight Llama; built on first use (no hub: local text, random weights)."""
    path = Path(os.environ.get("AUTOTUNE_TINY_MODEL", ROOT / "models" / "tiny-llama"))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_tiny_model.py"), str(path)], check=True,
                   stdout=subprocess.DEVNULL)
    return path


@pytest.fixture(scope="session")
def vllm_command() -> list[str]:
    """The real vLLM CLI from this environment (scripts/install_cpu.sh puts it beside the interpreter)."""
    exe = Path(sys.executable).parent / "vllm"
    if not exe.exists():
        pytest.fail(f"real vLLM is not installed beside {sys.executable}: run scripts/install_cpu.sh")
    return [str(exe), "serve"]


@pytest.fixture(scope="session")
def engine_env() -> dict[str, str]:
    """CPU engine settings shared by the real-vLLM tests; the compile cache survives between tests and runs."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "autotune-tests" / "vllm"
    return {"VLLM_CACHE_ROOT": str(cache), "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture
def state_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "state"
    monkeypatch.setenv("AUTOTUNE_STATE_DIR", str(d))
    return d


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_sim(tiny_model, tmp_path_factory):
    """A simulated Llama-3.1-8B on an H100 (vllm-sim, start-up time x 0.01) for a module's tests; its URL."""
    import signal
    import time

    import httpx

    port = free_port()
    logs = tmp_path_factory.mktemp("sim")
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune.sim.cli", "--gpu", "h100-80gb", "--time-scale", "0.01", "serve",
         "llama-3.1-8b", "--port", str(port), "--tokenizer", str(tiny_model)],
        cwd=ROOT, stdout=(logs / "out.log").open("wb"), stderr=(logs / "err.log").open("wb"), stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (logs / "err.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "vllm-sim did not become healthy"
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
