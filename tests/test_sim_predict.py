"""``vllm-sim predict``: autotune bench's numbers in virtual time, vLLM's start-up failures, and agreement with serve.

The agreement test runs ``vllm-sim serve`` in real time and replays one light workload on it
with ``autotune replay``, then predicts the same workload; see its docstring for the tolerance.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from autotune.measure.session import Outcome
from autotune.sim import cli
from autotune.sim.config import SimConfig
from autotune.sim.profiles import gpu_profile, model_shape
from autotune.sim.virtual import SimEngine, simulate
from autotune.workload.trace import Request, Workload
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
SIM = [sys.executable, "-m", "autotune.sim.cli"]
AUTOTUNE = [sys.executable, "-m", "autotune"]
# short prompts, no shared system prompt: the API server's own costs (tokenizing a 3k-token prompt takes
# milliseconds), which predict does not model, stay small next to the engine's
LIGHT = ["--scenario", "chat", "--rate", "4", "--requests", "30", "--prompt-tokens", "128-512", "--prefix-tokens", "0",
         "--output-tokens", "32-96"]


def predict(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*SIM, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def _ordered(d: dict) -> bool:
    return d["count"] > 0 and 0 < d["p50"] <= d["p90"] <= d["p95"] <= d["p99"] and d["mean"] > 0


def _bench_keys() -> set[str]:
    """The keys ``autotune bench --json`` writes, less what only a process has."""
    return set(Outcome(url="").to_json()) - {"url", "argv", "env", "engine_stop_s"}


def test_predict_prints_bench_metrics_and_writes_its_json(tiny_model, tmp_path):
    out = tmp_path / "p.json"
    r = predict("--gpu", "h100-80gb", "predict", "meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "128",
                "--tokenizer", str(tiny_model), "--scenario", "chat", "--rate", "6", "--requests", "60",
                "--slo", "p95:ttft<2s", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    for row in ("request throughput", "output throughput", "total token throughput", "TTFT", "TPOT", "ITL", "E2E"):
        assert row in r.stdout
    d = json.loads(out.read_text())
    assert _bench_keys() <= set(d)
    assert d["predicted"] is True and d["gpu"] == "NVIDIA H100 80GB HBM3" and d["gpu_profile"] == "h100-80gb"
    assert d["vllm_args"]["max_num_seqs"] == 128 and d["kv_cache_tokens"] > 0
    assert d["failure"] is None and d["failure_class"] is None and d["slos_hold"] is True
    assert d["engine_start_s"] > 0  # the simulated start-up
    m = d["metrics"]
    assert m["requests"] == m["completed"] == 60 and m["failed"] == 0
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0
    assert m["total_token_throughput"] > m["output_throughput"]
    for metric in ("ttft", "tpot", "itl", "e2e"):
        assert _ordered(m[metric]), (metric, m[metric])
    assert m["e2e"]["p50"] > m["ttft"]["p50"]
    assert len(d["slos"]) == 1 and d["slos"][0]["holds"] is True
    assert d["slos"][0]["measured"] == pytest.approx(m["ttft"]["p95"], rel=0.05)


@pytest.mark.parametrize("gpu,flags,text", [
    ("a10-24gb", ["--gpu-memory-utilization", "0.3"], "ValueError: No available memory for the cache blocks"),
    ("a10-24gb", ["--max-model-len", "131072"],
     "ValueError: To serve at least one request with the model's max seq len (131072)"),
])
def test_a_config_that_cannot_start_prints_vllms_failure(tmp_path, gpu, flags, text):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0.0, "prompt": "hello there", "output_tokens": 4}\n')
    out = tmp_path / "f.json"
    r = predict("--gpu", gpu, "predict", "llama-3.1-8b", *flags, "--workload", str(trace), "--json", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    # vLLM's split: the engine core's root cause on stdout, the API server's generic error on stderr
    assert "(EngineCore pid=" in r.stdout and text in r.stdout
    assert "Engine core initialization failed" in r.stderr
    assert "would not start (oom)" in r.stderr.splitlines()[-1]
    d = json.loads(out.read_text())
    assert d["failure_class"] == "oom" and text in d["failure"]["summary"] and d["failure"]["exit_code"] == 1
    assert d["metrics"] is None and d["slos_hold"] is False and d["predicted"] is True


def test_a_config_vllm_refuses_is_invalid_args(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0.0, "prompt": "hello there", "output_tokens": 4}\n')
    out = tmp_path / "f.json"
    r = predict("predict", "llama-3.1-8b", "--max-num-batched-tokens", "8", "--workload", str(trace),
                "--json", str(out))
    assert r.returncode == 1
    assert "1 validation error for SchedulerConfig" in r.stderr and "must be greater than or equal to" in r.stderr
    assert json.loads(out.read_text())["failure_class"] == "invalid-args"


@pytest.mark.parametrize("args,says", [
    (["llama-3.1-8b", "--scenario", "chat", "--rate", "4", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["llama-3.1-8b", "--rate", "4"], "give a workload"),
    (["llama-3.1-8b", "--scenario", "chat", "--rate", "0", "--tokenizer", "models/tiny-llama"], "must be positive"),
    (["llama-3.1-8b", "--scenario", "chats", "--rate", "4"], "unknown scenario 'chats'"),
    (["llama-3.1-8b", "--workload", "no/such.jsonl"], "does not exist"),
    (["llama-3.1-8b", "--scenario", "chat", "--rate", "4", "--max-concurrency", "0"], "--max-concurrency"),
    (["llama-3.1-8b", "--scenario", "chat", "--rate", "4", "--requests", "0"], "--requests must be at least 1"),
    (["llama-3.1-8b", "--scenario", "chat", "--rate", "4", "--load", "nan"], "--load must be a positive number"),
    (["llama-3.1-8b", "--scenario", "chat", "--rate", "4", "--warmup", "-1"], "--warmup must be 0 or more"),
    (["llama-3.1-8b", "--scenario", "chat", "--rate", "4", "--request-timeout", "5"], "unrecognized arguments"),
    (["llama-3.1-8b", "--scenario", "chat", "--rate", "4", "--slo", "ttft<<1"], "SLO"),
    (["--scenario", "chat", "--rate", "4"], "required: MODEL"),
    (["llama-3.1-8b", "--gpu-total-memory", "lots", "--scenario", "chat", "--rate", "4"], "--gpu-total-memory"),
    (["llama-3.1-70b", "--quantization", "awq", "--scenario", "chat", "--rate", "4"],
     "vllm-sim does not model --quantization awq"),
    (["llama-3.1-8b", "-dp", "2", "--speculative-config", '{"method": "ngram"}', "--scenario", "chat", "--rate", "4"],
     "does not model --data-parallel-size 2, --speculative-config"),
])
def test_bad_usage_is_one_line_and_exit_2(args, says):
    r = predict("predict", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm-sim predict: error: ") and says in lines[0], r.stderr


def test_a_built_in_model_needs_no_tokenizer_and_a_70b_on_an_a10_is_vllms_oom(capsys):
    """Token counts are all the simulator needs: the scenario's lengths and prefix groups, no prompt text."""
    assert cli.main(["--gpu", "h100-80gb", "predict", "llama-3.1-8b", "--scenario", "chat", "--rate", "4",
                     "--requests", "12"]) == 0
    out, err = capsys.readouterr()
    assert "request throughput" in out and "TTFT" in out and err == ""
    assert cli.main(["--gpu", "a10-24gb", "predict", "meta-llama/Llama-3.1-70B-Instruct", "--scenario", "chat",
                     "--rate", "4", "--requests", "12"]) == 1
    out, err = capsys.readouterr()
    assert "torch.OutOfMemoryError: CUDA out of memory" in out
    assert err.splitlines()[-1].startswith("vllm-sim predict: the engine would not start (oom)")


