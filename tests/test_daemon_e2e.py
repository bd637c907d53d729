"""The daemon's wrong decisions of issue 15, end to end: its own loop, vllm-sim as production and as staging, real
traffic, and the commands an operator types.

Production is a vllm-sim reading a YAML config, restarted by the tests/fixtures/sim_service.py stand-in for
systemctl (each restart leaves a ``run-N.log``, so a test counts restarts); users send an open-loop stream of
short completions at a fixed rate (their failed requests are counted); the daemon ticks in this process, as in
tests/test_daemon.py, with a 4 s window. Reproduced, and checked not to happen any more:

- item 3: the canary's own requests read as production's traffic and start a drift tuning right after a publish;
- item 5: ``autotune rollback --to N``, N what production runs, restarts production (and fails requests);
- item 4: ``autotune retune`` outside the tuning windows is consumed and lost, and status says "watching".

Every process started here (production's vllm-sim, a tuning's child and its staging engine) is stopped in
the fixture's teardown.
"""

import datetime as dt
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from autotune.cli import main
from autotune.daemon.config import load_daemon_config
from autotune.daemon.loop import Daemon
from autotune.daemon.state import DaemonState, Phase
from tests.conftest import free_port
from tests.test_daemon import STAGING
from tests.test_publish import SERVICE

WINDOW_S = 4.0
TICK_S = 0.5
RATE = 5.0  # users' requests per second
CANARY = 40  # the canary's requests: 8 s of as many again as users send, enough to read as drift in a window

DAEMON = """
name = "prod"
slos = ["ttft<500ms"]

[production]
url = "http://127.0.0.1:{port}"
config = "{root}/etc/production.yaml"
model = "llama-3.1-8b"
restart = {restart}
health_timeout = "20s"

[staging]
study = "{root}/staging.toml"

[watch]
scrape_interval = "1s"
window = "{window:g}s"

[triggers]
drift = 0.5
cooldown = "0"
every = "0"

[tuning]
canary_requests = {canary}
{windows}

[publish]
approval = {approval}

[metrics]
listen = ""
"""


class Users:
    """Production's users: ``rate`` short completions a second, each sent on time whatever the last one does
    (open loop: a faster config does not change what they send). Counts what failed."""

    def __init__(self, port: int, rate: float = RATE) -> None:
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.rate = rate
        self.sent = self.failed = 0
        self._stop = threading.Event()
        # open loop for real: enough workers that a slow production never holds back what users send (with 16, a
        # saturated production saw at most 16 requests, and the rest waited in this pool, out of its sight)
        self._pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="user")
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=256))
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self) -> None:
        try:
            r = self._client.post(self.url, json={"model": "llama-3.1-8b", "prompt": "hello " * 40, "max_tokens": 8,
                                                  "ignore_eos": True})
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        with self._lock:
            self.failed += not ok

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            self.sent += 1
            self._pool.submit(self._one)
            self._stop.wait(max(t0 + self.sent / self.rate - time.monotonic(), 0))

    def __enter__(self) -> "Users":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()


class Prod:
    """Production (vllm-sim behind the systemctl stand-in), the staging study and a daemon file, with its daemon."""

    def __init__(self, root: Path, tiny_model: Path) -> None:
        self.root, self.port = root, free_port()
        self.service = root / "service"
        self.config = root / "etc" / "production.yaml"
        self.config.parent.mkdir()
        # what production runs before autotune: two sequences at a time
        self.config.write_text(f"model: llama-3.1-8b\nmax-model-len: 8192\nmax-num-seqs: 2\ntokenizer: {tiny_model}\n")
        self.restart = [sys.executable, str(SERVICE), "restart", str(self.service), str(self.config), str(self.port),
                        "--gpu", "a10-24gb", "--time-scale", "0.01"]
        (root / "staging.toml").write_text(STAGING.format(root=root, python=sys.executable, port=free_port(),
                                                          model=tiny_model))
        self.path = root / "daemon.toml"
        self.daemons: list[Daemon] = []

    def start(self) -> None:
        import subprocess

        subprocess.run(self.restart, check=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"production's vllm-sim did not come up: {self.logs()}")

    def write(self, *, windows: str = "", approval: bool = False) -> Path:
        self.path.write_text(DAEMON.format(port=self.port, root=self.root, restart=json.dumps(self.restart),
                                           window=WINDOW_S, canary=CANARY, windows=windows,
                                           approval=str(approval).lower()))
        return self.path

    def daemon(self) -> Daemon:
        d = Daemon(load_daemon_config(self.path))
        self.daemons.append(d)
        d._resume()  # what `run` does first: production's config adopted as entry 1
        return d

    def restarts(self) -> int:
        return len(list(self.service.glob("run-*.log")))

    def pid(self) -> int:
        return int((self.service / "pid").read_text())

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace")[-1500:] for p in sorted(self.service.glob("run-*.log")))

    def close(self) -> None:
        import subprocess

        for d in self.daemons:  # what `run` does when it stops: the tuning's child, a publish in flight, the watcher
            d.tuning.stop()
            d.publishing.pool.shutdown(wait=True)
            d.watcher.close()
        subprocess.run([sys.executable, str(SERVICE), "stop", str(self.service)], check=False)


def running(tmp_path: Path, tiny_model: Path, max_num_seqs: int = 2):
    """Production started with ``max_num_seqs`` sequences at a time, stopped (with what it started) at the end."""
    p = Prod(tmp_path, tiny_model)
    p.config.write_text(f"model: llama-3.1-8b\nmax-model-len: 8192\nmax-num-seqs: {max_num_seqs}\n"
                        f"tokenizer: {tiny_model}\n")
    try:
        p.start()
        yield p
    finally:
        p.close()


