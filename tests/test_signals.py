"""Signals stop every command that owns a process, and nothing is left behind.

Each test runs ``autotune`` as a real subprocess, with vllm-sim as its engine (one test: real
vLLM), signals it mid-run and checks within 10 s: the process exited (128 + the signal for the
commands that own an engine), no process of the engine's group is alive, the port is free and no
leftover record remains. Then: a rerun resumes the study; after ``kill -9`` the rerun says what it
reaped and which trial it failed; the daemon says when it cannot scrape production and
``autotune status`` shows it.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import optuna
import psutil
import pytest
from optuna.trial import TrialState

from autotune.engine.launcher import port_is_free
from autotune.engine.leftovers import group_members
from tests.conftest import ROOT, free_port
from tests.test_daemon import DAEMON, STAGING, Traffic, setup  # noqa: F401 (setup: a fixture)

STOP_WITHIN = 10.0  # seconds from the signal to: autotune gone, engine group gone, port free
SIM = f"{sys.executable} -m autotune.sim.cli --gpu a10-24gb --time-scale 0.01 serve"


class Autotune:
    """``python -m autotune ARGS`` in the background, its output in files (a pipe could fill up)."""

    def __init__(self, tmp_path: Path, name: str, *args: str, state: Path) -> None:
        self.err_path = tmp_path / f"{name}.stderr"
        self.out_path = tmp_path / f"{name}.stdout"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=ROOT, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=err, env={**os.environ, "AUTOTUNE_STATE_DIR": str(state)})

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def lines(self, start: str) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith(start)]

    def alive(self) -> None:
        assert self.proc.poll() is None, f"autotune exited ({self.proc.returncode}) too early:\n{self.stderr[-3000:]}"

    def signal_and_wait(self, sig: int) -> float:
        """Send ``sig``; seconds until the process is gone (fails past STOP_WITHIN)."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=STOP_WITHIN)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_WITHIN:.0f} s after {signal.Signals(sig).name}:\n{self.stderr[-3000:]}")
        return time.monotonic() - t0


@pytest.fixture
def cleanup():
    """Whatever a failing test leaves (autotune processes, engine groups) is killed afterwards."""
    procs: list[subprocess.Popen] = []
    groups: list[int] = []
    yield procs, groups
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for pgid in groups:
        for member in group_members(pgid):
            member.kill()


def serving_engine(run: Autotune, state: Path, port: int, timeout: float = 120.0) -> dict:
    """Wait until the engine autotune started answers /health; its leftover record."""
    record = state / "engines" / f"engine-{port}.json"
    deadline = time.monotonic() + timeout
    while True:
        run.alive()
        if record.exists():
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return json.loads(record.read_text())
            except httpx.TransportError:
                pass
        assert time.monotonic() < deadline, f"no healthy engine on port {port}:\n{run.stderr[-3000:]}"
        time.sleep(0.2)


def assert_nothing_left(rec: dict, state: Path) -> None:
    assert group_members(rec["pgid"]) == [], "a process of the engine's group outlived autotune"
    assert port_is_free("127.0.0.1", rec["port"])
    assert not (state / "engines" / f"engine-{rec['port']}.json").exists()


def write_study(tmp_path: Path, tiny_model: Path, port: int, *, step: str, trials: int) -> Path:
    """The daemon tests' staging study (vllm-sim on an A10, the vllm-defaults baseline), with these steps and budget."""
    path = tmp_path / "staging.toml"
    text = STAGING.format(root=tmp_path, python=sys.executable, port=port, model=tiny_model)
    for old, new in (('step_duration = "2s"', f'step_duration = "{step}"'), ("trials = 3", f"trials = {trials}")):
        assert text.count(old) == 1, f"the staging study no longer says {old}"
        text = text.replace(old, new)
    path.write_text(text)
    return path


def trials_of(tmp_path: Path) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="staging", storage=f"sqlite:///{tmp_path}/studies.db").trials


