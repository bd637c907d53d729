"""What vLLM's scheduler costs per step, measured by running vLLM's own V1 Scheduler in this process.

vllm-sim's step model charges the host ``host_step_s`` per step and ``host_seq_s`` per scheduled sequence
(``autotune.sim.profiles.GpuProfile``); part of that is the engine core's scheduler, which runs on the CPU
whatever the GPU. This script measures that part on real vLLM code with no model at all: vLLM's
``vllm.v1.core.sched.scheduler.Scheduler`` with a KV cache of ``--blocks`` blocks, ``R`` requests decoding
and ``W`` waiting, stepped through ``schedule()`` and ``update_from_output()`` with a model output that samples
one token per request that finished its prompt (what the engine core does around each forward). The time per
step is the median over ``--steps`` steps; the median slope from one running request to each larger batch is the
cost per running request, what one request's step leaves beside it the fixed cost.

Not in it: the worker's input preparation and sampling, the output processor in the API server, and the
forward itself; in a GPU step those overlap the GPU (async scheduling) or not. CPU time carries to another
host in proportion to single-core speed (bench_front_end.py prints this host's). Rerun:

    .venv/bin/python scripts/bench_scheduler.py --json bench/scheduler_cpu.json     # ~1 min

Needs scripts/install_cpu.sh's vLLM (any build: nothing runs on a device).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_scheduler(model: Path, blocks: int, max_num_seqs: int, max_batched: int):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=str(model), max_model_len=4096, dtype="float32")
    cache_config = CacheConfig(block_size=16, enable_prefix_caching=True)
    cache_config.num_gpu_blocks = blocks  # what the engine core sets once the workers have profiled memory
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    config = VllmConfig(model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    return Scheduler(config, kv, StructuredOutputManager(config), block_size=16, log_stats=True)


def make_request(i: int, prompt_len: int, max_tokens: int):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [(i * 7919 + k) % 4000 + 10 for k in range(prompt_len)]
    return Request(f"r{i}", ids, params, None, block_hasher=get_request_block_hasher(16, sha256))


def step(sched) -> float:
    """One engine-core step around a model that samples token 11 for every request past its prompt; seconds."""
    from vllm.v1.outputs import ModelRunnerOutput

    t0 = time.perf_counter()
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [
        [11] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_prompt_tokens else [] for r in ids
    ]
    result = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)}, sampled_token_ids=sampled
    )
    sched.update_from_output(out, result)
    return time.perf_counter() - t0


def measure(model: Path, running: int, waiting: int, steps: int, blocks: int) -> dict:
    """``running`` requests decoding (prompts prefilled first, unmeasured) and ``waiting`` more queued behind a
    full max_num_seqs: the median time of a decode step."""
    sched = make_scheduler(model, blocks, max_num_seqs=running, max_batched=max(8192, running))
    for i in range(running + waiting):
        sched.add_request(make_request(i, 64, 10_000))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or len(sched.running) < running:
        step(sched)
    times = [step(sched) for _ in range(steps)]
    return {"running": running, "waiting": waiting, "step_us": round(1e6 * statistics.median(times), 1)}


def per_request(rows: list[dict]) -> tuple[float, float]:
    """(fixed us, us per running request) of a decode step: the median slope from one running request to each
    larger batch, and what one request's step leaves beside it."""
    one = next(r["step_us"] for r in rows if r["running"] == 1)
    slope = statistics.median((r["step_us"] - one) / (r["running"] - 1) for r in rows if r["running"] > 1)
    return one - slope, slope


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="measured decode steps per row (default 200)")
    ap.add_argument("--blocks", type=int, default=200_000, help="KV cache blocks (default: never full)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-scheduler-") as tmp:
        model = Path(tmp) / "tiny-llama"
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "build_tiny_model.py"), str(model)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        rows = [measure(model, r, 0, a.steps, a.blocks) for r in (1, 16, 64, 256, 1024)]
        rows += [measure(model, r, 1000, a.steps, a.blocks) for r in (64, 256)]
    decode = [r for r in rows if r["waiting"] == 0]
    a0, b0 = per_request(decode)
    from importlib.metadata import version

    result = {
        "vllm": version("vllm"),
        "rows": rows,
        "fit": {"step_s": round(a0 * 1e-6, 8), "seq_s": round(b0 * 1e-6, 9)},
    }
    print(f"vLLM {result['vllm']}: scheduler + output update per decode step")
    for r in rows:
        print(f"  running {r['running']:>5}, waiting {r['waiting']:>5}: {r['step_us']:>9.1f} us")
    print(f"fit: {a0:.1f} us + {b0:.2f} us x running requests")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
