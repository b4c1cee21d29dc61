# Sourced by the bench/gpu_*.sh device scripts after gpu_build.sh: stack_ab NAME SCENARIO PROFILE
# ARGS... runs `bench/stack.py --size flash --scenarios SCENARIO ARGS...` once per tag of ORDER
# (default "kernel xla kernel"), one process each, with the flags the caller's
# `tag_flags TAG` prints; records $OUT/h200_NAME_<i>_<tag>.json and logs under $OUT/logs. The
# first run also profiles PROFILE (or $PROFILE) and dumps the thunk sequences: the Pallas
# kernel's lines show whether it runs inside a CUDA graph (indented = recorded into one).
stack_ab() {
  local name=$1 scenario=$2 profile=$3 i=0 tag extra flags
  shift 3
  for tag in ${ORDER-kernel xla kernel}; do
    i=$((i + 1)); extra="$(tag_flags "$tag")"; flags="$PROF"
    if [ $i = 1 ]; then
      extra="$extra --profile ${PROFILE:-$profile}"
      flags="$flags --xla_dump_to=/tmp/${name}_dump --xla_dump_hlo_module_re=.*stack_step.*"
    fi
    # shellcheck disable=SC2086  # $extra holds several flags
    XLA_FLAGS="$flags" timeout "${STACK_TIMEOUT:-150}" python3 bench/stack.py --size flash --scenarios "$scenario" \
      "$@" $extra --json "$OUT/h200_${name}_${i}_$tag.json" >"$OUT/logs/stack_${i}_$tag.log" 2>&1
    echo "$i $tag rc=$? ($(( $(date +%s) - t0 )) s)"; grep "^$scenario\|Error" "$OUT/logs/stack_${i}_$tag.log" | head -6
    if [ $i = 1 ]; then
      grep -n "sparse_attention_kernel" /tmp/"${name}"_dump/*thunk_sequence_after_thunk_passes.txt 2>/dev/null | head -4
      (cd /tmp/"${name}"_dump 2>/dev/null && tar czf "$OUT/logs/thunks.tar.gz" $(ls | grep thunk_sequence_after_thunk_passes)) \
        || true
    fi
  done
}
