#!/usr/bin/env bash
# From a fresh machine to a tuned vLLM configuration, on a CPU host: install real vLLM (CPU build), build the tiny
# model, then run the example study (studies/tiny-cpu-chat.toml: vLLM's defaults and one more baseline, a search,
# the re-measurement, best.yaml): about 7 minutes on a 2-core host with the install, most of it vLLM's engine starts.
#
#   bash scripts/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_cpu.sh
.venv/bin/python scripts/build_tiny_model.py models/tiny-llama
exec .venv/bin/autotune study studies/tiny-cpu-chat.toml --trials 5
