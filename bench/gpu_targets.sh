#!/usr/bin/env bash
# One H200 call for issue 9's target table as the package stands: build; the prefill stacks
# (PREFILL_STACKS, default csa; 4k and 16k) as an A/B of the package default against
# --prefill-blocks OLD_BLOCKS (ORDER, default "default old default"; OLD_BLOCKS default
# 64,64,8,3,0 = the prefill default before skip_masked_blocks); the decode stacks at B = 1, 32
# and 2k, 16k (CSA x4, HCA x4; the package default, one process; on the same buffers every step,
# as a model's device-side decode loop runs them: SAME_BUFFERS=all, the default; SAME_BUFFERS=
# for the usual steps, new positions and a new output each step); the module call against the
# jitted step (flash CSA decode). PREFILL=0 / DECODE=0 / CALL=0 leave a part out. The decode
# stacks' optimized programs go through bench/hlo_census.py (copies, conditionals, thunks by kind:
# h200_hlo_census.json, the table in logs/hlo_census.md, the programs in logs/decode_hlo.tgz;
# HLO_DUMP=0 leaves it out).
#                                                      device run:  bash bench/gpu_targets.sh
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
PROF="--xla_enable_command_buffers_during_profiling=true"
source "$(dirname "$0")/gpu_build.sh"
mkdir -p "$OUT/logs"
if [ "${PREFILL:-1}" = 1 ]; then
  tag_flags() {  # default: the package's blocks; old: OLD_BLOCKS for every prefill the kernel runs
    case $1 in old) echo "--prefill-blocks ${OLD_BLOCKS:-64,64,8,3,0}" ;; esac
  }
  source "$(dirname "$0")/gpu_stack_ab.sh"
  ORDER=${ORDER:-default old default} stack_ab stack_prefill_targets stack_prefill "csa/prefill:4096" \
    --stacks "${PREFILL_STACKS:-csa}" --prefills "${PREFILLS:-4096,16384}"
fi
if [ "${DECODE:-1}" = 1 ]; then
  SB=${SAME_BUFFERS-all}
  DUMP=""; [ "${HLO_DUMP:-1}" = 1 ] && DUMP="--xla_dump_to=/tmp/dsv4_hlo_dump --xla_dump_hlo_module_re=.*stack_step.*"
  rm -rf /tmp/dsv4_hlo_dump
  XLA_FLAGS="$PROF $DUMP" timeout ${STACK_TIMEOUT:-200} python3 bench/stack.py --size flash --scenarios stack_decode \
    --stacks "${DECODE_STACKS:-csa,hca}" --batches "${BATCHES:-1,32}" --contexts "${CONTEXTS:-2048,16384}" \
    ${SB:+--same-buffers $SB} ${DECODE_ARGS:-} --json "$OUT/h200_stack_decode_targets.json" >"$OUT/logs/decode.log" 2>&1
  echo "decode stacks rc=$? ($(( $(date +%s) - t0 )) s)"; grep "^stack_decode\|Error" "$OUT/logs/decode.log" | head -10
  if [ -n "$DUMP" ]; then
    python3 bench/hlo_census.py /tmp/dsv4_hlo_dump --json "$OUT/h200_hlo_census.json" >"$OUT/logs/hlo_census.md" 2>&1
    cat "$OUT/logs/hlo_census.md"
    # The optimized programs themselves, for what the census does not say (which op a kernel is).
    (cd /tmp/dsv4_hlo_dump && tar czf "$OUT/logs/decode_hlo.tgz" ./*after_optimizations.txt ./*thunk_sequence.txt 2>/dev/null)
    rm -rf /tmp/dsv4_hlo_dump
  fi
fi
if [ "${CALL:-1}" = 1 ]; then
  timeout ${CALL_TIMEOUT:-90} python3 bench/stack.py --size flash --call-overhead-only --call-overhead-size flash \
    --json "$OUT/h200_call_overhead.json" >"$OUT/logs/call_overhead.log" 2>&1
  echo "call overhead rc=$?"; tail -2 "$OUT/logs/call_overhead.log"
fi
(cd "$OUT" && tar czf logs.tar.gz logs && rm -rf logs)
echo "total: $(( $(date +%s) - t0 )) s"