def started_study(tmp_path, tiny_model, cleanup) -> tuple[Autotune, dict, Path, Path]:
    """A study whose first trial (the vllm-defaults baseline) is measuring, its steps a minute long."""
    state, port = tmp_path / "state", free_port()
    path = write_study(tmp_path, tiny_model, port, step="60s", trials=2)
    run = Autotune(tmp_path, "study", "study", str(path), state=state)
    cleanup[0].append(run.proc)
    rec = serving_engine(run, state, port)
    cleanup[1].append(rec["pgid"])
    time.sleep(1.0)  # the replay is under way
    return run, rec, state, path


def resume(tmp_path, tiny_model, path, port, state) -> subprocess.CompletedProcess:
    """Rerun the study with short steps and one more finished trial to reach: it resumes, never starts over."""
    write_study(tmp_path, tiny_model, port, step="2s", trials=1)
    return subprocess.run([sys.executable, "-m", "autotune", "study", str(path), "--no-remeasure"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "AUTOTUNE_STATE_DIR": str(state)})


# -- the launcher: a stop in progress is never cut in half ----------------------------------------------

STUBBORN_LAUNCHER = '''
import sys, textwrap
from pathlib import Path
from autotune.engine.launcher import Engine, LaunchSpec, stop_on_signals
from autotune.errors import Interrupted

engine = textwrap.dedent("""
    import http.server, signal, sys
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # sits out SIGTERM: only the SIGKILL after the grace ends it
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")
port, state = int(sys.argv[1]), Path(sys.argv[2])
stop_on_signals()
e = Engine(LaunchSpec(argv=[sys.executable, "-c", engine, str(port)], port=port, log_dir=state / "logs",
                      state_dir=state, stop_grace=3.0))
try:
    e.start()
    print("stopping", e.pid, flush=True)
    e.stop()
    print("not reached: the signal is raised when the stop ends", flush=True)
except Interrupted as i:
    print("interrupted after the stop:", e.state.value, flush=True)
    sys.exit(i.exit_code)
'''


def test_signals_during_a_stop_wait_for_its_end(tmp_path):
    port, state = free_port(), tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN_LAUNCHER, str(port), str(state)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("stopping"), line
    pgid = int(line.split()[1])
    time.sleep(0.5)  # inside the stop: the engine sits out SIGTERM, the grace runs
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # a second one does not cut the clean-up short either
    out, _ = proc.communicate(timeout=STOP_WITHIN)
    assert proc.returncode == 143 and out == "interrupted after the stop: stopped\n", out
    assert group_members(pgid) == []  # the SIGKILL after the grace came: the stop ran to its end
    assert port_is_free("127.0.0.1", port) and not (state / "engines" / f"engine-{port}.json").exists()


