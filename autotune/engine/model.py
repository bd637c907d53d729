"""Where a model's files are, and what its config.json says about its size: the one place autotune reads it.

A model is named the way ``vllm serve`` takes it: a local directory, or a Hugging Face id such as
``meta-llama/Llama-3.1-8B-Instruct``, found in the Hugging Face cache (``HF_HUB_CACHE``, ``HF_HOME``) at
the engine's ``revision``, the way vLLM finds it there; on request, config.json and the tokenizer files
alone are downloaded into that cache (never the weights: those are the engine's to fetch).

The pre-check (engine/vllm/precheck.py) needs the KV bytes per token and the weights; vllm-sim's
performance model (sim/) also needs the parameters a token passes through and the vocabulary.
Decoder-only transformers with GQA (Llama, Qwen2/3, Mistral), their mixture-of-experts kin (gpt-oss,
Qwen3-MoE, Mixtral, DeepSeek-style shared experts and leading dense layers), sliding-window layers
(gpt-oss, Gemma), and fp8, MXFP4 or int4 (AWQ, GPTQ) weights; what else a config.json holds (MLA, linear-attention
layers, other quantizations) is named in ``ModelShape.not_modelled``.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["ModelShape", "ModelFiles", "DTYPE_BYTES", "locate", "parse_bytes"]

# what a study needs of a model it does not run itself: its shape and the tokenizer its prompts are built with
SMALL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


@dataclass(frozen=True)
class ModelFiles:
    """Where the files of a model were found: a directory holding its config.json, or None and why not."""

    name: str
    directory: Path | None
    found: str  # one line for the user: where the files came from, or why there are none

    @property
    def tokenizer(self) -> Path | None:
        """The directory with the model's tokenizer.json, when it is there."""
        if self.directory is not None and (self.directory / "tokenizer.json").is_file():
            return self.directory
        return None

    @property
    def on_hub(self) -> bool:
        """The name can be a Hugging Face id (org/name), so downloading can help; a path that is not there cannot."""
        return not self.name.startswith((".", "/", "~")) and _REPO_ID.fullmatch(self.name) is not None

    def fetch_advice(self) -> str:
        """What puts the model's config and tokenizer where vLLM finds it, in words that work when followed."""
        if self.on_hub:
            return f"put its config and tokenizer in the Hugging Face cache with `{self.fetch_command()}`"
        return "give the directory the model was downloaded to"

    def fetch_command(self) -> str:
        """The command that puts the small files in the Hugging Face cache (huggingface_hub's own CLI)."""
        return f"hf download {self.name} {' '.join(SMALL_FILES)}"


def locate(
    name: str,
    revision: str | None = None,
    *,
    download: bool = False,
    cache_dir: str | Path | None = None,
    endpoint: str | None = None,
) -> ModelFiles:
    """Find a model as vLLM would: a local directory, else the Hugging Face cache, else (``download``) the Hub.

    The cache lookup never touches the network; ``download`` fetches only :data:`SMALL_FILES` with
    huggingface_hub (the library vLLM itself downloads with; ``HF_ENDPOINT``, ``HF_TOKEN`` and
    ``HF_HUB_OFFLINE`` apply). ``cache_dir`` and ``endpoint`` default to huggingface_hub's (``HF_HUB_CACHE``,
    ``HF_HOME``; ``HF_ENDPOINT``).
    """
    local = Path(name).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return ModelFiles(name, local, f"model {name}: the local directory {local.resolve()}")
        return ModelFiles(name, None, f"model {name}: the directory {local.resolve()} has no config.json")
    if name.startswith((".", "/", "~")) or not _REPO_ID.fullmatch(name):
        return ModelFiles(name, None, f"model {name}: no such directory (and not a Hugging Face id: org/name)")
    import huggingface_hub
    from huggingface_hub import constants

    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    at = f" at revision {revision}" if revision else ""
    cached = huggingface_hub.try_to_load_from_cache(name, "config.json", cache_dir=cache, revision=revision)
    if isinstance(cached, str):
        snapshot = Path(cached).parent
        return ModelFiles(
            name, snapshot, f"model {name}: the Hugging Face cache {cache}{at} (snapshot {snapshot.name[:12]})"
        )
    missing = f"model {name}: not a local directory, and not in the Hugging Face cache {cache}{at}"
    if not download:
        return ModelFiles(name, None, missing)
    hub = endpoint or constants.ENDPOINT
    try:
        files = [
            huggingface_hub.hf_hub_download(name, "config.json", revision=revision, cache_dir=cache, endpoint=endpoint)
        ]
        for extra in SMALL_FILES[1:]:
            # a model without a fast tokenizer: counted with ~4 bytes a token where that is allowed
            with contextlib.suppress(huggingface_hub.errors.EntryNotFoundError):
                files.append(
                    huggingface_hub.hf_hub_download(name, extra, revision=revision, cache_dir=cache, endpoint=endpoint)
                )
    except (OSError, huggingface_hub.errors.HfHubHTTPError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        return ModelFiles(name, None, f"{missing}, and downloading its config.json from {hub} failed: {why}")
    snapshot = Path(files[0]).parent
    return ModelFiles(
        name,
        snapshot,
        f"model {name}: downloaded {', '.join(Path(f).name for f in files)} (not the "
        f"weights) from {hub}{at} into the Hugging Face cache {cache}",
    )


DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_ds_mla": 1,
    "int8": 1,
}


