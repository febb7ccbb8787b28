#!/usr/bin/env bash
# The main job: 4 local workers learn scikit-learn's digits with CaSync
# (PowerSGD, auto plan) and again without compression; prints accuracy and
# throughput per epoch and a final comparison table. Options: --help.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
exec python -m hipress_like.demo "$@"
