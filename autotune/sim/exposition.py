"""vLLM's Prometheus exposition (``/metrics``), as vllm-sim serves it.

The Prometheus metrics are vLLM 0.33's names, help texts, label names and buckets
(v1/metrics/loggers.py, buckets.py), in a private registry; ``realtime.RealtimeEngine`` feeds
them from what the simulation did: TTFT is a token's step end minus the request's arrival,
and so on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from autotune.sim.config import SimConfig
from autotune.sim.startup import MemoryPlan

__all__ = ["FINISH_REASONS", "SimMetrics", "build_1_2_5_buckets", "cache_config_info"]

# vllm/v1/metrics/buckets.py (0.33) (a data table: laid out by hand)
# fmt: off
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# fmt: on
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, ... up to max_value (vLLM's request_tokens family)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return out
            out.append(v)
        exponent += 1


class SimMetrics:
    """vLLM 0.33's Prometheus metrics (the ones the study and dashboards read), in a private registry."""

    def __init__(self, model_name: str, config: SimConfig, plan: MemoryPlan) -> None:
        self.registry = r = CollectorRegistry()
        names = ["model_name", "engine"]
        lv = (model_name, "0")

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=r).labels(*lv)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=r).labels(*lv)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, names, buckets=list(buckets), registry=r).labels(*lv)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*names, "finished_reason"], registry=r
        )
        self.success = {reason: success.labels(*lv, reason) for reason in FINISH_REASONS}
        tokens = build_1_2_5_buckets(config.max_model_len)
        self.req_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.req_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self.params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.req_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        self.prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        )
        # An info-style gauge set to 1, its labels the CacheConfig's fields as vLLM's metrics_info() gives them.
        info = cache_config_info(config, plan)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info), registry=r).labels(
            **info
        ).set(1)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def cache_config_info(config: SimConfig, plan: MemoryPlan) -> dict[str, str]:
    """vLLM's CacheConfig.metrics_info() after start-up (str() of every field), plus ``engine``."""
    return {
        "block_size": str(config.block_size),
        "user_specified_block_size": "True",
        "kv_cache_layout": "None",
        "prefix_match_unit": "None",
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "cache_dtype": config.kv_cache_dtype,
        "is_attention_free": "False",
        "num_gpu_blocks_override": "None",
        "sliding_window": "None",
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "prefix_caching_hash_algo": "sha256",
        "prefix_cache_retention_interval": "0",
        "kv_cache_dtype_skip_layers": "[]",
        "mamba_page_size_padded": "None",
        "skip_page_size_padded": "None",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": "False",
        "replayssm_buffer_len": "16",
        "use_replayssm": "False",
        "use_kda_recoverssm": "False",
        "num_gpu_blocks": str(plan.num_blocks),
        "num_cpu_blocks": "0",
        "effective_attention_block_size": str(config.block_size),
        "kv_cache_size_tokens": str(plan.kv_tokens),
        "kv_cache_max_concurrency": str(round(plan.kv_tokens / config.max_model_len, 2)),
        "hash_block_size": str(config.block_size),
        "cache_hit_alignment_tokens": str(config.block_size),
        "kv_sharing_fast_prefill": "False",
        "swa_bounded_replay": "True",
        "kv_cache_memory_bytes": str(config.kv_cache_memory_bytes),
        "kv_offloading_size": "None",
        "kv_offloading_backend": "native",
        "_block_size_resolved": "True",
        "engine": "0",
    }
