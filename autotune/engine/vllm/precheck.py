"""Can a candidate hold even one max_model_len sequence? Decided before any engine starts.

The KV cache of one token is 2 (K and V) x layers x KV heads x head dim x bytes per element
(KV heads, not query heads, for GQA). A candidate whose KV budget
cannot hold one full-length sequence fails at start-up in vLLM ("KV cache is needed, which is
larger than the available KV cache memory"); here it is pruned at zero engine seconds.

Only what is provable is pruned: the budget is taken optimistically (no activation or
CUDA-graph memory, all of the requested share of device memory), so a pass here is no promise,
and a fail is certain.
"""

from __future__ import annotations

from autotune.engine.args import EngineArgs
from autotune.engine.model import ModelShape, parse_bytes

__all__ = ["precheck"]

GiB = 1 << 30
MiB = 1 << 20


def _fmt(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def precheck(shape: ModelShape, args: EngineArgs, platform: str, device_memory_bytes: int | None = None) -> str | None:
    """The reason a candidate is provably infeasible, or None when it may fit."""
    v = args.values
    shape = shape.served(str(v["quantization"]) if v.get("quantization") else None)
    max_len = int(parse_bytes(v["max_model_len"])) if "max_model_len" in v else shape.max_position
    if not max_len:
        return None
    per_token = shape.kv_bytes_per_token(str(v.get("kv_cache_dtype", "auto")), str(v.get("dtype", "auto")))
    need = per_token * max_len
    budget: float
    if "kv_cache_memory_bytes" in v:
        budget, source = parse_bytes(v["kv_cache_memory_bytes"]), "kv_cache_memory_bytes"
    elif platform == "cpu" and "VLLM_CPU_KVCACHE_SPACE" in args.env:
        budget, source = float(args.env["VLLM_CPU_KVCACHE_SPACE"]) * GiB, "VLLM_CPU_KVCACHE_SPACE"
    elif platform != "cpu" and device_memory_bytes:
        gpus = int(v.get("tensor_parallel_size", 1)) * int(v.get("pipeline_parallel_size", 1))
        share = float(v.get("gpu_memory_utilization", 0.92)) * device_memory_bytes * gpus
        if shape.weights_bytes >= share:
            return (
                f"the weights alone ({_fmt(shape.weights_bytes)}) exceed gpu_memory_utilization's share of "
                f"{gpus} GPU(s) ({_fmt(share)})"
            )
        budget, source = share - shape.weights_bytes, "gpu_memory_utilization x device memory - weights"
    else:
        return None
    if need > budget:
        return (
            f"one {max_len}-token sequence needs {_fmt(need)} of KV cache ({per_token} B/token); "
            f"at most {_fmt(budget)} is available ({source})"
        )
    return None
