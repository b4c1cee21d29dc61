#!/usr/bin/env bash
# One H200 call: an A/B of bench/stack.py switches (issue 9), each variant in its own process
# (the switches are read at trace time). V4-Flash stacks of 4 layers, decode; the mixed stack is
# profiled per XLA operation (kernel time) at B = 1 and 32, 16k, in every variant; then the
# module call against the jitted step.
#   VARIANTS: '|'-separated extra arguments, one per variant ('' = the package's defaults)
#   e.g.  VARIANTS='|--dot-min-rows 1' bash bench/gpu_ab.sh               device run, one call
# (the 2026-12-01 run compared a version with --merged-projections, since removed: bench/RESULTS.md)
set -uo pipefail
export XLA_FLAGS="${XLA_FLAGS:-} --xla_enable_command_buffers_during_profiling=true"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
source "$(dirname "$0")/gpu_build.sh"
IFS='|' read -r -a variants <<< "${VARIANTS:-}"
i=0
for v in "${variants[@]}"; do
  timeout ${AB_TIMEOUT:-150} python3 bench/stack.py --size flash --scenarios stack_decode --stacks mixed,csa,hca \
    --batches ${BATCHES:-1,8,32} --contexts ${CONTEXTS:-16384} --profile 1:16384,32:16384 $v \
    --json "$OUT/h200_stack_ab_$i.json" >"$OUT/stack_ab_$i.log" 2>&1
  echo "variant $i [$v] rc=$?"; grep "^stack_decode\|Error" "$OUT/stack_ab_$i.log" | head -12
  i=$((i + 1))
done
# The module call against the jitted step (issue 9's thin-call target), flash CSA decode, B = 1.
timeout ${CALL_TIMEOUT:-90} python3 bench/stack.py --size flash --call-overhead-only --call-overhead-size flash \
  --json "$OUT/h200_call_overhead.json" >"$OUT/call_overhead.log" 2>&1
echo "call overhead rc=$?"; tail -2 "$OUT/call_overhead.log"
echo "total: $(( $(date +%s) - t0 )) s"
