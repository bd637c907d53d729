# Sourced by install_cpu.sh and install_xinference.sh (not run on its own): a virtual
# environment with the CPU build of torch, installed first so that nothing after it can
# pull a CUDA torch.
#
# Expects: venv, python, torch_version, log(). Sets: py, pip (an array), have NAME VERSION.

if [ ! -x "$venv/bin/python" ]; then
  log "creating venv $venv"
  "$python" -m venv "$venv"
  # Keep the venv out of git wherever it lives (Python >= 3.13 venv does this itself).
  printf '*\n' >"$venv/.gitignore"
fi
py="$venv/bin/python"
pip=("$py" -m pip install --disable-pip-version-check -q)

have() { "$py" - "$1" "$2" <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    sys.exit(0 if version(sys.argv[1]) == sys.argv[2] else 1)
except PackageNotFoundError:
    sys.exit(1)
PY
}

if ! have torch "${torch_version}+cpu" && ! have torch "$torch_version"; then
  log "installing torch==$torch_version (CPU build)"
  "${pip[@]}" "torch==$torch_version"
fi
