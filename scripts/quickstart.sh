#!/usr/bin/env bash
# From a fresh machine to a tuned vLLM configuration, on a CPU host: install real vLLM (CPU build),
# build the tiny model, measure vLLM's defaults once, then run the example study
# (studies/tiny-cpu-chat.toml: baselines, a search, re-measurement, best.yaml; ~15-25 min here).
#
#   bash scripts/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_cpu.sh
.venv/bin/python scripts/build_tiny_model.py models/tiny-llama
.venv/bin/autotune bench --model models/tiny-llama --engine-nice 10 \
  --env VLLM_CPU_KVCACHE_SPACE=1 --env VLLM_CACHE_ROOT=runs/vllm-cache \
  --scenario chat --rate 4 --requests 60 --prefix-tokens 256-512 --prompt-tokens 32-128 --output-tokens 16-64 \
  --slo 'ttft<1s' --slo 'tpot<100ms' --json runs/quickstart-bench.json || true  # an SLO miss is a result too
exec .venv/bin/autotune study studies/tiny-cpu-chat.toml --trials 6
