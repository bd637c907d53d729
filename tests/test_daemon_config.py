"""Daemon files read strictly: every bad value is one ConfigError line naming the file, the key and what it expects."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

from autotune.daemon.config import load_daemon_config
from autotune.engine.kind import get_kind
from autotune.errors import ConfigError
from autotune.publish.vllm_config import VllmConfigTarget

ROOT = Path(__file__).resolve().parents[1]


def config(tmp_path, **tables):
    """A daemon file that loads, with ``tables`` (section -> {key: value}; "" the top level) on top."""
    (tmp_path / "s.toml").write_text("")  # the staging study: the daemon file only names it
    data = {
        "slos": ["ttft<1s"],
        "production": {"url": "http://127.0.0.1:8000", "config": str(tmp_path / "p.yaml"), "model": "m",
                       "restart": ["true"]},
        "staging": {"study": "s.toml"},
        "metrics": {"listen": ""},
    }
    for section, values in tables.items():
        (data if section == "top" else data.setdefault(section, {})).update(values)
    p = tmp_path / "d.toml"
    p.write_text(tomli_w.dumps(data))
    return p


def test_a_good_file_loads(tmp_path):
    cfg = load_daemon_config(config(tmp_path, triggers={"every": "0", "cooldown": "2d"}, watch={"window": "5m"}))
    assert (cfg.triggers.every_s, cfg.triggers.cooldown_s, cfg.window_s, cfg.metrics_listen) == (0, 172800, 300, None)


@pytest.mark.parametrize("section,key,value,message", [
    ("top", "slos", [800], "d.toml slos must be a list of strings, got [800]"),
    ("top", "slos", "ttft<1s", 'd.toml slos must be a list of strings, got "ttft<1s"'),
    ("top", "name", 5, "d.toml name must be a string, got 5"),
    ("production", "url", 8000, "d.toml [production].url must be a string, got 8000"),
    ("production", "url", "127.0.0.1:8000",
     'd.toml [production].url must be production\'s base URL, e.g. http://127.0.0.1:8000, got "127.0.0.1:8000"'),
    ("production", "config", 5, "d.toml [production].config must be a string, got 5"),
    ("production", "model", True, "d.toml [production].model must be a string, got true"),
    ("production", "health_timeout", True,
     "d.toml [production].health_timeout must be a duration like 90s, 30m or 2h, got true"),
    ("staging", "study", 5, "d.toml [staging].study must be a string, got 5"),
    ("staging", "trace", False, "d.toml [staging].trace must be a string, got false"),
    ("watch", "window", "0s", 'd.toml [watch].window must be a duration > 0s, got "0s"'),
    ("watch", "scrape_interval", "0s", 'd.toml [watch].scrape_interval must be a duration >= 1s, got "0s"'),
    ("watch", "scrape_interval", 0.2, "d.toml [watch].scrape_interval must be a duration >= 1s, got 0.2"),
    ("triggers", "drift", "big", 'd.toml [triggers].drift must be a number > 0, got "big"'),
    ("triggers", "drift", [0.5], "d.toml [triggers].drift must be a number > 0, got [0.5]"),
    ("triggers", "breach_windows", "3", 'd.toml [triggers].breach_windows must be an integer >= 1, got "3"'),
    ("triggers", "breach_windows", True, "d.toml [triggers].breach_windows must be an integer >= 1, got true"),
    ("triggers", "cooldown", True, "d.toml [triggers].cooldown must be a duration like 90s, 30m or 2h (or 7d), got true"),
    ("triggers", "every", ["7d"], 'd.toml [triggers].every must be a duration like 90s, 30m or 2h (or 7d), got ["7d"]'),
    ("tuning", "windows", [1], "d.toml [tuning].windows must be a list of strings, got [1]"),
    ("tuning", "windows", 5, "d.toml [tuning].windows must be a list of strings, got 5"),
    ("tuning", "canary_requests", "60", 'd.toml [tuning].canary_requests must be an integer >= 1, got "60"'),
    ("tuning", "canary_requests", 0, "d.toml [tuning].canary_requests must be an integer >= 1, got 0"),
    ("publish", "approval", "false", 'd.toml [publish].approval must be true or false, got "false"'),
    ("metrics", "listen", "127.0.0.1:70000",
     'd.toml [metrics].listen must be HOST:PORT with a port from 1 to 65535, e.g. 127.0.0.1:9464, got "127.0.0.1:70000"'),
    ("metrics", "listen", "127.0.0.1:0",
     'd.toml [metrics].listen must be HOST:PORT with a port from 1 to 65535, e.g. 127.0.0.1:9464, got "127.0.0.1:0"'),
])
def test_each_bad_value_is_one_line_naming_the_file_and_the_key(tmp_path, section, key, value, message):
    with pytest.raises(ConfigError) as e:
        load_daemon_config(config(tmp_path, **{section: {key: value}}))
    assert type(e.value) is ConfigError
    assert str(e.value) == message


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    p = config(tmp_path)
    p.write_bytes(p.read_bytes().replace(b'"m"', b'"\xe9"'))
    with pytest.raises(ConfigError) as e:
        load_daemon_config(p)
    assert type(e.value) is ConfigError and str(e.value).startswith(f"{p}: not UTF-8 text")


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_metrics_port_in_use_stops_the_daemon_not_the_other_commands(tmp_path, taken_port):
    p = config(tmp_path, metrics={"listen": f"127.0.0.1:{taken_port}"})
    with pytest.raises(ConfigError) as e:
        load_daemon_config(p, serving=True)
    assert type(e.value) is ConfigError
    assert str(e.value).startswith(f"d.toml [metrics].listen: cannot listen on 127.0.0.1:{taken_port}: the port is in use")
    # `autotune status`, `publish` and `rollback` read the same file while the daemon holds its port
    assert load_daemon_config(p).metrics_listen == ("127.0.0.1", taken_port)

    r = subprocess.run([sys.executable, "-m", "autotune", "daemon", "--config", str(p)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "the port is in use" in r.stderr


def test_a_free_metrics_port_passes_the_bind_test(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_daemon_config(config(tmp_path, metrics={"listen": f"localhost:{port}"}), serving=True)
    assert cfg.metrics_listen == ("localhost", port)


def _target(path):
    # the table is vLLM's flag table; reading the deployed config does not consult it
    return VllmConfigTarget(path, "m", ("true",), "http://127.0.0.1:8000", table=None)


def test_an_unparsable_production_config_is_named(tmp_path):
    prod = tmp_path / "p.yaml"
    prod.write_text("model: m\nmax-num-seqs: [8, 16\n")
    with pytest.raises(ConfigError) as e:
        _target(prod).deployed()
    assert type(e.value) is ConfigError
    assert str(e.value).startswith(f"{prod}: not valid YAML") and "\n" not in str(e.value)
    prod.write_text("- max-num-seqs\n")
    with pytest.raises(ConfigError, match="p.yaml: a vLLM config file is a YAML mapping"):
        _target(prod).deployed()
    prod.write_bytes(b"model: \xff\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        _target(prod).deployed()
    prod.write_text("model: m\nmax-num-seqs: 8\n")
    assert _target(prod).deployed() == {"max_num_seqs": 8}


def test_the_vllm_config_parser_names_its_source():
    with pytest.raises(ConfigError, match=r"^prod.yaml: not valid YAML: .*line \d"):
        get_kind("vllm").parse_config("a: [1\n", "prod.yaml")