@pytest.fixture
def prod(tmp_path, tiny_model, state_dir):
    yield from running(tmp_path, tiny_model)


def ticks(d: Daemon, seconds: float, until=lambda d: False) -> list[tuple[str, str]]:
    """Tick every TICK_S for ``seconds`` (or until ``until(d)``); each (phase, note) the daemon went through."""
    seen: list[tuple[str, str]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        d.tick()
        now = (d.state.phase.value, d.state.note)
        if not seen or seen[-1] != now:
            seen.append(now)
        if until(d):
            break
        time.sleep(TICK_S)
    return seen


def watched_a_full_window(d: Daemon) -> bool:
    return d.fingerprint is not None and d.state.tuned_fingerprint is not None


def cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(x) for x in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# -- items 3 and 5: the canary after a publish, and a rollback to what production runs ---------------------------

def test_the_canary_starts_no_tuning_and_a_rollback_to_the_live_entry_restarts_nothing(prod, capsys):
    path = prod.write(approval=True)
    d = prod.daemon()
    assert [e.outcome for e in d.history.entries()] == ["adopted"]
    # a proposal waits (a tuning found it; its numbers do not matter here): a person approves it below
    adopted = d.history.entries()[0].values  # production's whole config, as a tuning's winner carries it
    proposal = d.history.add("proposed", {**adopted, "max_num_seqs": 32},
                             source={"study": "prod-tune-001", "trial": 3, "capacity_rps": 9.0})
    d.state = d.store.save(DaemonState(phase=Phase.AWAITING_APPROVAL, since=time.time(), tunings=1,
                                       study_name="prod-tune-001", note=f"entry {proposal.number} waits"))
    with Users(prod.port) as users:
        ticks(d, 30, until=watched_a_full_window)
        assert watched_a_full_window(d), d.state.note
        assert d.fingerprint.request_rate == pytest.approx(RATE, rel=0.3)

        code, out, err = cli(capsys, "publish", "--config", path, "--approve", "--no-wait")
        assert code == 0, err
        restarts = prod.restarts()
        seen = ticks(d, 90, until=lambda d: d.state.phase is Phase.WATCHING)
        assert [p for p, _ in seen][:3] == ["publishing", "verifying", "watching"], seen
        assert d.history.get(proposal.number).outcome == "published", d.state.note
        assert prod.restarts() == restarts + 1 and "max-num-seqs: 32" in prod.config.read_text()

        # three windows of users' traffic after the canary: none may read the canary as drift
        after = ticks(d, 3 * WINDOW_S + 2)
        assert d.state.phase is Phase.WATCHING and d.state.tunings == 1, after
        assert not [n for _, n in after if "drift" in n], after
        assert d.fingerprint is not None and d.fingerprint.request_rate == pytest.approx(RATE, rel=0.3)

        # item 5: rolling back to the entry production runs changes nothing and restarts nothing
        pid, restarts, failed = prod.pid(), prod.restarts(), users.failed
        code, out, err = cli(capsys, "rollback", "--config", path, "--to", proposal.number)
        assert code == 0, err
        assert out.strip() == (f"autotune: production already runs entry {proposal.number}'s config: nothing changed, "
                               "nothing restarted"), out
        ticks(d, 2 * WINDOW_S)
        assert (prod.pid(), prod.restarts()) == (pid, restarts)
        assert users.failed == failed, "requests failed around a rollback that had nothing to do"
        assert [e.outcome for e in d.history.entries()] == ["adopted", "published"]
        assert d.state.phase is Phase.WATCHING and "drift" not in d.state.note, d.state.note
    print(f"users: {users.failed} of {users.sent} requests failed (production's restart for the publish, in place)")


# -- item 4: a retune outside the tuning windows waits for one ------------------------------------------------------

def _closed_window() -> str:
    """A tuning window that is not now (an hour long, starting two hours from now)."""
    start = (dt.datetime.now() + dt.timedelta(hours=2)).time()
    end = (dt.datetime.now() + dt.timedelta(hours=3)).time()
    return f'windows = ["{start:%H:%M}-{end:%H:%M}"]'


def test_a_retune_outside_the_windows_stays_pending_and_status_says_so(prod, capsys):
    path = prod.write(windows=_closed_window())
    d = prod.daemon()
    with Users(prod.port):
        code, out, err = cli(capsys, "retune", "--config", path, "--reason", "e2e")
        assert code == 0, err
        assert "pending: outside the tuning windows" in out, out
        seen = ticks(d, 30, until=watched_a_full_window)
        seen += ticks(d, WINDOW_S)  # the request is seen with a full window of traffic to imitate: only the window holds it
        assert d.state.phase is Phase.WATCHING, seen
        assert d.store.retune_request() == "e2e", "the request was consumed and lost"
        assert "requested: e2e; held until a tuning window opens (" in d.state.note, seen

        code, out, err = cli(capsys, "status", "--config", path)
        assert code == 0, err
        line = next((x for x in out.splitlines() if x.startswith("retune:")), out)
        assert line.startswith("retune: requested (e2e), pending: outside the tuning windows ("), out

        # `systemctl reload` with the windows gone: the pending request starts its tuning, and only then is taken
        prod.write(windows="")
        d.reload()
        ticks(d, 10, until=lambda d: d.state.phase is Phase.TUNING)
        assert d.state.phase is Phase.TUNING and d.state.trigger == "requested: e2e", d.state.note
        assert d.store.retune_request() is None
        d.tuning.stop()  # the tuning's staging engine is stopped with it (the fixture checks again)
