"""Production-facing paths against real vLLM (the CPU build, tiny model), not the simulator.

One real ``vllm serve`` for the whole module, brought up the way a host without systemd runs
production: the ``vllm-config`` publish target writes the YAML and runs scripts/restart_vllm.sh,
which starts ``vllm serve --config FILE`` and blocks until it serves. On that server:

- the YAML a publish writes (non-default values, a sampler's float written tidy) is accepted by
  vLLM's own ``--config`` reader, and the server runs with those values (its /metrics
  ``vllm:cache_config_info``, /v1/models, its "non-default args" log line, and what
  ``max_num_seqs`` does to concurrent requests);
- the daemon's watcher reads its real /metrics: request and token counts exact, TTFT and E2E
  consistent with what the client measured;
- ``autotune capture`` in front of it relays real SSE streams intact and records each request
  with the server's token counts.

Slow (one engine start, tens of seconds on CPU); marked ``engine`` and run in CI. Every cache the
engine writes lives under pytest's temp dirs, and the server's process group is reaped in the
module fixture's teardown whatever the tests did.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from autotune.daemon.prometheus import scrape
from autotune.daemon.watcher import Watcher
from autotune.engine.leftovers import group_members
from autotune.measure.replay import ReplayOptions, run_replay
from autotune.publish.target import create_target
from autotune.workload.trace import Request, Workload
from tests.conftest import free_port

pytestmark = [pytest.mark.engine, pytest.mark.alone]  # a queue and a slot count read from real timings

ROOT = Path(__file__).resolve().parents[1]
RESTART = ROOT / "scripts" / "restart_vllm.sh"

# What a study's winner looks like when it reaches publish: every value differs from vLLM's CPU
# defaults (128 seqs, 2048 batched tokens, prefix caching on, block size 128 on CPU, 0.92), and the
# memory fraction is a float as a sampler's arithmetic leaves it.
WINNER = {
    "max_num_seqs": 3,
    "max_num_batched_tokens": 768,
    "block_size": 64,
    "enable_prefix_caching": False,
    "gpu_memory_utilization": 0.8600000000000001,
    "max_model_len": 2048,
    "enforce_eager": True,  # also non-default, and a faster start for the test
}
PROMPT = ("The licensor grants you a worldwide, royalty-free, non-exclusive license to reproduce the work, "
          "prepare derivative works, and distribute copies in any medium, provided that you meet the conditions")


def _stop_group(pgid: int, grace: float = 20.0) -> None:
    """SIGTERM the server's session (its own process group), SIGKILL whatever is left after ``grace``."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not [p for p in group_members(pgid) if p.status() != psutil.STATUS_ZOMBIE]:
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def production(tmp_path_factory, tiny_model):
    """Real vLLM published through the vllm-config target: (target, base URL, its log, the run dir).

    The target's restart is scripts/restart_vllm.sh -- env ... vllm serve --host --port, so the
    YAML carries only the model and the tuned values, as the daemon writes it."""
    base = tmp_path_factory.mktemp("production")
    caches = base / "cache"
    run = base / "run"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    vllm = Path(sys.executable).parent / "vllm"
    assert vllm.exists(), f"real vLLM is not installed beside {sys.executable}: run scripts/install_cpu.sh"
    env = [f"VLLM_CACHE_ROOT={caches / 'vllm'}", f"VLLM_CONFIG_ROOT={caches / 'vllm-config'}",
           f"XDG_CACHE_HOME={caches / 'xdg'}", f"HF_HOME={caches / 'hf'}",
           f"TORCHINDUCTOR_CACHE_DIR={caches / 'inductor'}", "VLLM_NO_USAGE_STATS=1", "VLLM_CPU_KVCACHE_SPACE=1"]
    config = base / "production.yaml"
    settings = {
        "config": str(config),
        "model": str(tiny_model),
        "health_timeout": "10m",
        "restart": [str(RESTART), "--config", str(config), "--url", url, "--pidfile", str(run / "vllm.pid"),
                    "--log", str(run / "vllm.log"), "--timeout", "600", "--grace", "10", "--",
                    "env", *env, str(vllm), "serve", "--host", "127.0.0.1", "--port", str(port)],
    }
    with pytest.MonkeyPatch.context() as mp:
        # the target reads vLLM's flags (and may cache the parser's dump): not in the user's ~/.cache
        mp.setenv("XDG_CACHE_HOME", str(caches / "autotune"))
        target = create_target("vllm-config", url, settings)
        try:
            t0 = time.monotonic()
            target.deploy(WINNER)  # writes the YAML, runs the script: returns once the server serves
            started = time.monotonic() - t0
            yield target, url, run / "vllm.log", started
        finally:
            pidfile = run / "vllm.pid"
            if pidfile.exists():
                pgid = int(pidfile.read_text())  # setsid: the server's pid is its session and group
                _stop_group(pgid)
                assert not [p for p in group_members(pgid) if p.status() != psutil.STATUS_ZOMBIE], \
                    "the production vLLM outlived its fixture"


