"""Start an engine, know when it is ready or why it failed, and stop it without leftovers.

The launcher knows processes, ports and logs; it knows nothing of flags, SLOs or Optuna.

Lifecycle (illegal transitions raise):

    CREATED -> STARTING -> READY -> STOPPING -> STOPPED
                   \\                   ^
                    +--> FAILED -------+   (a failed engine is still stopped: no leftovers)

Readiness is ``GET /health`` == 200. Failure is known as soon as a log line proves it
(the spec's ``failure_patterns``, from the engine kind) or the process exits: the launcher never waits out
its timeout when the engine already said why.

Signals: a command that owns an engine calls ``stop_on_signals()``. SIGTERM (systemd, ``timeout``,
a container runtime, CI) and SIGHUP (a closed terminal) then do what Ctrl-C does: the handler
only notes the first signal and raises ``Interrupted`` in the main thread, where the ``finally``
blocks that stop engines run. It never raises inside a launch or a stop (the signal is raised
when that section ends, so neither is cut in half) and never twice (a second signal cannot cut
the clean-up short). An engine a signal kept from its stop anyway is stopped at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import enum
import errno
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

import httpx
import psutil

from autotune.engine.failures import COMMON_PATTERNS, Failure, FailureClass, LogWatch, Patterns, classify_exit
from autotune.engine.gpu import wait_released
from autotune.engine.health import probe
from autotune.engine.leftovers import EngineRecord, kill_group, reap_leftovers, remove_record, write_record
from autotune.errors import EngineFailure, IllegalTransition, Interrupted
from autotune.locations import state_dir as default_state_dir

__all__ = [
    "EngineState",
    "LaunchSpec",
    "Engine",
    "port_is_free",
    "stop_on_signals",
    "stop_received",
    "raise_if_interrupted",
    "raise_if_stopping",
]


class EngineState(enum.Enum):
    CREATED = "created"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


_ALLOWED = {
    EngineState.CREATED: {EngineState.STARTING, EngineState.STOPPED},
    EngineState.STARTING: {EngineState.READY, EngineState.FAILED, EngineState.STOPPING},
    EngineState.READY: {EngineState.FAILED, EngineState.STOPPING},
    EngineState.FAILED: {EngineState.STOPPING},
    EngineState.STOPPING: {EngineState.STOPPED},
    EngineState.STOPPED: set(),
}


def lower_priority(pid: int, nice: int) -> None:
    """Set ``nice`` on the process ``pid`` and on its session's autogroup.

    The engine leads a session of its own (start_new_session), and where the kernel schedules by autogroup (Linux
    with sched_autogroup_enabled, the default of Debian's and Ubuntu's kernels outside a cgroup with its own CPU
    weight) a session is a group weighed against the others by the group's nice alone: a process nice without it
    leaves the engine an equal share beside the replay client's session."""
    psutil.Process(pid).nice(nice)
    # no /proc/PID/autogroup: a kernel without autogroup scheduling (or not Linux), where the process nice is all
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


@dataclass
class LaunchSpec:
    argv: list[str]  # the whole command line, host and port included
    port: int
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    log_dir: Path = Path("runs/engine")
    startup_timeout: float = 900.0
    stop_grace: float = 15.0  # SIGTERM -> SIGKILL for an engine that was serving
    unready_stop_grace: float = 0.5  # the same for one that never served (failed, or stopped while starting):
    # nothing to drain, and vLLM's API server sits out SIGTERM while it waits for its engine core
    state_dir: Path | None = None  # where leftover records go (default: locations.state_dir())
    nice: int = 0  # > 0 lowers the engine's CPU priority: on a CPU host it must not starve the load generator
    failure_patterns: Patterns = field(default_factory=lambda: list(COMMON_PATTERNS))  # the engine kind's

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def _holder_of(port: int) -> str:
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f" (held by pid {c.pid}, {psutil.Process(c.pid).name()})"
    except (psutil.Error, OSError):
        pass
    return ""


class _Signals:
    """What the stop handler saw. Touched by the main thread only (Python runs handlers there)."""

    received: int | None = None  # the first stop signal
    raised = False
    sections = 0  # launches and stops under way


def stop_received() -> int | None:
    """The stop signal this process received (None: none yet), raised or still pending."""
    return _Signals.received


def stop_on_signals(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)) -> None:
    """Make ``signals`` raise ``Interrupted`` in the main thread, as Ctrl-C raises KeyboardInterrupt (call it there)."""
    for sig in signals:
        signal.signal(sig, _on_signal)


