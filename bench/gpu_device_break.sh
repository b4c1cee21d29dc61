#!/usr/bin/env bash
# One H200 call for the device break (issue 8): build the native handlers (CUDA included), gate
# them in float32 on the GPU (the native tests; golden replays and mode agreement in every
# execution mode), then time the selection alone (bench/topk.py) and V4-Flash decode steps in
# every mode (bench/run.py).      device run:  bash bench/gpu_device_break.sh   (records in $OUT)
set -uo pipefail
source "$(dirname "$0")/gpu_build.sh"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_native.py tests/test_attention.py \
  -k "test_native or native or device or agree_on_csa" >"$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"; grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -8
timeout 120 python3 bench/topk.py --json "$OUT/gpu_topk.json" 2>&1 | tail -32
timeout 270 python3 bench/run.py --size flash --layers csa --scenarios decode_pr,decode_long \
  --modes none,none-xla,narrow,narrow-device --no-peer --no-progress --json "$OUT/gpu_flash_device_break.json" \
  >"$OUT/run.log" 2>&1; echo "run rc=$?"; grep -v "^\[" "$OUT/run.log" | tail -42
