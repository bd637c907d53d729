"""The daemon: trigger logic and state (pure), and the whole loop against vllm-sim.

In the loop test, production is a vllm-sim reading a YAML config (restarted by the
tests/fixtures/sim_service.py stand-in for systemctl), the staging study runs vllm-sim too, and
real traffic flows to production while the daemon watches, tunes, publishes and verifies.
"""

import datetime as dt
import subprocess
import sys
import threading
import time

import httpx
import pytest

from autotune.daemon.config import TimeWindow, load_daemon_config
from autotune.daemon.exporter import DaemonMetrics
from autotune.daemon.loop import Daemon
from autotune.daemon.state import DaemonState, Observation, Phase, StateStore, decide
from autotune.errors import IllegalTransition
from autotune.errors import ConfigError
from tests.conftest import free_port
from tests.test_publish import SERVICE

H = 3600.0


def _decide(state=DaemonState(), obs=None, **kw):
    args = dict(now=10 * 86400.0, drift_threshold=0.5, breach_windows=3, every_s=7 * 86400, cooldown_s=6 * H,
                in_window=True)
    args.update(kw)
    return decide(state, obs, **args)


def test_drift_beyond_the_threshold_triggers():
    assert _decide(obs=Observation(0.7, False)).trigger.startswith("traffic drift 0.70")
    assert _decide(obs=Observation(0.3, False)).trigger is None


def test_a_breach_must_last_before_it_triggers():
    s = DaemonState()
    for _ in range(2):
        d = _decide(s, Observation(0.0, True))
        assert d.trigger is None
        s = DaemonState(breach_streak=d.breach_streak)
    assert _decide(s, Observation(0.0, True)).trigger == "SLO missed in 3 windows in a row"
    assert _decide(s, Observation(0.0, False)).breach_streak == 0  # one good window resets the count
    assert _decide(s, Observation(0.0, None)).breach_streak == 2  # an empty window says nothing


def test_cooldown_and_windows_hold_triggers_but_not_requests():
    recent = DaemonState(last_tuning_end=10 * 86400.0 - H)
    held = _decide(recent, Observation(2.0, False))
    assert held.trigger is None and "cooldown" in held.waiting  # hysteresis: no back-to-back tunings
    assert _decide(recent, Observation(2.0, False), manual="by hand").trigger == "requested: by hand"
    night_only = _decide(obs=Observation(2.0, False), in_window=False)
    assert night_only.trigger is None and "tuning window" in night_only.waiting


def test_schedule_triggers_after_every():
    old = DaemonState(last_tuning_end=10 * 86400.0 - 8 * 86400)
    assert _decide(old).trigger.startswith("scheduled: 8.0 days")
    assert _decide(DaemonState(last_tuning_end=10 * 86400.0 - 86400)).trigger is None


def test_time_windows_cross_midnight():
    w = TimeWindow.parse("22:00-04:00", "x")
    assert w.contains(dt.time(23, 30)) and w.contains(dt.time(3, 0)) and not w.contains(dt.time(12, 0))
    with pytest.raises(ConfigError):
        TimeWindow.parse("25:00-26:00", "x")


def test_state_machine_refuses_illegal_transitions_and_survives_a_restart(tmp_path):
    store = StateStore(tmp_path)
    s = store.save(DaemonState().to(Phase.TUNING, study_name="p-tune-001"))
    with pytest.raises(IllegalTransition):
        s.to(Phase.VERIFYING)
    again = store.load()
    assert again.phase is Phase.TUNING and again.study_name == "p-tune-001"
    store.request_retune("drift seen by a person")
    assert store.take_retune_request() == "drift seen by a person" and store.take_retune_request() is None


def test_daemon_config_errors_say_what_to_write(tmp_path):
    p = tmp_path / "d.toml"
    p.write_text('slos = ["ttft<1s"]\n[production]\nurl = "http://x"\nrestart = "systemctl restart vllm"\n'
                 'config = "/etc/vllm/p.yaml"\nmodel = "m"\n[staging]\nstudy = "s.toml"\n')
    with pytest.raises(ConfigError, match="list of strings"):
        load_daemon_config(p)
    p.write_text('slos = ["ttft<1s"]\n[production]\nurl = "http://x"\nkind = "k8s"\n')
    with pytest.raises(ConfigError, match="'vllm-config', 'xinference' or 'blue-green'"):
        load_daemon_config(p)


# --- the whole loop ------------------------------------------------------------------------------

STAGING = """
name = "staging"
slos = ["ttft<500ms"]
seed = 0
storage = "sqlite:///{root}/studies.db"
runs_dir = "{root}/runs"

[engine]
command = "{python} -m autotune.sim.cli --gpu a10-24gb --time-scale 0.01 serve"
model = "llama-3.1-8b"
port = {port}
startup_timeout = "60s"

[engine.gpu]
name = "NVIDIA A10"
memory = "23028MiB"

[engine.args]
max_model_len = 8192
tokenizer = "{model}"

[space]
max_num_seqs = {{ type = "int", low = 2, high = 64, log = true, default = 64 }}

[workload]
scenario = "high-concurrency"
rate = 4
tokenizer = "{model}"

[objective]
max_steps = 2
step_duration = "2s"

[budget]
trials = 3

[baselines]
builtin = ["vllm-defaults"]

[remeasure]
top = 1
repeats = 1
"""