def _on_signal(signum: int, _frame: object) -> None:
    if _Signals.received is not None:
        return  # the first one is being acted on: let its clean-up finish
    _Signals.received = signum
    if _Signals.sections:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None:
        # Raised here, the exception would land in whatever callback the loop is running, and an event
        # loop logs and swallows those (seen: aiohttp's data_received under uvloop, the replay going on).
        # Cancel the loop's tasks instead, as asyncio.Runner does for Ctrl-C; whoever runs the loop turns
        # the cancellation into Interrupted with raise_if_interrupted().
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.call_soon_threadsafe(lambda: None)  # wake the loop up
        return
    _raise_received(signum)


def raise_if_interrupted() -> None:
    """Raise the Interrupted a stop signal left pending (an event loop was running when it came)."""
    if _Signals.received is not None and not _Signals.raised:
        _raise_received(_Signals.received)


def raise_if_stopping() -> None:
    """In a thread other than the main one (a trial beside others), raise Interrupted once a stop signal came: the
    handler raises it in the main thread only, so the threads that measure look, between polls, and unwind too."""
    if _Signals.received is not None and threading.current_thread() is not threading.main_thread():
        raise Interrupted(_Signals.received)


def _raise_received(signum: int) -> None:
    _Signals.raised = True
    raise Interrupted(signum)


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """A launch or a stop runs to its end; a stop signal that came meanwhile is raised after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _Signals.sections += 1
    try:
        yield
    finally:
        _Signals.sections -= 1
        if not _Signals.sections and _Signals.received is not None and not _Signals.raised:
            _raise_received(_Signals.received)


_RUNNING: set[Engine] = set()  # launched and not yet stopped


@atexit.register
def _stop_running() -> None:
    """The last net: an engine whose stop a signal kept from starting (it landed just before) is stopped on exit."""
    for engine in list(_RUNNING):
        engine.stop()


class Engine:
    """One engine process. Use as a context manager, or call start() and stop() yourself."""

    def __init__(self, spec: LaunchSpec, on_line: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.state = EngineState.CREATED
        self.failure: Failure | None = None
        self.started_at: float | None = None  # wall clock, for reports
        self.ready_s: float | None = None  # seconds from launch to healthy
        self.stop_s: float | None = None
        self._on_line = on_line
        self._proc: subprocess.Popen[bytes] | None = None
        self._pgid: int | None = None
        self._watch = LogWatch(list(spec.failure_patterns))
        self._watch_lock = threading.Lock()
        self._failed = threading.Event()
        self._readers: list[threading.Thread] = []
        self._logs: list[IO[bytes]] = []
        self._state_dir = spec.state_dir or default_state_dir()

    # -- lifecycle -------------------------------------------------------------------------

    def _to(self, new: EngineState) -> None:
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(f"engine cannot go from {self.state.value} to {new.value}")
        self.state = new

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def failed_after_s(self) -> float | None:
        """Seconds from launch until the failure was known (None if it did not fail, or never launched)."""
        if self.failure is None or self.failure.detected_at is None or self._proc is None:
            return None
        return self.failure.detected_at - self._t0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def log_paths(self) -> dict[str, Path]:
        return {name: self.spec.log_dir / f"engine.{name}.log" for name in ("stdout", "stderr")}

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Launch and block until ready. Raises EngineFailure (the engine is stopped by then)."""
        self._to(EngineState.STARTING)
        try:
            with _uninterrupted():
                reap_leftovers(self._state_dir, running={e.pid for e in list(_RUNNING) if e.pid is not None})
                if not port_is_free(self.spec.host, self.spec.port):
                    self._fail(
                        Failure(
                            FailureClass.PORT_IN_USE,
                            f"port {self.spec.port} on {self.spec.host} is already in use{_holder_of(self.spec.port)}",
                        )
                    )
                self._launch()
            self._wait_ready()
        except BaseException:  # KeyboardInterrupt included: never leave the engine behind
            self.stop()
            raise

    def _launch(self) -> None:
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env, "PYTHONUNBUFFERED": "1"}
        self.started_at = time.time()
        self._t0 = time.monotonic()
        self._proc = subprocess.Popen(
            self.spec.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._pgid = self._proc.pid  # start_new_session: the engine leads its own group
        _RUNNING.add(self)
        if self.spec.nice:
            # set before vLLM spawns its engine core and workers (seconds later), which inherit it
            lower_priority(self._proc.pid, self.spec.nice)
        me = psutil.Process()
        write_record(
            self._state_dir,
            EngineRecord(
                pid=self._proc.pid,
                pgid=self._pgid,
                create_time=psutil.Process(self._proc.pid).create_time(),
                owner_pid=me.pid,
                owner_create_time=me.create_time(),
                port=self.spec.port,
                argv=list(self.spec.argv),
            ),
        )
        for name, stream in (("stdout", self._proc.stdout), ("stderr", self._proc.stderr)):
            log = open(self.log_paths[name], "wb")  # noqa: SIM115 - the reader thread writes it; stop() closes it
            self._logs.append(log)
            t = threading.Thread(target=self._read, args=(stream, log), name=f"engine-{name}", daemon=True)
            t.start()
            self._readers.append(t)

    def _read(self, stream: IO[bytes], log: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            log.write(raw)
            log.flush()
            line = raw.decode("utf-8", "replace")
            with self._watch_lock:
                hit = self._watch.feed(line)
            if hit is not None:
                self._failed.set()
            if self._on_line is not None:
                self._on_line(line)

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = self._t0 + self.spec.startup_timeout
        next_probe = 0.0
        with httpx.Client(timeout=httpx.Timeout(2.0, connect=0.5)) as client:
            while True:
                raise_if_stopping()
                # A log line that proves a failure wakes us at once.
                if self._failed.wait(0.05):
                    self._fail_from_log()
                code = self._proc.poll()
                if code is not None:
                    self._drain_readers()
                    self._fail_from_exit(code)
                now = time.monotonic()
                if now >= next_probe:
                    next_probe = now + 0.25
                    # no answer yet: vLLM listens only once the engine is built
                    if probe(self.url, client=client).ok:
                        self.ready_s = time.monotonic() - self._t0
                        self._to(EngineState.READY)
                        return
                if now >= deadline:
                    with self._watch_lock:
                        tail = self._watch.tail()
                    self._fail(
                        Failure(
                            FailureClass.STARTUP_TIMEOUT, f"not healthy after {self.spec.startup_timeout:.0f} s", tail
                        )
                    )

    def _fail_from_log(self) -> None:
        # The proof usually ends a burst (a traceback, a pydantic error): let the rest of the burst land
        # in the excerpt. Bounded, so a failure is still reported well within 2 s of its line.
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline and self._proc is not None and self._proc.poll() is None:
            time.sleep(0.02)
        with self._watch_lock:
            found = self._watch.found
        assert found is not None  # _failed is set once the watch found a proof, which it keeps
        cls, line, excerpt = found
        self._fail(Failure(cls, line, excerpt, self._proc.poll() if self._proc else None, time.monotonic()))

    def _fail_from_exit(self, code: int) -> None:
        with self._watch_lock:
            f = classify_exit(code, self._watch)
        self._fail(Failure(f.failure_class, f.summary, f.excerpt, code, time.monotonic()))

    def _fail(self, failure: Failure) -> None:
        if failure.detected_at is None:
            failure = replace(failure, detected_at=time.monotonic())
        self.failure = failure
        self._to(EngineState.FAILED)
        raise EngineFailure(failure)

    def check(self) -> Failure | None:
        """After ready: has the engine died? (Call between measurements.)"""
        if self._proc is None or self.state is not EngineState.READY:
            return self.failure
        code = self._proc.poll()
        if code is None:
            return None
        self._drain_readers()
        with self._watch_lock:
            f = classify_exit(code, self._watch)
        if f.failure_class is not FailureClass.OOM:
            f = Failure(FailureClass.CRASHED, f"died after becoming ready: {f.summary}", f.excerpt, code)
        self.failure = f
        self._to(EngineState.FAILED)
        return f

    def _drain_readers(self, timeout: float = 2.0) -> None:
        for t in self._readers:
            t.join(timeout)

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL after the grace, then wait for the port and GPU memory."""
        if self.state in (EngineState.STOPPING, EngineState.STOPPED):
            return
        with _uninterrupted():
            self._stop()

    def _stop(self) -> None:
        if self.state is EngineState.CREATED:
            self._to(EngineState.STOPPED)
            return
        grace = self.spec.stop_grace if self.state is EngineState.READY else self.spec.unready_stop_grace
        self._to(EngineState.STOPPING)
        t0 = time.monotonic()
        pids: set[int] = set()
        if self._proc is not None and self._pgid is not None:
            try:
                tree = [psutil.Process(self._proc.pid), *psutil.Process(self._proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                tree = []
            pids = {p.pid for p in tree} | {self._proc.pid}
            kill_group(self._pgid, grace, extra=tree)
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._drain_readers()
            for log in self._logs:
                log.close()
            deadline = time.monotonic() + 30
            while not port_is_free(self.spec.host, self.spec.port) and time.monotonic() < deadline:
                time.sleep(0.1)
            wait_released(pids, timeout=60)
            remove_record(self._state_dir, self.spec.port)
        _RUNNING.discard(self)
        self.stop_s = time.monotonic() - t0
        self._to(EngineState.STOPPED)
