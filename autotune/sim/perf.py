"""How long one engine step takes: a roofline plus the host's overhead.

A step computes ``T`` new tokens for ``S`` sequences. Per GPU (tensor parallelism splits the
weights, the heads and the KV cache; pipeline parallelism splits the layers):

- bytes moved: every weight once (of a mixture of experts, the routed experts the step's tokens
  touch: ``StepModel.experts_read``), the KV cache of every scheduled sequence's context (read by
  attention; a sliding-window layer reads at most its window), the new tokens' KV (written);
- FLOPs: 2 x active parameters x T for the matmuls (``ModelShape.active_params``: a MoE token's
  routed experts only), 2 x hidden x vocab per sampled sequence for the LM head, and 4 x layers x
  heads x head_dim x (new tokens x context) for attention; fp8 weights compute at the GPU's fp8 peak
  where it has one (``GpuProfile.fp8_flops``), MXFP4 and int4 weights at bf16 (weight-only kernels);
- time = rooflines, one after the other, as the kernels run: the linear layers
  max(weight bytes / (bandwidth x e_bw), matmul FLOPs / (peak x e_flops)), a mixture of experts' fused-MoE call
  in each MoE layer (``moe_layer_seconds``: a fixed cost, then the touched experts' reads or their grouped GEMMs),
  and attention max(KV bytes / (bandwidth x e_attn_bw), attention FLOPs / (peak x e_attn_flops)). The e's are
  the achievable shares of the datasheet peaks, per GPU (``GpuProfile``): measured with PyTorch
  on the H100 and H200 (scripts/gpu_microbench.py: the models' own layer GEMMs and flash
  attention, bench/gpu_microbench_*.json), fitted on public measurements for the A100, and 0.85 /
  0.70 elsewhere (STREAM-like copies reach ~85 % of HBM bandwidth, large bf16 GEMMs ~70 % MFU);
  attention's shares are the GEMMs' where nobody measured them; where the shares were measured on short
  kernel runs, a whole step sustains ``GpuProfile.sustained_compute`` of the compute ones (0.6 on Hopper,
  fitted on public prefill runs);
- plus two all-reduces per layer under tensor parallelism (ring: 2 (tp-1)/tp x activation bytes
  over the link, and a fixed latency each: ``GpuProfile.allreduce_latency_s``, ~8 us by default);
  expert parallelism puts whole experts on each GPU, and the step waits for the GPU whose experts
  drew the most tokens; pipeline parallelism runs micro-batches through its stages (``seconds``);
- plus host overhead: scheduling, sampling and input preparation (``GpuProfile.host_step_s`` +
  ``host_seq_s`` per sequence, 40 us + 37.5 us on a GPU host; --async-scheduling overlaps about half of it
  with the GPU) and kernel launches: with CUDA graphs, a decode-only batch that fits a captured size
  replays one graph (``graph_layer_s`` per layer, ~5 us: the layer's small kernels and the gaps between
  them), a mixed batch runs piecewise graphs (~25 us per layer);
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
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from autotune.engine.model import WEIGHT_FORMATS, ModelShape
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
        c = self.config
        s = self.shape.served(c.quantization)
        tp, pp = c.tensor_parallel_size, c.pipeline_parallel_size
        self._tp, self._pp = tp, pp
        # one pipeline stage: tp GPUs holding layers / pp layers
        split = tp * pp
        self._weights = (s.weights_bytes - min(s.expert_weights_bytes, s.weights_bytes)) / split  # read every step
        self._moe_layers, self._experts, self._routed = s.moe_layers / pp, s.experts, s.experts_per_token
        # expert parallelism: each GPU holds experts / tp whole experts, instead of every expert's width / tp
        self._ep = c.whole_experts(s)
        self._held = s.experts / tp if self._ep else s.experts  # experts a GPU computes (without EP: a slice of each)
        # one routed expert of one layer, per GPU, as loaded: read when a token of the step is routed to it
        loaded = s.loaded_expert_weights_bytes(tp, self._ep)
        per_expert = loaded / (s.moe_layers * s.experts) if s.moe_layers else 0.0
        self._expert = per_expert if self._ep else per_expert / tp
        # per token: the routed experts' grouped GEMMs apart, at their own share of the GEMM rate
        self._expert_flops = 2 * s.moe_layers * s.experts_per_token * s.expert_params / split
        self._matmul_flops = 2 * s.active_params / split - self._expert_flops
        if weight_only(s, self.gpu):
            self._matmul_flops /= self.gpu.weight_only_share
        # per sampled sequence; under pipeline parallelism on the last stage only, which ``seconds`` charges
        # through the mean stage
        self._head_flops = 2 * s.hidden * s.vocab / split
        full = s.layers - s.sliding_layers
        self._attn_flops = 4 * full * s.heads * s.head_dim / split  # per (new token x context token)
        self._window_flops = 4 * s.sliding_layers * s.heads * s.head_dim / split  # the same, within the window
        elem = s.kv_element_bytes(c.kv_cache_dtype, c.dtype)
        self._kv = s.kv_bytes_per_token(c.kv_cache_dtype, c.dtype, tp) / pp  # per token, per GPU
        self._window_kv = 2 * s.sliding_layers * s.kv_heads_per_gpu(tp) * s.head_dim * elem / pp
        self._window = s.sliding_window
        g = self.gpu
        # fp8 weights run W8A8 GEMMs where the GPU has fp8 tensor cores; elsewhere (Ampere: Marlin) and for
        # MXFP4 and int4 (weight-only kernels) the GEMMs compute in bf16
        peak = g.fp8_flops if s.weight_quant == "fp8" and g.fp8_flops else g.bf16_flops
        self._bw = g.bandwidth * g.bandwidth_efficiency
        expert_share = g.expert_bandwidth_efficiency
        if expert_share is None or marlin_kernels(s, g):
            expert_share = g.bandwidth_efficiency
        self._expert_bw = g.bandwidth * expert_share
        self._flops = peak * g.compute_efficiency * g.sustained_compute
        w8a8 = s.weight_quant == "fp8" and g.fp8_flops  # Triton's W8A8 fused MoE, not Marlin's
        self._grouped_share = (w8a8 and g.fp8_grouped_gemm_share) or g.grouped_gemm_share
        self._marlin = marlin_kernels(s, g)
        self._padding: dict[int, float] = {}  # padded_rows_share by step size: steps repeat their sizes
        self._attn_bw = g.bandwidth * (g.attention_bandwidth_efficiency or g.bandwidth_efficiency)
        self._attn_flops_rate = (
            g.bf16_flops * (g.attention_compute_efficiency or g.compute_efficiency) * g.sustained_compute
        )
        if s.attention_sinks:
            self._attn_flops_rate *= g.sink_attention_share
        self._act_bytes = 2 * s.hidden  # one token's activation, bf16
        self._graphs = capture_sizes(c)
        self._layers = s.layers / pp

    def step_seconds(self, plan: StepPlan) -> float:
        tokens = 0
        attn = window_attn = 0.0
        kv_read = window_read = 0
        sampled = 0
        decode_only = True
        w = self._window
        for req, n in plan.scheduled:
            ctx = req.num_computed  # before this step
            tokens += n
            attn += n * (ctx + (n + 1) / 2)
            kv_read += ctx + n
            if w:
                window_attn += n * min(ctx + (n + 1) / 2, w)
                window_read += min(ctx + n, w + n - 1)
            if ctx + n >= req.num_tokens:
                sampled += 1
            if n > 1 or ctx + n < req.num_tokens:
                decode_only = False
        return self.seconds(tokens, len(plan.scheduled), sampled, attn, kv_read, decode_only, window_attn, window_read)

    def experts_read(self, tokens: float) -> float:
        """Routed experts a step of ``tokens`` tokens reads per MoE layer, per GPU: each token picks
        ``experts_per_token`` of ``experts``, taken as uniform and independent, so the expected number touched is
        E x (1 - (1 - k/E)^T), every expert once the batch is large. Under expert parallelism a GPU holds E / tp
        of them and the step waits for the GPU that touched the most (``_busiest``)."""
        if not self._experts:
            return 0.0
        touched = 1.0 - (1.0 - self._routed / self._experts) ** tokens
        if not self._ep:
            return self._experts * touched
        held = self._held
        return min(held, _busiest(self._tp, held * touched, held * touched * (1 - touched)))

    def moe_layer_seconds(self, tokens: float) -> float:
        """One MoE layer's routed experts for a step of ``tokens`` tokens, per GPU, as the step charges them: the
        fused-MoE call's fixed cost (``GpuProfile.moe_call_s``: routing, alignment, the activation, the kernels'
        ramp) plus whichever takes longer of reading the experts it touches (``expert_bandwidth_efficiency`` of the
        bandwidth, and ``moe_expert_s`` per expert) and their grouped GEMMs at ``grouped_gemm_share`` of the GEMM
        rate over each expert's rows padded to the kernel's row block (``padding``), plus the routed tokens' hidden
        vectors it moves (``routed_activation_seconds``). It is what vLLM's benchmarks/kernels/benchmark_moe.py
        times as one fused-MoE call (scripts/bench_moe_kernels.py compares the two)."""
        if not self._moe_layers:
            return 0.0
        touched = self.experts_read(tokens)
        reads = touched * (self._expert / self._expert_bw + self.gpu.moe_expert_s)
        gemms = tokens * self._grouped_flops(tokens) / self._moe_layers / self._flops * self.padding(tokens)
        return self.gpu.moe_call_s + max(reads, gemms) + self.routed_activation_seconds(tokens)

    def padding(self, tokens: float) -> float:
        """How many more rows the grouped GEMMs compute than a step routes: vLLM's ``moe_align_block_size`` pads each
        expert's tokens to a multiple of the kernel's row block (``moe_block_rows``), so an expert routed a few rows
        past a block computes a whole block more. Each expert's rows taken as Poisson with the step's mean."""
        n = max(1, round(tokens))
        if n not in self._padding:
            block = moe_block_rows(n * self._routed / self._held, n <= self._held, self._marlin)
            self._padding[n] = padded_rows_share(n * self._routed / self._experts, block)
        return self._padding[n]

    def routed_activation_seconds(self, tokens: float) -> float:
        """The hidden vectors one MoE layer's fused-MoE call moves on the busiest GPU: each (token, routed expert)
        pair's is gathered into the first grouped GEMM, written by the second and read back by the sum over the
        token's experts (vLLM's ``fused_experts`` keeps them in a tokens x top-k x hidden cache), in bf16, at the
        bandwidth, apart from the weights' reads. Under tensor parallelism every GPU does it for every pair, at
        full hidden width however thin its slice of each expert, so it weighs most where experts are thin and
        split many ways (Qwen3-235B at TP 8: 192 of each expert's 1536 columns a GPU). Under expert parallelism a
        GPU gathers and writes only its own experts' pairs, but zeroes the whole cache first (``expert_map``) and
        sums all of it."""
        pairs = tokens * self._routed
        vectors = 3 * pairs
        if self._ep:
            vectors = 2 * pairs + 2 * pairs * self._expert_load(tokens) / self._tp
        return vectors * self._act_bytes / self._bw

    def _grouped_flops(self, tokens: float) -> float:
        """The routed experts' FLOPs per token, all MoE layers of a GPU, weighed by the busiest GPU's load and
        counted at the grouped GEMMs' share of the GEMM rate."""
        return self._expert_flops * self._expert_load(tokens) / self._grouped_share

    def _expert_load(self, tokens: float) -> float:
        """The busiest GPU's share of the routed tokens over the mean share: 1 unless expert parallelism puts
        whole experts on each GPU, where the T x k routings land on tp GPUs as a binomial draw."""
        if not self._ep or tokens <= 0:
            return 1.0
        picks = tokens * self._routed
        mean = picks / self._tp
        return _busiest(self._tp, mean, mean * (1 - 1 / self._tp)) / mean

    def seconds(
        self,
        tokens: int,
        seqs: int,
        sampled: int,
        attn: float,
        kv_tokens: int,
        decode_only: bool,
        window_attn: float | None = None,
        window_kv_tokens: int | None = None,
    ) -> float:
        """The step's time from its aggregates (pure: what the tests and the benchmark call). The window
        aggregates are the sliding-window layers' (context capped at the window); not given, those layers are
        charged the whole context.

        Under pipeline parallelism vLLM keeps up to pp micro-batches in flight, one per stage: the batch's
        sequences split into min(pp, seqs) micro-batches, and each is back for its next step after passing all
        pp stages, so the step takes pp stage times of one micro-batch (with fewer micro-batches than stages,
        the pipeline has bubbles) plus the activations' hops between stages."""
        if tokens == 0:
            return 0.0
        window_attn = attn if window_attn is None else window_attn
        window_kv_tokens = kv_tokens if window_kv_tokens is None else window_kv_tokens
        if self._pp == 1:
            return self._stage_seconds(
                tokens, seqs, sampled, attn, kv_tokens, decode_only, window_attn, window_kv_tokens
            )
        micro = min(self._pp, seqs)
        stage = self._stage_seconds(
            tokens / micro,
            seqs / micro,
            sampled / micro,
            attn / micro,
            kv_tokens / micro,
            decode_only,
            window_attn / micro,
            window_kv_tokens / micro,
        )
        hop = self.gpu.allreduce_latency_s + tokens / micro * self._act_bytes / self.gpu.link_bandwidth
        return self._pp * (stage + hop)

    def _stage_seconds(
        self,
        tokens: float,
        seqs: float,
        sampled: float,
        attn: float,
        kv_tokens: float,
        decode_only: bool,
        window_attn: float,
        window_kv_tokens: float,
    ) -> float:
        linear = max(
            (self._weights + tokens * (self._kv + self._window_kv)) / self._bw,
            (tokens * self._matmul_flops + sampled * self._head_flops) / self._flops,
        )
        experts = self._moe_layers * self.moe_layer_seconds(tokens)
        attention = max(
            (kv_tokens * self._kv + window_kv_tokens * self._window_kv) / self._attn_bw,
            (attn * self._attn_flops + window_attn * self._window_flops) / self._attn_flops_rate,
        )
        gpu = linear + experts + attention
        if self._tp > 1:
            ring = 2 * (self._tp - 1) / self._tp * tokens * self._act_bytes
            gpu += 2 * self._layers * (self.gpu.allreduce_latency_s + ring / self.gpu.link_bandwidth)
        host = self.gpu.host_step_s + self.gpu.host_seq_s * seqs
        if self.config.async_scheduling:
            host *= 0.5
        if self.config.enforce_eager:
            launch = self.gpu.eager_layer_s * self._layers
        elif decode_only and self._graphs and seqs <= self._graphs[-1]:
            launch = self.gpu.graph_layer_s * self._layers
            # a graph runs padded to the next captured size
            padded = self._graphs[bisect.bisect_left(self._graphs, math.ceil(seqs))]
            gpu *= 1.0 + 0.1 * (padded - seqs) / padded
        else:
            launch = 25e-6 * self._layers
        return gpu + host + launch


def moe_block_rows(rows_per_expert: float, few_tokens: bool, marlin: bool) -> int:
    """The row block vLLM's fused-MoE kernels pad each expert's tokens to. Marlin's: the first of 8, 16, 32, 48
    and 64 that the mean rows an expert falls below 0.9 of, else 64 (``fused_marlin_moe``); Triton's default
    config as the scored runs' vLLM (0.10-0.11) and the kernel tables' had it: 16 while the call has no more tokens
    than the experts it holds, else 64 (``get_default_config``). Later vLLM picks 16-128 by the step's tokens, and
    the tuned config files vLLM ships for some GPUs and shapes override either."""
    if marlin:
        return next((b for b in (8, 16, 32, 48, 64) if rows_per_expert / b < 0.9), 64)
    return 16 if few_tokens else 64


def padded_rows_share(mean: float, block: int) -> float:
    """E[ceil(r / block) x block] / E[r] for an expert's rows r ~ Poisson(mean): what padding to the row block
    adds to the rows a grouped GEMM computes (1.0: none). Summed over the pmf within 8 standard deviations."""
    if mean <= 0:
        return 1.0
    sd = math.sqrt(mean)
    lo, hi = max(1, int(mean - 8 * sd)), int(mean + 8 * sd) + block
    padded = sum(
        math.exp(r * math.log(mean) - mean - math.lgamma(r + 1)) * -(-r // block) * block for r in range(lo, hi + 1)
    )
    return padded / mean


def marlin_kernels(served: ModelShape, gpu: GpuProfile) -> bool:
    """Does vLLM run the checkpoint's quantized weights through Marlin's weight-only kernels, dequantized inside a
    bf16 GEMM (MXFP4 and int4, fp8 where there are no fp8 tensor cores), rather than W8A8 GEMMs and Triton's fused
    MoE? Marlin's expert reads keep the linear layers' bandwidth share: no public table times them
    (``GpuProfile.expert_bandwidth_efficiency`` is Triton's)."""
    q = served.weight_quant
    return q in ("mxfp4", "int4") or (q == "fp8" and not gpu.fp8_flops)


def weight_only(served: ModelShape, gpu: GpuProfile) -> bool:
    """Are the linear layers' weights quantized while the GPU computes them in bf16 (``marlin_kernels``)? Then they
    reach ``GpuProfile.weight_only_share`` of its GEMM rate. MXFP4 quantizes only the experts, whose grouped GEMMs
    have their own share."""
    scope = WEIGHT_FORMATS.get(served.weight_quant, (0.0, ""))[1]
    return scope == "linear" and marlin_kernels(served, gpu)


def _busiest(gpus: int, mean: float, variance: float) -> float:
    """The expected largest of ``gpus`` draws of a count with this mean and variance (normal approximation:
    mean + sqrt(2 ln n) standard deviations)."""
    return mean + math.sqrt(2 * math.log(gpus) * max(variance, 0.0))


# VLLM_V1_OUTPUT_PROC_CHUNK_SIZE: V1's output handler processes a step's outputs in slices of at most this many
# requests and yields to the event loop between slices (vllm/v1/engine/async_llm.py, `output_handler`)
OUTPUT_SLICE = 128


@dataclass
class FrontEnd:
    """vLLM's API server process: what a request costs before the engine sees it and after it answers.

    One process serves every request (``vllm serve`` runs one API server by default), so its
    work is serialized: a request costs ``request_s`` (HTTP, JSON, the chat template, request
    setup) plus ``prompt_token_s`` per prompt token (tokenization) before the engine core gets
    it, and every step's outputs cost ``output_token_s`` per token (detokenization, the step's
    output record) and ``chunk_s`` per SSE chunk (the response object, its JSON, the write)
    before the client sees them. ``latency_s`` is the part of the path that is not serialized
    (the client, the socket, the ZMQ hop to the engine core): a floor under TTFT. Under a burst
    the serialized costs queue, which is the front-end's own throughput ceiling.

    The process is an asyncio event loop, and the model runs its work in the loop's order
    (``run``). A request's handler runs in two parts: it renders the request (``render_share``
    of ``request_s``: the body, its validation, the chat template) and hands the prompt to the
    tokenizer's thread; the rest (the tokens, the engine request, the hop to the engine core)
    runs when the thread is done. Handlers of requests that have arrived stand ahead in the
    loop's queue of anything that becomes ready later, so a burst renders in full before its
    first request reaches the engine; the second parts then take turns with the output handler,
    so a burst's first requests stream tokens while the later ones are still being admitted.

    With ``merge`` (vLLM V1) the output handler processes the steps the engine core sent in
    order, each in slices of ``OUTPUT_SLICE`` requests, and yields to the event loop only
    between slices and when no step is queued. At a yield each request's stream sends what its
    ``RequestOutputCollector`` gathered, in one chunk (vllm#12298), and the handler takes the
    steps that have arrived since. So a process that falls behind merges a request's tokens
    only across steps small enough to be one slice; a step of more requests sends every token
    in a chunk of its own. V0 sends every token in a chunk of its own, in step order.

    ``arrive`` and ``deliver`` hand the process its work, ``run`` advances its clock
    (``free_s``) as far as the work handed so far decides: the virtual-time engine (virtual.py)
    runs it whole, the HTTP server's engine (realtime.py) its request side (outputs leave there at
    the step's end). The constants are measured on real vLLM (``API_SERVER`` below,
    scripts/bench_front_end.py), the floor fitted.
    """

    request_s: float = 0.0
    prompt_token_s: float = 0.0
    output_token_s: float = 0.0
    chunk_s: float = 0.0
    latency_s: float = 0.0
    render_share: float = 0.0
    merge: bool = True
    free_s: float = 0.0  # when the work the process has done so far ends
    # the request handlers between two calls: requests not yet rendered (arrival, request, prompt tokens) and
    # rendered ones waiting for their second part; whether a second part or the output handler has the next turn
    rendering: list[tuple[float, Hashable, int]] = field(default_factory=list, init=False, repr=False)
    adding: list[tuple[Hashable, int]] = field(default_factory=list, init=False, repr=False)
    adds_next: bool = field(default=True, init=False, repr=False)
    # the output handler between two calls: the steps the engine core sent that it has not taken, the slices it took
    # and has not processed, and the tokens that cost the process nothing (no output costs) to send as they come
    arrived: list[tuple[float, list[tuple[Hashable, Any]]]] = field(default_factory=list, init=False, repr=False)
    taken: list[list[list[tuple[Hashable, Any]]]] = field(default_factory=list, init=False, repr=False)
    passed: list[tuple[Any, float]] = field(default_factory=list, init=False, repr=False)

    def arrive(self, now: float, request: Hashable, prompt_tokens: int) -> None:
        """A request reached the server at ``now``; ``run`` says when it reaches the engine core."""
        bisect.insort(self.rendering, (now, request, prompt_tokens), key=lambda r: r[0])

    def deliver(self, now: float, outputs: Sequence[tuple[Hashable, Any]]) -> None:
        """A step's new tokens, one ``(request, token)`` each, at the step's end ``now`` (steps in the order they
        end); ``run`` says when each reaches its client."""
        if not (self.output_token_s or self.chunk_s):
            self.passed += [(token, now) for _, token in outputs]
        elif outputs:  # the engine core sends nothing for a step that made no token (a prefill chunk)
            self.arrived.append((now, list(outputs)))

    @property
    def pending(self) -> bool:
        """Is there work handed to the process that ``run`` has not finished?"""
        return bool(self.rendering or self.adding or self.arrived or self.taken or self.passed)

    def run(self, known: float) -> tuple[list[tuple[float, Hashable]], list[tuple[Any, float]]]:
        """Run the process while what it does depends only on the work handed to it for times up to ``known``
        (``math.inf``: to its end). Returns the requests that reach the engine core, with when, and the tokens
        whose time at the client is now known, with that time."""
        admitted: list[tuple[float, Hashable]] = []
        sent, self.passed = self.passed, []
        while True:
            start, work = self._next()
            if start > known or start == math.inf:
                return admitted, sent
            if work == "render":
                _, request, tokens = self.rendering.pop(0)
                self.free_s = start + self.request_s * self.render_share
                self.adding.append((request, tokens))
            elif work == "add":
                request, tokens = self.adding.pop(0)
                self.free_s = start + self.request_s * (1 - self.render_share) + self.prompt_token_s * tokens
                admitted.append((self.free_s + self.latency_s, request))
                self.adds_next = False
            else:
                sent += self._handle(start)
                self.adds_next = True

    @property
    def next_at(self) -> float:
        """When the process starts its next piece of work, as far as the work handed to it says (``math.inf``:
        none)."""
        return self._next()[0]

    def _next(self) -> tuple[float, str]:
        """The process's next piece of work and when it starts: a request's handler that has arrived goes first
        (ahead in the loop's queue of whatever became ready after it), then the second parts of rendered requests
        and the output handler take turns."""
        render_at = max(self.free_s, self.rendering[0][0]) if self.rendering else math.inf
        add_at = self.free_s if self.adding else math.inf
        output_at = self.free_s if self.taken else max(self.free_s, self.arrived[0][0]) if self.arrived else math.inf
        start = min(render_at, add_at, output_at)
        if render_at == start:
            return start, "render"
        if add_at == start and (self.adds_next or output_at > start):
            return start, "add"
        return start, "output"

    def _handle(self, start: float) -> list[tuple[Any, float]]:
        """The output handler from ``start`` to its next yield: it takes the steps that have arrived, processes
        slices until it yields, and each stream sends what it gathered."""
        self.free_s = start
        while self.arrived and self.arrived[0][0] <= start:
            outputs = self.arrived.pop(0)[1]
            n = math.ceil(len(outputs) / OUTPUT_SLICE) if self.merge else 1
            self.taken.append([outputs[i * len(outputs) // n : (i + 1) * len(outputs) // n] for i in range(n)])
        unsent: dict[Hashable, list[Any]] = {}
        done: list[tuple[Any, float]] = []
        while True:
            step = self.taken[0]
            for request, token in step.pop(0):
                self.free_s += self.output_token_s
                if self.merge:
                    unsent.setdefault(request, []).append(token)
                else:  # V0: each token in its own chunk
                    self.free_s += self.chunk_s
                    done.append((token, self.free_s))
            if not step:
                self.taken.pop(0)
            if step or not self.taken:
                break  # a yield: between two slices of a step, or with no step taken
        for tokens in unsent.values():
            self.free_s += self.chunk_s
            done += [(token, self.free_s) for token in tokens]
        return done

    def reset(self, merge: bool | None = None) -> FrontEnd:
        """This front end idle, with nothing waiting (and ``merge`` if given)."""
        return replace(self, free_s=0.0, merge=self.merge if merge is None else merge)


# vLLM's API server: what its one process spends per request, per prompt token, per streamed token and per SSE
# chunk, measured on real vLLM 0.32's CPU build (scripts/bench_front_end.py: the API-server process's CPU seconds
# over bursts of streamed requests; bench/front_end_cpu.json for the request and prompt costs,
# bench/front_end_cpu_xeon.json for the output costs, the host whose figures the fit part chooses). render_share is
# measured the same way (`--order`, bench/front_end_order.json). latency_s, the path outside that process, is a floor
# under TTFT fitted on the fit part's V1 low-load points (bench/sim_fidelity.md).
MEASURED_API_SERVER = FrontEnd(
    request_s=2.34e-3, prompt_token_s=1.87e-6, output_token_s=15.5e-6, chunk_s=32.1e-6, render_share=0.33
)
API_SERVER = replace(MEASURED_API_SERVER, latency_s=0.050)