DAEMON = """
name = "prod"
slos = ["ttft<500ms"]

[production]
url = "http://127.0.0.1:{prod_port}"
config = "{root}/etc/production.yaml"
model = "llama-3.1-8b"
restart = {restart}
health_timeout = "10s"

[staging]
study = "{root}/staging.toml"

[watch]
window = "5s"

[triggers]
drift = 5.0
# four users in a closed loop on production's two sequences always leave requests waiting: a saturated
# production, which the daemon would rightly tune for on its own; these tests start tunings by request
breach_windows = 1000
cooldown = "1h"

[tuning]
canary_requests = 10

[publish]
approval = {approval}

[metrics]
listen = ""
"""


@pytest.fixture
def setup(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_STATE_DIR", str(tmp_path / "state"))
    prod_port = free_port()
    service = tmp_path / "service"
    config = tmp_path / "etc" / "production.yaml"
    config.parent.mkdir()
    # what production runs before autotune: two sequences at a time, far below what the GPU can do
    config.write_text(f"model: llama-3.1-8b\nmax-model-len: 8192\nmax-num-seqs: 2\ntokenizer: {tiny_model}\n")
    restart = [sys.executable, str(SERVICE), "restart", str(service), str(config), str(prod_port),
               "--gpu", "a10-24gb", "--time-scale", "0.01"]
    subprocess.run(restart, check=True)
    (tmp_path / "staging.toml").write_text(STAGING.format(root=tmp_path, python=sys.executable, port=free_port(),
                                                          model=tiny_model))

    def make(approval=False):
        import json
        (tmp_path / "daemon.toml").write_text(DAEMON.format(prod_port=prod_port, root=tmp_path, approval=str(approval).lower(),
                                                            restart=json.dumps(restart)))
        return load_daemon_config(tmp_path / "daemon.toml")

    daemons = []

    def daemon(cfg, **kw):
        """A Daemon the teardown stops as ``run`` would: its tuning child (and the staging engine in that
        child's process group), a publish in flight, the watcher; whatever assertion failed before."""
        d = Daemon(cfg, **kw)
        daemons.append(d)
        return d

    try:
        yield make, daemon, prod_port, config
    finally:
        for d in daemons:
            try:
                d.tuning.stop()
                d.publishing.pool.shutdown(wait=True)
                d.watcher.close()
            except Exception as e:  # the next daemon and production are stopped all the same
                print(f"teardown: stopping a daemon failed: {e!r}", file=sys.stderr)
        subprocess.run([sys.executable, str(SERVICE), "stop", str(service)], check=False)


class Traffic:
    """Production's users: a steady stream of short completions."""

    def __init__(self, port, users=4):
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(users)]

    def _run(self):
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                try:
                    c.post(self.url, json={"model": "llama-3.1-8b", "prompt": "hello " * 40, "max_tokens": 8,
                                           "ignore_eos": True})
                except httpx.HTTPError:
                    time.sleep(0.2)  # production restarting
                time.sleep(0.1)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


def _tick_until(daemon, phase, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        daemon.tick()
        if daemon.state.phase is phase:
            return
        time.sleep(0.5)
    raise AssertionError(f"daemon still {daemon.state.phase.value} ({daemon.state.note}) after {timeout} s")


def _tick_until_watched(daemon, timeout):
    """Ticks until the daemon has watched a full window of production traffic. Production is restarted as
    systemd restarts it, without waiting for it to serve, so the first scrapes may find nothing listening."""
    deadline = time.monotonic() + timeout
    while daemon.state.tuned_fingerprint is None or daemon.fingerprint is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"no full window of production traffic watched after {timeout} s ({daemon.state.note})")
        daemon.tick()
        time.sleep(0.5)


def test_the_daemon_tunes_on_request_and_publishes_a_verified_config(setup):
    make, daemon, prod_port, config = setup
    cfg = make()
    metrics = DaemonMetrics()
    with Traffic(prod_port):
        d = daemon(cfg, metrics=metrics)
        d._resume()
        assert [e.outcome for e in d.history.entries()] == ["adopted"]
        _tick_until_watched(d, 60)  # the fingerprint it is tuned for
        assert d.fingerprint.request_rate > 1
        StateStore(d.root).request_retune("test")
        d.tick()
        assert d.state.phase is Phase.TUNING and d.state.trigger == "requested: test"

        # a restarted daemon resumes the tuning from the state file (the study from its storage)
        d.tuning.stop()
        d = daemon(cfg, metrics=metrics)
        assert d.state.phase is Phase.TUNING
        _tick_until(d, Phase.PUBLISHING, 240)
        _tick_until(d, Phase.WATCHING, 120)
    entries = d.history.entries()
    assert [e.outcome for e in entries] == ["adopted", "published"], d.state.note
    assert "max-num-seqs: 2\n" not in config.read_text()  # production left its poor config
    assert entries[1].canary["slos"][0]["holds"]
    from prometheus_client import generate_latest
    text = generate_latest(metrics.registry).decode()
    assert 'autotune_publishes_total{outcome="published"} 1.0' in text
    assert 'autotune_daemon_phase{autotune_daemon_phase="watching"} 1.0' in text


def test_approval_mode_waits_for_a_person(setup):
    make, daemon, prod_port, config = setup
    cfg = make(approval=True)
    with Traffic(prod_port):
        d = daemon(cfg)
        d._resume()
        _tick_until_watched(d, 60)
        StateStore(d.root).request_retune("test")
        _tick_until(d, Phase.AWAITING_APPROVAL, 240)
        assert "max-num-seqs: 2\n" in config.read_text()  # nothing published without a person
        r = subprocess.run([sys.executable, "-m", "autotune", "publish", "--config", str(cfg.source), "--reject"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        _tick_until(d, Phase.WATCHING, 10)
    assert [e.outcome for e in d.history.entries()] == ["adopted", "rejected"]
    assert "max-num-seqs: 2\n" in config.read_text()
