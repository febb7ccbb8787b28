#!/usr/bin/env bash
# The MXNet extra's own environment: create it, and optionally run its tests.
#
# Usage:  scripts/env_mxnet.sh                 # create/refresh .venv-mxnet (~2-3 min first time)
#         scripts/env_mxnet.sh --test          # ... then run the MXNet tests in it
#         scripts/env_mxnet.sh --test -k bitwise   # extra arguments go to pytest
#         HIPRESS_MXNET_VENV=/path/venv scripts/env_mxnet.sh
#
# Why a venv of its own: mxnet==1.9.1 (the last release) imports on Python
# 3.11 only with numpy==1.23.5 (newer numpy removed np.bool, which MXNet's
# Python code still uses; ../shared/ENVIRONMENT.md), so it cannot share the
# main .venv, whose numpy is current.
#
# What it installs:
#   1. numpy==1.23.5 and mxnet==1.9.1 (the CPU wheel with MKLDNN; it has the
#      distributed kvstore dist_sync, used as the speed baseline);
#   2. torch==2.13.0, the CPU wheel on local disk, pinned exactly as
#      scripts/bootstrap.sh pins it (a range admitting 2.14.1 makes pip fetch
#      a CUDA build); the engine runs on torch tensors and the MXNet face hands
#      it Gluon's gradients through DLPack;
#   3. this package editable with [dev,mpi] (mpi only when Open MPI's mpicc is
#      present).
# Every pip call runs under a constraints file pinning numpy==1.23.5, so the
# package's own dependencies (scikit-learn, scipy, matplotlib, pymoo, ...)
# resolve to releases that still support it instead of upgrading numpy. The
# [mxnet] extra is not used for step 3: its pins are already satisfied by 1.
#
# Idempotent: a stamp (a hash of setup.py and this script) makes a second run
# a no-op.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HIPRESS_MXNET_VENV:-$ROOT/.venv-mxnet}
PY=${PYTHON:-python3}
STAMP=$VENV/.hipress-mxnet-stamp
want=$(cat "$ROOT/setup.py" "$ROOT/scripts/env_mxnet.sh" | sha1sum | cut -c1-16)

say() { echo "[env_mxnet] $*" >&2; }
die() { echo "[env_mxnet] error: $*" >&2; exit 1; }

run_tests=0
if [ "${1:-}" = "--test" ]; then
  run_tests=1
  shift
fi

command -v "$PY" >/dev/null 2>&1 || die "no $PY. Fix: install Python 3.10/3.11 or set PYTHON=/path/python3."
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV ..."
  "$PY" -m venv "$VENV" || die "could not create a virtualenv at $VENV. Fix: apt-get install -y python3-venv, or set HIPRESS_MXNET_VENV."
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  say "installing numpy 1.23.5, mxnet 1.9.1, torch and hipress-like into $VENV (first run ~2-3 min) ..."
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  constraints=$VENV/.hipress-mxnet-constraints.txt
  echo "numpy==1.23.5" > "$constraints"
  # pip's exit status survives the filter (pipefail); the filter drops the local
  # index's "Location ... is ignored" warnings and the editable-install banner
  pipi() {
    "$VENV/bin/python" -m pip install -q -c "$constraints" "$@" 2>&1 \
      | { grep -v -e "^WARNING: Location '" -e "BuildBackendWarning" || true; }
  }
  pipi "numpy==1.23.5" "mxnet==1.9.1" \
    || die "pip could not install numpy==1.23.5 and mxnet==1.9.1 (see above). mxnet 1.9.1 has wheels for Linux x86_64 and Python <= 3.11 only."
  pipi "torch==${HIPRESS_TORCH:-2.13.0}" \
    || die "pip could not install torch==${HIPRESS_TORCH:-2.13.0} (see above)."
  extras=dev
  command -v mpicc >/dev/null 2>&1 && extras=dev,mpi
  pipi -e "$ROOT[$extras]" \
    || die "pip could not install hipress-like[$extras] beside numpy==1.23.5 (see above); a dependency may need a numpy newer than 1.23.5: pin an older release of it in $constraints."
  "$VENV/bin/python" - <<'EOF' || die "the install finished but mxnet/torch/hipress_like do not import together (see above)."
import mxnet as mx, numpy, torch, hipress_like  # noqa: F401
import hipress_like.mxnet  # noqa: F401
assert numpy.__version__ == "1.23.5", numpy.__version__
print(f"[env_mxnet] mxnet {mx.__version__}, numpy {numpy.__version__}, torch {torch.__version__}")
EOF
  echo "$want" > "$STAMP"
  say "ready: $VENV"
else
  say "$VENV is up to date; nothing to install."
fi

if [ "$run_tests" = 1 ]; then
  cd "$ROOT"
  say "running the MXNet tests: $VENV/bin/python -m pytest -m frameworks tests/frameworks/test_mxnet.py $*"
  exec env PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m pytest -m frameworks \
    tests/frameworks/test_mxnet.py "$@"
fi
