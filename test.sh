#!/usr/bin/env bash
# Run the test suite (sets up .venv on first use).
#   ./test.sh            default suite (unit + multiprocess, ~minutes)
#   ./test.sh --all      also slow, network-emulation (root) and framework tests
#   ./test.sh -k ring    any other arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
if [ "${1:-}" = "--all" ]; then
  shift
  exec python -m pytest "$@"
fi
exec python -m pytest -m "not slow and not netem and not frameworks" "$@"
