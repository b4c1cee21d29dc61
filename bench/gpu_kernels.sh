#!/usr/bin/env bash
# One H200 call after a csrc/ change (issues 8 and 9): build, gate the native handlers on the GPU
# (tests/test_native.py and the execution-mode agreement tests), time the selection alone
# (bench/topk.py with kernel device times), then the 4-layer stacks (bench/stack.py).
#                                   device run:  bash bench/gpu_kernels.sh   (records in $OUT)
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
PROF="--xla_enable_command_buffers_during_profiling=true"
source "$(dirname "$0")/gpu_build.sh"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_native.py tests/test_attention.py \
  -k "native or device or agree_on_csa" >"$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -8
XLA_FLAGS="$PROF" timeout 100 python3 bench/topk.py --device-time --repeats 10 --json "$OUT/h200_topk.json" 2>&1 | tail -16
# The stacks: mixed (CSA, HCA, CSA, HCA) over the whole matrix with a profile and the module
# call's overhead, then the per-type stacks at the issue's target shapes.
XLA_FLAGS="$PROF" timeout ${STACK_TIMEOUT:-170} python3 bench/stack.py --size flash --stacks mixed \
  --profile 1:16384,32:16384 --call-overhead --call-overhead-size flash --json "$OUT/h200_stack_mixed.json" \
  >"$OUT/stack_mixed.log" 2>&1; echo "stack mixed rc=$?"; grep -v "^|" "$OUT/stack_mixed.log" | grep -v "^$" | head -14
timeout ${TYPES_TIMEOUT:-90} python3 bench/stack.py --size flash --stacks csa,hca --scenarios stack_decode \
  --batches 1,32 --contexts 2048,16384 --json "$OUT/h200_stack_types.json" >"$OUT/stack_types.log" 2>&1
echo "stack types rc=$?"; grep -v "^|" "$OUT/stack_types.log" | grep -v "^$" | head -9
echo "total: $(( $(date +%s) - t0 )) s"
