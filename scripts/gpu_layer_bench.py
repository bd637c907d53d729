"""A whole decoder layer on an NVIDIA GPU, timed with PyTorch: decode batches and chunked long prefills (issue 26).

scripts/gpu_microbench.py times a layer's kernels one kind at a time. vllm-sim adds them up and adds
a launch cost per layer; this script times what it adds up: one Llama/Qwen decoder layer (RMSNorm,
QKV, rotary, attention, O, residual, RMSNorm, gate_up, SiLU x up, down, residual) on random bf16 data.

- ``decode``: batch B (1 .. 256), every sequence with a KV cache of L tokens (1K .. 32K, up to
  1M cached tokens in all), one new token each; timed eager and replayed from a CUDA graph, so
  the difference is the launch cost per layer (vLLM's ``--enforce-eager`` against its graphs).
  The KV cache is paged: blocks of 16 tokens in a shared pool, read through a shuffled block
  table. PyTorch has no paged decode kernel, so the layer gathers a sequence's blocks
  (``index_select``) into the layout SDPA takes: ``paged_gather`` moves the KV twice and bounds
  vLLM's paged kernel from above; ``contiguous`` (the same cache already in place) bounds it
  from below.
- ``compiled``: the decode layer compiled by torch.compile (fused as vLLM V1 compiles its model)
  and replayed from a CUDA graph, beside its four GEMMs alone in a graph: the GEMMs' weight-read
  share as vLLM's graphs see it, and what the layer's other kernels cost on top.
- ``prefill``: a 32K-token prompt through one layer, whole and chunked at 2K and 8K tokens, each
  chunk attending to the prompt's earlier tokens and causally to itself (lower-right causal
  mask); and each chunk's attention alone, by kernel (``chunk_attention``): PyTorch runs the
  masked call and forced FlashAttention-2 at about half the speed of the kernel it picks for the
  unmasked split, so the layer rows of chunks with a prefix carry a kernel choice vLLM does not
  make (its Hopper kernel is FlashAttention-3).

Each row is the median of CUDA-event-timed repeats after a warm-up. Rows are written as they are
measured, so a run cut short keeps what it measured; ``derived`` (``derive``) sums them up in the
step model's terms, and ``--derive`` recomputes it from a stored file without a GPU
(``bench_sim_fidelity.py --graph-measured`` runs the simulator with it). Run it where a GPU and
PyTorch are:

    python3 scripts/gpu_layer_bench.py --gpu h100-80gb --json bench/gpu_layer_h100.json
    python3 scripts/gpu_layer_bench.py --gpu h200-141gb --json bench/gpu_layer_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_microbench
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from autotune.sim.profiles import MODELS, gpu_profile

SHAPES = ("llama-3-8b", "qwen3-32b")  # --shapes NAME[:TP],... for others
BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (1024, 4096, 16384, 32768)
MAX_CACHED = 1 << 20  # tokens in one layer's cache: 4 GiB of bf16 K+V at 8 KV heads x 128
BLOCK = 16
DEVICE = "cuda"
PROMPT = 32768
CHUNKS = (2048, 8192)
COMPILED_BATCHES = (1, 32)


# gpu_microbench's timer (CUDA events, median after a warm-up), with fewer repeats: a layer runs longer than a GEMM
timed = partial(gpu_microbench.timed, repeats=20, warmup=3)


class Layer:
    """One decoder layer's weights and its forward pass, written as vLLM runs it; under tensor parallelism
    ``tp`` the slice one GPU holds (heads, KV heads and the MLP's width divided; no all-reduce)."""

    def __init__(self, cfg: dict, tp: int = 1) -> None:
        h, d = cfg["hidden_size"], cfg["head_dim"]
        self.heads, self.d = cfg["num_attention_heads"] // tp, d
        self.kv_heads = max(1, cfg["num_key_value_heads"] // tp)
        q, kv, inter = self.heads * d, self.kv_heads * d, cfg["intermediate_size"] // tp
        self.qkv, self.o, self.gate_up, self.down = gpu_microbench.layer_weights(cfg, tp, DEVICE)
        self.norm1 = torch.ones(h, device=DEVICE, dtype=torch.bfloat16)
        self.norm2 = torch.ones(h, device=DEVICE, dtype=torch.bfloat16)
        self.split = (q, kv, kv)
        self.inter = inter

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """x: (tokens, hidden); ``attend(q, k, v)`` takes (tokens, heads, d) and returns (tokens, heads * d)."""
        y = F.rms_norm(x, (x.shape[-1],), self.norm1)
        q, k, v = (y @ self.qkv).split(self.split, dim=-1)
        q = self.rope(q.view(-1, self.heads, self.d), cos, sin)
        k = self.rope(k.view(-1, self.kv_heads, self.d), cos, sin)
        x = x + attend(q, k, v.view(-1, self.kv_heads, self.d)) @ self.o
        y = F.rms_norm(x, (x.shape[-1],), self.norm2)
        gate, up = (y @ self.gate_up).split(self.inter, dim=-1)
        return x + (F.silu(gate) * up) @ self.down


def graph_of(fn) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after a warm-up on a side stream as PyTorch asks."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def decode_point(layer: Layer, model: str, batch: int, context: int) -> list[dict]:
    """One decode step of ``batch`` sequences of ``context`` cached tokens, both KV layouts."""
    blocks = batch * context // BLOCK
    # the pool holds K and V for every block; a shuffled table maps each sequence to its blocks
    pool = torch.randn(2, blocks, BLOCK, layer.kv_heads, layer.d, device=DEVICE, dtype=torch.bfloat16)
    table = torch.randperm(blocks, device=DEVICE)
    # the same cache in SDPA's layout: (batch, kv_heads, context, d)
    k_in_place, v_in_place = (pool[i].view(batch, context, layer.kv_heads, layer.d).transpose(1, 2) for i in (0, 1))
    x = torch.randn(batch, layer.qkv.shape[0], device=DEVICE, dtype=torch.bfloat16)
    cos = torch.randn(batch, 1, layer.d // 2, device=DEVICE, dtype=torch.bfloat16)
    sin = torch.randn_like(cos)

    def gathered(which: int) -> torch.Tensor:
        kv = pool[which].index_select(0, table)
        return kv.view(batch, context, layer.kv_heads, layer.d).transpose(1, 2)

    def attend_paged(q, k, v):
        out = F.scaled_dot_product_attention(q.unsqueeze(2), gathered(0), gathered(1), enable_gqa=True)
        return out.reshape(batch, -1)

    def attend_in_place(q, k, v):
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k_in_place, v_in_place, enable_gqa=True)
        return out.reshape(batch, -1)

    rows = []
    for kv_layout, attend in (("contiguous", attend_in_place), ("paged_gather", attend_paged)):
        row = {"model": model, "batch": batch, "context": context, "kv": kv_layout}
        try:
            row["eager_s"] = timed(partial(layer.forward, x, cos, sin, attend))
            row["graph_s"] = timed(graph_of(partial(layer.forward, x, cos, sin, attend)).replay)
        except RuntimeError as exc:  # out of memory or a backend that cannot be captured
            row["error"] = str(exc).splitlines()[0][:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def decode_rows(layer: Layer, model: str) -> list[dict]:
    rows = []
    for batch in BATCHES:
        for context in CONTEXTS:
            if batch * context <= MAX_CACHED:
                rows += decode_point(layer, model, batch, context)
                torch.cuda.empty_cache()
    return rows


def compiled_point(layer: Layer, model: str, batch: int, context: int = 1024) -> dict:
    """The decode layer as vLLM V1 runs it: compiled by torch.compile (inductor fuses the norms, rotary,
    residual adds and SiLU x up, as vLLM's compiled model does), then replayed from a CUDA graph; beside
    it the layer's four GEMMs alone in a graph, so ``layer - gemms`` is what the rest of the layer costs."""
    k = torch.randn(batch, layer.kv_heads, context, layer.d, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    x = torch.randn(batch, layer.qkv.shape[0], device=DEVICE, dtype=torch.bfloat16)
    cos = torch.randn(batch, 1, layer.d // 2, device=DEVICE, dtype=torch.bfloat16)
    sin = torch.randn_like(cos)
    weights = (layer.qkv, layer.o, layer.gate_up, layer.down)
    xs = [torch.randn(batch, w.shape[0], device=DEVICE, dtype=torch.bfloat16) for w in weights]

    def attend(q, _k, _v):
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True).reshape(batch, -1)

    def gemms() -> None:
        for a, w in zip(xs, weights, strict=True):
            a @ w

    row = {"model": model, "batch": batch, "context": context}
    try:
        row["gemms_graph_s"] = timed(graph_of(gemms).replay)
        compiled = torch.compile(partial(layer.forward, x, cos, sin, attend), fullgraph=True)
        began = time.monotonic()
        compiled()
        row["compile_s"] = time.monotonic() - began
        row["compiled_graph_s"] = timed(graph_of(compiled).replay)
    except Exception as exc:  # noqa: BLE001 - a compiler failure is a row's result, not the run's end
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    print(json.dumps(row), flush=True)
    return row


def compiled_rows(layer: Layer, model: str) -> list[dict]:
    return [compiled_point(layer, model, batch) for batch in COMPILED_BATCHES]


def chunk_attention(layer: Layer, chunk: int, start: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict:
    """The chunk's attention alone, three ways: one call with the lower-right causal mask (what the
    layer runs), and split as a flash kernel without a mask argument runs it: the chunk's queries
    against the prefix (no mask) plus the chunk against itself (causal), with the kernel PyTorch
    picks and with FlashAttention-2 forced. The split leaves out merging the two softmaxes (one
    elementwise pass over the chunk's outputs)."""
    q = torch.randn(1, layer.heads, chunk, layer.d, device=DEVICE, dtype=torch.bfloat16)
    k_own, v_own = k_cache[:, :, start : start + chunk], v_cache[:, :, start : start + chunk]
    keys, values = k_cache[:, :, : start + chunk], v_cache[:, :, : start + chunk]
    mask = causal_lower_right(chunk, start + chunk)
    masked = partial(F.scaled_dot_product_attention, q, keys, values, attn_mask=mask, enable_gqa=True)
    out = {"attention_masked_s": timed(masked, repeats=10)}

    def split() -> None:
        if start:
            F.scaled_dot_product_attention(q, k_cache[:, :, :start], v_cache[:, :, :start], enable_gqa=True)
        F.scaled_dot_product_attention(q, k_own, v_own, is_causal=True, enable_gqa=True)

    out["attention_split_s"] = timed(split, repeats=10)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out["attention_split_flash_s"] = timed(split, repeats=10)
    except RuntimeError as exc:
        out["attention_split_flash_error"] = str(exc).splitlines()[0][:200]
    return out


def prefill_chunk(layer: Layer, model: str, prompt: dict[str, torch.Tensor], chunk: int, start: int) -> dict:
    """One chunk of the prompt, ``start`` tokens already in the cache, through the whole layer."""
    end = start + chunk
    x, cos, sin = (prompt[name][start:end] for name in ("x", "cos", "sin"))
    k_cache, v_cache = prompt["k"], prompt["v"]

    def attend(q, k, v):
        # this chunk's own K/V join the cached prefix, as vLLM writes them before attention runs
        keys = torch.cat((k_cache[:, :, :start], k.transpose(0, 1).unsqueeze(0)), dim=2)
        values = torch.cat((v_cache[:, :, :start], v.transpose(0, 1).unsqueeze(0)), dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=causal_lower_right(chunk, end), enable_gqa=True
        )
        return out.squeeze(0).transpose(0, 1).reshape(chunk, -1)

    row = {"model": model, "prompt": PROMPT, "chunk": chunk, "prefix": start}
    try:
        row["seconds"] = timed(partial(layer.forward, x, cos, sin, attend), repeats=10)
        row |= chunk_attention(layer, chunk, start, k_cache, v_cache)
    except RuntimeError as exc:
        row["error"] = str(exc).splitlines()[0][:200]
    print(json.dumps(row), flush=True)
    return row


def prefill_rows(layer: Layer, model: str) -> list[dict]:
    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16)

    # the prompt's inputs, and its K and V as earlier chunks left them in the cache: (1, kv_heads, PROMPT, d)
    prompt = {
        "x": draw(PROMPT, layer.qkv.shape[0]),
        "cos": draw(PROMPT, 1, layer.d // 2),
        "sin": draw(PROMPT, 1, layer.d // 2),
        "k": draw(1, layer.kv_heads, PROMPT, layer.d),
        "v": draw(1, layer.kv_heads, PROMPT, layer.d),
    }
    rows = [
        prefill_chunk(layer, model, prompt, chunk, start)
        for chunk in (PROMPT, *CHUNKS)
        for start in range(0, PROMPT, chunk)
    ]
    torch.cuda.empty_cache()
    return rows


def layer_bytes(shape: str) -> tuple[int, int]:
    """(weight bytes of one layer's four GEMMs, KV bytes per cached token) on one GPU, for NAME[:TP]."""
    name, _, tp = shape.partition(":")
    cfg, tp = MODELS[name], int(tp or 1)
    kv = max(1, cfg["num_key_value_heads"] // tp) * cfg["head_dim"]
    return 2 * sum(i * o for i, o in gpu_microbench.layer_shapes(cfg, tp)), 2 * 2 * kv


def derive(out: dict, bandwidth: float) -> dict[str, float]:
    """What the step model takes from the rows (pure), as shares of the datasheet ``bandwidth``:

    - ``graph_gemm_bandwidth_share``: a layer's weight bytes / its four GEMMs' time in a graph, median;
    - ``kv_bandwidth_share``: the KV cache's read rate at the margin, the slope of the graph-replayed
      contiguous decode layer over its shortest and longest context at each batch, median;
    - ``graph_layer_s``: the compiled layer in a graph less its GEMMs and its KV reads at that rate,
      median: what the layer's other kernels (norms, rotary, the cache write, attention's fixed
      part, SiLU x up, residuals) cost a decode step per layer."""
    gemm = [layer_bytes(r["model"])[0] / r["gemms_graph_s"] / bandwidth for r in out["compiled"] if "error" not in r]
    slopes = []
    for shape in {r["model"] for r in out["decode"]}:
        for batch in BATCHES:
            rows = sorted(
                (r["context"], r["graph_s"])
                for r in out["decode"]
                if r["model"] == shape and r["batch"] == batch and r["kv"] == "contiguous" and "graph_s" in r
            )
            if len(rows) > 1:
                (short, fast), (long, slow) = rows[0], rows[-1]
                slopes.append(batch * (long - short) * layer_bytes(shape)[1] / (slow - fast) / bandwidth)
    kv_share = statistics.median(slopes)
    rest = [
        r["compiled_graph_s"]
        - r["gemms_graph_s"]
        - r["batch"] * r["context"] * layer_bytes(r["model"])[1] / (bandwidth * kv_share)
        for r in out["compiled"]
        if "error" not in r
    ]
    return {
        "graph_gemm_bandwidth_share": round(statistics.median(gemm), 3),
        "kv_bandwidth_share": round(kv_share, 3),
        "graph_layer_s": round(statistics.median(rest), 7),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", required=True, help="the vllm-sim profile this GPU is (h100-80gb, h200, ...)")
    ap.add_argument("--json", type=Path, required=True, help="where to write every row")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="vllm-sim model names, NAME:TP a tensor-parallel slice")
    ap.add_argument("--parts", default="decode,compiled,prefill", help="which measurements, comma-separated")
    ap.add_argument("--derive", action="store_true", help="only recompute `derived` in the --json file (no GPU)")
    args = ap.parse_args(argv)
    bandwidth = gpu_profile(args.gpu).bandwidth
    if args.derive:
        out = json.loads(args.json.read_text())
        out["derived"] = derive(out, bandwidth)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(out["derived"]))
        return 0
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    out: dict = {
        "gpu_profile": args.gpu,
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "block_size": BLOCK,
        "decode": [],
        "compiled": [],
        "prefill": [],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")

    parts = [p for p in args.parts.split(",") if p]
    measure = {"decode": decode_rows, "compiled": compiled_rows, "prefill": prefill_rows}
    for shape in args.shapes.split(","):
        model, _, tp = shape.partition(":")
        layer = Layer(MODELS[model], int(tp or 1))
        model = shape if tp else model
        for part in parts:
            with torch.inference_mode():
                out[part] += measure[part](layer, model)
            save()
        del layer
        torch.cuda.empty_cache()
    out["derived"] = derive(out, bandwidth)
    save()
    print("derived:", json.dumps(out["derived"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
