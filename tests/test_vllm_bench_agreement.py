"""`autotune replay` and `vllm bench serve`, side by side on the same server and the same requests.

The server is the fixed-timing one (TTFT 50 ms, 10 ms per token) streaming like vLLM with
``--stream-interval 4`` (chunks of 1, 4, 4, ... tokens), so a client that counted chunks
instead of the usage chunk's tokens, or divided by chunks for TPOT, would disagree. Both
clients send 40 completions of 32 output tokens (``ignore_eos``) at 8 requests/s with
burstiness 1000 (gamma gaps with a 3 % coefficient of variation: close to evenly spaced, so
the two arrival sequences, drawn by different generators, offer the same load).

Tolerances (what a 2-core host under load still meets; a miss means a definition differs):

- median TTFT within 10 ms of each other (20 % of the server's 50 ms); both clients measured
  3-5 ms over the server's TTFT on an idle host.
- output throughput within 5 %. Measured: about 2.3 % apart, and that part is systematic:
  ``vllm bench serve`` starts its clock one inter-arrival gap (1/rate) before its first send
  and spreads N requests over N/rate, where autotune times from the first send to the last
  end, so vLLM's duration is longer by about 1/rate (0.125 s of ~5.3 s).
- median TPOT within 1 ms (both 10 ms: tokens from the usage chunk, not chunks).
- the same total output tokens (1280) and no failures on either side.

vLLM's ``custom`` dataset needs pandas, which vLLM's CPU build does not install, so vLLM
reads ``--dataset-name random`` with fixed lengths (16 prompt, 32 output tokens), and
autotune reads the same lengths from a vllm bench custom JSONL file (``prompt`` and
``output_tokens``), one of its workload formats. The fixed-timing server ignores prompt text.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_replay import fixed_timing_server, own_session_dying_with_parent

TTFT_MS, ITL_MS, STREAM_INTERVAL = 50.0, 10.0, 4
REQUESTS, OUTPUT_TOKENS, RATE, BURSTINESS = 40, 32, 8.0, 1000.0

TTFT_TOLERANCE_MS = 10.0
THROUGHPUT_TOLERANCE = 0.05
TPOT_TOLERANCE_MS = 1.0


def run_owned(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a command in its own process group; the whole group is killed whatever happens (and the command
    itself if this process dies)."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, preexec_fn=own_session_dying_with_parent,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(argv, proc.returncode, out, "")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def vllm_bench(url: str, tokenizer: Path, result_dir: Path) -> dict:
    exe = Path(sys.executable).parent / "vllm"
    if not exe.exists():
        pytest.fail(f"real vLLM is not installed beside {sys.executable}: run scripts/install_cpu.sh")
    argv = [str(exe), "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", "fixed-timing", "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", str(OUTPUT_TOKENS),
            "--random-range-ratio", "0", "--num-prompts", str(REQUESTS), "--request-rate", str(RATE),
            "--burstiness", str(BURSTINESS), "--seed", "0", "--ignore-eos", "--disable-tqdm",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", "vllm-bench.json"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CACHE_ROOT": str(result_dir / "vllm-cache"), "XDG_CACHE_HOME": str(result_dir / "cache")}
    done = run_owned(argv, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:]
    return json.loads((result_dir / "vllm-bench.json").read_text())


def autotune_replay(url: str, workload: Path, out: Path, workers: int) -> dict:
    argv = [sys.executable, "-m", "autotune", "replay", "--url", url, "--workload", str(workload),
            "--rate", str(RATE), "--burstiness", str(BURSTINESS), "--seed", "0", "--warmup", "0", "--json", str(out),
            "--workers", str(workers)]
    done = run_owned(argv, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]
    return json.loads(out.read_text())["metrics"]


def test_autotune_replay_agrees_with_vllm_bench_serve(tiny_model, tmp_path):
    """In one process and split across three worker processes alike."""
    workload = tmp_path / "custom.jsonl"  # vllm bench's custom JSONL format
    workload.write_text("".join(json.dumps({"prompt": f"request {i}: tell me about the sea",
                                            "output_tokens": OUTPUT_TOKENS}) + "\n" for i in range(REQUESTS)))
    with fixed_timing_server(TTFT_MS, ITL_MS, "--stream-interval", str(STREAM_INTERVAL)) as url:
        vb = vllm_bench(url, tiny_model, tmp_path)
        ats = {w: autotune_replay(url, workload, tmp_path / f"autotune-{w}.json", w) for w in (1, 3)}
    for workers, at in ats.items():
        agree(vb, at, workers)


def agree(vb: dict, at: dict, workers: int) -> None:
    print(f"{workers} worker(s): median TTFT ms: vllm bench {vb['median_ttft_ms']:.2f}, autotune "
          f"{at['ttft']['p50'] * 1000:.2f}; output tok/s: vllm bench {vb['output_throughput']:.1f}, autotune "
          f"{at['output_throughput']:.1f}; median TPOT ms: vllm bench {vb['median_tpot_ms']:.2f}, autotune "
          f"{at['tpot']['p50'] * 1000:.2f}; duration s: vllm bench {vb['duration']:.3f}, autotune {at['duration_s']:.3f}")
    assert (vb["completed"], vb["failed"]) == (REQUESTS, 0)
    assert (at["completed"], at["failed"]) == (REQUESTS, 0)
    assert vb["total_output_tokens"] == at["output_tokens"] == REQUESTS * OUTPUT_TOKENS

    vb_ttft, at_ttft = vb["median_ttft_ms"], at["ttft"]["p50"] * 1000
    assert vb_ttft >= TTFT_MS and at_ttft >= TTFT_MS  # no client sees a token before the server sends it
    assert abs(vb_ttft - at_ttft) <= TTFT_TOLERANCE_MS, (workers, vb_ttft, at_ttft)

    vb_tput, at_tput = vb["output_throughput"], at["output_throughput"]
    assert abs(at_tput - vb_tput) / vb_tput <= THROUGHPUT_TOLERANCE, (workers, vb_tput, at_tput)

    vb_tpot, at_tpot = vb["median_tpot_ms"], at["tpot"]["p50"] * 1000
    assert vb_tpot == pytest.approx(ITL_MS, abs=TPOT_TOLERANCE_MS)
    assert abs(vb_tpot - at_tpot) <= TPOT_TOLERANCE_MS, (workers, vb_tpot, at_tpot)
    # ITL is per chunk for both: about STREAM_INTERVAL tokens' time apart
    assert at["itl"]["p50"] * 1000 == pytest.approx(vb["median_itl_ms"], rel=0.25)
