#!/usr/bin/env bash
# Build Horovod 0.28.1 (PyTorch + gloo + MPI, CPU; + MXNet or TensorFlow when the venv
# has it) into the project's .venv (or HIPRESS_VENV, e.g. .venv-mxnet, .venv-tf).
#
# Usage:  scripts/env_horovod.sh            # one command; ~3-10 min the first time,
#                                           # seconds once its wheel is cached
#         scripts/env_horovod.sh --test     # ... then run the Horovod tier (extra
#                                           # arguments go to pytest)
#         HIPRESS_VENV=/path/venv scripts/env_horovod.sh
#
# The wheel cache: the first build leaves its wheel in
# ${HIPRESS_WHEEL_CACHE:-~/.cache/hipress-like/wheels}/horovod-<version>-<key>/, where
# <key> hashes what the binary depends on (Horovod's version, Python's, torch's,
# the C++ compiler's and Open MPI's, the machine); a later run with the same key
# installs that wheel instead of compiling (CI keeps the folder between runs).
#
# Idea: Horovod 0.28.1 (the newest on PyPI) builds against torch 2.x with two
# build-environment settings and no source change (measured, see
# ../shared/ENVIRONMENT.md):
#   1. cmake below 4 (Horovod's CMakeLists use syntax cmake 4 removed);
#   2. a C++ compiler wrapper that rewrites -std=c++14 / -std=c++11 (and the
#      gnu++ forms) to -std=c++17, because Horovod's CMake forces C++14 while
#      torch 2.x headers need C++17.
# The build uses the venv's torch, so pip must not isolate it
# (--no-build-isolation). The script is idempotent: when horovod.torch already
# imports with gloo, MPI and PyTorch built in, it does nothing.
set -euo pipefail
run_tests=0
if [ "${1:-}" = "--test" ]; then run_tests=1; shift; fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HIPRESS_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
HVD_VERSION=${HIPRESS_HOROVOD_VERSION:-0.28.1}

die() { echo "[env_horovod] error: $*" >&2; exit 1; }
say() { echo "[env_horovod] $*" >&2; }

# MXNet in the venv (scripts/env_mxnet.sh's): Horovod is built with it too
WITH_MXNET=0
[ -x "$PY" ] && "$PY" -c "import mxnet" >/dev/null 2>&1 && WITH_MXNET=1
# TensorFlow in the venv (scripts/env_tensorflow.sh's): likewise
WITH_TF=0
[ -x "$PY" ] && "$PY" -c "import tensorflow" >/dev/null 2>&1 && WITH_TF=1

# TensorFlow's wheel must ship the headers its own headers include: TF 2.21's
# xla/printer.h includes highwayhash/arch_specific.h, which the wheel lacks, and
# Horovod's TF ops then fail to compile (measured, after a 10-minute build; no
# source change fixes a header that is not there). Then Horovod is built without
# its TensorFlow ops: horovodrun and horovod.torch, which is all the TensorFlow
# face needs to run under horovodrun; only Horovod's own TF ops (and its TF test
# files) are missing.
if [ "$WITH_TF" = 1 ]; then
  tfinc=$("$PY" -c 'import tensorflow as t; print(t.sysconfig.get_include())' 2>/dev/null)
  if grep -qs "highwayhash/" "$tfinc/xla/printer.h" && [ ! -e "$tfinc/highwayhash/arch_specific.h" ]; then
    say "TensorFlow $("$PY" -c 'import tensorflow as t; print(t.__version__)' 2>/dev/null) in $VENV ships headers that include highwayhash/, which its wheel does not contain, so Horovod's TensorFlow ops cannot compile: building Horovod without them (horovodrun and horovod.torch; the TensorFlow face runs under horovodrun without Horovod's TF ops)."
    WITH_TF=0
  fi
fi

# --- already built? -------------------------------------------------------
check_built() {
  WITH_MXNET=$WITH_MXNET WITH_TF=$WITH_TF "$PY" - <<'EOF' 2>/dev/null
import os
import horovod, horovod.torch as hvd
assert hvd.gloo_built() and hvd.mpi_built(), "gloo/mpi missing"
if os.environ["WITH_MXNET"] == "1":
    import horovod.mxnet
if os.environ["WITH_TF"] == "1":
    import horovod.tensorflow
print(horovod.__version__)
EOF
}
run_tier() {
  [ "$run_tests" = 1 ] || exit 0
  cd "$ROOT"
  say "running the Horovod tier: $PY -m pytest -m frameworks tests/frameworks/test_horovodrun.py tests/frameworks/test_horovod_surface.py tests/frameworks/test_horovod_calls.py tests/frameworks/test_horovod_elastic.py $*"
  exec env PATH="$VENV/bin:$PATH" "$PY" -m pytest -m frameworks \
    tests/frameworks/test_horovodrun.py tests/frameworks/test_horovod_surface.py \
    tests/frameworks/test_horovod_calls.py tests/frameworks/test_horovod_elastic.py "$@"
}
if [ -x "$PY" ] && have=$(check_built); then
  say "Horovod $have with PyTorch, gloo and MPI already built in $VENV; nothing to do."
  run_tier "$@"
fi

# --- prerequisites ----------------------------------------------------------
[ -x "$PY" ] || die "no virtualenv at $VENV. Fix: run scripts/bootstrap.sh (or ./test.sh) first, or set HIPRESS_VENV."
"$PY" -c "import torch" 2>/dev/null \
  || die "torch is not installed in $VENV. Fix: run scripts/bootstrap.sh first (Horovod builds against the venv's torch)."
