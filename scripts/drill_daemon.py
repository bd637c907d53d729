#!/usr/bin/env python3
"""An operator's drill of the daemon: what users see while it is surged, approved, rolled back, reloaded, stopped,
killed and broken, on a blue/green production behind real nginx.

    .venv/bin/python scripts/drill_daemon.py [--short] [--dir DIR] [--tokenizer DIR]

What runs, all on this host and all stopped at the end (also on Ctrl-C or SIGTERM):

- production: blue and green vllm-sim instances (an 8B on a simulated A10; start-up x0.01, serving in real
  time) behind nginx with the shipped snippet (systemd/nginx-autotune.conf, its arrivals log included), started
  and stopped by tests/fixtures/sim_service.py, the stand-in for systemctl. Blue serves first, two sequences at
  a time: a config a surge saturates.
- the daemon: `python -m autotune daemon --config DIR/daemon.toml` as its own process (its journal in
  DIR/journal-N.log), approval on, an 8 s window, tunings of three trials on a staging vllm-sim.
- users: an open loop of short streamed completions through nginx, each one's outcome kept.

Scenarios, in order (--short: the first three, the crash and the broken proxy, about two minutes; the rest
runs a real tuning three times, about ten): steady traffic; a surge past capacity (the tuning must imitate at
least 75 % of what users offered: it starts within seconds of the surge, and one of that window's 1 s scrape
intervals straddles the change); SIGTERM mid-tuning and a restart that resumes it; approve the proposal;
roll back by hand; reload with a changed SLO; kill -9 of the daemon during a canary and after a switch;
a crash of the serving color; a proxy config nginx rejects. Each prints one row: users' requests failed
during it (publishes, rollbacks and daemon kills must fail none), what the daemon decided, and the
scenario's own check. Exits 1 when a check fails. Needs nginx (scripts/ci_system_deps.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the test rig: real nginx plus vllm-sim instances behind tests/fixtures/sim_service.py (systemctl's stand-in)
from autotune.publish.history import Entry, History  # noqa: E402
from tests import bluegreen_rig as rig  # noqa: E402
from tests.test_daemon import STAGING  # noqa: E402  (the daemon tests' staging study: vllm-sim, 3 trials)

PY = sys.executable
BLUE = {"max_model_len": 8192, "max_num_seqs": 2, "gpu_memory_utilization": 0.9}
STEADY, SURGE, AFTER = 2.0, 12.0, 3.0  # users' request rates: before, during and after the surge


@dataclass
class Users:
    """An open loop of short completions through the proxy; every request's (sent, ended, ok) is kept."""

    url: str
    rate: float
    log: list[tuple[float, float, str]] = field(default_factory=list)  # (sent, ended, why it failed or "")

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="user")
        self._client = httpx.Client(timeout=20, limits=httpx.Limits(max_connections=256), trust_env=False)
        self._lock = threading.Lock()
        self._in_flight: set[float] = set()  # when each request still running was sent
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _one(self, t0: float) -> None:
        try:
            with self._client.stream("POST", f"{self.url}/v1/completions", json={
                    "model": "llama-3.1-8b", "prompt": "hello " * 40, "max_tokens": 8, "ignore_eos": True,
                    "stream": True}) as r:
                body = "".join(r.iter_text())
                why = "" if r.status_code == 200 and "[DONE]" in body else f"HTTP {r.status_code}: {body[:80]}"
        except httpx.HTTPError as e:
            why = f"{type(e).__name__}: {e}"[:120]
        with self._lock:
            self.log.append((t0, time.time(), why))
            self._in_flight.discard(t0)

    def _run(self) -> None:
        t, sent = time.monotonic(), 0
        while not self._stop.is_set():
            sent += 1
            t0 = time.time()
            with self._lock:
                self._in_flight.add(t0)
            self._pool.submit(self._one, t0)
            t += 1.0 / self.rate  # a new rate applies from the next request on
            self._stop.wait(max(t - time.monotonic(), 0))

    def failed(self, t0: float, t1: float) -> tuple[int, int, str]:
        """(failed, sent, the first failure's error) among the requests sent between t0 and t1 (wall clock), once
        all of them have ended (the client's timeout at most)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with self._lock:
                if not any(t0 <= t <= t1 for t in self._in_flight):
                    break
            time.sleep(0.1)
        with self._lock:
            seen = [why for sent, _, why in self.log if t0 <= sent <= t1]
        errors = [why for why in seen if why]
        return len(errors), len(seen), errors[0] if errors else ""

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()


@dataclass
class Row:
    started: float  # wall clock
    ended: float
    scenario: str
    failed: int
    sent: int
    decided: str
    check: str
    ok: bool


class Drill:
    def __init__(self, root: Path, tokenizer: Path) -> None:
        self.root, self.tokenizer = root, tokenizer
        self.nginx = rig.Nginx(root / "nginx", free_port(), root / "nginx" / "vllm-upstream.conf")
        ports = {"blue": free_port(), "green": free_port()}
        self.desc = {**rig.rig_description(root, self.nginx, ports), "tokenizer": str(tokenizer)}
        self.target = rig.make_target(self.desc)
        self.metrics_port = free_port()
        self.staging_port = free_port()
        self.config = root / "daemon.toml"
        self.state = root / "state" / "daemon" / "prod"
        self.daemon: subprocess.Popen | None = None
        self.starts = 0
        self.journal_at = 0
        self.rows: list[Row] = []
        self.users: Users | None = None

    # -- set-up ------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.target.colors["blue"].server.deploy({**BLUE, "tokenizer": str(self.tokenizer)})
        self.nginx.upstream_file.parent.mkdir(parents=True, exist_ok=True)
        self.nginx.upstream_file.write_text(f"server {self.target.colors['blue'].backend} max_fails=0;\n")
        self.nginx.start()
        # four load steps, not the daemon tests' two: a saturated production's demand is imitated at what the proxy
        # has logged (a request is logged as it ends), 75-100 % of it, and two steps from there can end below where
        # production's config misses: the daemon then rightly states no gain, and the drill has no proposal
        staging = STAGING.format(root=self.root, python=PY, port=self.staging_port, model=self.tokenizer)
        (self.root / "staging.toml").write_text(staging.replace("max_steps = 2", "max_steps = 4"))
        self.write_config(slo="ttft<2s")
        self.users = Users(self.nginx.url, STEADY)
        self.start_daemon()

    def write_config(self, slo: str) -> None:
        import tomli_w

        production = {"url": self.nginx.url, "kind": "blue-green", "model": "llama-3.1-8b", "verify_window": "4s",
                      "health_timeout": "20s",
                      "proxy": {"kind": "nginx", "upstream_file": self.desc["upstream_file"],
                                "test": self.desc["test"], "reload": self.desc["reload"], "switch_timeout": "15s"}}
        for name, c in self.target.colors.items():
            production[name] = {"config": str(c.server.config_path), "url": c.url, "start": list(c.server.restart),
                                "stop": list(c.stop_argv)}
        data = {"name": "prod", "slos": [slo], "state_dir": str(self.root / "state"), "production": production,
                "staging": {"study": str(self.root / "staging.toml")},
                "watch": {"scrape_interval": "1s", "window": "8s", "arrivals_log": str(self.nginx.arrivals_log)},
                "triggers": {"drift": 0.5, "cooldown": "0", "every": "0"},
                "tuning": {"canary_requests": 20}, "publish": {"approval": True},
                "metrics": {"listen": f"127.0.0.1:{self.metrics_port}"}}
        self.config.write_text(tomli_w.dumps(data))

    def start_daemon(self) -> None:
        self.starts += 1
        log = open(self.root / f"journal-{self.starts}.log", "w")  # noqa: SIM115  # the process holds it
        self.daemon = subprocess.Popen([PY, "-m", "autotune", "daemon", "--config", str(self.config)], cwd=ROOT,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.journal_at = 0
        self.wait(lambda: self.phase() is not None, 60, "the daemon wrote no state")

    def close(self) -> None:
        if self.users is not None:
            self.users.close()
            with open(self.root / "users.jsonl", "w") as f:  # every request: when it left and ended, why it failed
                for sent, ended, why in sorted(self.users.log):
                    f.write(json.dumps({"sent": sent, "ended": ended, "error": why}) + "\n")
            with open(self.root / "scenarios.jsonl", "w") as f:
                for r in self.rows:
                    f.write(json.dumps(vars(r)) + "\n")
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.daemon.pid, signal.SIGKILL)
        self.nginx.stop()
        for c in self.target.colors.values():
            self.target.stop_quietly(c)

    # -- what the daemon says and keeps -------------------------------------------------------------------

    def state_json(self) -> dict:
        try:
            return json.loads((self.state / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def phase(self) -> str | None:
        return self.state_json().get("phase")

    def journal(self) -> list[str]:
        """The journal lines since the last call."""
        text = (self.root / f"journal-{self.starts}.log").read_text(errors="replace")
        lines = text[self.journal_at:].splitlines()
        self.journal_at = len(text)
        return [x for x in lines if x.strip()]

    def history(self) -> list[Entry]:
        return History(self.state / "history").entries()

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([PY, "-m", "autotune", *args, "--config", str(self.config)], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)

    def live(self) -> str:
        return self.target.live().name

    def wait(self, cond: Callable[[], bool], seconds: float, what: str) -> None:
        deadline = time.monotonic() + seconds
        while not cond():
            if self.daemon is not None and self.daemon.poll() is not None and self.daemon.returncode not in (0,):
                raise RuntimeError(f"the daemon exited {self.daemon.returncode} while waiting: {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} (after {seconds:.0f} s)")
            time.sleep(0.2)

    # -- the scenarios ------------------------------------------------------------------------------------

    def scenario(self, name: str, run: Callable[[], tuple[str, str, bool]], may_fail_requests: bool = False) -> None:
        t0 = time.time()
        try:
            decided, check, ok = run()
        except RuntimeError as e:
            decided, check, ok = "", f"did not happen: {e}", False
        time.sleep(1.0)  # requests sent just before the end finish
        failed, sent, first = self.users.failed(t0, time.time())
        if not may_fail_requests and failed:
            ok = False
            check += f"; first failed request: {first}"
        self.rows.append(Row(t0, time.time(), name, failed, sent, decided, check, ok))
        print(f"drill: {name}: {'ok' if ok else 'FAILED'}: {check}", file=sys.stderr, flush=True)

    def steady(self) -> tuple[str, str, bool]:
        time.sleep(12)
        phase = self.phase()
        return self._said(), f"phase {phase}", phase == "watching"

    def surge(self) -> tuple[str, str, bool]:
        self.users.rate = SURGE
        self.wait(lambda: self.phase() == "tuning", 90, "no tuning started")
        self.users.rate = AFTER
        imitated = (self.state_json().get("imitated") or {}).get("request_rate") or 0.0
        return (self._said(), f"imitated {imitated:.1f} of {SURGE:g} req/s offered ({imitated / SURGE:.0%})",
                imitated >= 0.75 * SURGE)

    def sigterm_mid_tuning(self) -> tuple[str, str, bool]:
        self.daemon.send_signal(signal.SIGTERM)
        rc = self.daemon.wait(90)
        staging_free = _port_free(self.staging_port)
        said = self._said()
        if self.short:
            return said, f"exit {rc}; staging engine {'stopped' if staging_free else 'LEFT RUNNING'}", \
                rc == 0 and staging_free
        self.start_daemon()
        self.wait(lambda: "resum" in " ".join(self.journal_peek()), 60, "the restarted daemon did not resume")
        return said, f"exit {rc}; staging engine {'stopped' if staging_free else 'LEFT RUNNING'}; resumed", \
            rc == 0 and staging_free

    def journal_peek(self) -> list[str]:
        return (self.root / f"journal-{self.starts}.log").read_text(errors="replace").splitlines()

    def approve(self) -> tuple[str, str, bool]:
        self.wait(lambda: self.phase() == "awaiting_approval", 300, "no proposal")
        before = self.live()
        proposal = [e for e in self.history() if e.outcome == "proposed"][-1]
        production = [e for e in self.history() if e.outcome in ("adopted", "published")][-1]
        changed = sorted(k for k in set(proposal.values) | set(production.values)
                         if proposal.values.get(k) != production.values.get(k))
        r = self.cli("publish", "--approve")
        after = self.live()
        return (self._said(), f"diff {changed}; {before} -> {after}; publish exit {r.returncode}",
                r.returncode == 0 and after != before and changed == ["max_num_seqs"])

    def rollback(self) -> tuple[str, str, bool]:
        before = self.live()
        r = self.cli("rollback")
        self.wait(lambda: self.phase() == "watching", 60, "the daemon did not settle")
        after = self.live()
        return self._said(), f"{before} -> {after}; rollback exit {r.returncode}", r.returncode == 0 and after != before

    def reload(self) -> tuple[str, str, bool]:
        self.write_config(slo="ttft<3s")
        self.daemon.send_signal(signal.SIGHUP)
        time.sleep(4)
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        met = re.findall(r'autotune_production_slo_met\{slo="([^"]+)"\}', text)
        return self._said(), f"slo_met gauges: {sorted(set(met))}", set(met) == {"p95:ttft<3s"}

    def surge_again(self) -> tuple[str, str, bool]:
        """Users surge past the rolled-back config again and a person asks for a tuning: a new proposal."""
        self.users.rate = SURGE
        time.sleep(6)
        r = self.cli("retune", "--reason", "drill: a second surge")
        self.wait(lambda: self.phase() == "tuning", 60, "no tuning started")
        self.users.rate = AFTER
        self.wait(lambda: self.phase() == "awaiting_approval", 300, "no proposal")
        number = [e for e in self.history() if e.outcome == "proposed"][-1].number
        return self._said(), f"entry {number} proposed", r.returncode == 0

    def kill_9_at(self, step: str, outcome: str) -> Callable[[], tuple[str, str, bool]]:
        """Approve the proposal, kill -9 the daemon once the publish reaches ``step``, start it again: it settles
        the publish to ``outcome`` with one color serving."""
        def run() -> tuple[str, str, bool]:
            self.wait(lambda: self.phase() == "awaiting_approval", 60, "no proposal to approve")
            number = [e for e in self.history() if e.outcome == "proposed"][-1].number
            self.cli("publish", "--approve", "--no-wait")
            self.wait(lambda: (self._entry(number).switch or {}).get("step") == step, 120,
                      f"the publish never reached {step}")
            os.kill(self.daemon.pid, signal.SIGKILL)
            self.daemon.wait(10)
            said = self._said()
            self.start_daemon()
            self.wait(lambda: self._entry(number).outcome not in ("proposed", "pending"), 120, "no recovery")
            time.sleep(2)
            serving = [name for name, c in self.target.colors.items() if rig.color_serving(c.url)]
            said = said + " | " + self._said()
            got = self._entry(number).outcome
            return said, f"entry {number}: {got}; serving {serving}", got == outcome and len(serving) == 1
        return run

    def _entry(self, number: int) -> Entry:
        return History(self.state / "history").get(number)

    def crash_serving_color(self) -> tuple[str, str, bool]:
        color = self.target.live()
        pid = int((Path(self.desc[color.name]["state"]) / "pid").read_text())
        os.killpg(pid, signal.SIGKILL)
        time.sleep(4)
        down = [x for x in self.journal() if "cannot scrape production" in x]
        subprocess.run(list(color.server.restart), check=True, capture_output=True)  # systemd's Restart=on-failure
        self.wait(lambda: any("scraping production works again" in x for x in self.journal_peek()), 60,
                  "scraping never worked again")
        self._said()
        return (" | ".join(down), f"{len(down)} journal line(s) while it was down",
                len(down) == 1 and f"{color.name} (" in down[0] and "does not answer /health" in down[0])

    def broken_proxy(self) -> tuple[str, str, bool]:
        conf = self.nginx.prefix / "autotune-vllm.conf"
        good = conf.read_text()
        conf.write_text(good + "\nthis is not nginx;\n")
        try:
            r = self.cli("daemon", "--check", timeout=120)
            lines = [x for x in r.stderr.splitlines() if ": proxy config: " in x]
            serving = rig.color_serving(self.nginx.url)
        finally:
            conf.write_text(good)
        return (lines[0][:160] if lines else r.stderr[-160:], f"check exit {r.returncode}; production serving: "
                f"{serving}", r.returncode == 1 and len(lines) == 1 and serving)

    def _said(self) -> str:
        lines = [re.sub(r"^autotune: ", "", x) for x in self.journal()]
        return " | ".join(x[:140] for x in lines[-3:])

    def run(self, short: bool) -> int:
        self.short = short
        self.start()
        self.scenario("steady traffic", self.steady)
        self.scenario("surge past capacity", self.surge, may_fail_requests=True)
        self.scenario("SIGTERM mid-tuning", self.sigterm_mid_tuning, may_fail_requests=True)
        if not short:
            self.scenario("approve the proposal", self.approve)
            self.scenario("roll back by hand", self.rollback)
            self.scenario("reload with a new SLO", self.reload)
            self.scenario("a second surge, a new proposal", self.surge_again, may_fail_requests=True)
            # cut before users saw it: rolled back, and proposed again for a person to approve again
            self.scenario("kill -9 during the canary", self.kill_9_at("canary", "rolled-back"))
            self.scenario("kill -9 after the switch", self.kill_9_at("verifying", "published"))
        if self.daemon is None or self.daemon.poll() is not None:
            self.start_daemon()
        self.scenario("crash of the serving color", self.crash_serving_color, may_fail_requests=True)
        self.scenario("a proxy config nginx rejects", self.broken_proxy)
        return 0 if all(r.ok for r in self.rows) else 1


def free_port() -> int:
    """A port the kernel just had free (the ephemeral range: apart from the test suite's blocks, tests/conftest.py)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def print_table(rows: list[Row]) -> None:
    print(f"{'scenario':30} {'failed':>11}  {'ok':4} check")
    for r in rows:
        print(f"{r.scenario:30} {f'{r.failed}/{r.sent}':>11}  {'ok' if r.ok else 'FAIL':4} {r.check}")
    print("\nwhat the daemon said, per scenario:")
    for r in rows:
        print(f"  {r.scenario}: {r.decided or '(nothing)'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="steady, surge, SIGTERM, crash, broken proxy (~2 min)")
    p.add_argument("--dir", type=Path, help="keep everything here (default: a temporary directory)")
    p.add_argument("--tokenizer", type=Path, help="a local tokenizer (default: the tiny model, built here)")
    a = p.parse_args(argv)
    root = a.dir or Path(tempfile.mkdtemp(prefix="autotune-drill-"))
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = a.tokenizer
    if tokenizer is None:
        tokenizer = root / "models" / "tiny-llama"
        subprocess.run([PY, str(ROOT / "scripts" / "build_tiny_model.py"), str(tokenizer)], check=True,
                       stdout=subprocess.DEVNULL)
    drill = Drill(root, tokenizer)
    # SIGTERM (a CI runner's timeout, `kill`) and SIGINT, even where a non-interactive shell started the drill in
    # the background with SIGINT ignored, unwind through drill.close(): no engine, nginx or daemon outlives it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    try:
        code = drill.run(a.short)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the clean-up short
            signal.signal(signum, signal.SIG_IGN)
        drill.close()
    print_table(drill.rows)
    print(f"\n(journals and state in {root})")
    return code


if __name__ == "__main__":
    sys.exit(main())
