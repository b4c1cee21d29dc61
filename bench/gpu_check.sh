#!/usr/bin/env bash
# One H200 call to check the package as it stands (issue 9): build with the CUDA handlers, the GPU
# gates (native handlers, execution-mode agreement, the fused input projections and the CUDA
# single-token GEMMs), the V4-Flash stacks at 16k (B = 1, 32), and the module call against the
# jitted step.                                         device run:  bash bench/gpu_check.sh
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
source "$(dirname "$0")/gpu_build.sh"
timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/test_native.py tests/test_attention.py \
  tests/test_backend.py -k "native or device or agree_on_csa or fused or single_token" >"$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -8
timeout ${STACK_TIMEOUT:-120} python3 bench/stack.py --size flash --scenarios stack_decode --stacks mixed,csa,hca \
  --batches 1,32 --contexts 16384 --json "$OUT/h200_stack_check.json" >"$OUT/stack_check.log" 2>&1
echo "stacks rc=$?"; grep "^stack_decode\|Error" "$OUT/stack_check.log" | head -8
timeout ${CALL_TIMEOUT:-90} python3 bench/stack.py --size flash --call-overhead-only --call-overhead-size flash \
  --json "$OUT/h200_call_overhead.json" >"$OUT/call_overhead.log" 2>&1
echo "call overhead rc=$?"; tail -2 "$OUT/call_overhead.log"
echo "total: $(( $(date +%s) - t0 )) s"