# quantized weight formats: bytes a weight, and whether every decoder linear layer is stored so or only the routed
# experts (embeddings and the LM head stay in dtype): fp8 (one byte; its scales are negligible); MXFP4 (4 bits and
# an 8-bit scale per 32 values: gpt-oss's experts); int4 AWQ/GPTQ (4 bits, an fp16 scale and a 4-bit zero per
# group of 128)
WEIGHT_FORMATS: dict[str, tuple[float, str]] = {
    "fp8": (1.0, "linear"),
    "mxfp4": (4.25 / 8, "experts"),
    "int4": ((4 + 20 / 128) / 8, "linear"),
}
# vLLM pads MXFP4 experts as it loads them: each GPU's slice of an expert's width to a multiple of 128 and the
# hidden size to 256, the Marlin MoE kernel's tiles (quantization/mxfp4.py, Mxfp4MoEMethod.create_weights). Marlin
# runs them wherever the GPU has no FP4 tensor cores: the A100 always, and the H100 until vLLM bundled Triton's
# MoE kernels into its build (vllm-project/vllm#28788, November 2025). vLLM 0.10.1's log for gpt-oss-120b on an
# H100 reads "Model loading took 65.9651 GiB" (vllm-project/vllm#23278) where the checkpoint holds 60.7 GiB; with
# Triton's kernels 0.14.1 logs 64.38 GiB (vllm-project/vllm#33155).
MXFP4_PADDING = (128, 256)


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    max_position: int
    weights_bytes: int  # the weight files' size, or the parameter count x dtype when there are none
    heads: int = 0
    hidden: int = 0
    intermediate: int = 0
    vocab: int = 0
    tied_embeddings: bool = False
    # mixture of experts: routed experts per MoE layer (0: a dense model), how many a token is routed to, one
    # expert's MLP width, the always-on shared experts' width (summed), and the leading layers that keep a dense
    # MLP of ``intermediate`` (DeepSeek's and GLM's first_k_dense_replace)
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    dense_layers: int = 0
    # layers whose attention sees only the last ``sliding_window`` tokens (config.json's layer_types)
    sliding_layers: int = 0
    sliding_window: int = 0
    # how the checkpoint's weights are stored when not in ``dtype`` (quantization_config, or --quantization
    # fp8 applied by ``served``): a key of WEIGHT_FORMATS
    weight_quant: str = ""
    # learned attention sinks (gpt-oss): vLLM runs them on FlashAttention 3 where it has it (Hopper) and on its
    # Triton attention backend elsewhere (sim/perf.py)
    attention_sinks: bool = False
    # what of the architecture this shape leaves out ("" when nothing): its parameters, memory and step time
    # are then wrong, so whatever estimates from it says so instead of estimating
    not_modelled: str = ""

    @classmethod
    def from_config(cls, cfg: dict[str, Any], weights_bytes: int | None = None) -> ModelShape:
        quantized = cfg.get("quantization_config") or cfg.get("text_config", {}).get("quantization_config")
        sinks = "GptOssForCausalLM" in (cfg.get("architectures") or ())
        cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg.get("hidden_size") or 0)
        experts = max(int(cfg.get(k) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
        moe = cfg if experts else {}  # a dense config's intermediate_size is not an expert's
        expert_intermediate = int(moe.get("moe_intermediate_size") or moe.get("intermediate_size") or 0)
        shared = int(moe.get("shared_expert_intermediate_size") or 0)
        shared = shared or int(moe.get("n_shared_experts") or 0) * expert_intermediate
        layer_types = list(cfg.get("layer_types") or ())
        sliding = layer_types.count("sliding_attention")
        # every layer sliding: taken as full attention (more KV and reads than vLLM's, never fewer)
        sliding = sliding if sliding < len(layer_types) and cfg.get("sliding_window") else 0
        shape = cls(
            layers=int(cfg["num_hidden_layers"]),
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
            max_position=int(cfg.get("max_position_embeddings") or 0),
            weights_bytes=0,
            heads=heads,
            hidden=hidden,
            intermediate=int(cfg.get("intermediate_size") or 0),
            vocab=int(cfg.get("vocab_size") or 0),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            experts=experts,
            experts_per_token=int(moe.get("num_experts_per_tok") or moe.get("experts_per_token") or 0),
            expert_intermediate=expert_intermediate,
            shared_intermediate=shared,
            dense_layers=int(moe.get("first_k_dense_replace") or len(moe.get("mlp_only_layers") or ())),
            sliding_layers=sliding,
            sliding_window=int(cfg.get("sliding_window") or 0) if sliding else 0,
            weight_quant=_weight_quant(quantized),
            attention_sinks=sinks,
            not_modelled=_not_modelled(cfg, quantized),
        )
        return shape.with_weights(weights_bytes if weights_bytes else shape.estimated_weights_bytes)

    @classmethod
    def from_dir(cls, path: str | Path | None) -> ModelShape | None:
        """Read config.json and the weight files (a cache snapshot's links followed); None without config.json."""
        if path is None:
            return None
        p = Path(path)
        cfg_path = p / "config.json"
        if not cfg_path.is_file():
            return None
        weights = sum(f.stat().st_size for pat in ("*.safetensors", "*.bin", "*.pt") for f in p.glob(pat))
        return cls.from_config(json.loads(cfg_path.read_text()), weights or None)

    def with_weights(self, weights_bytes: int) -> ModelShape:
        return replace(self, weights_bytes=int(weights_bytes))

    def served(self, quantization: str | None) -> ModelShape:
        """The shape as ``vllm serve --quantization`` loads it: ``fp8`` quantizes an unquantized checkpoint's
        linear layers to one byte a weight as it loads (vLLM's online fp8), so the weights shrink to the estimate
        at fp8; a checkpoint's own quantization, or no flag, leaves it as it is. Other methods are unmodelled
        (sim/config.UNMODELLED)."""
        if quantization != "fp8" or self.weight_quant:
            return self
        fp8 = replace(self, weight_quant="fp8")
        return fp8.with_weights(round(self.weights_bytes * fp8.estimated_weights_bytes / self.estimated_weights_bytes))

    @property
    def attention_params(self) -> int:
        """One layer's q, k, v and o projections."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        return q + kv + self.heads * self.head_dim * self.hidden

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def expert_params(self) -> int:
        """One routed expert's gated MLP (gate, up, down)."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def active_params(self) -> int:
        """The linear layers' parameters one token passes through: attention, the dense MLPs, and in each MoE
        layer its router, shared experts and ``experts_per_token`` routed experts (norms are negligible; the
        embedding lookup computes nothing, the LM head is counted per sampled sequence)."""
        dense_mlp = (self.layers - self.moe_layers) * 3 * self.hidden * self.intermediate
        routed = self.experts_per_token * self.expert_params
        moe = self.moe_layers * (routed + 3 * self.hidden * self.shared_intermediate + self.hidden * self.experts)
        return self.layers * self.attention_params + dense_mlp + moe

    @property
    def params(self) -> int:
        """Every parameter: all experts, not only the active ones."""
        return (
            self.active_params
            + self.moe_layers * (self.experts - self.experts_per_token) * self.expert_params
            + (self.vocab * self.hidden * (1 if self.tied_embeddings else 2))
        )

    @property
    def expert_weights_bytes(self) -> int:
        """The routed experts' bytes, all MoE layers (estimated from the shape and ``weight_quant``)."""
        elem = WEIGHT_FORMATS[self.weight_quant][0] if self.weight_quant else DTYPE_BYTES.get(self.dtype, 2)
        return round(self.moe_layers * self.experts * self.expert_params * elem)

    def loaded_expert_weights_bytes(self, tp: int = 1, expert_parallel: bool = False) -> int:
        """The routed experts' bytes, all GPUs together, as vLLM holds them at tensor-parallel size ``tp``: MXFP4
        experts padded to MXFP4_PADDING (each GPU's slice of an expert's width, the whole width under expert
        parallelism), other formats as stored."""
        if self.weight_quant != "mxfp4" or not self.moe_layers:
            return self.expert_weights_bytes
        width = self.expert_intermediate if expert_parallel else self.expert_intermediate // tp
        width_tile, hidden_tile = MXFP4_PADDING
        padded = -(-width // width_tile) * width_tile * (-(-self.hidden // hidden_tile) * hidden_tile)
        return round(self.expert_weights_bytes * padded / (width * self.hidden))

    def loaded_weights_bytes(self, tp: int = 1, expert_parallel: bool = False) -> int:
        """The weights' bytes, all GPUs together, as vLLM holds them (``loaded_expert_weights_bytes``)."""
        return self.weights_bytes + self.loaded_expert_weights_bytes(tp, expert_parallel) - self.expert_weights_bytes

    @property
    def estimated_weights_bytes(self) -> int:
        """The weights' bytes from the shape: the experts as ``expert_weights_bytes``, the other decoder linear
        layers in ``weight_quant`` where it covers them, the embeddings and LM head at ``dtype``."""
        elem = DTYPE_BYTES.get(self.dtype, 2)
        linear_elem, scope = WEIGHT_FORMATS.get(self.weight_quant, (elem, "linear"))
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        other_linear = self.params - embeddings - self.moe_layers * self.experts * self.expert_params
        return (
            self.expert_weights_bytes
            + round(other_linear * (linear_elem if scope == "linear" else elem))
            + (embeddings * elem)
        )

    def kv_heads_per_gpu(self, tp: int = 1) -> int:
        """The KV heads each of ``tp`` tensor-parallel GPUs holds. vLLM splits them across the GPUs, and where
        there are fewer KV heads than GPUs it replicates them, one on each GPU (``QKVParallelLinear``:
        ``max(1, heads // tp)``): Qwen3-235B's 4 KV heads at TP 8 take a whole head's cache on every GPU."""
        return max(1, self.kv_heads // tp)

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto", dtype: str = "auto", tp: int = 1) -> int:
        """2 (K and V) x layers x KV heads x head dim x bytes per element (KV heads, not query heads: GQA), on
        one of ``tp`` tensor-parallel GPUs (``kv_heads_per_gpu``; the whole model's at ``tp=1``).

        Sliding-window layers are left out: vLLM's hybrid KV cache manager keeps only the window's blocks
        for them, a bounded amount per request rather than per token of context."""
        return (
            2
            * (self.layers - self.sliding_layers)
            * self.kv_heads_per_gpu(tp)
            * self.head_dim
            * self.kv_element_bytes(kv_cache_dtype, dtype)
        )

    def window_blocks(self, block_size: int) -> int:
        """The blocks of the KV pool (pages of the full-attention layers' size, ``kv_bytes_per_token``) that a
        running request's sliding-window layers hold: the window plus the block being written, in each of them."""
        if not self.sliding_layers:
            return 0
        per_layer_group = -(-(self.sliding_window - 1) // block_size) + 1
        return -(-per_layer_group * self.sliding_layers // (self.layers - self.sliding_layers))

    def kv_element_bytes(self, kv_cache_dtype: str = "auto", dtype: str = "auto") -> int:
        if kv_cache_dtype not in ("auto", None):
            return DTYPE_BYTES.get(kv_cache_dtype, 2)
        return DTYPE_BYTES.get(self.dtype if dtype in ("auto", None) else dtype, 2)


def _weight_quant(quantized: Any) -> str:
    """The modelled weight format a quantization_config names (a key of WEIGHT_FORMATS), else ""."""
    if not isinstance(quantized, dict):
        return ""
    method = str(quantized.get("quant_method", ""))
    if method in ("fp8", "fbgemm_fp8", "mxfp4"):
        return "fp8" if "fp8" in method else method
    if method in ("awq", "gptq") and int(quantized.get("bits") or 0) == 4:
        return "int4"
    if method == "compressed-tensors":
        weights = [g.get("weights") or {} for g in (quantized.get("config_groups") or {}).values()]
        if weights and all(w.get("num_bits") == 8 and w.get("type") == "float" for w in weights):
            return "fp8"
    return ""


def _not_modelled(cfg: dict[str, Any], quantized: Any) -> str:
    """What a config.json holds beyond what ``ModelShape`` models (its module docstring)."""
    missing = []
    if cfg.get("kv_lora_rank"):
        missing.append("multi-head latent attention (kv_lora_rank)")
    if int(cfg.get("decoder_sparse_step") or 1) > 1:
        missing.append(f"MoE in every {cfg['decoder_sparse_step']}th layer (decoder_sparse_step)")
    kinds = set(cfg.get("layer_types") or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        missing.append(f"hybrid attention ({', '.join(sorted(kinds))} layers)")
    if isinstance(quantized, dict) and not _weight_quant(quantized):
        missing.append(f"quantized weights ({quantized.get('quant_method', 'quantization_config')})")
    return "; ".join(missing)


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
