"""The shipped systemd units and polkit rule, checked by the real tools.

- ``systemd-analyze verify`` on both units: no errors, no warnings.
- ``systemd-analyze security --offline=yes``: exposure 3.0 or lower (lower is safer).
- vllm@.service's ExecStartPost health wait, run for real against a local HTTP server.
- The polkit rule: text checks, and when ``node`` is installed, the rule itself evaluated
  with a fake ``polkit`` object.

systemd-analyze comes from the Debian package ``systemd`` (scripts/ci_system_deps.sh).
"""

from __future__ import annotations

import http.server
import json
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "systemd"
AUTOTUNE_UNIT = UNITS / "autotune.service"
VLLM_UNIT = UNITS / "vllm@.service"
POLKIT_RULE = UNITS / "50-autotune-vllm.rules"
MAX_EXPOSURE = 3.0

# Where the units expect the two virtual environments on a host.
VENV_BINS = ("/opt/autotune/.venv/bin/", "/opt/vllm/.venv/bin/")


@pytest.fixture(scope="module")
def analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.fail("systemd-analyze is not installed: run scripts/ci_system_deps.sh (Debian package systemd)")
    return exe


def directives(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment, in order (repeated keys kept)."""
    out, section = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def values(path: Path, key: str) -> list[str]:
    return [v for _, k, v in directives(path) if k == key]


@pytest.fixture(scope="module")
def unit_dir(tmp_path_factory) -> Path:
    """The units, copied, with only the venv prefix of their Exec*= lines changed.

    ``systemd-analyze verify`` checks that every Exec*= binary exists and is executable, and
    /opt/autotune and /opt/vllm do not exist on a test machine. So, in the copies only,
    ``/opt/<x>/.venv/bin/`` becomes a temp bin directory whose ``autotune``, ``vllm`` and
    ``python`` are symlinks to this interpreter (an existing executable: all verify looks
    at). Everything else in the text is the shipped unit, byte for byte.
    """
    d = tmp_path_factory.mktemp("units")
    bin_dir = d / "bin"
    bin_dir.mkdir()
    for name in ("autotune", "vllm", "python"):
        (bin_dir / name).symlink_to(sys.executable)
    for unit in (AUTOTUNE_UNIT, VLLM_UNIT):
        text = unit.read_text()
        for prefix in VENV_BINS:
            text = text.replace(prefix, f"{bin_dir}/")
        assert not [x for x in text.splitlines() if x.startswith("Exec") and "/opt/" in x]
        (d / unit.name).write_text(text)
    return d


def _missing_user_line(line: str) -> bool:
    """A complaint about User=autotune / User=vllm when that user does not exist here.

    systemd 252's verify does not resolve User=, so this matches nothing today; a newer
    systemd may, and a missing *account* on a test machine is not a defect of the unit.
    Only that exact situation is tolerated: any other message fails the test.
    """
    for user in ("autotune", "vllm"):
        try:
            pwd.getpwnam(user)
            continue
        except KeyError:
            pass
        if re.search(rf"\buser\b.*\b{user}\b|\b{user}\b.*\buser\b", line, re.IGNORECASE):
            return True
    return False


@pytest.mark.parametrize("unit", ["autotune.service", "vllm@production.service"])
def test_verify_reports_nothing(analyze, unit_dir, unit):
    # vllm@production.service has no file of its own: verify loads the template
    # vllm@.service from the same directory and instantiates it (%i = production).
    r = subprocess.run([analyze, "verify", "--man=no", str(unit_dir / unit)],
                       check=False, capture_output=True, text=True, timeout=120)
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    complaints = [x for x in lines if not _missing_user_line(x)]
    assert r.returncode == 0, r.stdout + r.stderr
    assert complaints == [], "\n".join(complaints)


def test_verify_would_catch_a_broken_unit(analyze, unit_dir, tmp_path):
    """The check above is not vacuous: the same call flags a typo and a missing binary."""
    broken = unit_dir.joinpath("autotune.service").read_text()
    broken = broken.replace("KillMode=mixed", "KillMode=mixd")
    broken = broken.replace(f"{unit_dir}/bin/autotune", "/nonexistent/autotune")
    (tmp_path / "autotune.service").write_text(broken)
    r = subprocess.run([analyze, "verify", "--man=no", str(tmp_path / "autotune.service")],
                       check=False, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert "mixd" in out and "/nonexistent/autotune" in out, out


def exposure(analyze: str, path: Path) -> float:
    r = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(path)],
                       check=False, capture_output=True, text=True, timeout=120)
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    return float(m.group(1))


def test_autotune_unit_exposure(analyze):
    # The shipped file itself: security does not need the binaries to exist.
    assert exposure(analyze, AUTOTUNE_UNIT) <= MAX_EXPOSURE


def test_vllm_unit_exposure(analyze, unit_dir):
    assert exposure(analyze, unit_dir / "vllm@production.service") <= MAX_EXPOSURE


def test_autotune_unit_contract():
    u = AUTOTUNE_UNIT
    assert values(u, "ExecStart") == ["/opt/autotune/.venv/bin/autotune daemon --config /etc/autotune/daemon.toml"]
    assert values(u, "Type") == ["notify"] and values(u, "NotifyAccess") == ["main"]
    assert values(u, "WatchdogSec") and values(u, "Restart") == ["on-failure"]
    assert values(u, "User") == ["autotune"] and values(u, "Group") == ["autotune"]
    # autotune.locations reads $STATE_DIRECTORY, which StateDirectory= sets.
    assert values(u, "StateDirectory") == ["autotune"]
    assert values(u, "ReadWritePaths") == ["/etc/vllm"]
    assert values(u, "CapabilityBoundingSet") == [""] and values(u, "AmbientCapabilities") == [""]
    assert values(u, "DevicePolicy") == ["closed"]
    assert any(v.startswith("char-nvidia-uvm ") for v in values(u, "DeviceAllow"))
    assert values(u, "PrivateDevices") == []  # would hide /dev/nvidia*


def test_vllm_unit_contract():
    u = VLLM_UNIT
    (start,) = values(u, "ExecStart")
    assert start.startswith("/opt/vllm/.venv/bin/vllm serve --config /etc/vllm/%i.yaml")
    # host and port come from the unit: autotune refuses to publish them into the YAML.
    assert "--host ${SERVE_HOST}" in start and "--port ${SERVE_PORT}" in start
    assert values(u, "User") == ["vllm"] and values(u, "Restart") == ["on-failure"]
    assert values(u, "TimeoutStartSec") == ["15min"]


# --- vllm@.service's ExecStartPost: wait for /health -----------------------------------


def health_wait_argv() -> list[str]:
    """ExecStartPost= as systemd runs it, interpreter swapped for this one.

    systemd splits the line into words (quotes removed) and expands C escapes; the code
    only uses ``\\n``, so shlex plus that one replacement is the same transformation (the
    assertions below make sure no other escape, specifier or variable is in the code).
    """
    (line,) = values(VLLM_UNIT, "ExecStartPost")
    words = shlex.split(line)
    assert words[:2] == ["/opt/vllm/.venv/bin/python", "-c"] and len(words) == 3, words
    code = words[2]
    assert "%" not in code and "$" not in code
    assert re.findall(r"\\.", code) == [r"\n"] * code.count("\\"), "escapes other than \\n"
    return [sys.executable, "-c", code.replace("\\n", "\n")]


class _Health(http.server.BaseHTTPRequestHandler):
    answers: ClassVar[list[int]] = []

    def do_GET(self) -> None:
        if self.path != "/health":
            self.send_response(404)
        else:  # the answers in turn, then the last one for good
            self.send_response(self.answers.pop(0) if len(self.answers) > 1 else self.answers[0])
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[tuple[int, list[int]]]:
    answers: ClassVar[list[int]] = []
    handler = type("Handler", (_Health,), {"answers": answers})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], answers
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_health_wait_returns_once_health_is_200(health_server, host):
    port, answers = health_server
    answers.extend([503, 200])  # loading, then serving
    # a proxy in the unit's environment (for hub downloads) must not catch the local check
    env = {**os.environ, "SERVE_HOST": host, "SERVE_PORT": str(port), "http_proxy": "http://127.0.0.1:9"}
    r = subprocess.run(health_wait_argv(), env=env, check=False, timeout=60)
    assert r.returncode == 0
    assert answers == [200]  # the 503 was seen, and waited out


def test_health_wait_keeps_waiting_while_not_healthy(health_server):
    port, answers = health_server
    answers.append(503)
    env = {**os.environ, "SERVE_HOST": "127.0.0.1", "SERVE_PORT": str(port)}
    with pytest.raises(subprocess.TimeoutExpired):  # systemd's TimeoutStartSec= ends it
        subprocess.run(health_wait_argv(), env=env, check=False, timeout=5)


# --- polkit rule ---------------------------------------------------------------------


def rule_code() -> str:
    """The rule without its comments."""
    return "\n".join(line.split("//", 1)[0] for line in POLKIT_RULE.read_text().splitlines())


def test_polkit_rule_names_only_vllm_units_and_nginx_reload():
    code = rule_code()
    assert re.findall(r"[\w.-]+@", code) == ["vllm@"]  # the one unit pattern
    assert re.findall(r"\.(?:service|socket|timer|target|mount|path|slice|scope)\b", code) == [r".service",
                                                                                               ".service"]
    assert re.findall(r'"([a-z.]+)"', code) == ["autotune", "unit", "verb", "start", "stop", "restart",
                                                "nginx.service", "reload"]
    assert 'id === "org.freedesktop.systemd1.manage-units"' in code
    # polkit runs ECMAScript 5 (duktape, or mozjs in old versions): no ES6 syntax.
    assert not re.search(r"=>|`|\blet\b|\bconst\b", code)


# unit, verb, user, action -> what polkit should answer
RULE_CASES = [
    ("vllm@production.service", "restart", "autotune", None, "yes"),
    ("vllm@production.service", "start", "autotune", None, "yes"),
    ("vllm@staging.service", "stop", "autotune", None, "yes"),
    ("vllm@production.service", "reload", "autotune", None, "no"),
    ("vllm@production.service", "kill", "autotune", None, "no"),
    ("vllm@production.service", "set-property", "autotune", None, "no"),
    ("sshd.service", "restart", "autotune", None, "no"),
    ("autotune.service", "restart", "autotune", None, "no"),
    ("vllm@.service", "restart", "autotune", None, "no"),
    ("xvllm@production.service", "restart", "autotune", None, "no"),
    ("vllm@production.service.d", "restart", "autotune", None, "no"),
    ("vllm@production.socket", "start", "autotune", None, "no"),
    ("vllm@a.service\nsshd.service", "restart", "autotune", None, "no"),
    (None, None, "autotune", "org.freedesktop.systemd1.manage-unit-files", "no"),
    (None, None, "autotune", "org.freedesktop.systemd1.reload-daemon", "no"),
    (None, None, "autotune", "org.freedesktop.login1.reboot", None),  # not systemd1: defaults apply
    ("nginx.service", "reload", "autotune", None, "yes"),  # the blue/green switch
    ("nginx.service", "restart", "autotune", None, "no"),
    ("nginx.service", "stop", "autotune", None, "no"),
    ("nginx.service", "start", "autotune", None, "no"),
    ("nginx.socket", "reload", "autotune", None, "no"),
    ("xnginx.service", "reload", "autotune", None, "no"),
    ("nginx.service", "reload", "alice", None, None),
    ("vllm@blue.service", "restart", "autotune", None, "yes"),
    ("vllm@green.service", "stop", "autotune", None, "yes"),
    ("vllm@production.service", "restart", "vllm", None, None),
    ("vllm@production.service", "restart", "alice", None, None),
    ("vllm@production.service", "restart", "root", None, None),
]

NODE_HARNESS = r"""
const fs = require("fs"), vm = require("vm");
const [rulePath, casesPath] = process.argv.slice(2);
const rules = [];
// The parts of polkit's JavaScript API a rule can use, with polkit's values.
const polkit = {
  Result: {YES: "yes", NO: "no", AUTH_SELF: "auth_self", AUTH_SELF_KEEP: "auth_self_keep",
           AUTH_ADMIN: "auth_admin", AUTH_ADMIN_KEEP: "auth_admin_keep", NOT_HANDLED: null},
  addRule: (f) => rules.push(f),
  addAdminRule: () => {},
  log: () => {},
};
vm.runInNewContext(fs.readFileSync(rulePath, "utf8"), {polkit}, {filename: rulePath});
const out = JSON.parse(fs.readFileSync(casesPath, "utf8")).map(([id, details, user]) => {
  const action = {id, lookup: (key) => details[key]};
  const subject = {user, groups: [user], local: false, active: false, isInGroup: (g) => g === user};
  for (const rule of rules) {
    const r = rule(action, subject);
    if (r !== null && r !== undefined) return r;  // first answer wins, as in polkit
  }
  return null;
});
console.log(JSON.stringify({rules: rules.length, answers: out}));
"""


def test_polkit_rule_evaluated(tmp_path):
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed: run scripts/ci_system_deps.sh (it installs nodejs)")
    cases = []
    for unit, verb, user, action, _ in RULE_CASES:
        details = {} if unit is None else {"unit": unit, "verb": verb}
        cases.append([action or "org.freedesktop.systemd1.manage-units", details, user])
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "harness.js").write_text(NODE_HARNESS)
    r = subprocess.run([node, str(tmp_path / "harness.js"), str(POLKIT_RULE), str(tmp_path / "cases.json")],
                       check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["rules"] == 1
    got = {case[:4]: answer for case, answer in zip(RULE_CASES, result["answers"], strict=True)}
    expected = {case[:4]: case[4] for case in RULE_CASES}
    assert got == expected


# --- nginx: the blue/green proxy's reload drop-in ------------------------------------------------


def test_nginx_reload_drop_in_verifies_and_tests_before_it_reloads(analyze, tmp_path):
    """systemd/nginx-reload-tested.conf on Debian's own nginx.service (installed with nginx): verify reports
    nothing, and `systemctl reload nginx` then runs `nginx -t` before the reload."""
    shipped = Path("/lib/systemd/system/nginx.service")
    if not shipped.is_file():
        pytest.fail("nginx is not installed: run scripts/ci_system_deps.sh (it installs nginx)")
    (tmp_path / "nginx.service").write_text(shipped.read_text())
    drop_ins = tmp_path / "nginx.service.d"
    drop_ins.mkdir()
    (drop_ins / "autotune-reload-tested.conf").write_text((UNITS / "nginx-reload-tested.conf").read_text())
    r = subprocess.run([analyze, "verify", "--man=no", str(tmp_path / "nginx.service")],
                       capture_output=True, text=True, timeout=120)
    complaints = [x for x in (r.stdout + r.stderr).splitlines() if "nginx" in x or "autotune" in x]
    assert r.returncode == 0 and not complaints, r.stdout + r.stderr
    reloads = values(drop_ins / "autotune-reload-tested.conf", "ExecReload")
    assert reloads[0] == "" and " -t " in reloads[1] and reloads[2].endswith("-s reload")
