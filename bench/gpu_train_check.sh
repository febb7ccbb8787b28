#!/usr/bin/env bash
# End-to-end GPU check: examples/pytorch_digits.py on CUDA, 2 ranks over gloo on one GPU,
# for hand-written compressors and CompLL programs registered at run time, PS and Ring.
# --plan size: the engine's size rule compresses fc1 (8 MB), whatever the link ("auto"
# sends everything uncompressed on a loopback link, which would check nothing).
# Each run's log and a summary line go to $OUT (else results/gpu_train/); exits 1 when any
# run fails or ends below the accuracy floor. Needs torch with CUDA, cupy, lark, sklearn.
# ONLY (a regular expression) keeps the runs whose name matches it.
#   bash bench/gpu_train_check.sh [EPOCHS] [MIN_ACCURACY]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu_train}; mkdir -p "$out"
epochs=${1:-4}; floor=${2:-90}
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1
P=hipress_like/compressors
runs=(
  "none-ps --compression none"
  "onebit-ps --compression onebit" "onebit-ring --compression onebit --strategy ring"
  "terngrad-ps --compression terngrad" "dgc-ps --compression dgc"
  "powersgd-ring --compression powersgd --strategy ring"
  "compll-onebit-ps --compll $P/onebit/onebit.compll"
  "compll-tbq-ring --compll $P/quantizers/tbq.compll --strategy ring"
  "compll-terngrad-ps --compll $P/quantizers/terngrad.compll"
  "compll-dgc-ps --compll $P/sparse/dgc.compll"
  "compll-graddrop-ps --compll $P/sparse/graddrop.compll"
  "compll-powersgd-ring --compll $P/powersgd/powersgd.compll --strategy ring"
)
one() {
  local name=$1; shift
  timeout 300 torchrun --standalone --nproc_per_node=2 examples/pytorch_digits.py \
    --epochs "$epochs" --plan size "$@" >"$out/$name.log" 2>&1
  local rc=$? last
  last=$(grep '^epoch' "$out/$name.log" | tail -1)
  echo "$name rc=$rc ${last:-no epoch line}"
}
export -f one; export out epochs
printf '%s\n' "${runs[@]}" | grep -E "^(${ONLY:-.*}) " | xargs -P 4 -I{} bash -c 'one {}' | sort | tee "$out/summary.txt"
bad=$(awk -v f="$floor" '{ split($0, a, "accuracy"); acc = a[2] + 0 }
  $2 != "rc=0" || $3 != "epoch" || $5 != "cuda" || acc < f { n++ } END { print n + 0 }' \
  "$out/summary.txt")
echo "runs failing (rc, not on cuda, or accuracy under $floor%): $bad"
[ "$bad" -eq 0 ]
