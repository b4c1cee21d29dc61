#!/usr/bin/env bash
# One H200 call: the native selection kernels of the working tree against an earlier csrc/, in
# the same session (issues 8 and 9). Builds the tree's handlers, gates them on the GPU
# (tests/test_native.py, execution-mode agreement), times the selection alone (bench/topk.py
# with kernel device times) and the CSA / mixed stacks at 16k (bench/stack.py, a profile of the
# CSA stack); then builds the csrc/ files saved in OLD_CSRC (default build/old_csrc: carry it),
# times the same selection and CSA stack, and puts the tree's csrc/ back.
#      device run:  bash bench/gpu_native_ab.sh       (records in $OUT: *_new.json, *_old.json)
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
PROF="--xla_enable_command_buffers_during_profiling=true"
OLD_CSRC=${OLD_CSRC:-build/old_csrc}
source "$(dirname "$0")/gpu_build.sh"
timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/test_native.py tests/test_attention.py \
  -k "native or device or agree_on_csa or golden" >"$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -12
run_topk() {  # $1: tag
  XLA_FLAGS="$PROF" timeout ${TOPK_TIMEOUT:-120} python3 bench/topk.py --device-time --repeats 10 \
    --json "$OUT/h200_topk_$1.json" >"$OUT/topk_$1.log" 2>&1; echo "topk $1 rc=$?"; tail -31 "$OUT/topk_$1.log"
}
run_stack() {  # $1: tag, $2: stacks, $3...: extra flags
  local tag=$1 stacks=$2; shift 2
  XLA_FLAGS="$PROF" timeout ${STACK_TIMEOUT:-150} python3 bench/stack.py --size flash --scenarios stack_decode \
    --stacks "$stacks" --batches 1,32 --contexts 16384 "$@" --json "$OUT/h200_stack_$tag.json" \
    >"$OUT/stack_$tag.log" 2>&1; echo "stack $tag rc=$?"; grep "^stack_decode\|Error" "$OUT/stack_$tag.log" | head -8
}
run_topk new
run_stack new csa,mixed --profile 32:16384
if [ -d "$OLD_CSRC" ]; then
  cp -r csrc /tmp/csrc_tree && cp "$OLD_CSRC"/* csrc/
  python3 -m pip install -q --no-build-isolation --no-deps -e . -Ccmake.define.DSV4_CUDA=ON >"$OUT/build_old.log" 2>&1 \
    && { echo "old build: ok"; run_topk old; run_stack old csa; } || tail -20 "$OUT/build_old.log"
  cp /tmp/csrc_tree/* csrc/
fi
echo "total: $(( $(date +%s) - t0 )) s"
