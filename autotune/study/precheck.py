"""Can a candidate hold even one max_model_len sequence? Decided before any engine starts.

The KV cache of one token is 2 (K and V) x layers x KV heads x head dim x bytes per element
(the formula in the seed 002 blog post, with KV heads for GQA). A candidate whose KV budget
cannot hold one full-length sequence fails at start-up in vLLM ("KV cache is needed, which is
larger than the available KV cache memory"); here it is pruned at zero engine seconds.

Only what is provable is pruned: the budget is taken optimistically (no activation or
CUDA-graph memory, all of the requested share of device memory), so a pass here is no promise,
and a fail is certain.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from autotune.engine.args import EngineArgs

__all__ = ["ModelShape", "precheck", "parse_bytes"]

GiB = 1 << 30
MiB = 1 << 20
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
                "fp8_e5m2": 1, "fp8_ds_mla": 1, "int8": 1}


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    max_position: int
    weights_bytes: int

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelShape | None:
        """Read config.json and the weight files; None when the model is not a local directory."""
        p = Path(path)
        cfg_path = p / "config.json"
        if not cfg_path.is_file():
            return None
        cfg = json.loads(cfg_path.read_text())
        cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        weights = sum(f.stat().st_size for pat in ("*.safetensors", "*.bin", "*.pt") for f in p.glob(pat))
        return cls(
            layers=int(cfg["num_hidden_layers"]),
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
            max_position=int(cfg.get("max_position_embeddings") or 0),
            weights_bytes=weights,
        )

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto", dtype: str = "auto") -> int:
        if kv_cache_dtype not in ("auto", None):
            elem = _DTYPE_BYTES.get(kv_cache_dtype, 2)
        else:
            elem = _DTYPE_BYTES.get(self.dtype if dtype in ("auto", None) else dtype, 2)
        return 2 * self.layers * self.kv_heads * self.head_dim * elem


def parse_bytes(value: object) -> int:
    """vLLM's human-readable sizes: 1k = 1000, 1K = 1024, also M/G/T; plain ints pass."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)i?[bB]?\s*", str(value))
    if not m:
        raise ValueError(f"not a size: {value!r}")
    number, unit = float(m[1]), m[2]
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    base = 1024 if unit.isupper() else 1000
    return int(number * base**power)


def _fmt(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def precheck(shape: ModelShape, args: EngineArgs, platform: str, device_memory_bytes: int | None = None) -> str | None:
    """The reason a candidate is provably infeasible, or None when it may fit."""
    v: Mapping[str, object] = args.values
    max_len = int(parse_bytes(v["max_model_len"])) if "max_model_len" in v else shape.max_position
    if not max_len:
        return None
    per_token = shape.kv_bytes_per_token(str(v.get("kv_cache_dtype", "auto")), str(v.get("dtype", "auto")))
    need = per_token * max_len
    if "kv_cache_memory_bytes" in v:
        budget, source = parse_bytes(v["kv_cache_memory_bytes"]), "kv_cache_memory_bytes"
    elif platform == "cpu" and "VLLM_CPU_KVCACHE_SPACE" in args.env:
        budget, source = float(args.env["VLLM_CPU_KVCACHE_SPACE"]) * GiB, "VLLM_CPU_KVCACHE_SPACE"
    elif platform != "cpu" and device_memory_bytes:
        gpus = int(v.get("tensor_parallel_size", 1)) * int(v.get("pipeline_parallel_size", 1))
        share = float(v.get("gpu_memory_utilization", 0.92)) * device_memory_bytes * gpus
        if shape.weights_bytes >= share:
            return (f"the weights alone ({_fmt(shape.weights_bytes)}) exceed gpu_memory_utilization's share of "
                    f"{gpus} GPU(s) ({_fmt(share)})")
        budget, source = share - shape.weights_bytes, "gpu_memory_utilization x device memory - weights"
    else:
        return None
    if need > budget:
        return (f"one {max_len}-token sequence needs {_fmt(need)} of KV cache ({per_token} B/token); "
                f"at most {_fmt(budget)} is available ({source})")
    return None