def _non_default_args(log: Path) -> str:
    """The server's "non-default args: {...}" start-up line: the args its parser produced, --config included."""
    lines = [line for line in log.read_text().splitlines() if "non-default args:" in line]
    assert lines, log.read_text()[-3000:]
    return lines[-1]


def _families(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


# -- 1. the YAML a publish writes is what real vLLM runs --------------------------------------------

def test_the_published_yaml_is_accepted_by_real_vllm_and_served_as_written(production, tiny_model):
    target, url, log, started = production
    text = target.config_path.read_text()
    # written tidy, as a person would: the sampler's float noise does not reach production
    assert "gpu-memory-utilization: 0.86\n" in text and "0.8600000000000001" not in text
    assert f"model: {tiny_model}\n" in text
    assert target.deployed() == {**WINNER, "gpu_memory_utilization": 0.86}

    # it is real vLLM serving, started by the script with --config (nothing on its command line but the port)
    pid = int((log.parent / "vllm.pid").read_text())
    cmdline = psutil.Process(pid).cmdline()
    assert "--config" in cmdline and str(target.config_path) in cmdline and "--max-num-seqs" not in cmdline
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [str(tiny_model)]
    assert models[0]["max_model_len"] == WINNER["max_model_len"]

    # the engine's own cache config, as it exports it
    info = _families(url)["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "64", info
    assert info["gpu_memory_utilization"] == "0.86", info

    # vLLM's parser read the values from the file: its "non-default args" line names them
    logged = _non_default_args(log)
    for key, value in WINNER.items():
        expected = 0.86 if key == "gpu_memory_utilization" else value
        assert f"'{key}': {expected!r}" in logged, (key, logged)
    print(f"\nproduction vLLM published and serving in {started:.1f} s")


def test_a_false_boolean_in_the_published_yaml_reaches_vllm(production):
    target, url, log, _ = production
    # `enable-prefix-caching: false` would be dropped by vLLM's serve --config (vllm-project/vllm#51401)
    assert "no-enable-prefix-caching: true" in target.config_path.read_text()  # what autotune wrote
    assert target.deployed()["enable_prefix_caching"] is False  # what autotune believes is deployed
    assert "'enable_prefix_caching': False" in _non_default_args(log)
    info = _families(url)["vllm:cache_config_info"].samples[0].labels
    assert info["enable_prefix_caching"] == "False", info


def test_the_served_max_num_seqs_is_the_published_one(production):
    """8 long requests at once against 3 slots: never more than 3 run, and the other 5 wait for a slot.

    The waiting is read from the server's own queue-time histogram, not from gauge samples: on two
    shared cores a scrape can take a second, so a sampled gauge may never catch the slots full."""
    target, url, log, _ = production
    n, tokens = 8, 768
    body = {"model": target.model, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    errors: list[str] = []
    # all 8 sent at once, each long enough to outlast a slow start: with a client built per request after its
    # thread started, on two busy cores, 192-token requests of 0.6 s each arrived one after another and none
    # ever waited (CI: queue time 0.0002 s in all)
    together = threading.Barrier(n)

    def one() -> None:
        with httpx.Client(timeout=300, trust_env=False) as c:
            together.wait()
            try:
                r = c.post(url + "/v1/completions", json=body)
                if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != tokens:
                    errors.append(r.text[:300])
            except httpx.HTTPError as e:
                errors.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(n)]
    running = []
    with httpx.Client(timeout=10, trust_env=False) as client:
        before = scrape(url, client)
        for t in threads:
            t.start()
        try:
            while any(t.is_alive() for t in threads):
                running.append(scrape(url, client).gauges.get("running", 0.0))
                time.sleep(0.05)
        finally:  # a failed scrape must not leave these requests running into the next test's window
            for t in threads:
                t.join()
        after = scrape(url, client)
    assert not errors, errors
    assert running and max(running) <= WINNER["max_num_seqs"], running
    queued = after.histograms["queue_time"].minus(before.histograms["queue_time"])
    e2e = after.histograms["e2e"].minus(before.histograms["e2e"])
    assert queued.count == n and e2e.count == n, (queued, e2e)
    # Equal requests in waves of 3: the 3 of the second wave wait about one wave, the 2 of the third
    # about two, so the queue holds ~7 of the ~15 wave-lengths the 8 requests spend in the server.
    # With a slot for each request (vLLM's CPU default is 128) nothing waits.
    assert queued.sum >= 0.25 * e2e.sum, (queued.sum, e2e.sum)


# -- 2. the watcher reads real vLLM's /metrics ------------------------------------------------------

def test_the_watcher_reads_real_vllm_metrics(production):
    target, url, _, _ = production
    sizes = [(8, 24), (20, 40), (40, 16), (12, 64), (30, 32), (16, 8)]  # (prompt words, output tokens)
    words = PROMPT.split()
    reqs = tuple(Request(arrival_s=0.3 * i, output_tokens=out, prompt=" ".join((words * 3)[:w]))
                 for i, (w, out) in enumerate(sizes))
    with Watcher(url, window_s=3600) as watcher:
        assert watcher.poll() is None and watcher.errors == 0  # the first poll only takes a snapshot
        replay = run_replay(url, Workload(reqs, "watcher"), ReplayOptions(warmup_requests=0, model=target.model))
        results = replay.results
        assert all(r.success for r in results), [r.error for r in results]
        assert [r.output_tokens for r in results] == [out for _, out in sizes]  # ignore_eos + max_tokens

        # the measurement, retried (not the assertion): vLLM's stats may land just after the last stream ends
        deadline = time.monotonic() + 10
        while True:
            window = watcher.poll()
            assert window is not None, watcher.last_error
            if window.requests >= len(reqs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert watcher.errors == 0 and not window.reset
    assert window.requests == len(reqs)
    assert window.counters.get("requests_failed", 0.0) == 0
    # token counters and histograms: exact against the server's own usage reports
    assert window.counters["prompt_tokens"] == sum(r.prompt_tokens for r in results)
    assert window.counters["generation_tokens"] == sum(r.output_tokens for r in results)
    assert window.histograms["request_prompt_tokens"].count == len(reqs)
    assert window.prompt_tokens_mean == pytest.approx(sum(r.prompt_tokens for r in results) / len(reqs))
    assert window.output_tokens_mean == pytest.approx(sum(out for _, out in sizes) / len(reqs))
    # TTFT: one observation per request; the server's clock starts after the client's and stops before
    # the chunk reaches it, so its total lies between 0 and the client's (a few ms per request of slack)
    ttft = window.histograms["ttft"]
    assert ttft.count == len(reqs)
    client_ttft = [r.ttft for r in results]
    assert 0 < ttft.sum <= sum(client_ttft) + 0.005 * len(reqs), (ttft.sum, client_ttft)
    p50, (low, _) = window.quantile("ttft", 0.5), ttft.bucket_of(0.5)
    assert p50 is not None and p50 > 0 and low <= max(client_ttft), (p50, low, client_ttft)
    e2e = window.histograms["e2e"]
    assert e2e.count == len(reqs)
    assert ttft.sum < e2e.sum <= sum(r.e2e for r in results) + 0.01 * len(reqs), (e2e.sum, results)
    assert window.histograms["tpot"].count == len(reqs)
    assert window.gauges["running"] == 0 and window.gauges["waiting"] == 0
    assert 0.0 <= window.gauges["kv_cache_usage"] <= 1.0


# -- 3. the capture proxy in front of real vLLM -----------------------------------------------------

def _stream(url: str, body: dict, path: str = "/v1/completions") -> list[dict]:
    """The SSE events of one streamed request, parsed; the [DONE] marker as the string "[DONE]"."""
    events: list = []
    with httpx.Client(timeout=120, trust_env=False) as client:
        with client.stream("POST", url + path, json=body) as resp:
            assert resp.status_code == 200, resp.read()[:300]
            assert resp.headers["content-type"].startswith("text/event-stream")
            # SSE lines end at CRLF, LF or CR only (httpx's iter_lines also splits at U+2028, which a token may hold)
            for line in re.split(r"\r\n|\r|\n", resp.read().decode()):
                if line.startswith("data:"):
                    data = line[5:].strip()
                    events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _content(events: list) -> list[tuple]:
    """What a client reads from the events: per chunk, each choice's text and finish reason; usage chunks."""
    out = []
    for e in events:
        if e == "[DONE]":
            out.append(("[DONE]",))
        elif e.get("choices"):
            out.append(tuple((c.get("text", c.get("delta", {}).get("content")), c.get("finish_reason"))
                             for c in e["choices"]))
        else:
            out.append(("usage", e.get("usage")))
    return out


@pytest.fixture
def capture(production, tmp_path):
    """``autotune capture`` (the CLI) in front of production, in a process group of its own."""
    _, url, _, _ = production
    port = free_port()
    out = tmp_path / "trace.jsonl"
    err = tmp_path / "capture.err"
    with err.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "autotune", "capture", "--listen", f"127.0.0.1:{port}",
                                 "--upstream", url, "--out", str(out)], cwd=ROOT, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "capturing" not in err.read_text():
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, "autotune capture did not start listening"
            time.sleep(0.1)
        yield proc, f"http://127.0.0.1:{port}", out, err
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)


def test_capture_relays_real_sse_intact_and_records_the_servers_token_counts(production, capture):
    target, url, _, _ = production
    proc, proxy, trace, err = capture
    body = {"model": target.model, "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 0,
            "stream": True}
    direct = _stream(url, body)
    proxied = _stream(proxy, body)
    # greedy on one server: the same tokens in the same chunks, and no usage chunk the client did not ask for
    assert _content(proxied) == _content(direct)
    assert _content(direct)[-1] == ("[DONE]",) and not any(c[0] == "usage" for c in _content(direct))
    assert len([e for e in direct if e != "[DONE]"]) == 24  # one token per chunk (vLLM's default interval)

    # asked for usage: the client gets vLLM's usage chunk, and the trace the same counts
    with_usage = _stream(proxy, {**body, "stream_options": {"include_usage": True}})
    usage = [e["usage"] for e in with_usage if e != "[DONE]" and not e.get("choices") and e.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == 24
    assert _content(with_usage)[:-2] == _content(direct)[:-1]  # the tokens again, then usage, then [DONE]

    chat = {"model": target.model, "messages": [{"role": "system", "content": "You answer briefly."},
                                                {"role": "user", "content": PROMPT}],
            "max_tokens": 12, "ignore_eos": True, "temperature": 0, "stream": True}
    chat_direct = _stream(url, {**chat, "stream_options": {"include_usage": True}}, "/v1/chat/completions")
    chat_proxied = _stream(proxy, chat, "/v1/chat/completions")
    assert _content(chat_proxied) == [c for c in _content(chat_direct) if c[0] != "usage"]
    chat_usage = [e["usage"] for e in chat_direct if e != "[DONE]" and not e.get("choices") and e.get("usage")][0]

    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the proxy stops cleanly
    assert proc.wait(20) == 0, err.read_text()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [(r.get("api", "completion"), r["prompt_tokens"], r["output_tokens"]) for r in lines] == [
        ("completion", usage[0]["prompt_tokens"], 24),
        ("completion", usage[0]["prompt_tokens"], 24),
        ("chat", chat_usage["prompt_tokens"], 12),
    ]
    assert all("prompt" not in r for r in lines)  # no prompt text without --with-prompts
    arrivals = [r["arrival_s"] for r in lines]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
