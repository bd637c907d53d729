"""vLLM's start-up, simulated: memory accounting that fails where vLLM fails, and how long it takes.

Memory, per GPU, in the order vLLM 0.33's worker does it (v1/worker/gpu_worker.py, utils.py,
v1/core/kv_cache_utils.py):

1. requested = gpu_memory_utilization x total. If the device's free memory at start-up is
   less: ``ValueError: Free memory on device ... is less than desired GPU memory utilization``.
2. Load the weights (their share under tensor/pipeline parallelism). More than is free:
   ``torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ...``.
3. Profile a forward pass of max_num_batched_tokens tokens and a sampler warm-up of
   max_num_seqs dummy requests: the activation peak. Not free: the sampler's own OOM text.
4. Estimate CUDA graph memory (unless --enforce-eager); subtracted from the budget, as 0.33
   does by default (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1). V0 engines (``SimConfig.era``)
   captured graphs after allocating the KV cache, outside the budget: not subtracted.
5. KV cache = requested - weights - activation peak - non-torch memory - graphs, or exactly
   --kv-cache-memory-bytes when given. <= 0: ``No available memory for the cache blocks``;
   less than one max_model_len sequence: ``To serve at least one request with the model's
   max seq len ...``. Both are ValueErrors in the engine core: exit 1.

The activation and graph sizes are estimates (documented in docs/vllm-sim.md);
the boundaries they produce move with max_num_batched_tokens, max_num_seqs, enforce_eager and
the model's size the way vLLM's do, not to the last MiB.

Time: engine and process start, weight loading (disk, or about a second with
--load-format dummy), torch.compile (skipped with --enforce-eager), the profile run, graph
capture per captured batch size, API server start. ``time_scale`` multiplies all of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autotune.engine.model import ModelShape
from autotune.sim.config import SimConfig, capture_sizes
from autotune.sim.profiles import GpuProfile

__all__ = ["MemoryPlan", "Phase", "Startup", "plan_startup"]

GiB = 1 << 30
MiB = 1 << 20
NON_TORCH_BYTES = int(0.4 * GiB)  # CUDA context leftovers, cuBLAS workspaces
NCCL_BYTES = int(0.25 * GiB)  # communicator buffers with tensor/pipeline parallelism
DISK_BYTES_PER_S = 2.0e9  # safetensors from a local NVMe, page cache cold


def _gib(b: float) -> str:
    return f"{round(b / GiB, 2)}"


@dataclass(frozen=True)
class MemoryPlan:
    total: int
    requested: int
    weights: int  # per GPU
    activation_peak: int
    non_torch: int
    cudagraphs: int
    kv_cache: int  # per GPU
    kv_bytes_per_token: int  # per GPU
    num_blocks: int
    block_size: int

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class Phase:
    seconds: float
    lines: tuple[str, ...]  # what vLLM logs at the end of the phase


@dataclass
class Startup:
    phases: list[Phase] = field(default_factory=list)
    plan: MemoryPlan | None = None
    failure: tuple[str, ...] = ()  # the root-cause lines; the engine then exits 1

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)


def activation_peak(shape: ModelShape, config: SimConfig) -> tuple[int, int]:
    """(forward peak, sampler warm-up) bytes for the profile run, per GPU."""
    tp = config.tensor_parallel_size
    n = config.max_num_batched_tokens
    # residual + normed hidden states, q/k/v, and the gated MLP's two intermediates, bf16; a MoE layer holds its
    # fused kernel's three caches for each of a token's routed experts (vLLM's fused_moe workspace)
    mlp = 3 * shape.experts_per_token * shape.expert_intermediate if shape.experts else 2 * shape.intermediate
    per_token = 2 * (
        4 * shape.hidden + (shape.heads // tp + 2 * shape.kv_heads_per_gpu(tp)) * shape.head_dim + mlp // tp
    )
    # fp32 logits and probabilities for max_num_seqs dummy requests (the vocabulary is split by TP)
    sampler = config.max_num_seqs * shape.vocab * 4 * 2 // tp
    return n * per_token, sampler


def cudagraph_bytes(shape: ModelShape, config: SimConfig) -> int:
    sizes = capture_sizes(config)
    if not sizes:
        return 0
    # persistent input/output buffers of the largest graph across layers, plus a pool per graph
    return (shape.layers * max(sizes) * shape.hidden * 2 * 4) // config.tensor_parallel_size + len(sizes) * 4 * MiB


# vLLM's own words for each way a start fails here (engine/vllm/failures.py classifies them)
_NO_CACHE_BLOCKS = (
    "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
    "when initializing the engine (this flag also controls CPU memory reservation on the CPU "
    "backend, despite its name). See https://docs.vllm.ai/en/latest/configuration/"
    "conserving_memory/ for more details."
)


def _engine_config_line(config: SimConfig) -> str:
    return (
        f"Initializing a V1 LLM engine (v0.33.0) with config: max_seq_len={config.max_model_len}, "
        f"tensor_parallel_size={config.tensor_parallel_size}, "
        f"enforce_eager={config.enforce_eager}, "
        f"enable_prefix_caching={config.enable_prefix_caching}, "
        f"enable_chunked_prefill={config.enable_chunked_prefill}"
    )


def _weights_oom(weights: int, free: int, total: int) -> str:
    chunk = min(weights, 1 * GiB) // MiB
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {chunk}.00 MiB. GPU 0 has a total "
        f"capacity of {_gib(total)} GiB of which {_gib(max(free - weights, 0) * 0.01)} GiB is free. "
        f"Including non-PyTorch memory, this process has {_gib(free)} GiB memory in use."
    )


def _activation_oom(config: SimConfig, forward: int, total: int, *, sampler_only: bool) -> str:
    """The profiling run's failure: warming up the sampler (``sampler_only``), or the forward pass itself."""
    if sampler_only:
        return (
            f"RuntimeError: CUDA out of memory occurred when warming up sampler with "
            f"{config.max_num_seqs} dummy requests. Please try lowering `max_num_seqs` or "
            "`gpu_memory_utilization` when initializing the engine."
        )
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
        f"{forward // (4 * MiB)}.00 MiB. GPU 0 has a total capacity of {_gib(total)} GiB."
    )


