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


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop a process started with ``start_new_session=True`` and everything it started (its session's process
    group): SIGTERM, then SIGKILL after ``grace``. For teardowns: whatever the test did, nothing it started lives."""
    import signal

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; children that ignored SIGTERM may not be: the group gets the next signal too
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_sim(tiny_model, tmp_path_factory):
    """A simulated Llama-3.1-8B on an H100 (vllm-sim, start-up time x 0.01) for a module's tests; its URL."""
    import time

    import httpx

    port = free_port()
    logs = tmp_path_factory.mktemp("sim")
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune.sim.cli", "--gpu", "h100-80gb", "--time-scale", "0.01", "serve",
         "llama-3.1-8b", "--port", str(port), "--tokenizer", str(tiny_model)],
        cwd=ROOT, stdout=(logs / "out.log").open("wb"), stderr=(logs / "err.log").open("wb"), stdin=subprocess.DEVNULL,
        start_new_session=True)
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
        stop_group(proc, grace=5.0)


# -- no process outlives the run ----------------------------------------------------------------------

# what a test may start that must never be left behind: engines (real and simulated), the dashboard,
# the daemon and its tunings, the capture proxy, Xinference, PostgreSQL servers, nginx
_OWNED = ("vllm serve", "autotune.sim.cli", "vllm-sim", "optuna-dashboard", "-m autotune", "bin/autotune",
          "xinference", "EngineCore", "postgres -D", "nginx")


_RUN_MARK = "AUTOTUNE_TEST_RUN"  # in the environment of everything this run starts, so only its own count


def _leftovers(mark: str) -> list:
    import psutil

    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            if p.info["pid"] == me:
                continue
            line = " ".join(p.info["cmdline"] or [p.info["name"] or ""])
            if any(word in line for word in _OWNED) and p.environ().get(_RUN_MARK) == mark:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def pytest_sessionstart(session):
    import uuid

    os.environ[_RUN_MARK] = session.config._autotune_mark = uuid.uuid4().hex


def pytest_sessionfinish(session, exitstatus):
    """A run that leaves an engine, a dashboard or a daemon behind fails, naming each (and kills them, so
    the next run starts clean). Stragglers get a few seconds to finish their own shutdown first."""
    import time

    import psutil

    mark = getattr(session.config, "_autotune_mark", None)
    if mark is None:
        return
    deadline = time.monotonic() + 10
    left = _leftovers(mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _leftovers(mark)
    if not left:
        return
    lines = []
    for p in left:
        try:
            lines.append(f"pid {p.pid}: {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.NoSuchProcess:
            continue
    if lines:
        print("\nprocesses left behind by the test run (killed now):\n  " + "\n  ".join(lines), file=sys.stderr)
        session.exitstatus = 1
