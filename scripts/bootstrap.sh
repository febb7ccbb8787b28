#!/usr/bin/env bash
# Create/refresh the project virtualenv (.venv) on first use; fast when up to date.
# Sourced by run.sh and test.sh. Installs: torch (CPU wheel; pinned inside the
# machine's cap), the package in editable mode with [dev,docs,mpi], and Open MPI
# from apt when running as root and it is missing.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HIPRESS_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
STAMP=$VENV/.hipress-stamp
want=$(cat "$ROOT/setup.py" "$ROOT/scripts/bootstrap.sh" | sha1sum | cut -c1-16)

if ! command -v mpicc >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[bootstrap] installing Open MPI (apt)..." >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
       openmpi-bin libopenmpi-dev iproute2 >/dev/null) || echo "[bootstrap] apt failed; MPI tests will skip" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating $VENV ..." >&2
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[bootstrap] installing dependencies into $VENV (first run takes ~1-2 min)..." >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # The CPU wheel on local disk, pinned exactly: any range that admits 2.14.1
  # makes pip take the registry's CUDA build of it (~5.8 GB with its nvidia-*
  # packages). setup.py keeps the looser range for users' own installs.
  "$VENV/bin/python" -m pip install -q "torch==${HIPRESS_TORCH:-2.13.0}" 2>&1 | grep -v -i warning || true
  extras=dev,docs
  command -v mpicc >/dev/null 2>&1 && extras=dev,docs,mpi
  "$VENV/bin/python" -m pip install -q -e "$ROOT[$extras]" 2>&1 | grep -v -i warning || true
  "$VENV/bin/python" -c "import torch, hipress_like" || { echo "[bootstrap] install failed" >&2; exit 1; }
  echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
