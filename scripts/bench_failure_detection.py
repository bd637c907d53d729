#!/usr/bin/env python3
"""How soon after vLLM prints why it failed does the launcher report the class?

    .venv/bin/python scripts/bench_failure_detection.py [--real] [--repeat 5] [--out runs/bench_failure_detection.json]

Two measurements for each of `oom` and `invalid-args`:

1. replayed logs (always): a stand-in engine prints a real vLLM failure log captured here
   (tests/fixtures/vllm-0.32) line by line, notes the wall-clock time just before it writes
   the line that proves the class, then hangs, as vLLM's API server can after its engine core
   died. Latency = when Engine.start() raised (engine stopped) - when the line was written.
2. real vLLM (--real): the tiny model with the KV-too-small config (oom), and with
   max_num_batched_tokens below max_num_seqs (invalid-args, from vLLM's own config check).
   The write time is not observable to the second here (the pipe delivers it at once), so it
   reports the time from the line reaching the launcher to the class being known, and to
   start() returning with every engine process gone (vLLM's API server sits out SIGTERM after
   its engine core died, so that includes the 0.5 s SIGTERM->SIGKILL grace for engines that never served).
   The peers wait out a 300-600 s health timeout instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.engine.launcher import Engine, LaunchSpec  # noqa: E402
from autotune.engine.vllm.failures import PATTERNS  # noqa: E402
from autotune.errors import EngineFailure  # noqa: E402
from tests.conftest import free_port  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "vllm-0.32"

STAND_IN = r"""
import sys, time
log, stream, marker, stamp = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
out = sys.stdout if stream == "stdout" else sys.stderr
for line in open(log, encoding="utf-8"):
    if marker in line:
        open(stamp, "w").write(repr(time.time()))
    out.write(line)
    out.flush()
    time.sleep(0.002)
time.sleep(120)
"""

CASES = {
    "oom": ("kv-too-small.stdout", "stdout", "KV cache is needed"),
    "invalid-args": ("batched-below-seqs.stderr", "stderr", "Value error, max_num_batched_tokens"),
}


def replayed(case: str, tmp: Path) -> dict:
    log, stream, marker = CASES[case]
    stamp = tmp / f"{case}.stamp"
    port = free_port()
    spec = LaunchSpec(argv=[sys.executable, "-c", STAND_IN, str(FIXTURES / log), stream, marker, str(stamp)],
                      port=port, log_dir=tmp / case, state_dir=tmp / "state", stop_grace=5,
                      failure_patterns=PATTERNS)
    try:
        Engine(spec).start()
        raise SystemExit(f"{case}: the stand-in engine did not fail")
    except EngineFailure as e:
        reported = time.time()
        assert e.failure.failure_class.value == case, e.failure
    return {"latency_s": reported - float(stamp.read_text())}


def real(case: str, tmp: Path, model: Path, vllm: list[str], env: dict[str, str]) -> dict:
    port = free_port()
    args = {
        "oom": ["--kv-cache-memory-bytes", "33554432", "--max-model-len", "32768"],
        "invalid-args": ["--max-num-seqs", "4", "--max-num-batched-tokens", "2"],
    }[case]
    seen: dict[str, float] = {}
    marker = CASES[case][2]

    def on_line(line: str) -> None:
        if marker in line and "line" not in seen:
            seen["line"] = time.monotonic()

    spec = LaunchSpec(argv=[*vllm, str(model), "--port", str(port), *args], port=port, env=env,
                      log_dir=tmp / f"real-{case}", state_dir=tmp / "state", startup_timeout=600,
                      failure_patterns=PATTERNS)
    engine = Engine(spec, on_line=on_line)
    t0 = time.monotonic()
    try:
        engine.start()
        raise SystemExit(f"{case}: vLLM did not fail")
    except EngineFailure as e:
        returned = time.monotonic()
        assert e.failure.failure_class.value == case, e.failure
        known = e.failure.detected_at
    return {"engine_time_to_fail_s": seen["line"] - t0, "line_to_class_s": known - seen["line"],
            "line_to_engine_gone_s": returned - seen["line"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--real", action="store_true", help="also measure with real vLLM and the tiny model")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-llama")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_failure_detection.json")
    a = ap.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for case in CASES:
            lat = [replayed(case, tmp)["latency_s"] for _ in range(a.repeat)]
            results[f"replayed/{case}"] = {"median_s": statistics.median(lat), "max_s": max(lat), "runs": lat}
            print(f"replayed log, {case:12}: line written -> class reported: median {statistics.median(lat):.3f} s, "
                  f"max {max(lat):.3f} s ({a.repeat} runs)")
        if a.real:
            vllm = [str(Path(sys.executable).parent / "vllm"), "serve"]
            env = {"VLLM_CACHE_ROOT": str(Path.home() / ".cache" / "autotune-tests" / "vllm")}
            for case in CASES:
                r = real(case, tmp, a.model, vllm, env)
                results[f"real/{case}"] = r
                print(f"real vLLM,    {case:12}: engine needed {r['engine_time_to_fail_s']:.1f} s to fail; "
                      f"line -> class known {r['line_to_class_s']:.3f} s; "
                      f"-> start() returned, every engine process gone {r['line_to_engine_gone_s']:.3f} s")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
