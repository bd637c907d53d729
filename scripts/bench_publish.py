#!/usr/bin/env python3
"""Downtime of a publish: a restart publish against a blue/green switch, under the same steady traffic.

    .venv/bin/python scripts/bench_publish.py [--rate 4] [--seconds 40] [--time-scale 0.1] [--repeats 2]

Both run behind the same real nginx (systemd/nginx-autotune.conf) in front of vllm-sim (an 8B model on a
simulated A10; the start-up phases scaled by --time-scale, serving in real time), with users as
`autotune replay` streaming through nginx at a steady rate for the whole run:

  restart     kind vllm-config: write the YAML, restart the one instance, wait for health, canary
  blue-green  kind blue-green: start the idle color, canary it, switch nginx, verify, drain, stop the old

For each: requests failed (errors and streams cut short), TTFT p99 of the requests sent from the decision
to 5 s after the publish ended, and the time from the decision to the new config serving users (restart:
the new server healthy; blue/green: nginx switched). Start-up time scales with --time-scale: on a GPU a
real start takes minutes (systemd/vllm@.service allows 15), so the restart's outage grows with it while
the switch's does not. Needs nginx (scripts/ci_system_deps.sh) and the tiny model's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.measure.replay import ReplayOptions  # noqa: E402
from autotune.measure.slo import parse_slos  # noqa: E402
from autotune.publish.canary import replay_canary  # noqa: E402
from autotune.publish.history import History  # noqa: E402
from autotune.publish.transaction import publish  # noqa: E402
from autotune.workload.prompts import PromptBuilder, load_tokenizer, materialize  # noqa: E402
from autotune.workload.synth import SCENARIOS, synthesize  # noqa: E402
# the test rig: real nginx plus vllm-sim instances behind tests/fixtures/sim_service.py (systemctl's stand-in)
from tests import bluegreen_rig as rig  # noqa: E402
from tests.conftest import free_port  # noqa: E402

GOOD = {"max_model_len": 8192, "max_num_seqs": 64, "gpu_memory_utilization": 0.9}
NEW = {**GOOD, "max_num_seqs": 128}


def canary(tokenizer: Path):
    w = synthesize(SCENARIOS["high-concurrency"].with_overrides(output_tokens=(8, 16)), rate=4, num_requests=8, seed=1)
    w = materialize(w, PromptBuilder(load_tokenizer(tokenizer)), seed=1)
    return replay_canary(w, parse_slos(["ttft<2s"]), ReplayOptions(warmup_requests=0))


def one_run(kind: str, tmp: Path, tokenizer: Path, rate: float, seconds: float, time_scale: float) -> dict:
    import subprocess

    from autotune.daemon.production import production_verifier
    from autotune.publish.vllm_config import VllmConfigTarget

    rig.SIM = ("--gpu", "a10-24gb", "--time-scale", str(time_scale))
    ports = {"blue": free_port(), "green": free_port()}
    nginx = rig.Nginx(tmp / "nginx", free_port(), tmp / "nginx" / "vllm-upstream.conf")
    desc = {**rig.rig_description(tmp, nginx, ports), "tokenizer": str(tokenizer), "health_timeout": 600.0}
    target = rig.make_target(desc)
    blue = target.colors["blue"]
    blue.server.deploy({**GOOD, "tokenizer": str(tokenizer)})
    nginx.upstream_file.parent.mkdir(parents=True, exist_ok=True)
    nginx.upstream_file.write_text(f"server {blue.backend};\n")
    nginx.start()
    # restart: production is blue alone, restarted in place (the same unit stand-in, the same health wait)
    published = target if kind == "blue-green" else VllmConfigTarget(
        blue.server.config_path, blue.server.model, blue.server.restart, nginx.url, blue.server.table,
        health_timeout_s=600.0, restart_timeout_s=60.0, engine=blue.server.engine)
    out = tmp / "traffic"
    out.mkdir()
    n = int(seconds * rate)
    traffic = subprocess.Popen(
        [sys.executable, "-m", "autotune", "replay", "--url", nginx.url, "--scenario", "high-concurrency",
         "--rate", str(rate), "--burstiness", "100", "--requests", str(n), "--output-tokens", "8-24",
         "--tokenizer", str(tokenizer), "--warmup", "0", "--request-timeout", "120",
         "--json", str(out / "t.json"), "--requests-json", str(out / "r.jsonl")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(out / "log", "w"))
    try:
        time.sleep(5)
        serving_at: list[float] = []
        t0 = time.time()

        def on_phase(p: str) -> None:
            # restart: "verifying" comes once the restarted server is healthy; blue/green: once nginx switched
            if (kind == "restart" and p == "verifying") or (kind == "blue-green" and p == "watching production"):
                serving_at.append(time.time())

        result = publish(published, {**NEW, "tokenizer": str(tokenizer)}, History(tmp / "history"), canary(tokenizer),
                         on_phase=on_phase, verify=production_verifier(parse_slos(["ttft<2s"]), 5.0, min_requests=3))
        t1 = time.time()
        traffic.wait(seconds + 180)
    finally:
        if traffic.poll() is None:
            traffic.kill()
        nginx.stop()
        for c in target.colors.values():
            target.stop_quietly(c)
    start_wall = json.loads((out / "t.json").read_text()).get("started_at")
    requests = [json.loads(x) for x in (out / "r.jsonl").read_text().splitlines() if x.strip()]
    failed = [r for r in requests if not r["success"] or r["error"] or r["output_tokens"] != r["expected_output_tokens"]]
    # the replay's times are seconds after its start; its wall-clock start is the earliest send we can place
    if start_wall is None:
        start_wall = t0 - 5.0
    during = [r for r in requests if t0 <= start_wall + r["sent_s"] <= t1 + 5.0]
    ttfts = sorted(r["ttft"] for r in during if r["ttft"] is not None)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None
    return {"kind": kind, "ok": result.ok, "outcome": result.outcome, "requests": len(requests),
            "failed": len(failed), "during": len(during), "ttft_p99_s": p99,
            "decision_to_serving_s": (serving_at[0] - t0) if serving_at else None, "publish_s": t1 - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=4.0, help="users' requests per second (default 4)")
    ap.add_argument("--seconds", type=float, default=40.0, help="traffic per run (default 40)")
    ap.add_argument("--time-scale", type=float, default=0.1, help="vllm-sim start-up time scale (default 0.1)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "models" / "tiny-llama")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rig.nginx_binary()
    rows = []
    for i in range(a.repeats):
        for kind in ("restart", "blue-green"):
            tmp = Path(tempfile.mkdtemp(prefix=f"bench-publish-{kind}-"))
            try:
                row = one_run(kind, tmp, a.tokenizer, a.rate, a.seconds, a.time_scale)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'publish':<11} {'runs':>4} {'requests':>8} {'failed':>6} {'TTFT p99 during':>16} {'decision->serving':>18}")
    for kind in ("restart", "blue-green"):
        rs = [r for r in rows if r["kind"] == kind]
        p99 = [r["ttft_p99_s"] for r in rs if r["ttft_p99_s"] is not None]
        serve = [r["decision_to_serving_s"] for r in rs if r["decision_to_serving_s"] is not None]
        print(f"{kind:<11} {len(rs):>4} {sum(r['requests'] for r in rs):>8} {sum(r['failed'] for r in rs):>6} "
              f"{(f'{statistics.median(p99):.2f} s' if p99 else '-'):>16} "
              f"{(f'{statistics.median(serve):.1f} s' if serve else '-'):>18}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
