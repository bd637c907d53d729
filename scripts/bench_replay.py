#!/usr/bin/env python3
"""At what rate does a load client start to set the numbers it measures? Measured against a server whose timings
are exact, at rising rates, for autotune's replay and ``vllm bench serve`` side by side in one run.

    .venv/bin/python scripts/bench_replay.py [--rates 50,100,200,300,450,600] [--seconds 8] [--tokens 128]
        [--workers 1,2] [--no-vllm] [--out runs/bench_replay.json]

The server (scripts/fixed_timing_server.c, compiled with cc; one send(2) a token) writes every stream's first
token 5 ms after reading the request and one token every 5 ms after it, and records what it did. The client runs
on the first core, the server on the second. Each row: the offered rate and output tokens/s; the client's TTFT p50
and p99 against the server's own (truth); TPOT p50 (truth 5 ms); the client's CPU per streamed token (start-up
excluded) and the kernel's share of it; the server's CPU per token; the client's loop lag p99 and whether autotune
called the run client-bound. A client "holds" a rate while its p99 TTFT is within 2 ms of the truth's (the drift
column); the table ends with the highest rate each client held. Rows where the server wrote its first tokens late
say so: the truth is still what it did.
For an older autotune (before worker processes) beside this one: PYTHONPATH=/old/checkout ... --workers 1 --no-vllm.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import psutil

from autotune.measure import replay as replay_module
from autotune.measure.metrics import summarize
from autotune.measure.replay import ReplayOptions, run_replay
from autotune.workload.trace import Request, Workload

# an older autotune (before worker processes), so that a checkout of it can be measured beside this one
keep_workers = getattr(replay_module, "keep_workers", contextlib.nullcontext)
HAS_WORKERS = "workers" in {f.name for f in dataclasses.fields(ReplayOptions)}

ROOT = Path(__file__).resolve().parent.parent
TTFT_MS = ITL_MS = 5.0
HOLD_MS = 2.0  # a client holds a rate while its p99 TTFT is this close to the server's


def start_server(port: int, pin: bool, build: Path) -> subprocess.Popen:
    """The fixed-timing server, compiled from scripts/fixed_timing_server.c into ``build``."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("bench_replay: the fixed-timing server is C: install a compiler (apt-get install gcc)")
    exe = build / "fixed_timing_server"
    subprocess.run([cc, "-O2", "-o", str(exe), str(ROOT / "scripts/fixed_timing_server.c")], check=True)
    proc = subprocess.Popen([str(exe), "--port", str(port), "--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS)])
    if pin and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(proc.pid, {1})
    for _ in range(200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.05)
    raise SystemExit("bench_replay: the fixed-timing server did not start")


def truth(url: str) -> np.ndarray:
    """The server's TTFTs (s) since it was last asked, as it wrote them: the drift is measured against these, so a
    server running late moves the truth, not the drift. Where its first tokens left well after their time, the row
    says so (the rate is then near the server's own limit)."""
    seen = httpx.get(url + "/truth", timeout=30).json()
    ttfts = np.array([v["ttft"] for v in seen.values()])
    late = float(np.percentile(ttfts, 99)) - TTFT_MS / 1000 if seen else 0.0
    if late > 0.002:
        print(f"  (the server wrote its first tokens up to {late * 1000:.1f} ms late at p99: near its own limit)")
    return ttfts


def even(n: int, rate: float, tokens: int) -> Workload:
    return Workload(tuple(Request(i / rate, tokens, prompt=f"request {i}") for i in range(n)))


def autotune_row(url: str, rate: float, seconds: float, tokens: int, workers: int) -> dict:
    me = psutil.Process()
    options = ReplayOptions(warmup_requests=8, **({"workers": workers} if HAS_WORKERS else {}))
    with keep_workers():
        run_replay(url, even(8, 100.0, tokens), options)  # start-up: imports, connections, workers
        truth(url)
        cpu0 = _cpu(me)
        rep = run_replay(url, even(int(rate * seconds), rate, tokens), options)
        cpu, kernel = _cpu(me) - cpu0
    s = summarize(rep.results)
    return {"client": f"autotune, {workers} worker{'s' if workers > 1 else ''}", "rate": rate,
            "output_tok_s": s.output_throughput, "failed": s.failed, "ttft_p50": s.ttft.p50, "ttft_p99": s.ttft.p99,
            "tpot_p50": s.tpot.p50, "tokens": s.output_tokens, "cpu_us_per_token": cpu / max(s.output_tokens, 1) * 1e6,
            "kernel_us_per_token": kernel / max(s.output_tokens, 1) * 1e6,
            "loop_lag_p99": rep.loop_lag.p99 if HAS_WORKERS else None,
            "client_bound": rep.client_bound() if HAS_WORKERS else None, "truth": truth(url)}


SERVER_PID = 0


def _cpu(p: psutil.Process) -> np.ndarray:
    """CPU seconds of this process and its children (the server's left out), living or reaped: in all, and of it
    in the kernel."""
    t = p.cpu_times()
    total = np.array([t.user + t.system + t.children_user + t.children_system, t.system + t.children_system])
    for c in p.children(recursive=True):
        if c.pid == SERVER_PID:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            ct = c.cpu_times()
            total += [ct.user + ct.system, ct.system]
    return total


def vllm_row(url: str, rate: float, seconds: float, tokens: int, tokenizer: Path, tmp: Path) -> dict | None:
    exe = Path(sys.executable).parent / "vllm"
    if not exe.exists():
        return None
    n = int(rate * seconds)

    def bench(prompts: int, req_rate: float) -> tuple[dict, float]:
        argv = [str(exe), "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
                "--model", "fixed-timing", "--tokenizer", str(tokenizer), "--dataset-name", "random",
                "--random-input-len", "16", "--random-output-len", str(tokens), "--random-range-ratio", "0",
                "--num-prompts", str(prompts), "--request-rate", str(req_rate), "--burstiness", "1000", "--seed", "0",
                "--ignore-eos", "--disable-tqdm", "--num-warmups", "0", "--percentile-metrics", "ttft,tpot",
                "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(tmp),
                "--result-filename", "vllm-bench.json"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), "XDG_CACHE_HOME": str(tmp / "cache")}
        proc = psutil.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        cpu = np.zeros(2)
        while proc.poll() is None:
            try:
                cpu = _cpu(proc)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        if proc.returncode != 0:
            raise SystemExit(f"bench_replay: vllm bench serve failed (exit {proc.returncode})")
        return json.loads((tmp / "vllm-bench.json").read_text()), cpu

    _, startup_cpu = bench(1, 100.0)  # its start-up alone (imports, tokenizer, one request)
    truth(url)
    result, cpu = bench(n, rate)
    tokens = max(result["total_output_tokens"], 1)
    return {"client": "vllm bench serve", "rate": rate, "output_tok_s": result["output_throughput"],
            "failed": result["failed"], "ttft_p50": result["median_ttft_ms"] / 1000,
            "ttft_p99": result["p99_ttft_ms"] / 1000, "tpot_p50": result["median_tpot_ms"] / 1000,
            "tokens": tokens, "cpu_us_per_token": (cpu - startup_cpu)[0] / tokens * 1e6,
            "kernel_us_per_token": (cpu - startup_cpu)[1] / tokens * 1e6,
            "loop_lag_p99": None, "client_bound": None, "truth": truth(url)}


def held(row: dict) -> bool:
    return row["failed"] == 0 and row["ttft_p99"] - float(np.percentile(row["truth"], 99)) <= HOLD_MS / 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="50,100,200,300,450,600")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--workers", default="1,2", help="autotune's worker counts to compare")
    ap.add_argument("--port", type=int, default=8291)
    ap.add_argument("--no-vllm", action="store_true", help="leave vllm bench serve out")
    ap.add_argument("--no-pin", action="store_true", help="leave the client and server on every core")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_replay.json"))
    a = ap.parse_args(argv)
    rates = [float(x) for x in a.rates.split(",")]
    if not a.no_pin:
        os.sched_setaffinity(0, {0})
    global SERVER_PID
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(a.port, pin=not a.no_pin, build=Path(tmp))
        SERVER_PID = server.pid
        url = f"http://127.0.0.1:{a.port}"
        try:
            tokenizer = Path(tmp) / "tiny-llama"
            if not a.no_vllm:
                subprocess.run([sys.executable, str(ROOT / "scripts/build_tiny_model.py"), str(tokenizer)],
                               check=True, stdout=subprocess.DEVNULL)
            print(f"{'client':<22}{'req/s':>7}{'out tok/s':>11}{'TTFT p50':>10}{'p99':>8}{'truth p99':>11}"
                  f"{'drift':>8}{'TPOT p50':>10}{'CPU us/tok (kernel)':>20}{'server':>9}{'loop lag p99':>14}  verdict")
            for rate in rates:
                for w in (int(x) for x in a.workers.split(",")):
                    rows.append(_with_server_cpu(server, autotune_row, url, rate, a.seconds, a.tokens, w))
                    _print(rows[-1])
                if not a.no_vllm:
                    row = _with_server_cpu(server, vllm_row, url, rate, a.seconds, a.tokens, tokenizer, Path(tmp))
                    if row:
                        rows.append(row)
                        _print(row)
        finally:
            server.terminate()
            server.wait()
    print(f"highest rate whose p99 TTFT stays within {HOLD_MS:.0f} ms of the server's:")
    for client in dict.fromkeys(r["client"] for r in rows):
        ok = [r for r in rows if r["client"] == client and held(r)]
        best = max(ok, key=lambda r: r["rate"]) if ok else None
        print(f"  {client:<22}" + (f"{best['rate']:.0f} req/s, {best['output_tok_s']:,.0f} output tok/s" if best
                                   else "none of the rates tried"))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps([{**r, "truth": None, "truth_ttft_p99": float(np.percentile(r["truth"], 99))}
                                 for r in rows], indent=2) + "\n")
    return 0


