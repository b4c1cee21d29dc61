#!/usr/bin/env bash
# One H200 call for the compiled step (issue 9) and the top-k's device time (issue 8): build the
# native handlers, time V4-Flash stacks of 4 layers in one jax.jit (bench/stack.py: decode at
# B = 1, 8, 32 and 2k / 16k / 64k contexts, prefill 4k / 16k), profile the mixed stack's decode
# step per XLA operation, time the module call against the jitted step, and trace the top-k
# programs of bench/topk.py.            device run:  bash bench/gpu_stack.sh   (records in $OUT)
# STACK_ARGS overrides the stack run's arguments (e.g. a shorter matrix).
set -uo pipefail
# Command buffers stay on while the profiler runs (XLA turns them off by default then).
export XLA_FLAGS="${XLA_FLAGS:-} --xla_enable_command_buffers_during_profiling=true"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
source "$(dirname "$0")/gpu_build.sh"
# The mixed stack (CSA, HCA, CSA, HCA) over the whole matrix, with the profiles; then the
# per-type stacks at the issue's target shapes.
timeout ${STACK_TIMEOUT:-300} python3 bench/stack.py --size flash --stacks mixed --json "$OUT/h200_stack_mixed.json" \
  --profile 1:16384,32:16384 --call-overhead --call-overhead-size flash >"$OUT/stack_mixed.log" 2>&1
echo "stack mixed rc=$?"; grep -v "^|" "$OUT/stack_mixed.log" | tail -30
timeout ${TYPES_TIMEOUT:-150} python3 bench/stack.py --size flash --stacks csa,hca --scenarios stack_decode \
  --batches 1,32 --contexts 2048,16384 --json "$OUT/h200_stack_types.json" >"$OUT/stack_types.log" 2>&1
echo "stack types rc=$?"; grep -v "^|" "$OUT/stack_types.log" | tail -12
timeout ${TOPK_TIMEOUT:-90} python3 bench/topk.py --device-time --repeats 10 --json "$OUT/h200_topk_device_time.json" \
  2>&1 | tail -14
echo "total: $(( $(date +%s) - t0 )) s"