# -- bench and study ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sig, said", [
    (signal.SIGTERM, "autotune: stopped by SIGTERM; the engine was stopped"),
    (signal.SIGHUP, "autotune: stopped by SIGHUP; the engine was stopped"),
    (signal.SIGINT, "autotune: interrupted; the engine was stopped"),  # Ctrl-C, as before
], ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_bench_stops_its_engine_on_a_signal(tmp_path, tiny_model, cleanup, sig, said):
    state, port = tmp_path / "state", free_port()
    run = Autotune(tmp_path, "bench", "bench", "--model", "llama-3.1-8b", "--engine-cmd", SIM, "--port", str(port),
                   "--scenario", "high-concurrency", "--rate", "2", "--requests", "400", "--tokenizer", str(tiny_model),
                   "--log-dir", str(tmp_path / "logs"), "--", "--max-model-len", "8192", "--tokenizer", str(tiny_model),
                   state=state)
    cleanup[0].append(run.proc)
    rec = serving_engine(run, state, port)
    cleanup[1].append(rec["pgid"])
    time.sleep(1.0)  # the replay is under way
    took = run.signal_and_wait(sig)
    assert_nothing_left(rec, state)
    print(f"bench, {signal.Signals(sig).name}: stopped in {took:.2f} s")
    assert run.proc.returncode == 128 + sig
    assert run.lines("autotune:") == [said]
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("sig, said", [
    (signal.SIGTERM, "autotune: stopped by SIGTERM"),
    (signal.SIGINT, "autotune: interrupted"),  # Ctrl-C: the study stays resumable all the same
], ids=["SIGTERM", "SIGINT"])
def test_study_stops_on_a_signal_and_a_rerun_resumes(tmp_path, tiny_model, cleanup, sig, said):
    run, rec, state, path = started_study(tmp_path, tiny_model, cleanup)
    took = run.signal_and_wait(sig)
    assert_nothing_left(rec, state)
    print(f"study, {signal.Signals(sig).name}: stopped in {took:.2f} s")
    assert run.proc.returncode == 128 + sig  # 143 for SIGTERM, 130 for Ctrl-C
    # (the other "autotune:" line says what the simulator predicted before the first launch)
    assert run.lines(said) == [f"{said} during trial 0 (recorded as failed); the engine was stopped. Rerun the "
                               "same command to resume study staging."], run.stderr[-3000:]
    assert "Traceback" not in run.stderr  # Optuna's failed-trial warning would bring one
    first = [t for t in trials_of(tmp_path) if t.state is not TrialState.WAITING]  # the simulator's picks wait
    assert [(t.number, t.state) for t in first] == [(0, TrialState.FAIL)]

    r = resume(tmp_path, tiny_model, path, rec["port"], state)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    trials = trials_of(tmp_path)
    assert trials[0].state == TrialState.FAIL  # kept as it was: not run again under the same number
    # the interrupted baseline was queued again and measured in full this time
    again = [t for t in trials if t.number > 0 and t.user_attrs.get("baseline") == "vllm-defaults"]
    assert [t.state for t in again] == [TrialState.COMPLETE], r.stderr[-3000:]
    assert "left running" not in r.stderr  # nothing was left RUNNING: the signalled run failed it itself


def test_after_kill_9_the_rerun_reports_what_it_reaped_and_failed(tmp_path, tiny_model, cleanup):
    run, rec, state, path = started_study(tmp_path, tiny_model, cleanup)
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait()
    # kill -9 leaves the record and the trial RUNNING; the engine too, unless a write to its closed log pipe ends it
    assert (state / "engines" / f"engine-{rec['port']}.json").exists()
    assert [t.state for t in trials_of(tmp_path) if t.state is not TrialState.WAITING] == [TrialState.RUNNING]

    r = resume(tmp_path, tiny_model, path, rec["port"], state)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    assert_nothing_left(rec, state)
    failed = [line for line in r.stderr.splitlines() if "left running" in line]
    assert len(failed) == 1 and "trial 0 " in failed[0] and "marked failed" in failed[0], r.stderr[-3000:]
    reaped = [line for line in r.stderr.splitlines() if line.startswith("autotune: reaped")]
    assert len(reaped) == 1 and "leftover engine" in reaped[0], r.stderr[-3000:]
    print(reaped[0])
    assert f"pid {rec['pid']}" in reaped[0] and f"port {rec['port']}" in reaped[0]
    assert f"autotune pid {run.proc.pid}" in reaped[0]
    trials = trials_of(tmp_path)
    assert trials[0].state == TrialState.FAIL
    assert any(t.state == TrialState.COMPLETE for t in trials[1:])


# -- dashboard -----------------------------------------------------------------------------------------


