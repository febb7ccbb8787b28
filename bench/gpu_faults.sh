#!/usr/bin/env bash
# The fault suite's task-failure rows with the ranks training on a GPU (issue 46): an
# exception inside encode, an exception inside the bulk exchange and a killed rank, for
# Ring and PS, 2 ranks on the one GPU over gloo (tests/faults/fault_job.py with
# JOB_DEVICE=cuda). Stop 45 saw a Ring job on a GPU wait for its timeout after a task
# failure that the CPU names in 0.1-0.2 s; these rows show whether it still does.
# Writes $OUT/gpu_faults-<strategy>.json (else results/) and prints the suite's table.
#   bash bench/gpu_faults.sh [TRIALS]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results}; mkdir -p "$out"
# eager kernels: no Triton build per rank eats the time (the compiled ones round alike)
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1 JOB_DEVICE=${JOB_DEVICE:-cuda} \
  HIPRESS_NO_COMPILE=${HIPRESS_NO_COMPILE:-1}
for s in ring ps; do
  JOB_STRATEGY=$s "${PYTHON:-python3}" bench/faults.py --only raise/encode raise/exchange kill/forward \
    --trials "${1:-2}" --out "$out/gpu_faults-$s.json"
done
