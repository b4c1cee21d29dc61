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
i=0
for tag in ${ORDER-kernel xla kernel}; do
  i=$((i + 1)); extra=""; flags="$PROF"
  [ "$tag" = xla ] && extra="--no-decode-kernel"
  [ "$tag" = forced ] && extra="--decode-kernel"
  if [ $i = 1 ]; then
    extra="$extra --profile ${PROFILE:-hca/32:16384,csa/prefill:4096}"
    flags="$flags --xla_dump_to=/tmp/dk_dump --xla_dump_hlo_module_re=.*stack_step.*"
  fi
  XLA_FLAGS="$flags" timeout ${STACK_TIMEOUT:-170} python3 bench/stack.py --size flash --scenarios stack_decode \
    --stacks "${STACKS:-csa,hca}" --batches "${BATCHES:-1,32}" --contexts "${CONTEXTS:-16384}" $extra \
    --json "$OUT/h200_stack_decode_kernel_${i}_$tag.json" >"$OUT/logs/stack_${i}_$tag.log" 2>&1
  echo "$i $tag rc=$? ($(( $(date +%s) - t0 )) s)"; grep "^stack_decode\|Error" "$OUT/logs/stack_${i}_$tag.log" | head -6
  if [ $i = 1 ]; then  # the kernel's place in the thunk sequences: indented = recorded into a graph
    grep -n "sparse_attention_kernel\|^[0-9]*: k" /tmp/dk_dump/*thunk_sequence_after_thunk_passes.txt 2>/dev/null \
      | grep -B1 -A0 "sparse_attention_kernel" | head -12
    (cd /tmp/dk_dump 2>/dev/null && tar czf "$OUT/logs/thunks.tar.gz" $(ls | grep thunk_sequence_after_thunk_passes)) || true
  fi
done
(cd "$OUT" && tar czf logs.tar.gz logs && rm -rf logs)
echo "total: $(( $(date +%s) - t0 )) s"
