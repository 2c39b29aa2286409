# Sourced by demo.sh and test.sh: create or reuse the project's virtual environment.
# GPUPROF_VENV      where the environment lives (default: .venv in the repo)
# GPUPROF_TORCH     the torch requirement to install when torch is missing (default: torch==2.13.0)
# GPUPROF_TORCH_INDEX  a pip index for torch, e.g. PyTorch's CPU-only wheel index on a machine without a GPU
# GPUPROF_NEWEST_TORCH test.sh's second pass, in .venv-<it>: the newest torch tested (default torch==2.14.1)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${GPUPROF_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}

ensure_env() {  # $1: the extras to install, e.g. "[test]"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || { echo "gpuprof needs Python 3.10 or newer ($PYTHON is $("$PYTHON" -V 2>&1))" >&2; exit 2; }
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  local pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    echo "installing ${GPUPROF_TORCH:-torch==2.13.0} into $VENV" >&2
    "${pip[@]}" ${GPUPROF_TORCH_INDEX:+--index-url "$GPUPROF_TORCH_INDEX"} "${GPUPROF_TORCH:-torch==2.13.0}"
  fi
  "${pip[@]}" -e "$ROOT$1"
}