def test_dashboard_is_optuna_dashboard_itself_and_stops_on_sigterm(tmp_path, tiny_model, cleanup):
    path = write_study(tmp_path, tiny_model, free_port(), step="2s", trials=1)
    optuna.create_study(study_name="staging", storage=f"sqlite:///{tmp_path}/studies.db")
    port = free_port()
    run = Autotune(tmp_path, "dashboard", "dashboard", str(path), "--port", str(port), state=tmp_path / "state")
    cleanup[0].append(run.proc)
    deadline = time.monotonic() + 60
    while True:
        run.alive()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/studies", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, run.stderr
        time.sleep(0.2)
    # the pid autotune started as now runs optuna-dashboard: no child for a signal to miss
    assert any("optuna-dashboard" in part for part in psutil.Process(run.proc.pid).cmdline())
    took = run.signal_and_wait(signal.SIGTERM)
    print(f"dashboard, SIGTERM: stopped in {took:.2f} s")
    assert port_is_free("127.0.0.1", port)
    assert not [p for p in psutil.process_iter(["cmdline"])
                if any("optuna-dashboard" in c for c in p.info["cmdline"] or []) and str(port) in p.info["cmdline"]]
    assert run.lines("autotune:") == [f"autotune: optuna-dashboard on http://127.0.0.1:{port} (Ctrl-C stops it)"]


# -- daemon --------------------------------------------------------------------------------------------


def scrape_every_second(path: Path) -> None:
    """The daemon tests' file scrapes every 15 s (the default): every second here, over a 3 s window."""
    text = path.read_text()
    assert text.count('window = "5s"') == 1
    path.write_text(text.replace('window = "5s"', 'scrape_interval = "1s"\nwindow = "3s"'))


def daemon_file(tmp_path: Path, tiny_model: Path, prod_port: int) -> Path:
    """A daemon file for production at ``prod_port`` (its YAML written, its restart a no-op), scraping every second."""
    config = tmp_path / "etc" / "production.yaml"
    config.parent.mkdir()
    config.write_text(f"model: llama-3.1-8b\nmax-model-len: 8192\ntokenizer: {tiny_model}\n")
    write_study(tmp_path, tiny_model, free_port(), step="2s", trials=3)
    path = tmp_path / "daemon.toml"
    path.write_text(DAEMON.format(prod_port=prod_port, root=tmp_path, restart='["true"]', approval="false"))
    scrape_every_second(path)
    return path


def test_daemon_stops_its_tuning_and_staging_engine_on_sigterm(setup, tmp_path, tiny_model, cleanup):
    make, _, prod_port, _ = setup  # production serves: a vllm-sim behind a systemctl stand-in
    path = make().source
    scrape_every_second(path)
    staging_port = free_port()
    write_study(tmp_path, tiny_model, staging_port, step="2s", trials=3)
    state = tmp_path / "state"
    env = {**os.environ, "AUTOTUNE_STATE_DIR": str(state)}
    subprocess.run([sys.executable, "-m", "autotune", "retune", "--config", str(path), "--reason", "test"],
                   check=True, env=env, capture_output=True)  # taken once a full window of traffic is seen
    with Traffic(prod_port):
        run = Autotune(tmp_path, "daemon", "daemon", "--config", str(path), state=state)
        cleanup[0].append(run.proc)
        rec = serving_engine(run, state, staging_port, timeout=180)  # the tuning's staging engine
        cleanup[1].append(rec["pgid"])
        tuning = [p for p in psutil.Process(run.proc.pid).children() if "study" in p.cmdline()]
        assert len(tuning) == 1 and tuning[0].pid == rec["owner_pid"]
        time.sleep(1.0)
        took = run.signal_and_wait(signal.SIGTERM)
    assert_nothing_left(rec, state)
    assert not tuning[0].is_running() or tuning[0].status() == psutil.STATUS_ZOMBIE
    print(f"daemon, SIGTERM: stopped in {took:.2f} s")
    assert run.proc.returncode == 0
    assert run.lines("autotune: daemon") == ["autotune: daemon stopped by SIGTERM"]
    st = json.loads((state / "daemon" / "prod" / "state.json").read_text())
    assert st["phase"] == "tuning"  # resumed by the next start


