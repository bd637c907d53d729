"""scripts/drill_daemon.py: the operator's drill of the daemon, all eleven scenarios, on a host with one core kept
busy on purpose.

Real nginx with the shipped snippet in front of blue/green vllm-sim, the daemon as its own process, users
streaming through nginx: steady traffic, a surge past capacity that the tuning must imitate at 75 % of the
offered rate at least, SIGTERM mid-tuning (exit 0, no staging engine left), approve, roll back, reload, a second
surge and its proposal, kill -9 of the daemon during a canary and after a switch, a kill -9 of the serving color
(one journal line naming it), and a proxy config nginx rejects. A production host is never idle, so the drill
runs beside a process that spins one of the host's cores: the daemon's decisions must not depend on which of its
timers fires first. And a SIGTERM to the drill itself stops everything it started.
"""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
DRILL = ROOT / "scripts" / "drill_daemon.py"
SCENARIOS = ("steady traffic", "surge past capacity", "SIGTERM mid-tuning", "approve the proposal",
             "roll back by hand", "reload with a new SLO", "a second surge, a new proposal",
             "kill -9 during the canary", "kill -9 after the switch", "crash of the serving color",
             "a proxy config nginx rejects")
# users' requests may fail only where the serving engine is killed on purpose: nothing but a second serving
# instance would save those it held
MAY_FAIL = {"crash of the serving color"}

# real-time vllm-sim and a real daemon whose scenarios wait on its timers: beside other tests the host's load
# would be theirs, not the one core this test spins on purpose
pytestmark = [pytest.mark.engine, pytest.mark.alone, pytest.mark.timeout(1500)]


def _leftovers(root: Path) -> list[str]:
    """Processes whose command line names the drill's directory (its daemon, nginx, vllm-sim instances)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if str(root) in cmdline:
            found.append(cmdline[:200])
    return found


def test_the_full_drill_passes_every_check_with_one_core_busy(tmp_path, tiny_model):
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        r = subprocess.run([sys.executable, str(DRILL), "--dir", str(tmp_path / "drill"), "--tokenizer",
                            str(tiny_model)], cwd=ROOT, capture_output=True, text=True, timeout=1400)
    finally:
        spinner.kill()
        spinner.wait()
    print(r.stdout, r.stderr[-4000:])
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    table = r.stdout.split("what the daemon said")[0]
    rows = {line[:30].strip(): line[30:] for line in table.splitlines()}
    for name in SCENARIOS:
        assert name in rows and "  ok " in rows[name], (name, r.stdout)
    failed = {name: re.match(r"\s*(\d+)/(\d+)\s", rows[name]).groups() for name in SCENARIOS}
    assert all(int(f) == 0 for name, (f, _) in failed.items() if name not in MAY_FAIL), failed
    assert all(int(sent) > 0 for _, sent in failed.values()), failed
    assert re.search(r"imitated [\d.]+ of 12 req/s offered", rows["surge past capacity"])
    assert "1 journal line(s) while it was down" in rows["crash of the serving color"]
    assert not _leftovers(tmp_path / "drill")


def test_a_sigterm_to_the_drill_stops_everything_it_started(tmp_path, tiny_model):
    root = tmp_path / "drill"
    p = subprocess.Popen([sys.executable, str(DRILL), "--short", "--dir", str(root), "--tokenizer", str(tiny_model)],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (root / "journal-1.log").exists() or not _leftovers(root):  # the daemon and production run
            assert p.poll() is None and time.monotonic() < deadline, p.stdout.read() if p.poll() is not None else ""
            time.sleep(0.5)
        time.sleep(3)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert not _leftovers(root), out[-3000:]
