"""The vLLM metrics autotune reads from production's /metrics (vLLM 0.33, v1/metrics/loggers.py)."""

from __future__ import annotations

from autotune.engine.kind import MetricSpec

__all__ = ["METRICS"]

# Histogram keys for latencies are the SLO metric names (ttft, tpot, itl, e2e), so an SLO finds its
# histogram by its own name.
METRICS: dict[str, MetricSpec] = {
    # counters
    # every finished request; vLLM 0.13-0.33 count no aborted one here (vllm-project/vllm#31503, #55634), so a
    # client that gives up in the queue is invisible but for the num_requests_waiting gauge
    "requests": MetricSpec("vllm:request_success_total", "counter"),
    "requests_failed": MetricSpec(
        "vllm:request_success_total", "counter", label=("finished_reason", frozenset({"abort", "error"}))
    ),
    "prompt_tokens": MetricSpec("vllm:prompt_tokens_total", "counter"),
    "generation_tokens": MetricSpec("vllm:generation_tokens_total", "counter"),
    "preemptions": MetricSpec("vllm:num_preemptions_total", "counter"),
    "prefix_cache_queries": MetricSpec("vllm:prefix_cache_queries_total", "counter"),  # tokens
    "prefix_cache_hits": MetricSpec("vllm:prefix_cache_hits_total", "counter"),  # tokens
    # histograms
    "ttft": MetricSpec("vllm:time_to_first_token_seconds", "histogram"),
    "tpot": MetricSpec("vllm:request_time_per_output_token_seconds", "histogram"),
    "itl": MetricSpec("vllm:inter_token_latency_seconds", "histogram"),
    "e2e": MetricSpec("vllm:e2e_request_latency_seconds", "histogram"),
    "queue_time": MetricSpec("vllm:request_queue_time_seconds", "histogram"),
    "request_prompt_tokens": MetricSpec("vllm:request_prompt_tokens", "histogram"),
    "request_output_tokens": MetricSpec("vllm:request_generation_tokens", "histogram"),
    # gauges
    "running": MetricSpec("vllm:num_requests_running", "gauge"),
    "waiting": MetricSpec("vllm:num_requests_waiting", "gauge"),
    "kv_cache_usage": MetricSpec("vllm:kv_cache_usage_perc", "gauge", combine="mean"),
}
