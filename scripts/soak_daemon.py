#!/usr/bin/env python3
"""Soak the daemon: vllm-sim as production and staging, users' traffic that drifts twice, for --minutes.

    .venv/bin/python scripts/soak_daemon.py [--minutes 60] [--rate 4] [--dir DIR]

What runs, all on this host and all stopped at the end (also on Ctrl-C):

- production: a vllm-sim reading a YAML config (max-num-seqs 2 at first), restarted by the
  tests/fixtures/sim_service.py stand-in for `systemctl restart` (each restart leaves run-N.log);
- the daemon: `python -m autotune daemon --config DIR/daemon.toml`, its stdout and stderr (what
  journalctl would show) in DIR/journal.log; a 30 s window, drift 0.5, a 3-minute cooldown,
  tunings of 4 trials on a staging vllm-sim;
- users: an open-loop stream of completions at --rate req/s: short prompts first, then (after a
  third of the run) prompts four times longer with longer answers, then (after two thirds) three
  times the rate. Each change is a drift the daemon should tune for.

At the end it prints the tunings, publishes, rollbacks and failed requests, and checks that every
decision the state directory records has its journal line: each tuning started ("tuning NAME: ...")
and its verdict (a later line naming it), each history entry after the first ("entry N"). It exits 1
if one lacks its line, 0 otherwise. Not run in CI: it takes --minutes.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SERVICE = ROOT / "tests" / "fixtures" / "sim_service.py"
SIM = ["--gpu", "a10-24gb", "--time-scale", "0.01"]

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
trials = 4

[baselines]
builtin = ["vllm-defaults"]

[remeasure]
top = 1
repeats = 2
"""

