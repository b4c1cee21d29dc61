#!/usr/bin/env bash
# One H200 call for the Pallas sparse decode kernel (issue 9): build, the kernel's parity tests
# on the GPU (Triton against the XLA path at V4-Flash sizes, float32 within 2e-5, bf16 reported),
# the operation alone (bench/decode_kernel.py: block sizes against the XLA path; MICRO_ARGS),
# then the stacks in one machine (ORDER, default "kernel xla kernel": "kernel" = the package's
# default (the kernel for one-row CSA/HCA decode), "xla" = --no-decode-kernel, "forced" =
# --decode-kernel; ORDER="" skips them), with profiles of the HCA stack at B = 32 and a CSA
# prefill of 4k and the kernel's place in the thunks (inside a CUDA graph or not) in the first
# run. TESTS=0 skips the tests.
#                                                    device run:  bash bench/gpu_decode_kernel.sh
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
PROF="--xla_enable_command_buffers_during_profiling=true"
source "$(dirname "$0")/gpu_build.sh"
mkdir -p "$OUT/logs"
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -s -p no:cacheprovider tests/test_sparse_attention_kernel.py \
    >"$OUT/logs/tests.log" 2>&1; echo "kernel tests rc=$?"
  grep -E "bf16|passed|failed|FAILED|Error" "$OUT/logs/tests.log" | tail -14
fi
timeout ${MICRO_TIMEOUT:-150} python3 bench/decode_kernel.py --json "$OUT/h200_decode_kernel.json" ${MICRO_ARGS:-} \
  >"$OUT/logs/decode_kernel.log" 2>&1; echo "decode kernel bench rc=$?"; grep "^|" "$OUT/logs/decode_kernel.log" | tail -25
tag_flags() {  # ORDER's tags: kernel = the package default, xla = the XLA path, forced = the kernel everywhere
  case $1 in xla) echo "--no-decode-kernel" ;; forced) echo "--decode-kernel" ;; esac
}
source "$(dirname "$0")/gpu_stack_ab.sh"
STACK_TIMEOUT=${STACK_TIMEOUT:-170} stack_ab stack_decode_kernel stack_decode "hca/32:16384,csa/prefill:4096" \
  --stacks "${STACKS:-csa,hca}" --batches "${BATCHES:-1,32}" --contexts "${CONTEXTS:-16384}"
(cd "$OUT" && tar czf logs.tar.gz logs && rm -rf logs)
echo "total: $(( $(date +%s) - t0 )) s"
