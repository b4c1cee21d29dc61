#!/usr/bin/env bash
# Short H200 re-check after a change to csrc/ that leaves the kernels' arithmetic alone (the
# capsule dict moved to csrc/python_module.h; the top-k's batched loads into LoadKeyBatch):
# rebuild, the native gates in float32 (tests/test_native.py), and the selection timings.
#   device run:  bash bench/gpu_device_break_recheck.sh
set -uo pipefail
source "$(dirname "$0")/gpu_build.sh"
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_native.py >"$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"; tail -2 "$OUT/gpu_tests.log"
timeout 80 python3 bench/topk.py --repeats 15 --json "$OUT/gpu_topk.json" 2>&1 | tail -32