def _kv_too_small(config: SimConfig, need: int, kv: int, kv_per_token: int) -> str:
    est = (kv // kv_per_token) // config.block_size * config.block_size
    est_msg = f"Based on the available memory, the estimated maximum model length is {est}. " if est > 0 else ""
    return (
        f"ValueError: To serve at least one request with the model's max seq len ({config.max_model_len}), "
        f"({_gib(need)} GiB KV cache is needed, which is larger than the available KV cache memory "
        f"({_gib(kv)} GiB). {est_msg}Try increasing `gpu_memory_utilization` (which also controls CPU "
        "memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. "
        "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )


def plan_startup(
    shape: ModelShape, gpu: GpuProfile, config: SimConfig, *, used_by_others: int = 0, device: str = "cuda:0"
) -> Startup:
    s = Startup()
    shape = shape.served(config.quantization)
    gpus = config.gpus
    total = gpu.memory_bytes
    free = total - used_by_others
    requested = int(config.gpu_memory_utilization * total)
    s.phases.append(Phase(6.0, (_engine_config_line(config),)))
    if config.kv_cache_memory_bytes is None and free < requested:
        s.failure = (
            f"ValueError: Free memory on device {device} ({_gib(free)}/{_gib(total)} GiB) on startup is less "
            f"than desired GPU memory utilization ({config.gpu_memory_utilization}, {_gib(requested)} GiB). "
            "Decrease GPU memory utilization or reduce GPU memory used by other processes.",
        )
        return s

    weights = shape.loaded_weights_bytes(config.tensor_parallel_size, config.whole_experts(shape)) // gpus
    load_s = 1.0 if config.load_format == "dummy" else 2.0 + weights / DISK_BYTES_PER_S
    if weights > free - NON_TORCH_BYTES:
        s.phases.append(Phase(load_s * 0.8, ()))
        s.failure = (_weights_oom(weights, free, total),)
        return s
    s.phases.append(Phase(load_s, (f"Model loading took {_gib(weights)} GiB memory and {load_s:.6f} seconds",)))
    if not config.enforce_eager:
        s.phases.append(Phase(12.0, ("torch.compile takes 12.00 s in total",)))

    forward, sampler = activation_peak(shape, config)
    non_torch = NON_TORCH_BYTES + (NCCL_BYTES if gpus > 1 else 0)
    if weights + non_torch + forward + sampler > free:
        s.phases.append(Phase(2.0, ()))
        s.failure = (_activation_oom(config, forward, total, sampler_only=weights + non_torch + forward <= free),)
        return s
    graphs = cudagraph_bytes(shape, config)
    kv_per_token = (
        shape.kv_bytes_per_token(config.kv_cache_dtype, config.dtype, config.tensor_parallel_size)
        // config.pipeline_parallel_size
    )
    if config.kv_cache_memory_bytes is not None:
        kv = config.kv_cache_memory_bytes
    else:
        # V0 captured its graphs after allocating the cache, outside the budget (SimConfig.era)
        kv = requested - weights - forward - sampler - non_torch - (graphs if config.era != "v0" else 0)
    s.phases.append(Phase(2.0, (f"Available KV cache memory: {_gib(kv)} GiB",)))
    if kv <= 0:
        s.failure = (_NO_CACHE_BLOCKS,)
        return s
    # vLLM counts whole blocks (max_memory_usage_bytes: cdiv(max_model_len, block_size) pages), so a
    # max_model_len just past the estimated maximum fails instead of starting with a cache shorter
    # than one max_model_len sequence
    need = kv_per_token * (-(-config.max_model_len // config.block_size) * config.block_size)
    if need > kv:
        s.failure = (_kv_too_small(config, need, kv, kv_per_token),)
        return s
    if weights + forward + sampler + non_torch + graphs + kv > free:
        # --kv-cache-memory-bytes bypasses the budget: the allocation itself fails
        s.failure = (
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {kv // MiB}.00 MiB. "
            f"GPU 0 has a total capacity of {_gib(total)} GiB.",
        )
        return s
    blocks = kv // (kv_per_token * config.block_size)
    tokens = blocks * config.block_size
    s.plan = MemoryPlan(
        total, requested, weights, forward + sampler, non_torch, graphs, kv, kv_per_token, blocks, config.block_size
    )
    concurrency = f"{config.max_model_len:,} tokens per request: {tokens / config.max_model_len:.2f}x"
    s.phases.append(Phase(0.5, (f"GPU KV cache size: {tokens:,} tokens, Maximum concurrency for {concurrency}",)))
    sizes = capture_sizes(config)
    if sizes:
        secs = 2.0 + 0.08 * len(sizes) * math.sqrt(shape.layers / 32)
        s.phases.append(Phase(secs, (f"Graph capturing finished in {secs:.0f} secs, took {_gib(graphs)} GiB",)))
    s.phases.append(Phase(1.0, ()))  # the API server's own start; it logs its address itself
    return s
