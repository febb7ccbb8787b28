#!/usr/bin/env bash
# The TensorFlow extra's own environment: create it, and optionally run its tests.
#
# Usage:  scripts/env_tensorflow.sh            # create/refresh .venv-tf (~1-2 min first time)
#         scripts/env_tensorflow.sh --test     # ... then run the TensorFlow tests in it
#         scripts/env_tensorflow.sh --test -k bitwise   # extra arguments go to pytest
#         scripts/env_tensorflow.sh --with-horovod [--test] # also build Horovod (PyTorch +
#                                      gloo + MPI, ~5-10 min) into it, for the horovodrun tests
#         HIPRESS_TF_VENV=/path/venv scripts/env_tensorflow.sh
#         HIPRESS_TF_VENV=.venv-tf214 HIPRESS_TF_VERSION=2.14.1 scripts/env_tensorflow.sh
#                                      # a Keras 2 TensorFlow (2.14: 2.12/2.13 pin typing-extensions
#                                      # below torch 2.13's), one Horovod 0.28.1's TF ops
#                                      # compile against, for its own test files' reference)
#
# What it installs (measured, ../shared/ENVIRONMENT.md): torch==2.13.0 (the CPU
# wheel on local disk, pinned as scripts/bootstrap.sh pins it: any range that
# admits 2.14.1 makes pip fetch a CUDA build), tensorflow-cpu (2.21, which
# brings Keras 3 as tf.keras) beside it, and this package editable with the
# [dev,mpi] extras (mpi only when Open MPI's mpicc is present). The engine
# runs on torch tensors; the TensorFlow face hands it TF's gradients through
# DLPack, so both frameworks live in one process.
#
# Idempotent: a stamp (a hash of setup.py and this script) makes a second run
# a no-op. A separate venv keeps TensorFlow's 1.5 GB and its numpy pins out of
# the main .venv (MXNet needs numpy 1.23.5; see scripts/env_mxnet.sh if present).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HIPRESS_TF_VENV:-$ROOT/.venv-tf}
PY=${PYTHON:-python3}
STAMP=$VENV/.hipress-tf-stamp
TF_VERSION=${HIPRESS_TF_VERSION:-}
want=$( (cat "$ROOT/setup.py" "$ROOT/scripts/env_tensorflow.sh"; echo "$TF_VERSION") | sha1sum \
  | cut -c1-16)

say() { echo "[env_tensorflow] $*" >&2; }
die() { echo "[env_tensorflow] error: $*" >&2; exit 1; }

run_tests=0
with_horovod=0
if [ "${1:-}" = "--with-horovod" ]; then
  with_horovod=1
  shift
fi
if [ "${1:-}" = "--test" ]; then
  run_tests=1
  shift
fi

command -v "$PY" >/dev/null 2>&1 || die "no $PY. Fix: install Python 3.10+ or set PYTHON=/path/python3."
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV ..."
  "$PY" -m venv "$VENV" || die "could not create a virtualenv at $VENV. Fix: apt-get install -y python3-venv, or set HIPRESS_TF_VENV."
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  say "installing torch, tensorflow-cpu and hipress-like into $VENV (first run ~1-2 min) ..."
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q "torch==${HIPRESS_TORCH:-2.13.0}" \
    || die "pip could not install torch==${HIPRESS_TORCH:-2.13.0} (see above)."
  pin=()  # HIPRESS_TF_VERSION: held through the extras' install (their numpy may want newer)
  [ -n "$TF_VERSION" ] && pin=("tensorflow-cpu==$TF_VERSION")
  extras=tensorflow,dev
  command -v mpicc >/dev/null 2>&1 && extras=tensorflow,dev,mpi
  "$VENV/bin/python" -m pip install -q -e "$ROOT[$extras]" ${pin[@]+"${pin[@]}"} \
    || die "pip could not install hipress-like[$extras] (see above)."
  "$VENV/bin/python" - <<'EOF' || die "the install finished but torch/tensorflow/hipress_like do not import together (see above)."
import torch, tensorflow as tf, hipress_like  # noqa: F401
import hipress_like.tensorflow  # noqa: F401
print(f"torch {torch.__version__}, tensorflow {tf.__version__}")
EOF
  echo "$want" > "$STAMP"
  say "ready: $VENV"
else
  say "$VENV is up to date; nothing to install."
fi

if [ "$with_horovod" = 1 ]; then
  # horovodrun only launches and rendezvouses TensorFlow jobs here (hipress_like joins
  # through horovod.torch), so Horovod is built with PyTorch, not with TensorFlow.
  HIPRESS_VENV=$VENV bash "$ROOT/scripts/env_horovod.sh" \
    || die "building Horovod into $VENV failed (see above); the other tests do not need it."
fi

if [ "$run_tests" = 1 ]; then
  cd "$ROOT"
  say "running the TensorFlow tests: $VENV/bin/python -m pytest -m frameworks tests/frameworks/test_tensorflow.py tests/frameworks/test_tensorflow_elastic.py $*"
  exec env PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m pytest -m frameworks \
    tests/frameworks/test_tensorflow.py tests/frameworks/test_tensorflow_elastic.py "$@"
fi