def test_a_daemon_stopped_mid_trial_measures_the_cut_baseline_when_it_starts_again(setup, tmp_path, tiny_model,
                                                                                   cleanup):
    """Issue 15, item 2, with the real daemon: SIGTERM while its tuning's `production` baseline measures. The next
    start resumes the same tuning, and production's config is measured again: every baseline ends with a
    measurement, so a proposal is never judged against a production "0.00" (approval mode: nothing restarts
    production here)."""
    make, _, prod_port, _ = setup
    path = make(approval=True).source
    scrape_every_second(path)
    staging_port = free_port()
    write_study(tmp_path, tiny_model, staging_port, step="3s", trials=3)
    state = tmp_path / "state"
    env = {**os.environ, "AUTOTUNE_STATE_DIR": str(state)}
    subprocess.run([sys.executable, "-m", "autotune", "retune", "--config", str(path), "--reason", "test"],
                   check=True, env=env, capture_output=True)
    daemon_state = state / "daemon" / "prod" / "state.json"
    with Traffic(prod_port):
        run = Autotune(tmp_path, "daemon", "daemon", "--config", str(path), state=state)
        cleanup[0].append(run.proc)
        storage = f"sqlite:///{tmp_path}/studies.db"
        deadline = time.monotonic() + 180
        while True:  # production's baseline runs (the second trial: vllm-defaults goes first)
            run.alive()
            assert time.monotonic() < deadline, run.stderr[-3000:]
            name = json.loads(daemon_state.read_text()).get("study_name") if daemon_state.exists() else None
            try:
                trials = optuna.load_study(study_name=name, storage=storage).trials if name else []
            except KeyError:  # the tuning has not created its study yet
                trials = []
            if [t for t in trials if t.state is TrialState.RUNNING and t.user_attrs.get("baseline") == "production"]:
                break
            time.sleep(0.5)
        rec = serving_engine(run, state, staging_port, timeout=120)
        cleanup[1].append(rec["pgid"])
        time.sleep(2.0)  # its load steps are under way
        run.signal_and_wait(signal.SIGTERM)
        assert run.proc.returncode == 0
        cut = [t for t in optuna.load_study(study_name=name, storage=storage).trials
               if t.user_attrs.get("baseline") == "production"]
        assert [t.state for t in cut] == [TrialState.FAIL], cut  # interrupted: not PRUNED, which would count as done
        cut_baseline = "production"

        again = Autotune(tmp_path, "daemon-again", "daemon", "--config", str(path), state=state)
        cleanup[0].append(again.proc)
        deadline = time.monotonic() + 300
        while json.loads(daemon_state.read_text())["phase"] == "tuning":
            again.alive()
            assert time.monotonic() < deadline, again.stderr[-3000:]
            time.sleep(1.0)
        again.signal_and_wait(signal.SIGTERM)
    st = json.loads(daemon_state.read_text())
    trials = optuna.load_study(study_name=name, storage=storage).trials
    done = {t.user_attrs.get("baseline") for t in trials if t.state is TrialState.COMPLETE and t.value is not None}
    print(f"cut: trial {cut[0].number} ({cut_baseline}); after the restart: "
          f"{[(t.number, t.state.name, t.user_attrs.get('baseline')) for t in trials]}; daemon: {st['note']}")
    assert {"production", "vllm-defaults", cut_baseline} <= done, trials
    assert st["study_name"] == name and st["tunings"] == 1, st  # the same tuning, resumed, not a new one
    assert "no measurement" not in st["note"] and "production 0.00" not in st["note"], st["note"]


