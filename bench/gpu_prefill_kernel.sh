#!/usr/bin/env bash
# One H200 call for the Pallas sparse attention kernel run per query (prefill; issue 9): build,
# the kernel's prefill parity tests on the GPU (TESTS_K, default the V4-Flash-size prefill cases:
# Triton against the XLA path, float32 within 2e-5, bf16 reported), the operation alone (bench/decode_kernel.py
# --phases prefill: block shapes against the XLA path at a 4k prompt), then the prefill stacks
# (4k, 16k; CSA x4, HCA x4) in one machine: ORDER (default "kernel xla kernel"): "kernel" =
# --prefill-kernel with the fastest blocks of the operation's sweep, "xla" = --no-prefill-kernel,
# "default" = the package's default; a profile of the CSA prefill in the first run. TESTS=0
# skips the tests; MICRO=0 the sweep (then BLOCKS=bk,bh,warps,stages[,skip] or the kernel's forced blocks).
# DECODE_AB=1 adds one-row decode stacks (16k): the package default, then --no-decode-kernel.
#                                                    device run:  bash bench/gpu_prefill_kernel.sh
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
PROF="--xla_enable_command_buffers_during_profiling=true"
source "$(dirname "$0")/gpu_build.sh"
mkdir -p "$OUT/logs"
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -s -p no:cacheprovider tests/test_sparse_attention_kernel.py \
    -k "${TESTS_K:-flash_sizes and prefill}" >"$OUT/logs/tests.log" 2>&1; echo "kernel tests rc=$?"
  grep -E "bf16|passed|failed|FAILED|Error" "$OUT/logs/tests.log" | tail -24
fi
BLOCKS=${BLOCKS:-}
if [ "${MICRO:-1}" = 1 ]; then
  timeout ${MICRO_TIMEOUT:-150} python3 bench/decode_kernel.py --phases prefill --json "$OUT/h200_prefill_kernel.json" \
    ${MICRO_ARGS:-} >"$OUT/logs/prefill_kernel.log" 2>&1; echo "prefill kernel bench rc=$?"
  grep "^|" "$OUT/logs/prefill_kernel.log" | tail -20
  # The fastest blocks over both layer kinds (sum of their times) for the stacks.
  BLOCKS=$(python3 - "$OUT/h200_prefill_kernel.json" <<'PY' || true
import json, sys, collections
recs = json.load(open(sys.argv[1]))["records"]
total = collections.Counter()
kinds = {r["kind"] for r in recs}
for r in recs:
    if r["impl"].startswith("kernel") and "op_us" in r:
        total[r["impl"]] += r["op_us"]
ok = [i for i in total if sum(r["impl"] == i and "op_us" in r for r in recs) == len(kinds)]
best = min(ok, key=total.get)
print(",".join(v.split("=")[1] if "=" in v else "1" for v in best.split()[1:]))  # "skip" -> 1
PY
)
  echo "fastest blocks: ${BLOCKS:-none}"
fi
tag_flags() {  # ORDER's tags: kernel = forced with the sweep's fastest blocks, xla = the XLA path, default = none
  case $1 in xla) echo "--no-prefill-kernel" ;; kernel) echo "--prefill-kernel ${BLOCKS:+--prefill-blocks $BLOCKS}" ;; esac
}
source "$(dirname "$0")/gpu_stack_ab.sh"
stack_ab stack_prefill_kernel stack_prefill "csa/prefill:4096" \
  --stacks "${STACKS:-csa,hca}" --prefills "${PREFILLS:-4096,16384}"
if [ "${DECODE_AB:-0}" = 1 ]; then
  for tag in default xla; do
    extra=""; [ "$tag" = xla ] && extra="--no-decode-kernel"
    timeout ${STACK_TIMEOUT:-150} python3 bench/stack.py --size flash --scenarios stack_decode --stacks csa,hca \
      --batches 1 --contexts 16384 $extra --json "$OUT/logs/h200_stack_decode_$tag.json" >"$OUT/logs/decode_$tag.log" 2>&1
    echo "decode $tag rc=$? ($(( $(date +%s) - t0 )) s)"; grep "^stack_decode\|Error" "$OUT/logs/decode_$tag.log" | head -4
  done
fi
(cd "$OUT" && tar czf logs.tar.gz logs && rm -rf logs)
echo "total: $(( $(date +%s) - t0 )) s"
