import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny random-weight Llama (no hub: local text, random weights), built once per pytest run (~10 s) under
    the run's temp dir, which pytest-xdist's workers share: the first to need it builds it, the others wait on the
    lock and find it built. AUTOTUNE_TINY_MODEL names a kept one instead (built there if missing)."""
    import fcntl

    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = run_dir.parent  # each worker's basetemp is a folder of the run's
    kept = os.environ.get("AUTOTUNE_TINY_MODEL")
    path = Path(kept) if kept else run_dir / "models" / "tiny-llama"
    with open(run_dir / "tiny-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        # the script leaves a complete model as it is: only the first worker builds
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build_tiny_model.py"), str(path)], check=True,
                       stdout=subprocess.DEVNULL)
    return path


def own_core(which: int) -> str:
    """A core of this host for one of the two real studies that run side by side (the ``paired`` marker), as
    VLLM_CPU_OMP_THREADS_BIND takes it: 0 the first allowed core, -1 the last. vLLM's CPU worker binds itself to the
    first allowed cores by default, so side by side both engines would compute on one core, each at half speed,
    while the other core served only API servers and replay clients."""
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[which % len(cores)])


def example_study(name: str, tiny_model: Path, dest: Path) -> Path:
    """studies/NAME.toml copied to ``dest``, naming the run's tiny model where it names ./models/tiny-llama
    (the path the quickstart builds it at, relative to the working directory)."""
    text = (ROOT / "studies" / f"{name}.toml").read_text()
    assert '"./models/tiny-llama"' in text, f"studies/{name}.toml no longer names ./models/tiny-llama"
    path = dest / f"{name}.toml"
    path.write_text(text.replace('"./models/tiny-llama"', f'"{tiny_model}"'))
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
    """CPU engine settings shared by the real-vLLM tests. The compile cache is shared by the tests of one run
    and lives under the run's temporary XDG_CACHE_HOME (see pytest_sessionstart), never in the user's ~/.cache:
    a cache that survives between runs could hide a change."""
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


# Ports for the tests' servers, from a block of their worker's own below the kernel's ephemeral range (where
# bind(0) and outgoing connections take theirs; 32768 and up on Linux), each handed out once per run: with
# workers side by side, a port one test leaves unbound on purpose ("nothing listens there") is not another
# worker's server a moment later, and two tests never draw the same port.
_PORT_BLOCK = 1000
_PORT_BASE = 20000
_ports_given = 0


def script(name: str):
    """scripts/NAME.py imported as the module NAME (the scripts are no package; the benchmark's modules import each
    other by name, as when run from scripts/)."""
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, root / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    """scripts/bench_search.py, the search benchmark."""
    return script("bench_search")


def free_port() -> int:
    import socket

    global _ports_given
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    start = _PORT_BASE + (worker % 12) * _PORT_BLOCK
    while _ports_given < _PORT_BLOCK:
        port = start + _ports_given
        _ports_given += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # held by something outside this run
                continue
            return port
    raise RuntimeError(f"this worker gave out all {_PORT_BLOCK} ports of its block from {start}")


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


# -- the run spread over pytest-xdist's workers ---------------------------------------------------------

# scripts/run_tests.sh runs the tests that start no real engine on six workers, then the real engines that assert
# no speed on two, then the two real studies (`paired`) side by side, then those that assert speed (`alone`). A
# module-scoped fixture (a finished study, a running server) is paid once per worker that runs one of its
# module's tests, so such a module's tests stay on one worker.


def _shares_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(d.scope == "module" for defs in info.name2fixturedefs.values() for d in defs)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):  # -p no:xdist (the real engines' run): no groups to mark
        return
    for item in items:
        if _shares_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_collection_finish(session):
    """Under --dist loadgroup a group is read from the test's id: an id without it would build a module's fixture
    (a whole study, a server) once per worker, without a word. Say so instead."""
    if not session.config.getoption("loadgroup", False):
        return
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(f"pytest-xdist did not group {lost[0]} (and {len(lost) - 1} more): this pytest and "
                                "pytest-xdist do not work together (pytest-dev/pytest-xdist#1386); install .[test]")


# -- no process outlives the run ----------------------------------------------------------------------

# What a test may start must never be left behind: engines (real, simulated, fixed-timing and the fake ones
# tests write), the dashboard, the daemon and its tunings, the capture proxy, Xinference, PostgreSQL, nginx.
# Rather than a list of names that misses the next kind of process, every process this run started carries
# the run's mark in its environment (set at session start, inherited by each child and grandchild: nothing
# here starts a process with an environment of its own making), and any marked process alive at the end is
# a leftover. Another run's processes carry another mark and are none of this run's business.
_RUN_MARK = "AUTOTUNE_TEST_RUN"

# the one kind of marked process that may outlive the tests: the test process's own multiprocessing helper,
# which ends with it
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _leftovers(mark: str) -> list:
    import psutil

    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline", "name"]):
        try:
            if p.info["pid"] == me:
                continue
            if p.environ().get(_RUN_MARK) != mark:
                continue
            line = " ".join(p.info["cmdline"] or [p.info["name"] or ""])
            if p.info["ppid"] == me and any(h in line for h in _HELPERS):
                continue
            found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    # and what those started: a server that rewrites its process title over its environment (PostgreSQL's
    # backends, nginx's workers) no longer shows the mark, but its parent does
    seen = {p.pid for p in found}
    for p in list(found):
        try:
            for child in p.children(recursive=True):
                if child.pid not in seen and child.status() != psutil.STATUS_ZOMBIE:
                    seen.add(child.pid)
                    found.append(child)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


# Where a test run must write nothing. The repository's working tree, less what tools own there (git, the
# virtual environments the install scripts make before pytest, bytecode, pytest's and Hypothesis' own
# caches). The tiny model is built under pytest's temp dir (the tiny_model fixture), not in models/.
_REPO_SKIP = {".git", ".venv", ".venv-xinference", "__pycache__", ".pytest_cache", ".hypothesis",
              ".mypy_cache", ".ruff_cache"}
# And the user's own dirs, by the names autotune, vLLM, Hugging Face and torch write under.
_HOME_DIRS = (".cache", ".config", ".local/state", ".local/share")
_HOME_NAMES = ("autotune", "vllm", "huggingface", "torch", "triton", "optuna")


def _walk(top: Path, skip=frozenset()) -> dict:
    """path -> (mtime_ns, size) for files and links, None for directories."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for d in dirnames:
            found[os.path.join(dirpath, d)] = None
        for f in filenames:
            path = os.path.join(dirpath, f)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            found[path] = (st.st_mtime_ns, st.st_size)
    return found


