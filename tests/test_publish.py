"""Publishing to a production engine (vllm-sim reading a vLLM YAML config) with canary and rollback.

Production is a real vllm-sim process that a restart command (tests/fixtures/sim_service.py,
standing in for `systemctl restart vllm@production`) starts from the YAML file autotune writes.
"""

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from autotune.engine.vllm.flags import bundled_table
from autotune.errors import AutotuneError, UnknownFlagError
from autotune.publish.canary import replay_canary
from autotune.publish.history import History
from autotune.publish.transaction import CanaryResult, publish, recover, rollback
from autotune.engine.vllm.config import parse, render
from autotune.publish.vllm_config import VllmConfigTarget
from autotune.measure.replay import ReplayOptions
from autotune.measure.slo import parse_slos
from autotune.workload.synth import synthesize
from tests.conftest import free_port

SERVICE = Path(__file__).parent / "fixtures" / "sim_service.py"
GOOD = {"max_model_len": 8192, "max_num_seqs": 64, "gpu_memory_utilization": 0.9}


@pytest.fixture
def production(tmp_path, tiny_model):
    port = free_port()
    state = tmp_path / "service"
    config = tmp_path / "etc" / "production.yaml"
    restart = (sys.executable, str(SERVICE), "restart", str(state), str(config), str(port),
               "--gpu", "a10-24gb", "--time-scale", "0.01")
    target = VllmConfigTarget(config, "llama-3.1-8b", restart, f"http://127.0.0.1:{port}", bundled_table("0.33"),
                              health_timeout_s=8.0, restart_timeout_s=30.0)
    # production before autotune: a config a person wrote
    target.deploy({**GOOD, "tokenizer": str(tiny_model)})
    yield target
    subprocess.run([sys.executable, str(SERVICE), "stop", str(state)], check=False)


def canary_for(tiny_model, slos=("ttft<2s",)):
    from autotune.workload.synth import SCENARIOS
    w = synthesize(SCENARIOS["high-concurrency"].with_overrides(output_tokens=(16, 32)), rate=4, num_requests=12, seed=1)
    from autotune.workload.prompts import PromptBuilder, load_tokenizer, materialize
    w = materialize(w, PromptBuilder(load_tokenizer(tiny_model)), seed=1)
    return replay_canary(w, parse_slos(list(slos)), ReplayOptions(warmup_requests=1))


def test_render_and_parse_round_trip():
    text = render("m", {"max_num_seqs": 8, "enable_prefix_caching": False, "load_format": "dummy"}, ["hello"])
    assert text.startswith("# hello\n") and "load-format" not in text  # staging-only: never published
    assert parse(text) == ("m", {"max_num_seqs": 8, "enable_prefix_caching": False})


def test_a_good_config_is_published_and_verified(production, tmp_path, tiny_model):
    history = History(tmp_path / "history")
    new = {**GOOD, "tokenizer": str(tiny_model), "max_num_seqs": 128}
    result = publish(production, new, history, canary_for(tiny_model), source={"study": "s", "trial": 3})
    assert result.ok and result.outcome == "published"
    assert [e.outcome for e in history.entries()] == ["adopted", "published"]
    assert production.deployed()["max_num_seqs"] == 128
    assert result.entry.canary["slos"][0]["holds"] is True
    # the same config as the vllm/vllm-openai container would run it, beside it in the file
    container = [x for x in production.config_path.read_text().splitlines() if "in the official container" in x]
    assert len(container) == 1 and f"{production.config_path.resolve()}:/etc/vllm/config.yaml:ro" in container[0]
    assert "vllm/vllm-openai:v0.33" in container[0]
    r = httpx.post(f"{production.url}/v1/completions", json={"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


def test_a_config_that_fails_to_start_is_rolled_back(production, tmp_path, tiny_model):
    history = History(tmp_path / "history")
    before = production.config_path.read_text()
    # 8B weights in 70 % of an A10: no memory for the KV cache, the engine exits at start-up
    bad = {**GOOD, "tokenizer": str(tiny_model), "gpu_memory_utilization": 0.7}
    result = publish(production, bad, history, canary_for(tiny_model))
    assert not result.ok and result.outcome == "rolled-back"
    assert "not healthy" in result.entry.reason and result.entry.restored == 1
    assert production.config_path.read_text() == before  # the last good config, byte for byte
    assert httpx.get(f"{production.url}/health").status_code == 200  # and it serves again


def test_a_config_that_misses_the_slo_is_rolled_back(production, tmp_path, tiny_model):
    history = History(tmp_path / "history")
    # one sequence at a time: a burst of 12 requests queues far past a 300 ms TTFT
    slow = {**GOOD, "tokenizer": str(tiny_model), "max_num_seqs": 1, "max_num_batched_tokens": 8192}
    result = publish(production, slow, history, canary_for(tiny_model, ("ttft<300ms",)))
    assert result.outcome == "rolled-back"
    assert "canary missed" in result.entry.reason and "ttft<300ms" in result.entry.reason
    assert production.deployed()["max_num_seqs"] == 64


def test_unknown_flags_never_reach_production(production, tmp_path):
    before = production.config_path.read_text()
    with pytest.raises(UnknownFlagError):
        production.deploy({"max_num_seqs": 8, "swap_space": 4})
    assert production.config_path.read_text() == before


def test_rollback_by_hand_and_recovery_after_a_crash(production, tmp_path, tiny_model):
    history = History(tmp_path / "history")
    new = {**GOOD, "tokenizer": str(tiny_model), "max_num_seqs": 96}
    assert publish(production, new, history, lambda url: CanaryResult(True, {})).ok
    back = rollback(production, history)
    assert production.deployed()["max_num_seqs"] == 64 and back.source["rollback_to"] == 1

    # a daemon killed after writing a config, before verifying it: the next start verifies it
    entry = history.add("pending", {**GOOD, "tokenizer": str(tiny_model), "max_num_seqs": 80})
    production.deploy(entry.values)
    done = recover(production, history, lambda url: CanaryResult(True, {"slos": []}))
    assert done.ok and history.get(entry.number).outcome == "published"
    # killed before it wrote anything: nothing to undo, the entry is closed
    stale = history.add("pending", {**GOOD, "tokenizer": str(tiny_model), "max_num_seqs": 99})
    done = recover(production, history, lambda url: CanaryResult(True, {}))
    assert not done.ok and history.get(stale.number).reason == "interrupted before it was deployed"
    assert recover(production, history, lambda url: CanaryResult(True, {})) is None


def test_no_good_config_to_return_to_is_loud(tmp_path):
    class Broken:
        name = "broken"

        def deployed(self):
            return None

        def deploy(self, values):
            from autotune.errors import PublishError
            raise PublishError("restart failed")

        def endpoint(self):
            return "http://127.0.0.1:9"

        def canary_client(self):
            from autotune.publish.target import CanaryClient
            return CanaryClient()

        def production_values(self, values):
            return dict(values)

    with pytest.raises(AutotuneError, match="needs a person"):
        publish(Broken(), {"max_num_seqs": 8}, History(tmp_path / "h"), lambda url: CanaryResult(True, {}))
