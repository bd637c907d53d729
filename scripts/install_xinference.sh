#!/usr/bin/env bash
# Idempotent installer for a CPU-only Xinference 4.1 in its own virtual environment,
# used by tests/test_xinference_real.py and for trying the Xinference publish target
# on a host without a GPU.
#
#   bash scripts/install_xinference.sh                  # venv at ./.venv-xinference
#   XINFERENCE_VENV=/opt/xinference bash scripts/install_xinference.sh
#
# Why not `pip install xinference==4.1.*`: after CPU torch is in place pip still pulls
# about 4 GB of CUDA wheels (torch 2.15 + nvidia-* + triton + cuda-toolkit), because
# xinference requires `timm`, timm requires `torchvision`, and the newest torchvision
# (the only one our index offers without a matching CPU build) pins a newer, CUDA,
# torch. timm and torchvision are only imported by Xinference's vision models (never by
# its server or its text LLM engines). So: CPU torch first, the xinference wheel with
# --no-deps, then its requirements minus torch/timm/torchvision, plus `transformers`
# (its Transformers engine, the one that runs on CPU), all under a constraint that
# keeps the installed torch. vLLM is not installed here: Xinference's vLLM engine
# refuses to start without a GPU.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${XINFERENCE_VENV:-$here/.venv-xinference}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
xinference_version=${XINFERENCE_VERSION:-4.1.0}
torch_version=${TORCH_VERSION:-2.13.0}

log() { printf '[install_xinference] %s\n' "$*" >&2; }

# shellcheck source=cpu_torch_venv.sh
source "$here/scripts/cpu_torch_venv.sh"
# Refuse to go on with a CUDA torch: everything after this would follow it.
"$py" -W ignore -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else "torch " + torch.__version__ + " is a CUDA build; install the CPU wheel first")'
constraints="$venv/.torch-constraint.txt"
"$py" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' >"$constraints"

if ! have xinference "$xinference_version"; then
  log "installing xinference==$xinference_version (no deps)"
  "${pip[@]}" --no-deps "xinference==$xinference_version"
fi

marker="$venv/.xinference-deps-$xinference_version"
if [ ! -f "$marker" ]; then
  "$py" -c 'import packaging' 2>/dev/null || "${pip[@]}" packaging
  # The requirements of the installed wheel (no extras), minus the torch family and timm.
  mapfile -t req_list < <("$py" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "timm"}
for raw in requires("xinference") or []:
    req = Requirement(raw)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0].strip())
# The Transformers engine (extra "transformers" minus its vision/audio/quantization parts).
print("transformers>=4.53.3")
PY
  )
  # pip then warns "xinference 4.1.0 requires timm, which is not installed": expected, see the top.
  log "installing xinference requirements (torch family and timm excluded): ${#req_list[@]} packages"
  "${pip[@]}" -c "$constraints" "${req_list[@]}"
  touch "$marker"
fi

# Nothing CUDA may have come in through the back door (nvidia-ml-py is NVML's pure-Python binding).
cuda=$("$py" - <<'PY'
from importlib.metadata import distributions
names = sorted({d.metadata["Name"].lower() for d in distributions()})
print(" ".join(n for n in names if (n.startswith(("nvidia-", "cuda-")) and n != "nvidia-ml-py") or n == "triton"))
PY
)
if [ -n "$cuda" ]; then
  log "CUDA packages were installed, which this script exists to avoid: $cuda"
  exit 1
fi

log "checking: xinference-local --help"
"$venv/bin/xinference-local" --help >/dev/null
"$py" -W ignore -c 'import torch, xinference; print(f"[install_xinference] xinference {xinference.__version__}, torch {torch.__version__}")' >&2
log "done: $venv ($(du -sh "$venv" | cut -f1))"
