#!/usr/bin/env bash
# One short H200 call: the mixed 4-layer stack's decode step (B = 1 and 32, 16k context)
# traced per XLA operation (bench/stack.py --profile, command buffers kept on under the
# profiler).                          device run:  bash bench/gpu_profile.sh   (records in $OUT)
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
export XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true"
source "$(dirname "$0")/gpu_build.sh"
timeout 200 python3 bench/stack.py --size flash --stacks mixed --scenarios stack_decode --batches 1 --contexts 16384 \
  --profile 1:16384,32:16384 --json "$OUT/h200_stack_profile.json" > "$OUT/prof.log" 2>&1; echo rc=$?
grep -v "^$" "$OUT/prof.log" | tail -100 | cut -c1-200