def test_daemon_says_when_it_cannot_scrape_and_when_it_can_again(tmp_path, tiny_model, cleanup):
    state, prod_port = tmp_path / "state", free_port()  # nothing listens there yet
    path = daemon_file(tmp_path, tiny_model, prod_port)
    run = Autotune(tmp_path, "daemon", "daemon", "--config", str(path), state=state)
    cleanup[0].append(run.proc)

    def wait_for(text: str) -> list[str]:
        deadline = time.monotonic() + 60
        while not any(text in line for line in run.lines("autotune:")):
            run.alive()
            assert time.monotonic() < deadline, run.stderr[-3000:]
            time.sleep(0.2)
        return run.lines("autotune:")

    def status() -> list[str]:
        r = subprocess.run([sys.executable, "-m", "autotune", "status", "--config", str(path)], capture_output=True,
                           text=True, env={**os.environ, "AUTOTUNE_STATE_DIR": str(state)}, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    url = f"http://127.0.0.1:{prod_port}/metrics"
    wait_for("cannot scrape production")
    time.sleep(2.5)  # more failed scrapes: still one line for the streak
    failing = [line for line in run.lines("autotune:") if "cannot scrape" in line]
    assert len(failing) == 1 and url in failing[0] and "ConnectError" in failing[0], failing
    shown = status()
    scrape = [line for line in shown if line.startswith("production scrape:")]
    assert len(scrape) == 1 and "failing" in scrape[0] and url in scrape[0] and "ConnectError" in scrape[0], shown
    # the failing scrape is its own journal line and status line, not a second journal line by way of the note
    assert "cannot scrape" not in next(line for line in shown if line.startswith("note:")), shown

    logs = tmp_path / "sim"
    logs.mkdir()
    sim = subprocess.Popen([*SIM.split(), "llama-3.1-8b", "--port", str(prod_port), "--max-model-len", "8192",
                            "--tokenizer", str(tiny_model)], cwd=ROOT, stdin=subprocess.DEVNULL,
                           stdout=(logs / "out").open("wb"), stderr=(logs / "err").open("wb"))
    cleanup[0].append(sim)
    lines = wait_for("scraping production works again")
    assert lines[-1].startswith(f"autotune: scraping production works again ({url}) after ")
    scrape = [line for line in status() if line.startswith("production scrape:")]
    assert len(scrape) == 1 and scrape[0].startswith("production scrape: ok") and url in scrape[0], scrape

    # SIGHUP (systemctl reload) re-reads the file: a bad one changes nothing, a good one applies, it goes on
    good = path.read_text()
    path.write_text(good + "\n[oops\n")
    run.proc.send_signal(signal.SIGHUP)
    refused = wait_for("reload: ")[-1]
    assert refused.startswith(f"autotune: reload: {path} not applied, the running config stays: "), refused
    path.write_text(good.replace("approval = false", "approval = true"))
    run.proc.send_signal(signal.SIGHUP)
    assert wait_for("reloaded ")[-1] == f"autotune: reloaded {path}"
    run.alive()
    took = run.signal_and_wait(signal.SIGTERM)
    print(f"daemon, SIGTERM after two reloads: stopped in {took:.2f} s")
    assert run.proc.returncode == 0
    assert run.lines("autotune: daemon")[-1] == "autotune: daemon stopped by SIGTERM"


def unit_watchdog_s() -> float:
    """WatchdogSec= of the systemd unit this repository ships (systemd/autotune.service), in seconds."""
    import re

    m = re.search(r"^WatchdogSec=(\d+)(s|min)?$", (ROOT / "systemd" / "autotune.service").read_text(), re.M)
    assert m, "systemd/autotune.service no longer declares WatchdogSec= in seconds or minutes"
    return float(m.group(1)) * (60 if m.group(2) == "min" else 1)


def test_the_daemon_speaks_sd_notify_from_its_run_loop(tmp_path, tiny_model, cleanup, monkeypatch):
    """``autotune daemon`` as systemd runs it (Type=notify, WatchdogSec=2): a real AF_UNIX datagram socket stands
    where systemd's is. READY=1 once it runs, WATCHDOG=1 well within the watchdog (systemd kills a daemon silent
    for WatchdogSec), STATUS= lines, RELOADING=1 then READY=1 on SIGHUP, STOPPING=1 on SIGTERM."""
    import socket

    where = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(where))
    sock.settimeout(0.2)
    monkeypatch.setenv("NOTIFY_SOCKET", str(where))
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")  # watchdog_s below
    monkeypatch.delenv("WATCHDOG_PID", raising=False)  # systemd sets it to the main pid; unset: this process
    state, prod_port = tmp_path / "state", free_port()  # production does not answer: the loop goes on
    path = daemon_file(tmp_path, tiny_model, prod_port)
    # scraping every 15 s: the loop's pace below can only come from the watchdog (WatchdogSec / 2)
    text = path.read_text()
    assert text.count('scrape_interval = "1s"') == 1
    path.write_text(text.replace('scrape_interval = "1s"', 'scrape_interval = "15s"'))
    watchdog_s = 2.0
    got: list[tuple[float, str]] = []

    def listen(seconds: float, until: str | None = None) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                got.append((time.monotonic(), sock.recv(4096).decode()))
            except TimeoutError:
                continue
            if until is not None and until in got[-1][1]:
                return

    try:
        run = Autotune(tmp_path, "daemon", "daemon", "--config", str(path), state=state)
        cleanup[0].append(run.proc)
        listen(60, until="READY=1")
        assert got and "READY=1" in got[-1][1], (got, run.stderr[-2000:])
        ready_at = got[-1][0]
        listen(6)
        pings = [t for t, text in got if "WATCHDOG=1" in text and t >= ready_at]
        assert len(pings) >= 3, got
        gaps = sorted(b - a for a, b in zip([ready_at, *pings], pings))
        # paced at WatchdogSec / 2 (1 s here), not at WatchdogSec or the 15 s scrape interval: judged on the
        # median, so one gap a stalled VM stretches (the daemon's or this listener's) does not decide it
        assert gaps[len(gaps) // 2] <= 0.75 * watchdog_s, gaps
        # and no silence that would get it restarted under the unit this repository ships
        assert max(gaps) < unit_watchdog_s(), gaps
        assert any(text.startswith("STATUS=watching") for _, text in got), got
        n = len(got)
        run.proc.send_signal(signal.SIGHUP)
        listen(20, until="READY=1")
        after = [text for _, text in got[n:]]
        reloading = next(i for i, text in enumerate(after) if "RELOADING=1" in text)
        assert "MONOTONIC_USEC=" in after[reloading] and any("READY=1" in x for x in after[reloading:]), after
        n = len(got)
        run.proc.send_signal(signal.SIGTERM)
        listen(10, until="STOPPING=1")
        assert any("STOPPING=1" in text for _, text in got[n:]), got[n:]
        run.proc.wait(timeout=STOP_WITHIN)
        assert run.proc.returncode == 0
    finally:
        sock.close()


# -- real vLLM -----------------------------------------------------------------------------------------


@pytest.mark.engine
def test_bench_on_real_vllm_stops_its_engine_on_sigterm(tiny_model, vllm_command, engine_env, tmp_path, cleanup):
    state, port = tmp_path / "state", free_port()
    env_args = [a for k, v in engine_env.items() for a in ("--env", f"{k}={v}")]
    run = Autotune(tmp_path, "bench", "bench", "--model", str(tiny_model), "--engine-cmd", " ".join(vllm_command),
                   "--port", str(port), *env_args, "--scenario", "high-concurrency", "--rate", "2", "--requests", "400",
                   "--prompt-tokens", "16-32", "--output-tokens", "4-8", "--log-dir", str(tmp_path / "logs"),
                   "--", "--enforce-eager", state=state)
    cleanup[0].append(run.proc)
    rec = serving_engine(run, state, port, timeout=400)
    cleanup[1].append(rec["pgid"])
    assert len(group_members(rec["pgid"])) >= 2  # the API server and its engine core: a real group to stop
    time.sleep(3.0)
    took = run.signal_and_wait(signal.SIGTERM)
    assert_nothing_left(rec, state)
    print(f"bench on real vLLM, SIGTERM: stopped in {took:.2f} s")
    assert run.proc.returncode == 143
    assert run.lines("autotune:") == ["autotune: stopped by SIGTERM; the engine was stopped"]
