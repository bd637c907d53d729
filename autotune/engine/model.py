"""What a model's config.json says about its size: the one place autotune reads it.

The pre-check (engine/vllm/precheck.py) needs the KV bytes per token and the weights; vllm-sim's
performance model (sim/) also needs the parameter count per layer and the vocabulary. Dense
decoder-only transformers (Llama, Qwen2, Mistral) with GQA; MoE and MLA are not modelled.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["ModelShape", "DTYPE_BYTES", "parse_bytes"]

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1, "fp8_ds_mla": 1, "int8": 1}


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

    @classmethod
    def from_config(cls, cfg: dict[str, Any], weights_bytes: int | None = None) -> ModelShape:
        cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg.get("hidden_size") or 0)
        shape = cls(
            layers=int(cfg["num_hidden_layers"]),
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
            max_position=int(cfg.get("max_position_embeddings") or 0),
            weights_bytes=0, heads=heads, hidden=hidden, intermediate=int(cfg.get("intermediate_size") or 0),
            vocab=int(cfg.get("vocab_size") or 0), tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
        est = shape.params * DTYPE_BYTES.get(shape.dtype, 2)
        return shape.with_weights(weights_bytes if weights_bytes else est)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelShape | None:
        """Read config.json and the weight files; None when the model is not a local directory."""
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
        """2 (K and V) x layers x KV heads x head dim x bytes per element (seed 002's formula, with GQA)."""
        if kv_cache_dtype not in ("auto", None):
            elem = DTYPE_BYTES.get(kv_cache_dtype, 2)
        else:
            elem = DTYPE_BYTES.get(self.dtype if dtype in ("auto", None) else dtype, 2)
        return 2 * self.layers * self.kv_heads * self.head_dim * elem


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