def _written_places(home: Path) -> dict:
    snap = _walk(ROOT, _REPO_SKIP)
    for sub in _HOME_DIRS:
        base = home / sub
        if not base.is_dir():
            continue
        for entry in base.iterdir():
            if entry.name.lower().startswith(_HOME_NAMES):
                snap[str(entry)] = None if entry.is_dir() else (entry.lstat().st_mtime_ns, entry.lstat().st_size)
                if entry.is_dir() and not entry.is_symlink():
                    snap.update(_walk(entry))
    return snap


def _unexpected_writes(before: dict, after: dict) -> list[str]:
    """One line per path made, changed or removed; a new or removed directory hides what is under it."""
    lines, covered = [], []
    for path in sorted(set(before) | set(after)):
        if any(path.startswith(c + os.sep) for c in covered):
            continue
        if path not in before:
            lines.append(f"made: {path}")
        elif path not in after:
            lines.append(f"removed: {path}")
        elif before[path] != after[path]:
            lines.append(f"changed: {path}")
        else:
            continue
        if after.get(path, before.get(path)) is None:
            covered.append(path)
    return lines


def pytest_sessionstart(session):
    import shutil
    import tempfile
    import uuid

    os.environ[_RUN_MARK] = session.config._autotune_mark = uuid.uuid4().hex
    # the listing is taken before anything runs; the XDG dirs then point into one temp dir for the run, so
    # autotune's flag cache and state, vLLM's config and caches and Hugging Face's cache stay out of $HOME
    home = Path.home()
    session.config._autotune_written = (home, _written_places(home))
    xdg = Path(tempfile.mkdtemp(prefix="autotune-tests-xdg-"))
    for name in ("XDG_CACHE_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME"):
        (xdg / name.lower()).mkdir()
        os.environ[name] = str(xdg / name.lower())
    session.config.add_cleanup(lambda: shutil.rmtree(xdg, ignore_errors=True))


def _check_writes(session) -> None:
    """A run that wrote into the working tree or the user's dirs fails, naming each path on a line."""
    recorded = getattr(session.config, "_autotune_written", None)
    if recorded is None:
        return
    home, before = recorded
    lines = _unexpected_writes(before, _written_places(home))
    if lines:
        print("\nfiles the test run wrote outside temp dirs:\n  " + "\n  ".join(lines), file=sys.stderr)
        session.exitstatus = 1


def pytest_sessionfinish(session, exitstatus):
    """A run that leaves any process it started behind (an engine, a dashboard, a daemon, ...) fails, naming
    each (and kills them, so the next run starts clean). Stragglers get a few seconds to finish their own
    shutdown first."""
    import time

    import psutil

    _check_writes(session)
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