def test_a_model_directory_without_a_tokenizer_says_so_once(tmp_path, capsys):
    from autotune.sim.profiles import write_model_dir

    model = write_model_dir("llama-3.1-8b", tmp_path / "llama")
    assert cli.main(["predict", str(model), "--scenario", "chat", "--rate", "4", "--requests", "8"]) == 0
    out, err = capsys.readouterr()
    assert "request throughput" in out
    assert err.count("\n") == 1 and "has no tokenizer.json: prompts are the workload's token counts" in err


def test_a_workload_file_is_replayed_whole_unless_requests_says_otherwise(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"arrival_s": {0.01 * i:.2f}, "prompt_tokens": 64, "output_tokens": 4}}\n'
                             for i in range(250)))
    for extra, n in (([], 250), (["--requests", "30"], 30)):
        out_json = tmp_path / f"{n}.json"
        assert cli.main(["predict", "llama-3.1-8b", "--workload", str(trace), "--warmup", "0", *extra,
                         "--json", str(out_json)]) == 0
        err = capsys.readouterr().err
        assert f"replaying {n} requests" in err
        assert json.loads(out_json.read_text())["metrics"]["requests"] == n


def test_a_card_of_another_memory_size_sizes_the_kv_cache_by_it(tmp_path, capsys):
    """An H100 64GB is the H100 profile with 16 GiB less: the KV cache loses what gpu_memory_utilization gives of it
    (batching given: vLLM's defaults for it depend on the memory size, and with them the activation peak)."""
    from autotune.sim.kind import VllmSimKind
    from autotune.sim.profiles import GPUS

    kv = {}
    for total in ("", "64GiB"):
        out = tmp_path / f"{total or 'full'}.json"
        argv = ["--gpu", "h100-80gb", *(["--gpu-total-memory", total] if total else []), "predict", "llama-3.1-8b",
                "--gpu-memory-utilization", "0.9", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
                "--scenario", "chat", "--rate", "2", "--requests", "4", "--json", str(out)]
        assert cli.main(argv) == 0
        d = json.loads(out.read_text())
        kv[total] = d["kv_cache_tokens"]
        assert d["gpu_memory_bytes"] == (64 << 30 if total else GPUS["h100-80gb"].memory_bytes)
    assert capsys.readouterr().err == ""  # a measured profile: no note
    per_token = model_shape("llama-3.1-8b").kv_bytes_per_token()
    lost = 0.9 * (GPUS["h100-80gb"].memory_bytes - (64 << 30)) / per_token
    assert kv[""] - kv["64GiB"] == pytest.approx(lost, abs=2 * 16)  # within a block or two of rounding
    (info,) = VllmSimKind().devices(["vllm-sim", "--gpu", "h100-80gb", "--gpu-total-memory=64GiB", "serve"])
    assert info.name == GPUS["h100-80gb"].name and info.total_bytes == 64 << 30


