"""What an NVIDIA GPU really achieves on the kernels of a vLLM step, measured with PyTorch (issue 9).

vllm-sim's step model (autotune/sim/perf.py) is a roofline over each GPU's datasheet peaks times an
achievable share: ``bandwidth_efficiency`` for the bytes a step moves (weights, KV cache) and
``compute_efficiency`` for its FLOPs. Those shares were fitted to public serving measurements. This
script measures them instead, on the model shapes the calibration set uses, so that the shares
come from the hardware and the public measurements stay a pure score (bench/sim_fidelity.md).

Measured, each the median of CUDA-event-timed repeats after a warm-up, on random bf16 data:

- ``copy``: a 4 GiB device-to-device copy (bytes read + written): the memory ceiling;
- ``gemm``: one transformer layer's four linear layers (qkv, o, gate_up, down; tensor-parallel
  slices for tp > 1) for M tokens, M = 1 .. 8192: achieved weight-read bandwidth at small M,
  achieved FLOP/s at large M;
- ``prefill_attention``: causal flash attention (torch SDPA, GQA) over L tokens: achieved FLOP/s;
- ``decode_attention``: one new token per sequence against a KV cache of L tokens, batch B: the
  achieved KV-read bandwidth (SDPA, not vLLM's paged kernels: a floor on what vLLM reaches).

And derived from them (``derived`` in the JSON, what profiles.py takes):

- ``bandwidth_efficiency``: weight bytes / time of the layer GEMMs at M <= 16 (decode batches,
  weight-read bound), median over the models, / the datasheet bandwidth;
- ``compute_efficiency``: FLOPs / time of the layer GEMMs at M in 2048..8192 (a chunked-prefill
  step), median over the models, / the datasheet BF16 peak;
- the same two for attention (``attention_*``), reported, not used by the step model yet.

Run it where a GPU and PyTorch are (no vLLM needed):

    python3 scripts/gpu_microbench.py --gpu h100-80gb --json bench/gpu_microbench_h100.json

The datasheet peaks come from autotune/sim/profiles.py (``--gpu``), so the shares are of the same
peaks the simulator multiplies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from autotune.sim.profiles import MODELS, gpu_profile  # noqa: E402

# (profile name, tensor-parallel size): the shapes of the calibration set's models
SHAPES = [("qwen3-8b", 1), ("llama-3-8b", 1), ("qwen3-32b", 1), ("llama-3-70b", 4)]
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
DECODE_M = (1, 2, 4, 8, 16)
PREFILL_M = (2048, 4096, 8192)


def timed(fn, repeats: int = 30, warmup: int = 5) -> float:
    """Median seconds of one call of ``fn``, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def layer_shapes(cfg: dict, tp: int) -> list[tuple[int, int]]:
    """One layer's linear weights' (in, out) shapes, qkv, o, gate_up, down, as tensor parallelism slices them."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    return [(h, (q + 2 * kv) // tp), (q // tp, h), (h, 2 * inter // tp), (inter // tp, h)]


def layer_weights(cfg: dict, tp: int, device: str = "cuda") -> list[torch.Tensor]:
    """One layer's linear weights, (in, out), as tensor parallelism slices them on one GPU."""
    return [torch.randn(i, o, device=device, dtype=torch.bfloat16) * 0.02 for i, o in layer_shapes(cfg, tp)]


def measure_gemm(cfg: dict, tp: int) -> list[dict]:
    weights = layer_weights(cfg, tp)
    weight_bytes = sum(w.numel() * 2 for w in weights)
    flops_per_token = sum(2 * w.shape[0] * w.shape[1] for w in weights)
    rows = []
    for m in TOKENS:
        xs = [torch.randn(m, w.shape[0], device="cuda", dtype=torch.bfloat16) for w in weights]

        def layer() -> None:
            for x, w in zip(xs, weights):
                torch.matmul(x, w)

        s = timed(layer)
        rows.append({"tokens": m, "seconds": s, "weight_bytes": weight_bytes,
                     "bytes_per_s": (weight_bytes + sum(x.numel() * 2 for x in xs)) / s,
                     "flops_per_s": flops_per_token * m / s})
    return rows


