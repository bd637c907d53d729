"""vllm-sim as a process: vLLM's command line, start-up, failures, SSE shapes, metrics, real time.

One simulated llama-3.1-8b on an H100 serves most tests (module fixture); it has a WordLevel
tokenizer (``w0 w1 ...`` are one token each) so prompt lengths are exact. Start-up runs at
``--time-scale 0.01``; serving runs in real time (a decode step is ~7 ms).
"""

from __future__ import annotations

import itertools
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from autotune.engine.failures import FailureClass, LogWatch, classify_exit
from autotune.engine.vllm.failures import PATTERNS
from autotune.engine.launcher import Engine, EngineState, LaunchSpec, port_is_free
from autotune.sim import cli
from autotune.sim.config import SimConfig
from autotune.sim.perf import StepModel
from autotune.sim.profiles import gpu_profile, model_shape, write_model_dir
from autotune.sim.scheduler import Request, StepPlan, block_hashes
from autotune.sim.startup import plan_startup
from autotune.sim.text import TextCodec, eos_length
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
SIM = [sys.executable, "-m", "autotune.sim.cli"]
VOCAB = 5000
NAME = "sim-model"
_fresh = itertools.count(1)


def words(n: int, offset: int | None = None) -> str:
    """n one-token words; a fresh offset each call, so prompts do not share a prefix by accident."""
    start = next(_fresh) * 997 if offset is None else offset
    return " ".join(f"w{(start + i) % VOCAB}" for i in range(n))


@dataclass
class Sim:
    proc: subprocess.Popen
    port: int
    out: Path
    err: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def launch(tmp: Path, args: list[str], sim_opts: tuple[str, ...] = ("--time-scale", "0.01")) -> Sim:
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    out, err = tmp / "stdout.log", tmp / "stderr.log"
    proc = subprocess.Popen([*SIM, *sim_opts, "serve", *args, "--port", str(port)], cwd=ROOT,
                            stdout=out.open("wb"), stderr=err.open("wb"), stdin=subprocess.DEVNULL)
    return Sim(proc, port, out, err)


