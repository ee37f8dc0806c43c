#!/usr/bin/env bash
# Runs the suite (as `make test` does, without the set-up) while N busy processes compete for the
# CPUs, to find tests that race a fast model or a timer before a slower or busier CI machine does.
#   scripts/test-under-load.sh [N=2] [pytest arguments...]
# The busy processes end with the run, and after an hour in any case.
set -euo pipefail
cd "$(dirname "$0")/.."
load=${1:-2}
shift || true
burners=()
trap 'kill "${burners[@]}" 2>/dev/null || true' EXIT
for _ in $(seq "$load"); do
    timeout 3600 .venv/bin/python -c "while True: pass" &
    burners+=($!)
done
.venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
