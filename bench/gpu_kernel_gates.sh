#!/usr/bin/env bash
# One H200 call for the correctness gates of the GPU-only code paths (issue 9): build, the
# Pallas kernels' tests (the sparse attention kernel: Triton against the XLA path at V4-Flash
# sizes, decode and prefill, the forced and the CUDA-default blocks, float32 within 2e-5, bf16
# reported, the whole layer with the kernel against the layer without; the compressor's decode
# pooling against its XLA twin, alone and in the layer), then the golden replays in mode none
# and the execution-mode agreement on the GPU (the queries' and the output's in-place rope
# update runs only on the GPU, `backend.in_place_updates`). KERNEL_K selects kernel tests
# (pytest -k); GOLDEN=0 skips the golden replays and mode agreement.
#                                                      device run:  bash bench/gpu_kernel_gates.sh
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
source "$(dirname "$0")/gpu_build.sh"
timeout ${KERNEL_TIMEOUT:-450} python3 -m pytest -q -s -p no:cacheprovider --durations=8 \
  tests/test_sparse_attention_kernel.py tests/test_compressor_kernel.py ${KERNEL_K:+-k "$KERNEL_K"} >"$OUT/gpu_tests_kernel.log" 2>&1
echo "kernel tests rc=$?"
grep -E "bf16|passed|failed|FAILED|Error" "$OUT/gpu_tests_kernel.log" | tail -24
if [ "${GOLDEN:-1}" = 1 ]; then
  timeout ${GOLDEN_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_attention.py \
    -k "(golden and none) or agree_on_csa" >"$OUT/gpu_tests_golden.log" 2>&1; echo "golden + agreement tests rc=$?"
  grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_golden.log" | tail -8
fi
echo "total: $(( $(date +%s) - t0 )) s"
