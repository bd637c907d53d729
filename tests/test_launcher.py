"""The launcher against small stand-in engines (Python one-liners): lifecycle, fast failure, no leftovers.

The same paths run against real vLLM in test_engine_vllm.py; these cover the timing-sensitive
and odd cases (a process that ignores SIGTERM, a launcher killed -9) cheaply.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from autotune.engine.failures import FailureClass
from autotune.engine.launcher import Engine, EngineState, LaunchSpec, port_is_free
from autotune.engine.vllm.failures import PATTERNS
from autotune.errors import EngineFailure, IllegalTransition
from tests.conftest import free_port

HEALTHY = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a): pass
    print("Starting vLLM server on http://127.0.0.1:%s" % sys.argv[1], flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def spec(tmp_path, code, port=None, **kw):
    port = port or free_port()
    return LaunchSpec(argv=[sys.executable, "-c", code, str(port)], port=port, log_dir=tmp_path / "logs",
                      state_dir=tmp_path / "state", failure_patterns=PATTERNS, **kw)


def test_ready_then_stop_leaves_nothing(tmp_path):
    e = Engine(spec(tmp_path, HEALTHY))
    e.start()
    assert e.state is EngineState.READY and e.ready_s > 0
    pid = e.pid
    assert (tmp_path / "state" / "engines" / f"engine-{e.spec.port}.json").exists()
    e.stop()
    assert e.state is EngineState.STOPPED
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert port_is_free("127.0.0.1", e.spec.port)
    assert not (tmp_path / "state" / "engines" / f"engine-{e.spec.port}.json").exists()
    assert "Starting vLLM server" in (tmp_path / "logs" / "engine.stdout.log").read_text()


def test_nice_lowers_the_engine_and_its_sessions_autogroup(tmp_path):
    # the engine leads a session of its own: under autogroup scheduling only the group's nice weighs it against
    # the replay client's session (a process nice alone left both an equal share of a core)
    ours = read_autogroup("self")
    e = Engine(spec(tmp_path, HEALTHY, nice=7))
    e.start()
    try:
        assert psutil.Process(e.pid).nice() == 7
        if ours is not None:
            assert read_autogroup(e.pid).split()[-2:] == ["nice", "7"]
            # ours is untouched; it reads empty where this process is in the root group (a CI runner's service)
            assert read_autogroup("self") == ours
    finally:
        e.stop()


def read_autogroup(pid) -> str | None:
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def test_failure_line_is_reported_before_the_process_exits(tmp_path):
    code = textwrap.dedent("""
        import sys, time
        print("(EngineCore pid=1) ERROR ValueError: No available memory for the cache blocks. Try increasing", flush=True)
        time.sleep(60)
    """)
    e = Engine(spec(tmp_path, code))
    t0 = time.monotonic()
    with pytest.raises(EngineFailure) as info:
        e.start()
    f = info.value.failure
    assert f.failure_class is FailureClass.OOM
    assert "No available memory for the cache blocks" in f.summary
    assert time.monotonic() - t0 < 30  # it did not wait for the 60 s sleep (or a health timeout)
    assert e.state is EngineState.STOPPED


def test_stderr_lines_count_too(tmp_path):
    code = "import sys, time; print('vllm: error: unrecognized arguments: --swap-space 4', file=sys.stderr, flush=True); sys.exit(2)"
    with pytest.raises(EngineFailure) as info:
        Engine(spec(tmp_path, code)).start()
    assert info.value.failure.failure_class is FailureClass.INVALID_ARGS
    assert "--swap-space" in info.value.failure.summary


def test_exit_without_known_line_is_crashed(tmp_path):
    with pytest.raises(EngineFailure) as info:
        Engine(spec(tmp_path, "import sys; print('segfault-ish'); sys.exit(3)")).start()
    f = info.value.failure
    assert f.failure_class is FailureClass.CRASHED and f.exit_code == 3
    assert "segfault-ish" in f.excerpt


def test_startup_timeout(tmp_path):
    with pytest.raises(EngineFailure) as info:
        Engine(spec(tmp_path, "import time; time.sleep(60)", startup_timeout=1.0)).start()
    assert info.value.failure.failure_class is FailureClass.STARTUP_TIMEOUT


def test_port_in_use_is_known_before_launch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        e = Engine(spec(tmp_path, HEALTHY, port=port))
        with pytest.raises(EngineFailure) as info:
            e.start()
    assert info.value.failure.failure_class is FailureClass.PORT_IN_USE
    assert e.pid is None  # nothing was launched


def test_sigterm_ignored_gets_sigkill(tmp_path):
    code = textwrap.dedent("""
        import signal, subprocess, sys
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        print("child", child.pid, flush=True)
    """) + HEALTHY
    e = Engine(spec(tmp_path, code, stop_grace=1.0))
    e.start()
    time.sleep(0.2)
    child = int((tmp_path / "logs" / "engine.stdout.log").read_text().split()[1])
    e.stop()
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert not psutil.pid_exists(e.pid) or psutil.Process(e.pid).status() == psutil.STATUS_ZOMBIE


def test_illegal_transition_raises(tmp_path):
    e = Engine(spec(tmp_path, HEALTHY))
    e.stop()
    with pytest.raises(IllegalTransition, match="cannot go from stopped to starting"):
        e.start()


def test_launcher_killed_minus_9_leftover_is_reaped_by_next_start(tmp_path):
    port = free_port()
    launcher = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from autotune.engine.launcher import Engine, LaunchSpec
        code = {HEALTHY!r}
        e = Engine(LaunchSpec(argv=[sys.executable, "-c", code, "{port}"], port={port},
                              log_dir=Path({str(tmp_path / 'l1')!r}), state_dir=Path({str(tmp_path / 'state')!r})))
        e.start()
        print("engine", e.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    line = proc.stdout.readline()
    engine_pid = int(line.split()[1])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert psutil.pid_exists(engine_pid)  # the orphan is really there
    record = json.loads((tmp_path / "state" / "engines" / f"engine-{port}.json").read_text())
    assert record["pid"] == engine_pid
    # the next launch (any port) kills it first
    e = Engine(spec(tmp_path, HEALTHY))
    e.start()
    e.stop()
    gone = not psutil.pid_exists(engine_pid) or psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE
    assert gone
    assert port_is_free("127.0.0.1", port)
    assert not (tmp_path / "state" / "engines" / f"engine-{port}.json").exists()
