"""The hardware and models vllm-sim stands in for.

GPU figures are the vendors' datasheet numbers, dense (no 2:4 sparsity), for the SXM parts
where there is a choice; memory is what NVML reports as total (a little under the marketing
GB figure), since that is what vLLM's gpu_memory_utilization multiplies:

- H100 SXM5 80GB: 3.35 TB/s HBM3, 989 TFLOPS BF16 dense, NVLink 900 GB/s
  (NVIDIA H100 Tensor Core GPU datasheet, 2023); NVML total 81559 MiB.
- H200 SXM 141GB: 4.8 TB/s HBM3e, 989 TFLOPS BF16, NVLink 900 GB/s (NVIDIA H200 datasheet,
  2024); NVML total 143771 MiB.
- A100 SXM4 80GB: 2.039 TB/s HBM2e, 312 TFLOPS BF16, NVLink 600 GB/s (NVIDIA A100 datasheet,
  2021); NVML total 81920 MiB.
- L20 48GB: 864 GB/s GDDR6, 119.5 TFLOPS BF16 dense, PCIe Gen4 x16 64 GB/s (NVIDIA L20
  product brief, 2023); NVML total 46068 MiB.
- A10 24GB: 600 GB/s GDDR6, 125 TFLOPS BF16 dense, PCIe Gen4 x16 64 GB/s (NVIDIA A10
  datasheet, 2021); NVML total 23028 MiB.

Named models are the published config.json values of the dense models the example studies
use; any other model is read from its config.json (engine/model.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autotune.engine.model import ModelShape

__all__ = ["GpuProfile", "GPUS", "MODELS", "gpu_profile", "model_shape"]

MiB = 1 << 20


@dataclass(frozen=True)
class GpuProfile:
    name: str  # what NVML would call it
    memory_bytes: int
    bandwidth: float  # bytes/s, peak
    bf16_flops: float  # FLOP/s, dense peak
    link_bandwidth: float  # bytes/s per direction between GPUs (NVLink, else PCIe)


GPUS: dict[str, GpuProfile] = {
    "h100-80gb": GpuProfile("NVIDIA H100 80GB HBM3", 81559 * MiB, 3.35e12, 989e12, 450e9),
    "h200-141gb": GpuProfile("NVIDIA H200", 143771 * MiB, 4.8e12, 989e12, 450e9),
    "a100-80gb": GpuProfile("NVIDIA A100-SXM4-80GB", 81920 * MiB, 2.039e12, 312e12, 300e9),
    "l20-48gb": GpuProfile("NVIDIA L20", 46068 * MiB, 864e9, 119.5e12, 32e9),
    "a10-24gb": GpuProfile("NVIDIA A10", 23028 * MiB, 600e9, 125e12, 32e9),
}

# config.json fields of the dense models the example studies name
MODELS: dict[str, dict] = {
    "llama-3.1-8b": {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "torch_dtype": "bfloat16", "tie_word_embeddings": False},
    "qwen2.5-32b": {"num_hidden_layers": 64, "hidden_size": 5120, "num_attention_heads": 40,
                    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 27648, "vocab_size": 152064,
                    "max_position_embeddings": 32768, "torch_dtype": "bfloat16", "tie_word_embeddings": False},
    "llama-3.1-70b": {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 28672, "vocab_size": 128256,
                      "max_position_embeddings": 131072, "torch_dtype": "bfloat16", "tie_word_embeddings": False},
}
# names as people write them in studies (the Hugging Face ids of those models)
ALIASES = {"meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b", "Qwen/Qwen2.5-32B-Instruct": "qwen2.5-32b",
           "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b"}


def gpu_profile(name: str) -> GpuProfile:
    key = name.lower()
    if key not in GPUS:
        raise KeyError(f"unknown GPU profile {name!r}; choose one of {', '.join(GPUS)}")
    return GPUS[key]


def model_shape(model: str) -> ModelShape:
    """A named profile, a Hugging Face id we know, or a directory with config.json."""
    key = ALIASES.get(model, model).lower()
    if key in MODELS:
        return ModelShape.from_config(MODELS[key])
    shape = ModelShape.from_dir(model)
    if shape is None:
        raise KeyError(f"model {model!r}: not a directory with config.json and not one of {', '.join(MODELS)}")
    return shape


def write_model_dir(name: str, path: Path) -> Path:
    """A directory whose config.json is a named profile's: for studies that read the model's shape."""
    import json
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **MODELS[name]}, indent=1))
    return path