def wait_healthy(sim: Sim, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sim.proc.poll() is not None:
            raise AssertionError(f"vllm-sim exited {sim.proc.returncode}:\n{sim.out.read_text()}\n{sim.err.read_text()}")
        try:
            if httpx.get(sim.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError("vllm-sim did not become healthy")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = write_model_dir("llama-3.1-8b", tmp_path_factory.mktemp("model"))
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def sim(model_dir, tmp_path_factory):
    s = launch(tmp_path_factory.mktemp("sim"), [str(model_dir), "--served-model-name", NAME, "--load-format", "dummy",
                                                "--max-model-len", "4096"])
    try:
        wait_healthy(s)
        yield s
    finally:
        s.stop()


def sse(url: str, body: dict) -> list:
    """The events of one streamed response: parsed JSON objects, then "[DONE]"."""
    events: list = []
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metrics(sim: Sim) -> dict:
    text = httpx.get(sim.url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, family: str, sample: str | None = None, **labels: str) -> float:
    sample = sample or family
    return sum(s.value for s in fams[family].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


# --- the command line ---------------------------------------------------------------------------

def test_unknown_flag_is_a_usage_error():
    r = subprocess.run([*SIM, "serve", "llama-3.1-8b", "--max-num-seqs", "8", "--foo", "1"], cwd=ROOT, check=False,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "error: unrecognized arguments: --foo" in r.stderr
    watch = LogWatch(PATTERNS)
    for line in r.stderr.splitlines():
        watch.feed(line)
    assert classify_exit(r.returncode, watch).failure_class is FailureClass.INVALID_ARGS


def test_vllm_flag_spellings_and_config_file(tmp_path):
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("max_num_seqs: 32\nenable-prefix-caching: false\nenforce_eager: true\nport: 9001\n"
                   "compilation-config:\n  max_cudagraph_capture_size: 64\nserved-model-name: [a, b]\n")
    ns = cli.parse(["--gpu", "a100-80gb", "serve", "llama-3.1-8b", "--config", str(cfg), "--max-num-seqs", "64",
                    "--time-scale", "0.5", "--max_num_batched_tokens", "4096", "--max-model-len", "32K"])
    assert (ns.gpu, ns.time_scale, ns.model_tag) == ("a100-80gb", 0.5, "llama-3.1-8b")
    assert ns.max_num_seqs == 64  # the command line beats the file
    assert ns.enable_prefix_caching is False and ns.enforce_eager is True and ns.port == 9001
    assert ns.compilation_config == {"max_cudagraph_capture_size": 64}
    assert ns.served_model_name == ["a", "b"]
    assert ns.max_num_batched_tokens == 4096 and ns.max_model_len == 32768
    assert ns.host == "127.0.0.1"  # localhost unless told
    assert cli.parse(["serve", "m", "--disable-prefix-caching"]).enable_prefix_caching is False
    assert cli.parse(["serve", "m", "--no-enable-chunked-prefill"]).enable_chunked_prefill is False
    assert cli.parse(["serve", "m", "--enable-chunked-prefill"]).enable_chunked_prefill is True
    assert cli.parse(["serve", "m", "-tp", "2", "--max-model-len", "8k"]).tensor_parallel_size == 2
    assert cli.parse(["serve", "m", "--max-model-len", "8k"]).max_model_len == 8000
    assert cli.parse(["serve", "m", "-O3"]).optimization_level == "3"
    cfg.write_text("not_a_vllm_flag: 3\n")
    with pytest.raises(SystemExit) as e:
        cli.parse(["serve", "m", "--config", str(cfg)])
    assert e.value.code == 2


def test_codec_hashes_and_eos_are_deterministic():
    codec = TextCodec(None)  # ~4 bytes a token
    assert len(codec.encode("x" * 400)) == 100 and len(codec.encode("hi")) == 1
    shared = "shared system prompt " * 20  # 420 bytes: 105 tokens, 6 full blocks
    a, b = codec.encode(shared + "question one " * 20), codec.encode(shared + "another question " * 20)
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == len(a) // 16 and ha[:6] == hb[:6] and ha[6] != hb[6] and ha[-1] != hb[-1]
    lengths = [eos_length(codec.encode(f"prompt {i}")) for i in range(400)]
    assert lengths == [eos_length(codec.encode(f"prompt {i}")) for i in range(400)]
    assert 150 < sum(lengths) / len(lengths) < 400 and min(lengths) >= 1
    assert eos_length(a, min_tokens=5000) == 5000


# --- start-up -----------------------------------------------------------------------------------

def _longest_fitting_len(**values: object) -> int:
    """The largest --max-model-len that qwen2.5-32b starts with on an H100 with these engine args."""
    shape, gpu = model_shape("qwen2.5-32b"), gpu_profile("h100-80gb")

    def fits(n: int) -> bool:
        c = SimConfig.from_args({**values, "max_model_len": n}, gpu, shape)
        return plan_startup(shape, gpu, c).plan is not None

    lo, hi = 16, 32768
    assert fits(lo) and not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def test_memory_boundary_fails_as_oom_and_launcher_starts_the_one_that_fits(tmp_path):
    ok = _longest_fitting_len(gpu_memory_utilization=0.85, load_format="dummy", enforce_eager=True)
    args = ["--time-scale", "0.01", "serve", "Qwen/Qwen2.5-32B-Instruct", "--gpu-memory-utilization", "0.85",
            "--load-format", "dummy", "--enforce-eager"]
    # one token more than fits: vLLM's KV-cache error, exit 1, and our classifier says oom
    r = subprocess.run([*SIM, *args, "--max-model-len", str(ok + 1), "--port", str(free_port())], cwd=ROOT, check=False,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Engine core initialization failed" in r.stderr
    watch = LogWatch(PATTERNS)
    for line in (r.stdout + r.stderr).splitlines():
        watch.feed(line)
    f = classify_exit(r.returncode, watch)
    assert f.failure_class is FailureClass.OOM
    assert "(EngineCore pid=" in f.summary and "KV cache is needed" in f.summary
    # the one that fits, through our launcher
    port = free_port()
    spec = LaunchSpec(argv=[*SIM, *args, "--max-model-len", str(ok), "--port", str(port)], port=port,
                      log_dir=tmp_path / "logs", state_dir=tmp_path / "state", startup_timeout=60)
    e = Engine(spec)
    e.start()
    try:
        assert e.state is EngineState.READY
        card = httpx.get(e.url + "/v1/models").json()["data"][0]
        assert card["id"] == "Qwen/Qwen2.5-32B-Instruct" and card["max_model_len"] == ok
    finally:
        e.stop()
    assert e.state is EngineState.STOPPED and port_is_free("127.0.0.1", port)
    log = (tmp_path / "logs" / "engine.stdout.log").read_text()
    assert "Starting vLLM server on http://127.0.0.1:" in log and "Application startup complete." in log


def test_config_error_is_vllms_validation_error():
    r = subprocess.run([*SIM, "serve", "llama-3.1-8b", "--no-enable-chunked-prefill", "--max-model-len", "8192",
                        "--max-num-batched-tokens", "2048", "--port", str(free_port())], cwd=ROOT, check=False,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "ValidationError: 1 validation error for SchedulerConfig" in r.stderr
    assert "Value error, max_num_batched_tokens (2048) is smaller than max_model_len (8192)" in r.stderr
    watch = LogWatch(PATTERNS)
    for line in r.stderr.splitlines():
        watch.feed(line)
    assert classify_exit(1, watch).failure_class is FailureClass.INVALID_ARGS


def test_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([*SIM, "--time-scale", "0.01", "serve", "llama-3.1-8b", "--port", str(port)], cwd=ROOT, check=False,
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "[Errno 98] Address already in use" in r.stderr
    watch = LogWatch(PATTERNS)
    for line in r.stderr.splitlines():
        watch.feed(line)
    assert classify_exit(1, watch).failure_class is FailureClass.PORT_IN_USE


def test_refuses_until_started_then_stream_interval_then_sigterm(tmp_path):
    s = launch(tmp_path, ["llama-3.1-8b", "--load-format", "dummy", "--stream-interval", "3"],
               sim_opts=("--time-scale", "0.05"))  # ~1.4 s of start-up
    try:
        deadline = time.monotonic() + 30
        while "Initializing a V1 LLM engine" not in s.out.read_text():  # start-up under way: bound, not listening
            assert time.monotonic() < deadline and s.proc.poll() is None
            time.sleep(0.02)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", s.port), timeout=2).close()
        wait_healthy(s)
        ev = sse(s.url + "/v1/completions", {"prompt": "hello there", "max_tokens": 7, "ignore_eos": True,
                                             "stream": True})
        chunks = [e for e in ev if e != "[DONE]"]
        # the first token at once, then every 3 tokens, the rest with the finish
        assert [c["choices"][0]["text"].count(" ") for c in chunks] == [1, 3, 3]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    finally:
        t0 = time.monotonic()
        rc = s.stop()
        took = time.monotonic() - t0
    assert rc == 0 and took < 1.5


# --- the API ------------------------------------------------------------------------------------

def test_completion_sse_shape(sim):
    ev = sse(sim.url + "/v1/completions", {"model": NAME, "prompt": words(20), "max_tokens": 5, "ignore_eos": True,
                                           "stream": True, "stream_options": {"include_usage": True}})
    assert ev[-1] == "[DONE]"
    *tokens, usage = ev[:-1]
    assert len(tokens) == 5
    for i, c in enumerate(tokens):
        assert list(c) == ["id", "object", "created", "model", "choices"]
        assert c["object"] == "text_completion" and c["model"] == NAME and c["id"].startswith("cmpl-")
        assert c["id"] == tokens[0]["id"]
        (choice,) = c["choices"]
        assert list(choice) == ["index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids",
                                "token_ids"]
        assert choice["text"] and choice["finish_reason"] == ("length" if i == 4 else None)
    assert usage["choices"] == [] and usage["id"] == tokens[0]["id"]
    assert usage["usage"] == {"prompt_tokens": 20, "total_tokens": 25, "completion_tokens": 5}


def test_chat_sse_shape(sim):
    body = {"model": NAME, "messages": [{"role": "user", "content": words(10)}], "max_tokens": 4,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    ev = sse(sim.url + "/v1/chat/completions", body)
    assert ev[-1] == "[DONE]"
    role, *tokens, usage = ev[:-1]
    assert role["object"] == "chat.completion.chunk" and role["id"].startswith("chatcmpl-")
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]
    assert len(tokens) == 4
    assert all(t["choices"][0]["delta"]["content"] for t in tokens)
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None, None, None, "length"]
    assert "role" not in tokens[0]["choices"][0]["delta"]
    # the template adds <|user|> and <|assistant|> (one unknown token each here)
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 12, "total_tokens": 16,
                                                         "completion_tokens": 4}
    # continuous usage: every chunk counts so far
    body["stream_options"]["continuous_usage_stats"] = True
    ev = sse(sim.url + "/v1/chat/completions", body)
    assert [e["usage"]["completion_tokens"] for e in ev[:-1]] == [0, 1, 2, 3, 4, 4]


def test_simulated_eos_stops_early_and_deterministically(sim, model_dir):
    codec = TextCodec(str(model_dir / "tokenizer.json"))
    prompt = next(p for p in (words(8, offset=3000 + i) for i in range(500))
                  if 3 <= eos_length(codec.encode(p)) <= 30)
    n = eos_length(codec.encode(prompt))
    for _ in range(2):
        r = httpx.post(sim.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1000}, timeout=30).json()
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] == n
    r = httpx.post(sim.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 2
    r = httpx.post(sim.url + "/v1/completions", json={"prompt": prompt}, timeout=30).json()
    assert r["usage"]["completion_tokens"] == min(n, 16)  # vLLM's default max_tokens for completions


def test_errors_have_vllms_shape(sim):
    r = httpx.post(sim.url + "/v1/completions", json={"prompt": words(4100), "max_tokens": 1}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == "input_tokens"
    assert "maximum context length is 4096 tokens" in err["message"] and "4100 input tokens" in err["message"]
    r = httpx.post(sim.url + "/v1/completions", json={"model": "other", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert httpx.get(sim.url + "/version").json() == {"version": "0.33.0"}
    models = httpx.get(sim.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == NAME
    assert models["data"][0]["owned_by"] == "vllm" and models["data"][0]["max_model_len"] == 4096


def test_openai_client_works_unchanged(sim):
    import openai

    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="EMPTY")
    c = client.completions.create(model=NAME, prompt=words(6), max_tokens=3, extra_body={"ignore_eos": True})
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 3 and c.usage.prompt_tokens == 6
    stream = client.completions.create(model=NAME, prompt=words(6), max_tokens=3, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) and chunks[-1].usage.completion_tokens == 3
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": words(5)}],
                                          max_tokens=4, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens == 4 and chat.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": words(5)}],
                                            max_tokens=4, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 7 + 4


def test_metrics_are_vllms_and_count_what_happened(sim):
    before = metrics(sim)
    t0 = time.monotonic()
    client_e2e = 0.0
    for _ in range(3):
        t = time.monotonic()
        httpx.post(sim.url + "/v1/completions", json={"prompt": words(20), "max_tokens": 4, "ignore_eos": True},
                   timeout=30).raise_for_status()
        client_e2e += time.monotonic() - t
    t = time.monotonic()
    httpx.post(sim.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": words(10)}],
                                                       "max_tokens": 3, "ignore_eos": True}).raise_for_status()
    client_e2e += time.monotonic() - t
    assert time.monotonic() - t0 < 10
    after = metrics(sim)

    types = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
             "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
             "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
             "vllm:num_preemptions": "counter", "vllm:prefix_cache_queries": "counter",
             "vllm:prefix_cache_hits": "counter", "vllm:request_success": "counter",
             "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
             "vllm:request_time_per_output_token_seconds": "histogram",
             "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
             "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram"}
    for name, typ in types.items():
        assert after[name].type == typ, name
        for s in after[name].samples:
            assert s.labels["engine"] == "0", (name, s)
            # vLLM's cache_config_info carries the CacheConfig's fields and the engine, no model_name
            assert s.labels.get("model_name") == (None if name == "vllm:cache_config_info" else NAME), (name, s)
    info = after["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["enable_prefix_caching"] == "True"
    assert info.labels["gpu_memory_utilization"] == "0.92" and int(info.labels["num_gpu_blocks"]) > 1000
    assert {s.labels["finished_reason"] for s in after["vllm:request_success"].samples
            if s.name.endswith("_total")} == {"stop", "length", "abort", "error", "repetition"}
    les = [s.labels["le"] for s in after["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_bucket")]
    assert les[0] == "0.001" and les[-2:] == ["2560.0", "+Inf"] and len(les) == 23

    def delta(family: str, sample: str | None = None, **labels: str) -> float:
        return value(after, family, sample, **labels) - value(before, family, sample, **labels)

    assert delta("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 3 * 20 + 12
    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") == 3 * 4 + 3
    assert delta("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 4
    for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_time_per_output_token_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert delta(h, h + "_count") == 4, h
    assert delta("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 3 * 3 + 2
    assert delta("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == 72
    assert delta("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 15
    # the engine's latencies are inside what the client saw, and TTFT is part of E2E
    ttft = delta("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum")
    e2e = delta("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum")
    assert 0 < ttft < e2e <= client_e2e
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:num_requests_waiting") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0


def test_prefix_caching_through_the_server(sim):
    prefix = words(256)  # 16 full blocks
    before = metrics(sim)
    for tail in ("w1 w2 w3", "w4 w5 w6"):
        httpx.post(sim.url + "/v1/completions", json={"prompt": prefix + " " + tail, "max_tokens": 2,
                                                      "ignore_eos": True}, timeout=30).raise_for_status()
    after = metrics(sim)
    hits = value(after, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") - \
        value(before, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    queries = value(after, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") - \
        value(before, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
    assert hits == 256  # the second request found the shared 16 blocks
    assert queries == 2 * 259


def test_tokens_come_in_real_time(sim):
    """A lone stream's token gaps are the step model's decode step, without drift."""
    n = 80
    shape, gpu = model_shape(str(sim_model_dir(sim))), gpu_profile("h100-80gb")
    config = SimConfig.from_args({"max_model_len": 4096}, gpu, shape)
    req = Request("x", 10, n)
    req.num_output, req.num_computed = n // 2, 10 + n // 2 - 1  # a decode step halfway through
    expected = StepModel(shape, gpu, config).step_seconds(StepPlan([(req, 1)]))
    stamps = []
    with httpx.stream("POST", sim.url + "/v1/completions", json={"prompt": words(10), "max_tokens": n,
                                                                 "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.monotonic())
    assert len(stamps) == n
    # the median gap: a VM stall of the server or of this client lands in one or two gaps, which the median
    # ignores, while a step model or a real-time loop that drifted moves every gap
    median_gap = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
    print(f"decode step {expected * 1e3:.2f} ms, measured median gap {median_gap * 1e3:.2f} ms")
    assert 0.85 * expected < median_gap < 1.6 * expected, (median_gap, expected)


def sim_model_dir(sim: Sim) -> Path:
    return Path(json.loads(httpx.get(sim.url + "/v1/models").text)["data"][0]["root"])


def test_client_disconnect_aborts_the_request(sim):
    with httpx.stream("POST", sim.url + "/v1/completions", json={"prompt": words(50), "max_tokens": 3000,
                                                                 "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert value(metrics(sim), "vllm:num_requests_running") == 1
    deadline = time.monotonic() + 5
    while True:
        m = metrics(sim)
        if value(m, "vllm:num_requests_running") == 0 and value(m, "vllm:kv_cache_usage_perc") == 0:
            break
        assert time.monotonic() < deadline, "the aborted request kept running"
        time.sleep(0.05)
    gen = value(m, "vllm:generation_tokens", "vllm:generation_tokens_total")
    time.sleep(0.1)
    assert value(metrics(sim), "vllm:generation_tokens", "vllm:generation_tokens_total") == gen
