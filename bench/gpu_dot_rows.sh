#!/usr/bin/env bash
# One H200 call (issue 9): does giving single-token projections more rows help? XLA:GPU emits
# a one-row dot (a B = 1 decode step's projections) as a reduction fusion; DOT_MIN_ROWS > 1 makes
# it a GEMM on zero-padded rows (dsv4_jax.backend). V4-Flash CSA, HCA (and mixed) stacks of 4 layers,
# decode at B = 1 and 8 (2k, 16k), once per value (the value is read at trace time: one
# process each), with a per-op profile of the mixed stack at B = 1, 16k for values 1 and 2; then
# the module call against the jitted step (bench/stack.py --call-overhead-only).
#                                                   device run:  bash bench/gpu_dot_rows.sh
set -uo pipefail
export XLA_FLAGS="${XLA_FLAGS:-} --xla_enable_command_buffers_during_profiling=true"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
source "$(dirname "$0")/gpu_build.sh"
for rows in ${ROWS:-1 2 8}; do
  prof="--stacks csa,hca"; [ "$rows" -le 2 ] && prof="--stacks mixed,csa,hca --profile 1:16384"
  timeout ${ROWS_TIMEOUT:-120} python3 bench/stack.py --size flash --scenarios stack_decode \
    --batches 1,8 --contexts 2048,16384 --dot-min-rows "$rows" $prof --json "$OUT/h200_stack_dot_rows_$rows.json" \
    >"$OUT/stack_dot_rows_$rows.log" 2>&1
  echo "dot-min-rows $rows rc=$?"; grep "^stack_decode\|busy\|Error" "$OUT/stack_dot_rows_$rows.log" | head -12
done
timeout ${CALL_TIMEOUT:-90} python3 bench/stack.py --size flash --call-overhead-only --call-overhead-size flash \
  --json "$OUT/h200_call_overhead.json" >"$OUT/call_overhead.log" 2>&1
echo "call overhead rc=$?"; tail -8 "$OUT/call_overhead.log"
echo "total: $(( $(date +%s) - t0 )) s"
