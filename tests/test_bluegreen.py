"""Blue/green publishing behind a real nginx, under steady streaming traffic from the replay client.

Production: nginx (the shipped systemd/nginx-autotune.conf) in front of two vllm-sim instances, each
(re)started and stopped by tests/fixtures/sim_service.py, the stand-in for systemctl. Users' traffic is
`autotune replay` against nginx, in its own process, for the whole publish; nginx's access log says
which color served each request. (tests/bluegreen_rig.py builds it.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from autotune.daemon.production import production_verifier
from autotune.errors import ConfigError, PublishError
from autotune.measure.replay import ReplayOptions
from autotune.measure.slo import parse_slos
from autotune.publish.canary import replay_canary
from autotune.publish.history import History
from autotune.publish.target import create_target
from autotune.publish.transaction import publish
from autotune.workload.prompts import PromptBuilder, load_tokenizer, materialize
from autotune.workload.synth import SCENARIOS, synthesize
from tests.bluegreen_rig import Nginx, color_serving, make_target, rig_description
from tests.conftest import example_study, free_port

GOOD = {"max_model_len": 8192, "max_num_seqs": 64, "gpu_memory_utilization": 0.9}
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def rig(tmp_path, tiny_model):
    """Blue serving production behind nginx, green stopped: the state between publishes."""
    ports = {"blue": free_port(), "green": free_port()}
    nginx = Nginx(tmp_path / "nginx", free_port(), tmp_path / "nginx" / "vllm-upstream.conf")
    desc = {**rig_description(tmp_path, nginx, ports), "tokenizer": str(tiny_model)}
    (tmp_path / "rig.json").write_text(json.dumps(desc))
    target = make_target(desc)
    target.colors["blue"].server.deploy({**GOOD, "tokenizer": str(tiny_model)})
    nginx.upstream_file.parent.mkdir(parents=True, exist_ok=True)
    nginx.upstream_file.write_text(f"server {target.colors['blue'].backend};\n")
    nginx.start()
    try:
        yield target, nginx, desc
    finally:
        nginx.stop()
        for c in target.colors.values():
            target.stop_quietly(c)


def canary_for(tiny_model, slos=("ttft<2s",), requests=8, rate=4.0):
    w = synthesize(SCENARIOS["high-concurrency"].with_overrides(output_tokens=(8, 16)), rate=rate,
                   num_requests=requests, seed=1)
    w = materialize(w, PromptBuilder(load_tokenizer(tiny_model)), seed=1)
    return replay_canary(w, parse_slos(list(slos)), ReplayOptions(warmup_requests=0))


class Traffic:
    """Users: `autotune replay` streaming through nginx at a steady rate, in a process of its own."""

    def __init__(self, url: str, tiny_model: Path, out: Path, seconds: float, rate: float = 4.0) -> None:
        self.out = out
        n = int(seconds * rate)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "autotune", "replay", "--url", url, "--scenario", "high-concurrency",
             "--rate", str(rate), "--burstiness", "100", "--requests", str(n), "--output-tokens", "8-24",
             "--tokenizer", str(tiny_model), "--warmup", "0", "--json", str(out / "traffic.json"),
             "--requests-json", str(out / "requests.jsonl")],
            stdout=subprocess.DEVNULL, stderr=open(out / "traffic.log", "w"), start_new_session=True)
        self.requests = n

    def result(self, timeout: float = 180.0) -> dict:
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        assert rc == 0, (self.out / "traffic.log").read_text()[-2000:]
        lines = [json.loads(x) for x in (self.out / "requests.jsonl").read_text().splitlines() if x.strip()]
        return {"summary": json.loads((self.out / "traffic.json").read_text()), "requests": lines}


def failed(traffic: dict) -> list[dict]:
    """Requests that failed or were cut off (fewer tokens than asked for: ignore_eos makes them all come)."""
    return [r for r in traffic["requests"] if not r["success"] or r["error"]
            or r["output_tokens"] != r["expected_output_tokens"]]


def served_by(nginx: Nginx) -> list[tuple[float, int, str]]:
    return [(t, status, upstream) for t, status, upstream, uri in nginx.access_log() if "/v1/" in uri and
            "completions" in uri]


# --- the proxy alone ---------------------------------------------------------------------------------


def test_the_proxy_switches_and_says_which_backend_served(rig):
    target, nginx, _ = rig
    blue, green = target.colors["blue"], target.colors["green"]
    assert target.live() is blue
    r = httpx.get(f"{nginx.url}/health")
    assert r.status_code == 200 and r.headers["X-Autotune-Upstream"] == blue.backend
    target.stage(green, {**GOOD, "tokenizer": target.colors["blue"].server.deployed()["tokenizer"]})
    target.switch(green)
    assert target.live() is green and httpx.get(f"{nginx.url}/health").headers["X-Autotune-Upstream"] == green.backend


def test_a_proxy_config_that_nginx_rejects_changes_nothing(rig):
    target, nginx, _ = rig
    before = nginx.upstream_file.read_text()
    (nginx.prefix / "autotune-vllm.conf").write_text("this is not nginx syntax\n")
    with pytest.raises(PublishError, match=r"proxy test command .* exited 1") as e:
        target.switch(target.colors["green"])
    assert "\n" not in str(e.value)
    assert nginx.upstream_file.read_text() == before  # the file still names what serves
    assert httpx.get(f"{nginx.url}/health").headers["X-Autotune-Upstream"] == target.colors["blue"].backend


def test_a_proxy_that_is_down_is_one_line(rig):
    target, nginx, _ = rig
    nginx.stop()
    with pytest.raises(PublishError, match=r"proxy reload command .* exited") as e:
        target.switch(target.colors["green"])
    assert "\n" not in str(e.value) and target.live() is target.colors["blue"]


def test_settings_are_checked_with_one_line_each():
    table = {"model": "m", "blue": {"config": "/b.yaml", "url": "http://127.0.0.1:8001", "start": ["x"],
                                    "stop": ["y"]},
             "green": {"config": "/g.yaml", "url": "http://127.0.0.1:8001", "start": ["x"], "stop": ["y"]},
             "proxy": {"upstream_file": "/u.conf"}}
    with pytest.raises(ConfigError, match="same address 127.0.0.1:8001"):
        create_target("blue-green", "http://127.0.0.1:8000", table, "d.toml [production]")
    table["green"]["url"] = "http://127.0.0.1:8002"
    del table["proxy"]
    with pytest.raises(ConfigError, match=r"\[production\] proxy is missing|proxy"):
        create_target("blue-green", "http://127.0.0.1:8000", table, "d.toml [production]")
    table["proxy"] = {"upstream_file": "/u.conf", "reload": []}
    with pytest.raises(ConfigError, match="reload must be a non-empty argv"):
        create_target("blue-green", "http://127.0.0.1:8000", table, "d.toml [production]")


# --- publishing under traffic ----------------------------------------------------------------------


def test_a_publish_switches_with_no_request_lost(rig, tmp_path, tiny_model):
    target, nginx, _ = rig
    blue, green = target.colors["blue"], target.colors["green"]
    history = History(tmp_path / "history")
    traffic = Traffic(nginx.url, tiny_model, tmp_path, seconds=30)
    # users on blue first: at least one request served (nginx logs a request when it ends, and on a loaded host
    # the first may take longer than a fixed wait)
    deadline = time.time() + 30
    while not served_by(nginx) and time.time() < deadline:
        time.sleep(0.5)
    time.sleep(1)
    t0 = time.time()
    result = publish(target, {**GOOD, "tokenizer": str(tiny_model), "max_num_seqs": 128}, history,
                     canary_for(tiny_model), verify=production_verifier(parse_slos(["ttft<2s"]), 3.0, min_requests=3))
    t_done = time.time()
    seen = traffic.result()
    assert result.ok, result.entry.reason
    assert failed(seen) == [] and len(seen["requests"]) == traffic.requests  # nothing failed or cut off
    assert target.live() is green and green.server.deployed()["max_num_seqs"] == 128
    assert not color_serving(blue.url)  # the old color stopped once drained
    assert result.entry.switch["step"] == "done" and result.entry.switch["verified"]["requests"] >= 3
    log = served_by(nginx)
    assert {s for _, s, _ in log} == {200}
    before = [u for t, _, u in log if t < t0]
    after = [u for t, _, u in log if t > t_done]
    assert before and set(before) == {blue.backend}
    assert after and set(after) == {green.backend}


def test_a_canary_that_fails_before_the_switch_leaves_production_untouched(rig, tmp_path, tiny_model):
    target, nginx, _ = rig
    blue, green = target.colors["blue"], target.colors["green"]
    history = History(tmp_path / "history")
    traffic = Traffic(nginx.url, tiny_model, tmp_path, seconds=15)
    time.sleep(2)
    # one sequence at a time: the canary's burst queues far past 300 ms
    slow = {**GOOD, "tokenizer": str(tiny_model), "max_num_seqs": 1, "max_num_batched_tokens": 8192}
    result = publish(target, slow, history, canary_for(tiny_model, ("ttft<300ms",), requests=12, rate=50))
    seen = traffic.result()
    assert result.outcome == "rolled-back" and "canary missed" in result.entry.reason
    assert "before the switch: production stayed on blue" in result.entry.reason
    assert failed(seen) == [] and {u for _, _, u in served_by(nginx)} == {blue.backend}
    assert target.live() is blue and blue.server.deployed()["max_num_seqs"] == 64
    assert not color_serving(green.url)


def test_a_color_that_never_gets_healthy_leaves_production_serving(rig, tmp_path, tiny_model):
    target, nginx, _ = rig
    history = History(tmp_path / "history")
    # 8B weights in 70 % of an A10: no memory for the KV cache, vllm-sim exits at start-up like vLLM
    bad = {**GOOD, "tokenizer": str(tiny_model), "gpu_memory_utilization": 0.7}
    result = publish(target, bad, history, canary_for(tiny_model))
    assert result.outcome == "rolled-back" and "green did not come up" in result.entry.reason
    assert "\n" not in result.entry.reason
    assert target.live() is target.colors["blue"] and httpx.get(f"{nginx.url}/health").status_code == 200


def test_a_verification_that_fails_after_the_switch_switches_back(rig, tmp_path, tiny_model):
    target, nginx, _ = rig
    blue, green = target.colors["blue"], target.colors["green"]
    history = History(tmp_path / "history")
    traffic = Traffic(nginx.url, tiny_model, tmp_path, seconds=25, rate=6.0)
    time.sleep(3)
    # one sequence at a time passes a quiet canary (a few requests, one after another) but not users'
    # steady 6 requests/s, which queue on it
    slow = {**GOOD, "tokenizer": str(tiny_model), "max_num_seqs": 1, "max_num_batched_tokens": 8192}
    t0 = time.time()
    result = publish(target, slow, history, canary_for(tiny_model, ("p90:ttft<1s",), requests=3, rate=0.5),
                     verify=production_verifier(parse_slos(["p90:ttft<1s"]), 5.0, min_requests=3))
    t_back = time.time()
    seen = traffic.result()
    assert result.outcome == "rolled-back" and "after the switch" in result.entry.reason, result.entry.reason
    assert result.entry.switch["step"] == "switched back"
    assert target.live() is blue and not color_serving(green.url)
    assert failed(seen) == []  # the round trip cut nothing off: green drained before it stopped
    log = served_by(nginx)
    assert green.backend in {u for t, _, u in log if t0 < t < t_back}  # users really were on green
    assert {u for t, _, u in log if t > t_back} <= {blue.backend}


# --- a publisher killed at every step, production recovered by the daemon ------------------------


STEPS = ["starting", "canary", "switching", "verifying", "retiring"]


def daemon_config(target, nginx, desc, tmp_path, staging, verify_window="4s", gpus=None, canary_requests=60):
    """A daemon config for the rig: blue-green production, the repo's vllm-sim staging study, nothing
    that would start a tuning on its own (no schedule, no tuned fingerprint to drift from)."""
    import tomli_w

    production = {"url": nginx.url, "kind": "blue-green", "model": "llama-3.1-8b", "verify_window": verify_window,
                  "health_timeout": "20s",
                  "proxy": {"kind": "nginx", "upstream_file": desc["upstream_file"], "test": desc["test"],
                            "reload": desc["reload"]}}
    for name in ("blue", "green"):
        c = target.colors[name]
        production[name] = {"config": str(c.server.config_path), "url": c.url, "start": list(c.server.restart),
                            "stop": list(c.stop_argv)}
        if gpus:
            production[name]["gpus"] = gpus[name]
    data = {"slos": ["ttft<2s"], "state_dir": str(tmp_path / "state"), "production": production,
            "staging": {"study": str(staging)}, "metrics": {"listen": ""},
            "watch": {"scrape_interval": "1s", "window": "10s"}, "triggers": {"every": "0"},
            "tuning": {"canary_requests": canary_requests}, "publish": {"approval": True}}
    config = tmp_path / "d.toml"
    config.write_text(tomli_w.dumps(data))
    return config, tmp_path / "state" / "daemon" / "production" / "history"


@pytest.mark.parametrize("step", STEPS)
def test_a_daemon_killed_at_a_step_of_the_switch_resumes_to_one_color_serving(rig, tmp_path, tiny_model, step):
    """The daemon publishes an approved proposal; SIGKILL once the history says it began ``step``; a new
    daemon finds the open publish and settles it: one color serving, nginx on it, the history saying which."""
    from autotune.daemon.fingerprint import Fingerprint
    from autotune.daemon.state import DaemonState, Phase, StateStore

    target, nginx, desc = rig
    config, history_dir = daemon_config(target, nginx, desc, tmp_path, example_study("sim-h100-8b-chat", tiny_model, tmp_path),
                                        canary_requests=8)
    history = History(history_dir)
    blue_values = target.colors["blue"].server.deployed()
    history.add("adopted", blue_values, source={"target": "blue-green"})
    proposal = history.add("proposed", {**blue_values, "max_num_seqs": 96}, source={"study": "t", "trial": 1})
    # what a tuning leaves behind in approval mode: the traffic it was tuned for (the canary imitates it),
    # the proposal waiting, and a person's approval
    fp = Fingerprint(request_rate=4.0, prompt_tokens_mean=200, prompt_tokens_p50=200, prompt_tokens_p90=300,
                     output_tokens_mean=12, output_tokens_p50=12, output_tokens_p90=16, prefix_cache_hit_rate=None,
                     window_s=10, requests=40)
    store = StateStore(history_dir.parent)
    store.save(DaemonState(phase=Phase.AWAITING_APPROVAL, since=time.time(), tuned_fingerprint=fp.to_json(),
                           tunings=1, study_name="t", note=f"entry {proposal.number} waits"))
    store.approve(proposal.number)
    traffic = Traffic(nginx.url, tiny_model, tmp_path, seconds=30)

    def start_daemon(log: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "autotune", "daemon", "--config", str(config)], cwd=ROOT,
                                stdout=open(tmp_path / log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    first = start_daemon("daemon-1.log")
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            sw = history.get(proposal.number).switch
            if sw and sw.get("step") == step:
                break
            assert first.poll() is None, (tmp_path / "daemon-1.log").read_text()[-2000:]
            time.sleep(0.02)
        else:
            raise AssertionError(f"never reached step {step}: {(tmp_path / 'daemon-1.log').read_text()[-2000:]}")
        os.kill(first.pid, signal.SIGKILL)  # the daemon only: what it started (colors, nginx) lives on
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
    # a kill during "switching" may land before or after the proxy's file was rewritten: the file decides
    switched = target.colors["green"].backend in nginx.upstream_file.read_text()
    assert history.get(proposal.number).outcome == "pending"
    second = start_daemon("daemon-2.log")
    try:
        deadline = time.monotonic() + 90
        while history.get(proposal.number).outcome == "pending":
            assert second.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon-2.log").read_text()
            time.sleep(0.2)
        time.sleep(1.0)  # a tick after the recovery
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(30)
    journal = (tmp_path / "daemon-2.log").read_text()
    assert second.returncode == 0, journal
    seen = traffic.result()
    entry = history.get(proposal.number)
    assert f"recovered entry {entry.number}: {entry.outcome}" in journal, journal
    live = target.live()
    other = target.other(live)
    assert color_serving(live.url) and not color_serving(other.url)  # one color serving, the other stopped
    assert httpx.get(f"{nginx.url}/health").headers["X-Autotune-Upstream"] == live.backend
    assert live.server.deployed()["max_num_seqs"] == history.last_good().values["max_num_seqs"]
    if step in ("starting", "canary") or (step == "switching" and not switched):
        assert entry.outcome == "rolled-back" and live.name == "blue"
        assert "interrupted at step" in entry.reason
        # approved for a publish that never reached users: proposed again, for a person to approve again
        again = history.proposal()
        assert again is not None and again.number > entry.number and again.values == entry.values
        assert store.load().phase is Phase.AWAITING_APPROVAL and "approve" in store.load().note
    else:
        assert entry.outcome == "published" and live.name == "green"
        assert store.load().phase is Phase.WATCHING
    assert failed(seen) == []


# --- the daemon's view -------------------------------------------------------------------------------


def test_daemon_check_on_a_blue_green_production(rig, tmp_path, tiny_model):
    """`autotune daemon --check` reads a blue-green [production]: every command, the proxy, the live color."""
    import tomllib

    target, nginx, desc = rig
    config, _ = daemon_config(target, nginx, desc, tmp_path, example_study("sim-h100-8b-chat", tiny_model, tmp_path))

    def check():
        return subprocess.run([sys.executable, "-m", "autotune", "daemon", "--check", "--config", str(config)],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)

    r = check()
    assert r.returncode == 0 and "checks pass" in r.stdout, r.stdout + r.stderr
    # the proxy still answers (nginx: 502) but the color its file names is down: one line says which
    target.stop_quietly(target.colors["blue"])
    r = check()
    assert r.returncode == 1
    lines = [x for x in r.stderr.splitlines() if "production answers" in x]
    assert len(lines) == 1 and "502" in lines[0], r.stderr
    import tomli_w

    data = tomllib.loads(config.read_text())
    data["production"]["green"]["start"] = ["/no/such/systemctl", "restart", "vllm@green"]
    config.write_text(tomli_w.dumps(data))
    r = check()
    assert "[production.green].start: '/no/such/systemctl' is not an executable" in r.stderr
    # a broken nginx config (here: the upstream file it includes) is found by `nginx -t` now, not at the next switch
    good = nginx.upstream_file.read_text()
    nginx.upstream_file.write_text("server ;\n")
    try:
        r = check()
    finally:
        nginx.upstream_file.write_text(good)
    lines = [x for x in r.stderr.splitlines() if ": proxy config: " in x]
    assert r.returncode == 1 and len(lines) == 1 and "proxy test command" in lines[0], r.stderr


def test_a_rollback_by_hand_pauses_a_tuning_on_the_idle_gpus_and_resumes_it(rig, tmp_path, tiny_model):
    """Staging runs on the idle color's GPUs; `autotune rollback` during a tuning needs them: the daemon stops
    the tuning (resumable), rolls back, and resumes it on the GPUs the rollback left idle."""
    import tomllib

    from autotune.daemon.config import load_daemon_config
    from autotune.daemon.fingerprint import Fingerprint
    from autotune.daemon.loop import Daemon
    from autotune.daemon.state import Phase
    from tests.test_daemon import STAGING

    target, nginx, desc = rig
    staging = tmp_path / "staging.toml"
    staging.write_text(STAGING.format(root=tmp_path, python=sys.executable, port=free_port(), model=tiny_model))
    config, history = daemon_config(target, nginx, desc, tmp_path, staging, gpus={"blue": "0", "green": "1"})
    # green serves entry 2; blue (GPU 0) is idle
    result = publish(target, {**GOOD, "tokenizer": str(tiny_model), "max_num_seqs": 96}, History(history),
                     canary_for(tiny_model), verify=production_verifier(parse_slos(["ttft<2s"]), 1.0, min_requests=1000))
    assert result.ok and target.live().name == "green"
    d = Daemon(load_daemon_config(config))
    try:
        d._resume()
        fp = Fingerprint(request_rate=2.0, prompt_tokens_mean=200, prompt_tokens_p50=200, prompt_tokens_p90=300,
                         output_tokens_mean=16, output_tokens_p50=16, output_tokens_p90=24, prefix_cache_hit_rate=None,
                         window_s=10, requests=20)
        d.tuning.start("requested: by a test", fp)
        study_file = Path(d.state.study_file)
        assert tomllib.loads(study_file.read_text())["engine"]["env"]["CUDA_VISIBLE_DEVICES"] == "0"
        first_child = d.tuning.child
        time.sleep(3)  # the tuning's staging engine starts on blue's GPUs
        d.tick()
        assert d.state.phase is Phase.TUNING and d.tuning.child is first_child
        cli = subprocess.Popen([sys.executable, "-m", "autotune", "rollback", "--config", str(config), "--to", "1"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        notes = []
        deadline = time.monotonic() + 120
        while cli.poll() is None and time.monotonic() < deadline:
            d.tick()
            if not notes or notes[-1] != d.state.note:
                notes.append(d.state.note)
            time.sleep(0.3)
        out, err = cli.communicate(timeout=10)
        assert cli.returncode == 0, out + err
        assert "the daemon pauses it and rolls back to entry 1" in err and "back on entry 1" in out
        assert any("paused: a rollback by hand to entry 1 needs the idle GPUs" in n for n in notes), notes
        d.tick()  # the tuning resumes: a new child on the study it stopped
        assert d.state.phase is Phase.TUNING and d.tuning.child is not None and d.tuning.child is not first_child
        assert "resumes on GPUs 1" in d.state.note
        assert target.live().name == "blue" and not color_serving(target.colors["green"].url)
        assert target.live().server.deployed()["max_num_seqs"] == 64
        # staging follows the idle color: green's GPU now
        assert tomllib.loads(study_file.read_text())["engine"]["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    finally:
        d.tuning.stop()
        d.publishing.pool.shutdown(wait=True)
        d.watcher.close()


def test_a_crash_of_the_serving_color_is_one_journal_line_that_says_which(rig, tmp_path, tiny_model, capsys):
    """kill -9 of the color users are served by: nginx answers 502, and the daemon's one line says the color
    itself is down (not the proxy, not the network); another says when it serves again."""
    from autotune.daemon.config import load_daemon_config
    from autotune.daemon.loop import Daemon

    target, nginx, desc = rig
    config, _ = daemon_config(target, nginx, desc, tmp_path, example_study("sim-h100-8b-chat", tiny_model, tmp_path))
    d = Daemon(load_daemon_config(config))
    try:
        d._resume()
        d.tick()
        capsys.readouterr()
        blue = target.colors["blue"]
        os.killpg(int((Path(desc["blue"]["state"]) / "pid").read_text()), signal.SIGKILL)  # a crash, not a stop
        d.tick()
        d.tick()  # said once per streak
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"autotune: cannot scrape production ({nginx.url}/metrics): HTTPStatusError: "
                                   "Server error '502 Bad Gateway'"), lines
        assert f"blue ({blue.url}), the color serving users, does not answer /health either" in lines[0], lines
        subprocess.run(blue.server.restart, check=True)  # what vllm@blue's Restart=on-failure does
        deadline = time.monotonic() + 30
        while not color_serving(blue.url) and time.monotonic() < deadline:
            time.sleep(0.2)
        d.tick()
        assert capsys.readouterr().err.splitlines() == [
            f"autotune: scraping production works again ({nginx.url}/metrics) after 2 failed scrapes"]
    finally:
        d.watcher.close()