command -v g++ >/dev/null 2>&1 \
  || die "no C++ compiler (g++). Fix: apt-get install -y g++ (Horovod needs C++17 support, g++ >= 7)."
command -v gcc >/dev/null 2>&1 || die "no C compiler (gcc). Fix: apt-get install -y gcc."
command -v make >/dev/null 2>&1 || die "no make. Fix: apt-get install -y make."
command -v mpicxx >/dev/null 2>&1 && [ -n "$(mpicxx --showme:incdirs 2>/dev/null || true)" ] \
  || die "no Open MPI compiler wrapper/headers (mpicxx, mpi.h). Fix: apt-get install -y openmpi-bin libopenmpi-dev."
inc_ok=0
for d in $(mpicxx --showme:incdirs); do [ -f "$d/mpi.h" ] && inc_ok=1; done
[ "$inc_ok" = 1 ] || die "Open MPI headers (mpi.h) not found. Fix: apt-get install -y libopenmpi-dev."

# cmake < 4 in the venv (pip's cmake wheel); a system cmake >= 4 would fail.
cm_ver=$("$VENV/bin/cmake" --version 2>/dev/null | head -1 | awk '{print $3}' || true)
if [ -z "$cm_ver" ] || [ "${cm_ver%%.*}" -ge 4 ]; then
  say "installing cmake<4 into $VENV ..."
  "$PY" -m pip install -q "cmake<4" \
    || die "could not install cmake<4. Fix: pip install 'cmake<4' into $VENV (or apt-get install -y cmake, version 3.x)."
fi
export PATH="$VENV/bin:$PATH"
cmake --version >/dev/null 2>&1 || die "cmake not runnable. Fix: $PY -m pip install 'cmake<4'."
"$PY" -c "import wheel, setuptools" 2>/dev/null || "$PY" -m pip install -q wheel setuptools

# --- the C++17 wrapper ------------------------------------------------------
WRAPDIR=$VENV/.horovod-build
mkdir -p "$WRAPDIR"
REAL_CXX=$(command -v g++)
cat > "$WRAPDIR/cxx17" <<EOF
#!/usr/bin/env bash
# Generated by scripts/env_horovod.sh: force C++17 (torch 2.x needs it;
# Horovod 0.28.1's CMake asks for C++14).
args=()
for a in "\$@"; do
  case "\$a" in
    -std=c++11|-std=c++14|-std=c++1y) args+=("-std=c++17") ;;
    -std=gnu++11|-std=gnu++14|-std=gnu++1y) args+=("-std=gnu++17") ;;
    *) args+=("\$a") ;;
  esac
done
exec "$REAL_CXX" "\${args[@]}"
EOF
chmod +x "$WRAPDIR/cxx17"

# --- the wheel: from the cache, or built once into it ------------------------
CACHE=${HIPRESS_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hipress-like/wheels}
key=$( { echo "$HVD_VERSION"; "$PY" -c 'import sys, platform, torch; print(sys.version.split()[0], platform.machine(), torch.__version__)';
         if [ "$WITH_MXNET" = 1 ]; then "$PY" -c 'import mxnet; print("mxnet", mxnet.__version__)'; fi;
         if [ "$WITH_TF" = 1 ]; then "$PY" -c 'import tensorflow as t; print("tf", t.__version__)' 2>/dev/null; fi;
         "$REAL_CXX" --version | head -1; mpicxx --showme:version 2>&1 | head -1; } | sha256sum | cut -c1-16)
SLOT=$CACHE/horovod-$HVD_VERSION-$key
wheel=$(ls "$SLOT"/horovod-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  say "building horovod==$HVD_VERSION (PyTorch, gloo, MPI) into a wheel; this takes several minutes ..."
  mkdir -p "$CACHE"
  tmp=$(mktemp -d "$CACHE/.build.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  mx_flag=HOROVOD_WITHOUT_MXNET; [ "$WITH_MXNET" = 1 ] && mx_flag=HOROVOD_WITH_MXNET
  tf_flag=HOROVOD_WITHOUT_TENSORFLOW; [ "$WITH_TF" = 1 ] && tf_flag=HOROVOD_WITH_TENSORFLOW
  CXX=$WRAPDIR/cxx17 CC=$(command -v gcc) MAKEFLAGS=${MAKEFLAGS:--j2} \
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
    env "$mx_flag=1" "$tf_flag=1" "$PY" -m pip wheel --no-cache-dir --no-build-isolation --no-deps -w "$tmp" "horovod==$HVD_VERSION" \
    || die "the Horovod build failed (see the compiler output above). Check: g++ >= 7, cmake < 4 in $VENV, libopenmpi-dev, and that torch imports in $VENV."
  # publish the slot whole (a rename), so a build cut short never leaves a wheel behind
  rm -rf "$SLOT" && mv "$tmp" "$SLOT" && trap - EXIT
  wheel=$(ls "$SLOT"/horovod-*.whl | head -1)
else
  say "installing the cached wheel $wheel (key $key: Horovod, Python, torch, g++ and Open MPI versions)"
fi
"$PY" -m pip install -q "$wheel" \
  || die "could not install $wheel. Fix: delete $SLOT and rerun (it will rebuild)."

have=$(check_built) || die "horovod installed but horovod.torch does not import with gloo and MPI. Fix: rerun with 'pip uninstall -y horovod' first; check the build log above."
say "done: Horovod $have with PyTorch, gloo and MPI in $VENV (try: $VENV/bin/horovodrun --check-build)"
run_tier "$@"
