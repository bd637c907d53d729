"""Where a model's files are, and what its config.json says about its size: the one place autotune reads it.

A model is named the way ``vllm serve`` takes it: a local directory, or a Hugging Face id such as
``meta-llama/Llama-3.1-8B-Instruct``, found in the Hugging Face cache (``HF_HUB_CACHE``, ``HF_HOME``) at
the engine's ``revision``, the way vLLM finds it there; on request, config.json and the tokenizer files
alone are downloaded into that cache (never the weights: those are the engine's to fetch).

The pre-check (engine/vllm/precheck.py) needs the KV bytes per token and the weights; vllm-sim's
performance model (sim/) also needs the parameter count per layer and the vocabulary. Dense
decoder-only transformers (Llama, Qwen2, Mistral) with GQA; MoE and MLA are not modelled.
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
    # what of the architecture this dense-decoder shape leaves out ("" when nothing): its parameters, memory and
    # step time are then wrong, so whatever estimates from it says so instead of estimating
    not_modelled: str = ""

    @classmethod
    def from_config(cls, cfg: dict[str, Any], weights_bytes: int | None = None) -> ModelShape:
        quantized = cfg.get("quantization_config") or cfg.get("text_config", {}).get("quantization_config")
        cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg.get("hidden_size") or 0)
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
            not_modelled=_not_modelled(cfg, quantized),
        )
        est = shape.params * DTYPE_BYTES.get(shape.dtype, 2)
        return shape.with_weights(weights_bytes if weights_bytes else est)

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

    @property
    def params_per_layer(self) -> int:
        """Attention (q, k, v, o) and a gated MLP (gate, up, down); norms are negligible."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        return q + kv + o + 3 * self.hidden * self.intermediate

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.params_per_layer + embeddings

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto", dtype: str = "auto") -> int:
        """2 (K and V) x layers x KV heads x head dim x bytes per element (KV heads, not query heads: GQA)."""
        if kv_cache_dtype not in ("auto", None):
            elem = DTYPE_BYTES.get(kv_cache_dtype, 2)
        else:
            elem = DTYPE_BYTES.get(self.dtype if dtype in ("auto", None) else dtype, 2)
        return 2 * self.layers * self.kv_heads * self.head_dim * elem


def _not_modelled(cfg: dict[str, Any], quantized: Any) -> str:
    """What a config.json holds beyond a dense decoder of full-attention layers and unquantized weights."""
    missing = []
    experts = max(int(cfg.get(k) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    if experts:
        missing.append(f"mixture of experts ({experts} experts)")
    kinds = set(cfg.get("layer_types") or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        missing.append(f"hybrid attention ({', '.join(sorted(kinds))} layers)")
    if isinstance(quantized, dict):
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
