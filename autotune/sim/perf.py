"""How long one engine step takes: a roofline plus the host's overhead.

A step computes ``T`` new tokens for ``S`` sequences. Per GPU (tensor parallelism splits the
weights, the heads and the KV cache; pipeline parallelism is not modelled beyond memory):

- bytes moved: every weight once, the KV cache of every scheduled sequence's context (read by
  attention), the new tokens' KV (written);
- FLOPs: 2 x parameters x T for the matmuls, 2 x hidden x vocab per sampled sequence for the
  LM head, and 4 x layers x heads x head_dim x (new tokens x context) for attention;
- time = max(bytes / (bandwidth x 0.85), FLOPs / (peak x 0.70)): the achievable share of the
  datasheet peaks (STREAM-like copies reach ~85 % of HBM bandwidth; large bf16 GEMMs ~70 % MFU);
- plus two all-reduces per layer under tensor parallelism (ring: 2 (tp-1)/tp x activation bytes
  over the link, and ~8 us latency each);
- plus host overhead: scheduling, sampling and detokenizing (1.2 ms + 4 us per sequence;
  --async-scheduling overlaps about half of it with the GPU) and kernel launches: with CUDA
  graphs, a decode-only batch that fits a captured size replays one graph (~5 us per layer),
  a mixed batch runs piecewise graphs (~25 us per layer); --enforce-eager launches every kernel
  (~100 us per layer, about 15 kernels of ~6 us).

These constants are round numbers from published vLLM profiles, not a calibration against one
GPU; the README says so. What matters for the search is that the trade-offs point the right
way and have the right order of magnitude: batching amortizes the weight reads until compute
binds, long contexts make decode bandwidth-bound on KV, eager mode costs most at small batches.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from autotune.engine.model import ModelShape
from autotune.sim.config import SimConfig, capture_sizes
from autotune.sim.profiles import GpuProfile
from autotune.sim.scheduler import StepPlan

__all__ = ["StepModel"]

BANDWIDTH_EFFICIENCY = 0.85
COMPUTE_EFFICIENCY = 0.70
ALLREDUCE_LATENCY_S = 8e-6


@dataclass
class StepModel:
    shape: ModelShape
    gpu: GpuProfile
    config: SimConfig

    def __post_init__(self) -> None:
        s, c = self.shape, self.config
        tp = c.tensor_parallel_size
        self._tp = tp
        self._weights = s.weights_bytes / tp  # pipeline stages run one after another: no time saved
        self._matmul_flops = 2 * (s.layers * s.params_per_layer) / tp  # per token
        self._head_flops = 2 * s.hidden * s.vocab / tp  # per sampled sequence
        self._attn_flops = 4 * s.layers * s.heads * s.head_dim / tp  # per (new token x context token)
        self._kv = s.kv_bytes_per_token(c.kv_cache_dtype, c.dtype) / tp  # per token, per GPU
        self._bw = self.gpu.bandwidth * BANDWIDTH_EFFICIENCY
        self._flops = self.gpu.bf16_flops * COMPUTE_EFFICIENCY
        self._act_bytes = 2 * s.hidden  # one token's activation, bf16
        self._graphs = capture_sizes(c)
        self._layers = s.layers

    def step_seconds(self, plan: StepPlan) -> float:
        tokens = 0
        attn = 0.0
        kv_read = 0
        sampled = 0
        decode_only = True
        for req, n in plan.scheduled:
            ctx = req.num_computed  # before this step
            tokens += n
            attn += n * (ctx + (n + 1) / 2)
            kv_read += ctx + n
            if ctx + n >= req.num_tokens:
                sampled += 1
            if n > 1 or ctx + n < req.num_tokens:
                decode_only = False
        return self.seconds(tokens, len(plan.scheduled), sampled, attn, kv_read, decode_only)

    def seconds(self, tokens: int, seqs: int, sampled: int, attn: float, kv_tokens: int, decode_only: bool) -> float:
        """The step's time from its aggregates (pure: what the tests and the benchmark call)."""
        if tokens == 0:
            return 0.0
        moved = self._weights + kv_tokens * self._kv + tokens * self._kv
        flops = tokens * self._matmul_flops + sampled * self._head_flops + attn * self._attn_flops
        gpu = max(moved / self._bw, flops / self._flops)
        if self._tp > 1:
            ring = 2 * (self._tp - 1) / self._tp * tokens * self._act_bytes
            gpu += 2 * self._layers * (ALLREDUCE_LATENCY_S + ring / self.gpu.link_bandwidth)
        host = 1.2e-3 + 4e-6 * seqs
        if self.config.async_scheduling:
            host *= 0.5
        if self.config.enforce_eager:
            launch = 100e-6 * self._layers
        elif decode_only and self._graphs and seqs <= self._graphs[-1]:
            launch = 5e-6 * self._layers
            # a graph runs padded to the next captured size
            padded = self._graphs[bisect.bisect_left(self._graphs, seqs)]
            gpu *= 1.0 + 0.1 * (padded - seqs) / padded
        else:
            launch = 25e-6 * self._layers
        return gpu + host + launch
