"""A second publish target through the same transaction as vLLM's: registry, settings, publish, canary, rollback.

The toy target (tests/toy_target.py) restarts the toy engine (tests/toy_engine), a fixed-timing
server: its ``itl_ms`` decides whether the canary's TPOT SLO holds, its ``memory_gb`` whether it
starts at all. Nothing in autotune/ knows it: one ``register`` line makes it a target kind.
"""

import httpx
import pytest

from autotune.daemon.config import load_daemon_config
from autotune.daemon.production import build_target
from autotune.errors import ConfigError
from autotune.measure.replay import ReplayOptions
from autotune.measure.slo import parse_slos
from autotune.publish import target as targets
from autotune.publish.canary import replay_canary
from autotune.publish.history import History
from autotune.publish.transaction import publish, rollback
from autotune.workload.trace import Request, Workload
from tests.conftest import free_port


@pytest.fixture
def toy_kind():
    targets.register("toy", "tests.toy_target:ToyTarget")
    yield
    targets._REGISTRY.pop("toy")


@pytest.fixture
def production(toy_kind, tmp_path):
    port = free_port()
    study = tmp_path / "staging.toml"
    study.write_text('[engine]\nmodel = "m"\n[workload]\nscenario = "chat"\nrate = 1\nslos = ["ttft<1s"]\n')
    cfg = tmp_path / "daemon.toml"
    cfg.write_text(f'slos = ["tpot<10ms"]\n[production]\nurl = "http://127.0.0.1:{port}"\nkind = "toy"\n'
                   f'state = "{tmp_path / "prod"}"\nport = {port}\n[staging]\nstudy = "{study}"\n')
    (tmp_path / "prod").mkdir()
    target = build_target(load_daemon_config(cfg))  # through the daemon's own path: config -> registry -> target
    target.deploy({"itl_ms": 2, "memory_gb": 4})  # what ran before autotune
    yield target
    target.stop()


def canary():
    w = Workload(tuple(Request(i * 0.05, 8, prompt="hello") for i in range(10)))
    return replay_canary(w, parse_slos(["tpot<10ms"]), ReplayOptions(warmup_requests=0))


def test_an_unknown_target_kind_names_the_registered_ones(tmp_path, toy_kind):
    cfg = tmp_path / "d.toml"
    cfg.write_text('slos = ["ttft<1s"]\n[production]\nurl = "http://x"\nkind = "k8s"\n')
    with pytest.raises(ConfigError, match="'vllm-config', 'xinference', 'blue-green' or 'toy', got 'k8s'"):
        load_daemon_config(cfg)
    cfg.write_text('slos = ["ttft<1s"]\n[production]\nurl = "http://x"\nkind = "toy"\nport = "80"\n')
    with pytest.raises(ConfigError, match="kind toy takes state = DIR and port = N"):  # its own settings check
        load_daemon_config(cfg)


def test_the_toy_target_publishes_verifies_and_rolls_back(production, tmp_path):
    history = History(tmp_path / "history")
    ok = publish(production, {"itl_ms": 3, "memory_gb": 4}, history, canary())
    assert ok.ok and ok.outcome == "published" and production.deployed()["itl_ms"] == 3

    slow = publish(production, {"itl_ms": 40, "memory_gb": 4}, history, canary())  # TPOT 40 ms > 10 ms
    assert not slow.ok and "canary missed p95:tpot<10ms" in slow.entry.reason
    assert production.deployed()["itl_ms"] == 3  # back on the last good config, and serving
    assert httpx.get(production.endpoint() + "/health").status_code == 200

    oom = publish(production, {"itl_ms": 3, "memory_gb": 16}, history, canary())  # the toy cannot start it
    assert not oom.ok and "not healthy" in oom.entry.reason and production.deployed()["memory_gb"] == 4
    assert [e.outcome for e in history.entries()] == ["adopted", "published", "rolled-back", "rolled-back"]

    back = rollback(production, history, to=1)  # by hand, to what ran before autotune
    assert back.outcome == "published" and production.deployed() == {"itl_ms": 2, "memory_gb": 4}