@pytest.mark.parametrize("extra,says", [
    ({"kv_lora_rank": 512}, "multi-head latent attention (kv_lora_rank)"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantized weights (bitsandbytes)"),
    ({"layer_types": ["linear_attention", "full_attention"] * 16}, "hybrid attention (linear_attention layers)"),
])
def test_a_model_the_simulator_cannot_express_is_refused_by_name(tmp_path, extra, says):
    from autotune.sim.profiles import MODELS

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**MODELS["llama-3.1-8b"], **extra}))
    r = predict("predict", str(model), "--scenario", "chat", "--rate", "2")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"vllm-sim predict: error: vllm-sim does not model {model}: {says}; measure it "
                                     "on the GPU (autotune bench)"]


def test_a_model_it_cannot_find_is_a_usage_error_of_one_line(capsys):
    """predict says so as every bad input is said, exit 2 (serve keeps vLLM's OSError and exit 1: it plays vLLM)."""
    assert cli.main(["predict", "llama-9b", "--scenario", "chat", "--rate", "2"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("vllm-sim predict: error: model 'llama-9b': not a directory with config.json"), line


def test_a_profile_of_datasheet_figures_says_so(capsys):
    assert cli.main(["--gpu", "l4-24gb", "predict", "llama-3.1-8b", "--max-model-len", "8192", "--scenario", "chat",
                     "--rate", "1", "--requests", "4"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == ["vllm-sim predict: note: the l4-24gb profile is its datasheet's peaks with default "
                                "shares: no measurement or public run calibrates it"]


def test_serve_and_predict_share_one_command_line():
    argv = ["--gpu", "a100-80gb", "{}", "llama-3.1-8b", "-tp", "2", "--max-model-len", "8k", "--max_num_seqs", "64",
            "--no-enable-prefix-caching"]
    serve = cli.parse([a.replace("{}", "serve") for a in argv])
    pred = cli.parse([a.replace("{}", "predict") for a in argv] + ["--scenario", "chat", "--rate", "2"])
    assert (serve.command, pred.command) == ("serve", "predict")
    for key in ("gpu", "tensor_parallel_size", "max_model_len", "max_num_seqs", "enable_prefix_caching", "model_tag"):
        assert getattr(serve, key) == getattr(pred, key)
    assert pred.scenario == "chat" and pred.rate == 2.0 and not hasattr(serve, "scenario")


def _engine(**flags) -> SimEngine:
    gpu, shape = gpu_profile("h100-80gb"), model_shape("llama-3.1-8b")
    return SimEngine.start(shape, gpu, SimConfig.from_args(flags, gpu, shape))


def test_max_concurrency_holds_requests_back_as_the_client_does():
    w = Workload(tuple(Request(arrival_s=0.01 * i, output_tokens=20, prompt_tokens=300) for i in range(6)), "burst")
    free = simulate(_engine(), w)
    capped = simulate(_engine(), w, max_concurrency=1)
    assert [r.sent_s for r in free] == [r.scheduled_s for r in free]
    ends = [r.sent_s + r.e2e for r in capped]
    for prev_end, r in zip(ends, capped[1:]):
        assert r.sent_s == pytest.approx(prev_end)  # sent when the one before finished, not before
    assert max(r.sent_s - r.scheduled_s for r in capped) > 0  # the send lag shows the wait
    assert all(r.success for r in capped) and [r.output_tokens for r in capped] == [20] * 6


def test_prompt_ids_share_prefix_cache_blocks_where_tokens_agree():
    w = Workload((Request(0.0, 8, prompt_tokens=0), Request(1.0, 8, prompt_tokens=0)), "twice")
    same = [list(range(2000)), list(range(2000))]
    other = [list(range(2000)), list(range(5000, 7000))]
    hit = simulate(_engine(), w, prompt_ids=same)
    miss = simulate(_engine(), w, prompt_ids=other)
    assert [r.prompt_tokens for r in hit] == [2000, 2000]
    assert hit[1].ttft < miss[1].ttft * 0.5  # the second prefill is all cache hits but the last block


def _wait_healthy(proc: subprocess.Popen, url: str, err: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, err.read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "vllm-sim did not become healthy"
        time.sleep(0.1)


def test_server_and_predict_agree_on_one_workload(tiny_model, tmp_path):
    """One light workload replayed on ``vllm-sim serve`` (real time) and predicted in virtual time.

    Exactly equal: completed requests, prompt and output tokens (the same requests, tokenized
    by the same tokenizer, the same clamping). Within tolerance:

    - output throughput within 10 %: at 4 req/s, 30 requests, ~2 in flight, throughput is set
      by the arrivals, and the span hardly moves when the host stalls (measured: within 0.1 %);
    - median TTFT: ``-5 ms <= served - predicted <= 40 ms``. The served TTFT adds what predict
      does not model (HTTP, tokenizing a prompt of a few hundred tokens, SSE, the replay
      client): 4.5-6.2 ms on this 2-core VM (15.2-16.9 vs 10.7 ms over 3 runs, 4.6 ms with
      both cores busy with other work); 40 ms leaves room for a shared VM stalling the server
      or the client during a good part of the run, while a
      server that prefilled other lengths, or a client model that sent requests at other
      times, shows as a gap of a decode step or more on every request's TTFT;
    - median TPOT within 20 %: both are the StepModel's decode steps (measured: equal to
      0.1 ms); the real-time engine absorbs a host's lag up to 0.25 s without stretching steps.

    Requests: 30 at 4 req/s (about 8 s of real time), short prompts, no shared prefix (LIGHT).
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    err = tmp_path / "serve.err"
    proc = subprocess.Popen([*SIM, "--gpu", "h100-80gb", "--time-scale", "0.01", "serve", "llama-3.1-8b",
                             "--tokenizer", str(tiny_model), "--port", str(port)],
                            cwd=ROOT, stdout=(tmp_path / "serve.out").open("wb"), stderr=err.open("wb"),
                            stdin=subprocess.DEVNULL)
    try:
        _wait_healthy(proc, url, err)
        r = subprocess.run([*AUTOTUNE, "replay", "--url", url, *LIGHT, "--tokenizer", str(tiny_model),
                            "--json", str(tmp_path / "served.json")],
                           cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    p = predict("--gpu", "h100-80gb", "predict", "llama-3.1-8b", *LIGHT, "--tokenizer", str(tiny_model),
                "--json", str(tmp_path / "predicted.json"))
    assert p.returncode == 0, p.stdout + p.stderr
    served = json.loads((tmp_path / "served.json").read_text())["metrics"]
    pred = json.loads((tmp_path / "predicted.json").read_text())["metrics"]
    for key in ("completed", "prompt_tokens", "output_tokens"):
        assert served[key] == pred[key], key
    assert served["completed"] == 30
    assert pred["output_throughput"] == pytest.approx(served["output_throughput"], rel=0.10)
    gap = served["ttft"]["p50"] - pred["ttft"]["p50"]
    assert -0.005 <= gap <= 0.040, (served["ttft"], pred["ttft"])
    assert pred["tpot"]["p50"] == pytest.approx(served["tpot"]["p50"], rel=0.20)