def measure_prefill_attention(cfg: dict, tp: int) -> list[dict]:
    heads, kv_heads, d = cfg["num_attention_heads"] // tp, max(1, cfg["num_key_value_heads"] // tp), cfg["head_dim"]
    rows = []
    for length in (1024, 4096, 8192):
        q = torch.randn(1, heads, length, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, kv_heads, length, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        s = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), repeats=20)
        # the simulator's count: 4 x heads x head_dim x (new tokens x context), causal: L (L + 1) / 2
        flops = 4 * heads * d * length * (length + 1) / 2
        rows.append({"tokens": length, "seconds": s, "flops_per_s": flops / s})
    return rows


def measure_decode_attention(cfg: dict, tp: int) -> list[dict]:
    heads, kv_heads, d = cfg["num_attention_heads"] // tp, max(1, cfg["num_key_value_heads"] // tp), cfg["head_dim"]
    rows = []
    for batch, length in ((8, 4096), (32, 2048), (64, 4096), (128, 1024)):
        q = torch.randn(batch, heads, 1, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, length, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        s = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), repeats=20)
        kv_bytes = 2 * k.numel() * 2
        rows.append({"batch": batch, "context": length, "seconds": s, "bytes_per_s": kv_bytes / s})
        del q, k, v
    return rows


def measure_copy() -> float:
    n = 1 << 31  # 2^31 bf16 = 4 GiB
    src = torch.randn(n // 1024, 1024, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    s = timed(lambda: dst.copy_(src), repeats=20)
    return 2 * src.numel() * 2 / s


def derive(out: dict, bandwidth: float, bf16_flops: float) -> dict[str, float]:
    """The shares of the datasheet peaks profiles.py takes, from the measurements (pure)."""
    models = out["models"].values()
    bw = statistics.median(r["bytes_per_s"] for m in models for r in m["gemm"] if r["tokens"] in DECODE_M)
    fl = statistics.median(r["flops_per_s"] for m in models for r in m["gemm"] if r["tokens"] in PREFILL_M)
    attn_fl = statistics.median(r["flops_per_s"] for m in models for r in m["prefill_attention"] if r["tokens"] >= 4096)
    attn_bw = statistics.median(r["bytes_per_s"] for m in models for r in m["decode_attention"])
    return {"bandwidth_efficiency": round(bw / bandwidth, 3), "compute_efficiency": round(fl / bf16_flops, 3),
            "attention_compute_efficiency": round(attn_fl / bf16_flops, 3),
            "attention_bandwidth_efficiency": round(attn_bw / bandwidth, 3),
            "copy_efficiency": round(out["copy_bytes_per_s"] / bandwidth, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", required=True, help="the vllm-sim profile whose datasheet peaks the shares are of")
    ap.add_argument("--json", type=Path, required=True, help="where to write every measurement")
    args = ap.parse_args(argv)
    gpu = gpu_profile(args.gpu)
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    out: dict = {"gpu_profile": args.gpu, "device": props.name, "sms": props.multi_processor_count,
                 "memory_bytes": props.total_memory, "torch": torch.__version__, "cuda": torch.version.cuda,
                 "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                 "datasheet": {"bandwidth": gpu.bandwidth, "bf16_flops": gpu.bf16_flops},
                 "copy_bytes_per_s": measure_copy(), "models": {}}
    print(f"{props.name}: copy {out['copy_bytes_per_s'] / 1e12:.2f} TB/s "
          f"({out['copy_bytes_per_s'] / gpu.bandwidth:.0%} of {gpu.bandwidth / 1e12:.2f})", flush=True)
    for name, tp in SHAPES:
        cfg = MODELS[name]
        key = f"{name}-tp{tp}"
        gemm = measure_gemm(cfg, tp)
        out["models"][key] = {"gemm": gemm, "prefill_attention": measure_prefill_attention(cfg, tp),
                              "decode_attention": measure_decode_attention(cfg, tp)}
        torch.cuda.empty_cache()
        print(f"{key}: " + "  ".join(f"M={r['tokens']} {r['seconds'] * 1e6:.0f}us" for r in gemm), flush=True)
    out["derived"] = derive(out, gpu.bandwidth, gpu.bf16_flops)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print("derived shares of the datasheet peaks:", json.dumps(out["derived"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
