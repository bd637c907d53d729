"""How long one engine step takes: a roofline plus the host's overhead.

A step computes ``T`` new tokens for ``S`` sequences. Per GPU (tensor parallelism splits the
weights, the heads and the KV cache; pipeline parallelism is not modelled beyond memory):

- bytes moved: every weight once, the KV cache of every scheduled sequence's context (read by
  attention), the new tokens' KV (written);
- FLOPs: 2 x parameters x T for the matmuls, 2 x hidden x vocab per sampled sequence for the
  LM head, and 4 x layers x heads x head_dim x (new tokens x context) for attention;
- time = two rooflines, one after the other, as the kernels run: the linear layers
  max(weight bytes / (bandwidth x e_bw), matmul FLOPs / (peak x e_flops)) plus attention
  max(KV bytes / (bandwidth x e_attn_bw), attention FLOPs / (peak x e_attn_flops)). The e's are
  the achievable shares of the datasheet peaks, per GPU (``GpuProfile``): measured with PyTorch
  on the H100 and H200 (scripts/gpu_microbench.py: the models' own layer GEMMs and flash
  attention, bench/gpu_microbench_*.json), fitted on public measurements for the A100, and 0.85 /
  0.70 elsewhere (STREAM-like copies reach ~85 % of HBM bandwidth, large bf16 GEMMs ~70 % MFU);
  attention's shares are the GEMMs' where nobody measured them; where the shares were measured on short
  kernel runs, a whole step sustains ``GpuProfile.sustained_compute`` of the compute ones (0.6 on Hopper,
  fitted on public prefill runs);
- plus two all-reduces per layer under tensor parallelism (ring: 2 (tp-1)/tp x activation bytes
  over the link, and a fixed latency each: ``GpuProfile.allreduce_latency_s``, ~8 us by default);
- plus host overhead: scheduling, sampling and detokenizing (``GpuProfile.host_step_s`` +
  ``host_seq_s`` per sequence, 1.2 ms + 4 us by default; --async-scheduling overlaps about half of it
  with the GPU) and kernel launches: with CUDA graphs, a decode-only batch that fits a captured size
  replays one graph (~5 us per layer), a mixed batch runs piecewise graphs (~25 us per layer);
  --enforce-eager launches every kernel (``eager_layer_s``, ~100 us per layer, about 15 kernels of
  ~6 us). A CPU host has no graphs: its compiled steps cost the piecewise figure.

The host constants are round numbers from published vLLM profiles, except on the H100 (its fixed part
vLLM's scheduler as measured by scripts/bench_scheduler.py, its per-sequence part fitted) and the H200
(which takes the H100's); the A100's shares and the all-reduce latency of the calibrated GPUs are fitted
on public measurements too, the API server's costs (``FrontEnd``) measured on real vLLM
(bench/sim_fidelity.md has the errors on points held out of the fit). What
matters for the search is that the trade-offs point the right way and have the right order of
magnitude: batching amortizes the weight reads until compute binds, long contexts make decode
bandwidth-bound on KV, eager mode costs most at small batches.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from autotune.engine.model import ModelShape
from autotune.sim.config import SimConfig, capture_sizes
from autotune.sim.profiles import GpuProfile
from autotune.sim.scheduler import StepPlan

__all__ = ["StepModel"]


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
        g = self.gpu
        self._bw = g.bandwidth * g.bandwidth_efficiency
        self._flops = g.bf16_flops * g.compute_efficiency * g.sustained_compute
        self._attn_bw = g.bandwidth * (g.attention_bandwidth_efficiency or g.bandwidth_efficiency)
        self._attn_flops_rate = (
            g.bf16_flops * (g.attention_compute_efficiency or g.compute_efficiency) * g.sustained_compute
        )
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
        linear = max(
            (self._weights + tokens * self._kv) / self._bw,
            (tokens * self._matmul_flops + sampled * self._head_flops) / self._flops,
        )
        attention = max(kv_tokens * self._kv / self._attn_bw, attn * self._attn_flops / self._attn_flops_rate)
        gpu = linear + attention
        if self._tp > 1:
            ring = 2 * (self._tp - 1) / self._tp * tokens * self._act_bytes
            gpu += 2 * self._layers * (self.gpu.allreduce_latency_s + ring / self.gpu.link_bandwidth)
        host = self.gpu.host_step_s + self.gpu.host_seq_s * seqs
        if self.config.async_scheduling:
            host *= 0.5
        if self.config.enforce_eager:
            launch = self.gpu.eager_layer_s * self._layers
        elif decode_only and self._graphs and seqs <= self._graphs[-1]:
            launch = 5e-6 * self._layers
            # a graph runs padded to the next captured size
            padded = self._graphs[bisect.bisect_left(self._graphs, seqs)]
            gpu *= 1.0 + 0.1 * (padded - seqs) / padded
        else:
            launch = 25e-6 * self._layers
        return gpu + host + launch


@dataclass
class FrontEnd:
    """vLLM's API server process: what a request costs before the engine sees it and after it answers.

    One process serves every request (``vllm serve`` runs one API server by default), so its
    work is serialized: a request costs ``request_s`` (HTTP, JSON, the chat template, request
    setup) plus ``prompt_token_s`` per prompt token (tokenization) before the engine core gets
    it, and every step's outputs cost ``output_token_s`` per token (detokenization, the SSE
    chunk) before the client sees them. ``latency_s`` is the part of the path that is not
    serialized (the client, the socket, the ZMQ hop to the engine core): a floor under TTFT.
    Under a burst the serialized costs queue, which is the front-end's own throughput ceiling.

    ``admit`` and ``deliver`` advance the process's clock (``free_s``): the one model the
    virtual-time engine (virtual.py) and the HTTP server's engine (realtime.py) both apply.
    The constants are measured on real vLLM (``API_SERVER`` below, scripts/bench_front_end.py), the floor fitted.
    """

    request_s: float = 0.0
    prompt_token_s: float = 0.0
    output_token_s: float = 0.0
    latency_s: float = 0.0
    free_s: float = 0.0  # when the process is next idle

    def admit(self, now: float, prompt_tokens: int) -> float:
        """When a request that reached the server at ``now`` reaches the engine core."""
        start = max(now, self.free_s)
        self.free_s = start + self.request_s + self.prompt_token_s * prompt_tokens
        return self.free_s + self.latency_s

    def deliver(self, now: float, tokens: int) -> float:
        """When a step that ended at ``now`` with ``tokens`` new tokens has them at the client."""
        if not self.output_token_s:
            return now
        start = max(now, self.free_s)
        self.free_s = start + self.output_token_s * tokens
        return self.free_s

    def reset(self) -> FrontEnd:
        return FrontEnd(self.request_s, self.prompt_token_s, self.output_token_s, self.latency_s)


# vLLM's API server: what its one process spends per request, per prompt token and per streamed token, measured on
# real vLLM 0.32 (CPU build, the tiny model; scripts/bench_front_end.py, bench/front_end_cpu.json: CPU seconds of
# the API-server process over bursts of 400 streamed requests, on this project's 2-core AMD EPYC VM), taken as they
# are: the fit part of bench/sim_calibration.toml cannot tell a faster host core from this one (`scripts/
# bench_sim_fidelity.py --fit-front-end`: log loss 0.0170 at 1x, 0.0168 at its optimum 3.8x). The per-prompt-token
# cost agrees with what was fitted on public points before (2.2 us); the per-request cost is new (the fit had needed
# none) and the per-token one 2.9x the fitted 37.5 us (the ceiling it sets, ~9k streamed tokens/s in one process, is
# where Lambda's Llama-3-8B on 4 and 8 H100s plateaus). Each is the median of three rounds of bursts. latency_s is
# the path outside that process (the client, the socket, the hop to the engine core), a floor under TTFT fitted on
# the fit part's V1 low-load points (gpustack Qwen3-8B/H100 at concurrency 1-8; bench/sim_fidelity.md).
MEASURED_API_SERVER = FrontEnd(request_s=2.34e-3, prompt_token_s=1.87e-6, output_token_s=109e-6)
API_SERVER = replace(MEASURED_API_SERVER, latency_s=0.050)