DAEMON = """
name = "soak"
slos = ["ttft<500ms"]

[production]
url = "http://127.0.0.1:{port}"
config = "{root}/etc/production.yaml"
model = "llama-3.1-8b"
restart = {restart}
health_timeout = "60s"

[staging]
study = "{root}/staging.toml"

[watch]
scrape_interval = "2s"
window = "30s"

[triggers]
drift = 0.5
cooldown = "3m"
every = "0"

[tuning]
canary_requests = 30

[publish]
approval = false

[metrics]
listen = ""
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Users:
    """Open-loop users whose traffic drifts: ``shape(elapsed)`` gives (rate, prompt words, max tokens)."""

    def __init__(self, port: int, shape) -> None:
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.shape = shape
        self.sent = self.failed = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="user")
        self.client = httpx.Client(timeout=20, limits=httpx.Limits(max_connections=64))
        self.thread = threading.Thread(target=self.run, daemon=True)

    def one(self, words: int, tokens: int) -> None:
        try:
            ok = self.client.post(self.url, json={"model": "llama-3.1-8b", "prompt": "hello " * words,
                                                  "max_tokens": tokens, "ignore_eos": True}).status_code == 200
        except httpx.HTTPError:
            ok = False
        with self.lock:
            self.failed += not ok

    def run(self) -> None:
        t0 = next_at = time.monotonic()
        while not self.stop.is_set():
            rate, words, tokens = self.shape(time.monotonic() - t0)
            self.sent += 1
            self.pool.submit(self.one, words, tokens)
            next_at += 1.0 / rate
            self.stop.wait(max(next_at - time.monotonic(), 0))

    def __enter__(self) -> Users:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        self.pool.shutdown(wait=True, cancel_futures=True)  # requests not sent yet never will be
        self.client.close()


def wait_healthy(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"production did not come up on port {port}")


def tiny_model() -> Path:
    path = Path(os.environ.get("AUTOTUNE_TINY_MODEL", ROOT / "models" / "tiny-llama"))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_tiny_model.py"), str(path)], check=True,
                   stdout=subprocess.DEVNULL)
    return path


def report(root: Path, state: Path, journal: str, users: Users, restarts: int, minutes: float) -> int:
    daemon_dir = state / "daemon" / "soak"
    st = json.loads((daemon_dir / "state.json").read_text()) if (daemon_dir / "state.json").exists() else {}
    entries = [json.loads(p.read_text()) for p in sorted((daemon_dir / "history").glob("[0-9]*.json"))]
    outcomes: dict[str, int] = {}
    for e in entries:
        outcomes[e["outcome"]] = outcomes.get(e["outcome"], 0) + 1
    by_hand = sum(1 for e in entries if "rollback_to" in e.get("source", {}))
    tunings = sorted(p.stem for p in (daemon_dir / "tunings").glob("*.toml")) if (daemon_dir / "tunings").exists() else []
    lines = journal.splitlines()
    missing = []
    for name in tunings:
        said = [i for i, line in enumerate(lines) if name in line]
        if not any(f"tuning {name}: " in lines[i] for i in said):
            missing.append(f"{name}: no journal line for its start")
        elif name != st.get("study_name") or st.get("phase") != "tuning":  # finished: its verdict has a line too
            if len(said) < 2:
                missing.append(f"{name}: no journal line for its verdict")
    for e in entries[1:]:
        if not re.search(rf"\bentry {e['number']}\b", journal):
            missing.append(f"history entry {e['number']} ({e['outcome']}): no journal line names it")
    print(f"soak: {minutes:g} min, users sent {users.sent} requests, {users.failed} failed "
          f"({100 * users.failed / max(users.sent, 1):.2f} %)")
    print(f"soak: tunings {len(tunings)} (state: {st.get('tunings', 0)}), production restarts {restarts}")
    print("soak: history " + (", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) or "empty")
          + f"; rollbacks {outcomes.get('rolled-back', 0) + by_hand}")
    print(f"soak: journal {len(lines)} lines; daemon ended {st.get('phase', '?')}: {st.get('note', '')}")
    for m in missing:
        print(f"soak: MISSING {m}")
    print("soak: every decision has its journal line" if not missing else f"soak: {len(missing)} decisions unexplained")
    return 1 if missing else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=4.0, help="users' requests per second before the second drift")
    ap.add_argument("--dir", type=Path, default=None, help="where everything is kept (default: a new temp dir)")
    a = ap.parse_args()
    root = (a.dir or Path(tempfile.mkdtemp(prefix="autotune-soak-"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    state, service, model = root / "state", root / "service", tiny_model()
    port = free_port()
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc" / "production.yaml").write_text(f"model: llama-3.1-8b\nmax-model-len: 8192\nmax-num-seqs: 2\n"
                                                   f"tokenizer: {model}\n")
    restart = [sys.executable, str(SERVICE), "restart", str(service), str(root / "etc" / "production.yaml"),
               str(port), *SIM]
    (root / "staging.toml").write_text(STAGING.format(root=root, python=sys.executable, port=free_port(), model=model))
    (root / "daemon.toml").write_text(DAEMON.format(port=port, root=root, restart=json.dumps(restart)))
    print(f"soak: in {root} for {a.minutes:g} min; the journal: {root / 'journal.log'}", flush=True)

    seconds = a.minutes * 60

    def shape(t: float) -> tuple[float, int, int]:
        if t < seconds / 3:
            return a.rate, 40, 8
        if t < 2 * seconds / 3:
            return a.rate, 160, 64  # drift 1: longer prompts and answers
        return 3 * a.rate, 160, 64  # drift 2: three times the load

    subprocess.run(restart, check=True)
    daemon = None
    users = Users(port, shape)
    try:
        wait_healthy(port)
        env = {**os.environ, "AUTOTUNE_STATE_DIR": str(state), "PYTHONUNBUFFERED": "1"}
        with open(root / "journal.log", "wb") as journal, users:
            daemon = subprocess.Popen([sys.executable, "-m", "autotune", "daemon", "--config", str(root / "daemon.toml")],
                                      cwd=root, stdout=journal, stderr=subprocess.STDOUT, env=env)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and daemon.poll() is None:
                time.sleep(1.0)
            if daemon.poll() is not None:
                print(f"soak: the daemon exited early ({daemon.returncode})")
    except KeyboardInterrupt:
        print("soak: interrupted; stopping everything")
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(120)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        restarts = len(list(service.glob("run-*.log")))
        subprocess.run([sys.executable, str(SERVICE), "stop", str(service)], check=False)
    return report(root, state, (root / "journal.log").read_text(errors="replace"), users, restarts - 1, a.minutes)


if __name__ == "__main__":
    sys.exit(main())
