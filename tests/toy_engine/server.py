"""The toy engine: autotune.sim.fixed_timing's OpenAI-compatible streaming server behind its own command line.

    python -m tests.toy_engine.server --host 127.0.0.1 --port 8300 --itl-ms 2 --ttft-ms 5 --memory-gb 4

Unlike vLLM it takes no model argument (an extra positional is an argparse usage error, exit 2,
as is a negative latency),
and it has a memory limit: above MEMORY_GB it prints its own out-of-memory line and exits 1,
which the toy kind's failure patterns classify as oom. Otherwise it serves /health,
/v1/models and streaming completions with exactly the TTFT and ITL it was given.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from autotune.sim.fixed_timing import serve

MEMORY_GB = 8  # the toy's "device": more than this does not fit
OOM_LINE = "TOY ERROR: out of toy memory"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="toy-engine", description="a fixed-timing toy inference engine")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--itl-ms", type=float, default=2.0, help="inter-token latency")
    ap.add_argument("--ttft-ms", type=float, default=5.0, help="time to first token")
    ap.add_argument("--memory-gb", type=int, default=4, help=f"memory to reserve; more than {MEMORY_GB} fails")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.itl_ms < 0 or a.ttft_ms < 0:
        ap.error("latencies cannot be negative")  # exit 2, like any usage error
    if a.memory_gb > MEMORY_GB:
        print(f"{OOM_LINE} (asked for {a.memory_gb} GB, the toy has {MEMORY_GB} GB)", file=sys.stderr, flush=True)
        return 1
    print(f"toy engine: serving on {a.host}:{a.port} (ttft {a.ttft_ms} ms, itl {a.itl_ms} ms, "
          f"{a.memory_gb} GB)", flush=True)
    try:
        asyncio.run(serve(a.host, a.port, a.ttft_ms / 1000, a.itl_ms / 1000))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
