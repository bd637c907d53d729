"""The capture proxy in front of vllm-sim: clients see vLLM's answers unchanged, the trace sees the traffic."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from autotune.workload.capture import DEFAULT_HOST, CaptureStats, run_capture
from autotune.workload.trace import read_workload
from tests.conftest import free_port

MODEL = "llama-3.1-8b"


@pytest.fixture(scope="module")
def sim(vllm_sim) -> str:
    return vllm_sim


class Capture:
    """run_capture in a thread, as a CLI would run it in its main thread."""

    def __init__(self, upstream: str, out: Path, with_prompts: bool = False) -> None:
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.port = 0
        self.stats: CaptureStats | None = None
        self.error: BaseException | None = None

        def on_ready(port: int) -> None:
            self.port = port
            self.ready.set()

        def run() -> None:
            try:
                self.stats = run_capture(DEFAULT_HOST, 0, upstream, out, with_prompts=with_prompts,
                                         stop_event=self.stop, on_ready=on_ready)
            except Exception as e:  # surfaced by close()
                self.error = e
                self.ready.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.ready.wait(30) and self.error is None, self.error

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> CaptureStats:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive() and self.error is None, self.error
        assert self.stats is not None
        return self.stats


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def raw_events(url: str, body: dict) -> list[str]:
    """The SSE data lines of a streamed response, as the client receives them."""
    with httpx.stream("POST", url, json=body, timeout=30, trust_env=False) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.iter_lines() if line]


def test_capture_records_token_counts_and_leaves_responses_alone(sim, tmp_path):
    out = tmp_path / "trace.jsonl"
    cap = Capture(sim, out)
    try:
        client = openai.OpenAI(base_url=cap.url + "/v1", api_key="not-needed", max_retries=0)
        ignore = {"ignore_eos": True}
        # 1. chat, not streamed
        r1 = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                    {"role": "user", "content": "Name a colour."}],
                                            max_tokens=7, extra_body=ignore)
        assert r1.choices[0].message.content and r1.usage.completion_tokens == 7
        assert len(lines(out)) == 1  # written (and flushed) when the request completed, not at exit
        # 2. chat, streamed, without usage: the client must not see the usage chunk the proxy asked for
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count."}],
                                                     max_tokens=9, stream=True, extra_body=ignore))
        assert all(c.usage is None and c.choices for c in chunks)
        assert "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        # 3. completion, streamed, with usage: the client asked, the client gets it (once)
        stream = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, stream=True,
                                           stream_options={"include_usage": True}, extra_body=ignore)
        chunks3 = list(stream)
        with_usage = [c for c in chunks3 if c.usage is not None]
        assert len(with_usage) == 1 and not with_usage[0].choices and with_usage[0].usage.completion_tokens == 5
        # 4. completion, not streamed
        r4 = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, extra_body=ignore)
        assert r4.usage.completion_tokens == 4
        # the same requests straight to the server, for the prompt lengths it counts
        direct = openai.OpenAI(base_url=sim + "/v1", api_key="x", max_retries=0)
        p2 = direct.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count."}],
                                            max_tokens=1).usage.prompt_tokens
        # other paths pass through, and are not recorded
        assert [m.id for m in client.models.list()] == [MODEL]
        assert httpx.get(cap.url + "/metrics", timeout=10, trust_env=False).text.startswith("# HELP")
        # an error passes through with its status and body, and is not recorded
        with pytest.raises(openai.BadRequestError, match="maximum context length|cannot be greater"):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
        # a stream without usage, byte for byte: the events the server sends when not asked for usage
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "ignore_eos": True, "stream": True}
        via, straight = raw_events(cap.url + "/v1/completions", body), raw_events(sim + "/v1/completions", body)
        assert len(via) == len(straight) == 6 + 1 and via[-1] == "data: [DONE]"
        assert all('"usage"' not in e for e in via)
        assert [json.loads(e[6:])["choices"][0]["finish_reason"] for e in via[:-1]] == [None] * 5 + ["length"]
    finally:
        stats = cap.close()
    assert stats.recorded == 5 and stats.not_recorded == 1 and stats.upstream_errors == 0

    rows = lines(out)
    assert len(rows) == 5
    assert all("prompt" not in row and "prefix" not in row for row in rows)  # no text unless asked
    assert [(row.get("api", "completion"), row["output_tokens"]) for row in rows] == [
        ("chat", 7), ("chat", 9), ("completion", 5), ("completion", 4), ("completion", 6)]
    assert rows[0]["prompt_tokens"] == r1.usage.prompt_tokens
    assert rows[1]["prompt_tokens"] == p2
    assert rows[2]["prompt_tokens"] == with_usage[0].usage.prompt_tokens
    assert rows[3]["prompt_tokens"] == r4.usage.prompt_tokens
    arrivals = [row["arrival_s"] for row in rows]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)  # sequential requests: completion order is arrival order
    wl = read_workload(out)
    assert len(wl) == 5 and wl.requests[1].api == "chat" and wl.requests[1].output_tokens == 9


def test_with_prompts_keeps_the_text_and_a_restart_appends(sim, tmp_path):
    out = tmp_path / "trace.jsonl"
    cap = Capture(sim, out, with_prompts=True)
    try:
        client = openai.OpenAI(base_url=cap.url + "/v1", api_key="x", max_retries=0)
        client.completions.create(model=MODEL, prompt="Tell me about the sea", max_tokens=3)
        list(client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "You are terse."},
                                                                   {"role": "user", "content": "Why is it blue?"}],
                                            max_tokens=3, stream=True))
    finally:
        cap.close()
    rows = lines(out)
    assert rows[0]["prompt"] == "Tell me about the sea" and rows[0]["prompt_tokens"] > 0
    assert rows[1]["prompt"] == "You are terse.\nWhy is it blue?" and rows[1]["api"] == "chat"
    assert rows[1]["output_tokens"] >= 1
    # a half-written line (a crash) is cut off, and a new capture continues after the last arrival
    with out.open("a") as f:
        f.write('{"arrival_s": 99')
    cap = Capture(sim, out)
    try:
        openai.OpenAI(base_url=cap.url + "/v1", api_key="x", max_retries=0).completions.create(
            model=MODEL, prompt="again", max_tokens=2, extra_body={"ignore_eos": True})
    finally:
        cap.close()
    rows = lines(out)
    assert len(rows) == 3 and "prompt" not in rows[2]
    assert rows[2]["arrival_s"] == pytest.approx(rows[1]["arrival_s"] + 1)
    wl = read_workload(out)
    assert [r.prompt is not None for r in wl.requests] == [True, True, False]


def test_abandoned_stream_is_not_recorded_and_frees_the_server(sim, tmp_path):
    out = tmp_path / "trace.jsonl"
    cap = Capture(sim, out)
    try:
        body = {"model": MODEL, "prompt": "a long story", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", cap.url + "/v1/completions", json=body, timeout=30, trust_env=False) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 3:
                    break  # the client hangs up mid-stream
        deadline = time.monotonic() + 10
        while True:  # the server aborts the request once the proxy drops the upstream connection
            text = httpx.get(sim + "/metrics", timeout=5, trust_env=False).text
            running = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running{")]
            if running and float(running[0].rsplit(" ", 1)[1]) == 0:
                break
            assert time.monotonic() < deadline, "the abandoned request still runs upstream"
            time.sleep(0.05)
    finally:
        stats = cap.close()
    assert stats.recorded == 0 and stats.not_recorded == 1
    assert out.read_text() == ""


def test_unreachable_upstream_is_a_502(tmp_path):
    cap = Capture(f"http://127.0.0.1:{free_port()}", tmp_path / "trace.jsonl")
    try:
        r = httpx.post(cap.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10, trust_env=False)
        assert r.status_code == 502 and r.json()["error"]["code"] == 502
        assert "capture proxy: upstream" in r.json()["error"]["message"]
    finally:
        stats = cap.close()
    assert stats.upstream_errors == 1 and stats.recorded == 0
