#!/usr/bin/env python3
"""How accurate and how fast is the replay client? Measured against a server with known timings.

    .venv/bin/python scripts/bench_replay.py [--rates 300,500,700] [--seconds 10] [--out runs/bench_replay.json]

The fixed-timing server (autotune.sim.fixed_timing) runs in its own process, pinned to the
second core; the client is pinned to the first, so "one core" is literal. Two parts:

1. accuracy: 500 requests at 50 req/s, 16 tokens each, server TTFT 50 ms and ITL 10 ms; the
   client's TTFT and ITL are compared per request with the times the server recorded for itself
   (from reading the request to writing each chunk);
2. capacity: evenly spaced open-loop arrivals at each rate for --seconds, 8 output tokens,
   TTFT 20 ms, ITL 5 ms; reports completed requests/s, the lag between scheduled and actual
   send (p50/p99), and the client's CPU time per request.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from autotune.measure.metrics import summarize
from autotune.measure.replay import ReplayOptions, run_replay
from autotune.workload.trace import Request, Workload


def start_server(port: int, ttft_ms: float, itl_ms: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "autotune.sim.fixed_timing", "--port", str(port),
                             "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms)])
    if os.cpu_count() and os.cpu_count() > 1:
        os.sched_setaffinity(proc.pid, {1})
    for _ in range(200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.05)
    raise SystemExit("fixed-timing server did not start")


def even(n: int, rate: float, out: int, tag: str) -> Workload:
    return Workload(tuple(Request(i / rate, out, prompt=f"{tag}-{i}") for i in range(n)))


def accuracy(port: int) -> dict:
    server = start_server(port, 50.0, 10.0)
    try:
        url = f"http://127.0.0.1:{port}"
        rep = run_replay(url, even(500, 50.0, 16, "acc"), ReplayOptions(warmup_requests=8))
        truth = httpx.get(url + "/truth").json()
    finally:
        server.terminate()
        server.wait()
    runs = {k.rsplit("-", 1)[0] for k in truth if k.startswith("autotune-")}
    run = max(runs)
    ttft = np.array([r.ttft - truth[f"{run}-{r.index}"]["ttft"] for r in rep.results])
    itl = np.array([a - b for r in rep.results for a, b in zip(r.itl, truth[f"{run}-{r.index}"]["itl"])])

    def stats(x: np.ndarray) -> dict:
        a = np.abs(x) * 1000
        return {"mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)),
                "p99_ms": float(np.percentile(a, 99)), "bias_ms": float(x.mean() * 1000)}

    return {"requests": len(rep.results), "failed": sum(not r.success for r in rep.results),
            "ttft_error": stats(ttft), "itl_error": stats(itl)}


def capacity(port: int, rate: float, seconds: float) -> dict:
    server = start_server(port, 20.0, 5.0)
    try:
        n = int(rate * seconds)
        cpu0 = time.process_time()
        rep = run_replay(f"http://127.0.0.1:{port}", even(n, rate, 8, f"cap{rate}"), ReplayOptions(warmup_requests=16))
        cpu = time.process_time() - cpu0
    finally:
        server.terminate()
        server.wait()
    s = summarize(rep.results)
    return {"rate": rate, "requests": n, "failed": s.failed, "completed_rps": s.request_throughput,
            "send_lag_p50_ms": s.send_lag.p50 * 1000, "send_lag_p99_ms": s.send_lag.p99 * 1000,
            "client_cpu_ms_per_request": cpu / n * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="300,500,700")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--port", type=int, default=8291)
    ap.add_argument("--out", type=Path, default=Path("runs/bench_replay.json"))
    a = ap.parse_args()
    os.sched_setaffinity(0, {0})
    acc = accuracy(a.port)
    print(f"accuracy ({acc['requests']} requests, {acc['failed']} failed), |client - server| in ms:")
    for k in ("ttft_error", "itl_error"):
        e = acc[k]
        print(f"  {k.split('_')[0].upper():5} mean {e['mean_ms']:.2f}  p50 {e['p50_ms']:.2f}  p99 {e['p99_ms']:.2f}  (bias {e['bias_ms']:+.2f})")
    caps = []
    print("capacity (one core, 8-token streams):")
    print("  rate req/s | completed req/s | failed | send lag p50 ms | p99 ms | client CPU ms/request")
    for rate in (float(x) for x in a.rates.split(",")):
        c = capacity(a.port, rate, a.seconds)
        caps.append(c)
        print(f"  {rate:10.0f} | {c['completed_rps']:15.1f} | {c['failed']:6d} | {c['send_lag_p50_ms']:15.2f} | "
              f"{c['send_lag_p99_ms']:6.2f} | {c['client_cpu_ms_per_request']:.2f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"accuracy": acc, "capacity": caps}, indent=2) + "\n")


if __name__ == "__main__":
    main()
