#!/usr/bin/env bash
# The H200 entry point: one device call, one or more subcommands run in order after one build
# (bench/gpu_build.sh: the package with its CUDA handlers). Records and logs go under $OUT.
#
#   bash bench/gpu.sh gates           the GPU-only tests: every Pallas kernel (forward and backward)
#                                     against its XLA reference at V4-Flash sizes, the gradients
#                                     with the Triton kernels against the CPU's, the golden replays
#                                     and the break modes' agreement on the GPU (GATES_K: pytest -k)
#   bash bench/gpu.sh train           bench/train.py --size flash $TRAIN_ARGS -> $OUT/train*.json
#   bash bench/gpu.sh stack           bench/stack.py --size flash $STACK_ARGS -> $OUT/stack*.json
#
# e.g. TRAIN_ARGS="--stacks csa,hca --batches 1,4 --lengths 4096,16384" bash bench/gpu.sh gates train
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
source "$(dirname "$0")/gpu_build.sh"

gates() {
  timeout "${GATES_TIMEOUT:-420}" python3 -m pytest -q -s -p no:cacheprovider --durations=10 \
    tests/test_sparse_attention_backward.py tests/test_gradients.py tests/test_sparse_attention_kernel.py \
    tests/test_compressor_kernel.py ${GATES_K:+-k "$GATES_K"} >"$OUT/gpu_gates.log" 2>&1
  echo "kernel gates rc=$?"
  grep -E "bf16|passed|failed|FAILED|Error" "$OUT/gpu_gates.log" | tail -40
  if [ "${GOLDEN:-1}" = 1 ]; then
    timeout "${GOLDEN_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_attention.py \
      -k "(golden and none) or agree_on_csa" >"$OUT/gpu_golden.log" 2>&1
    echo "golden replays + mode agreement rc=$?"
    grep -E "passed|failed|FAILED|Error" "$OUT/gpu_golden.log" | tail -8
  fi
}

train() {
  timeout "${TRAIN_TIMEOUT:-480}" python3 bench/train.py --size flash --json "$OUT/train${TRAIN_TAG:-}.json" \
    ${TRAIN_ARGS:-} 2>&1 | tail -40
}

stack() {
  timeout "${STACK_TIMEOUT:-480}" python3 bench/stack.py --size flash --json "$OUT/stack${STACK_TAG:-}.json" \
    ${STACK_ARGS:-} 2>&1 | tail -40
}

for cmd in "$@"; do
  echo "== $cmd ($(( $(date +%s) - t0 )) s)"
  "$cmd"
done
echo "total: $(( $(date +%s) - t0 )) s"
