#!/usr/bin/env bash
# One H200 call: the V4-Flash stacks of the working tree against the same tree with some files
# replaced by saved versions (A/B of a Python or csrc/ change in one session, on one machine).
#   AB_DIR   files at their paths relative to the repository root (default build/ab_old: carry it)
#   ORDER    tags in the order they run, "new" = the tree, "old" = with AB_DIR's files, any other
#            tag T = with build/ab_T's files (carry those too) (default "new old new": a drift of
#            the machine shows as two different "new" rows)
#   STACKS, BATCHES, CONTEXTS: bench/stack.py's --stacks / --batches / --contexts (csa / 1,32 / 16384)
#   PROFILE  B:CTX (e.g. 32:16384): every run also profiles that case of its first stack (kernels by
#            stage in its JSON and log; bench/stack.py keeps command buffers on while profiling)
#   FLAGS_T  extra XLA flags for the runs of tag T (e.g. FLAGS_nomerge="--xla_disable_hlo_passes=dot-merger"
#            with ORDER="new nomerge new": a tag with no build/ab_T directory runs the tree as it is)
#   ARGS_T   extra bench/stack.py arguments for the runs of tag T (e.g. ARGS_nock="--no-compress-kernel")
#                                   device run:  bash bench/gpu_tree_ab.sh    (records in $OUT)
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
AB_DIR=${AB_DIR:-build/ab_old}
source "$(dirname "$0")/gpu_build.sh"
ORDER=${ORDER:-new old new}
variant_dir() {  # the files a tag swaps in: none for "new" and for a tag without its directory
  local d; case $1 in new) d="" ;; old) d="$AB_DIR" ;; *) d="build/ab_$1" ;; esac
  if [ -n "$d" ] && [ -d "$d" ]; then echo "$d"; fi
}
saved=/tmp/ab_tree_saved; rm -rf "$saved"; mkdir -p "$saved"
for tag in $ORDER; do  # the tree's own version of every file some variant replaces
  d=$(variant_dir "$tag"); [ -n "$d" ] || continue
  (cd "$d" && find . -type f) | while read -r f; do mkdir -p "$saved/$(dirname "$f")"; cp "$f" "$saved/$f"; done
done
use() {  # $1: a tag of ORDER
  (cd "$saved" && find . -type f) | while read -r f; do cp "$saved/$f" "$f"; done
  local d; d=$(variant_dir "$1")
  if [ -n "$d" ]; then (cd "$d" && find . -type f) | while read -r f; do cp "$d/$f" "$f"; done; fi
  if (cd "$saved" && find . -type f) | grep -q "^./csrc/"; then
    python3 -m pip install -q --no-build-isolation --no-deps -e . -Ccmake.define.DSV4_CUDA=ON >"$OUT/build_$1.log" 2>&1
  fi
}
i=0
for tag in $ORDER; do
  i=$((i + 1)); use "$tag"
  extra_flags=$(eval echo "\${FLAGS_$tag:-}"); extra_args=$(eval echo "\${ARGS_$tag:-}")
  # XLA reads a non-empty XLA_FLAGS that does not start with "--" as a file name: a lone
  # space (no flags anywhere) must become no variable at all.
  xla_flags=$(echo ${XLA_FLAGS:-} $extra_flags)
  ( if [ -n "$xla_flags" ]; then export XLA_FLAGS="$xla_flags"; else unset XLA_FLAGS; fi
    timeout ${STACK_TIMEOUT:-120} python3 bench/stack.py $extra_args ${PROFILE:+--profile $PROFILE} --size flash --scenarios stack_decode --stacks "${STACKS:-csa}" \
      --batches "${BATCHES:-1,32}" --contexts "${CONTEXTS:-16384}" --json "$OUT/h200_stack_ab_${i}_$tag.json" \
      >"$OUT/stack_ab_${i}_$tag.log" 2>&1 )
  echo "$i $tag rc=$?"; grep "^stack_decode\|Error" "$OUT/stack_ab_${i}_$tag.log" | head -6
done
use new
echo "ab total: $(( $(date +%s) - t0 )) s"
