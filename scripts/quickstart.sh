#!/usr/bin/env bash
# From a fresh machine to a measured vLLM configuration: install (CPU), build the tiny model,
# then bench vLLM's default configuration against a chat workload with SLOs.
#
#   bash scripts/quickstart.sh [extra engine args, e.g. --max-num-seqs 8]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_cpu.sh
.venv/bin/python scripts/build_tiny_model.py models/tiny-llama
exec .venv/bin/autotune bench --model models/tiny-llama \
  --env VLLM_CPU_KVCACHE_SPACE=1 --env VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$HOME/.cache/autotune-tests/vllm}" \
  --scenario chat --rate 4 --requests 60 --prefix-tokens 256-512 --prompt-tokens 32-128 --output-tokens 16-64 \
  --slo 'ttft<1s' --slo 'tpot<100ms' --json runs/quickstart.json -- "$@"