def _with_server_cpu(server: subprocess.Popen, row: Callable[..., dict | None], *args: object) -> dict | None:
    """``row(*args)``, with the server's CPU per token over all of it (start-up runs included: an upper bound)."""
    cpu = lambda: sum(psutil.Process(server.pid).cpu_times()[:2])  # noqa: E731
    before = cpu()
    r = row(*args)
    return r and {**r, "server_us_per_token": (cpu() - before) / r["tokens"] * 1e6}


def _print(r: dict) -> None:
    ms = lambda x: "-" if x is None else f"{x * 1000:.1f}"  # noqa: E731
    verdict = ("holds" if held(r) else "drifts") + (", client-bound" if r["client_bound"] else "")
    truth_p99 = float(np.percentile(r["truth"], 99))
    cpu = f"{r['cpu_us_per_token']:.1f} ({r['kernel_us_per_token']:.1f})"
    print(f"{r['client']:<22}{r['rate']:>7.0f}{r['output_tok_s']:>11,.0f}{ms(r['ttft_p50']):>10}{ms(r['ttft_p99']):>8}"
          f"{ms(truth_p99):>11}{ms(r['ttft_p99'] - truth_p99):>8}{ms(r['tpot_p50']):>10}{cpu:>16}"
          f"{r['server_us_per_token']:>9.1f}{ms(r['loop_lag_p99']):>14}  {verdict}")


if __name__ == "__main__":
    sys.exit(main())
