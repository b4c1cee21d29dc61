#!/usr/bin/env bash
# The H200 entry point: one device call, one or more subcommands run in order after one build
# (bench/gpu_build.sh: the package with its CUDA handlers). Records and logs go under $OUT.
#
#   gates     the GPU-only tests: every Pallas kernel (forward and backward) against its XLA
#             reference at V4-Flash sizes, the gradients with the Triton kernels against the CPU's
#             (GATES_K: pytest -k), then the golden replays (the official recording's too), the break
#             modes' agreement and the FP8 caches' bit-exactness (GOLDEN=0: not)
#   train     bench/train.py --size flash $TRAIN_ARGS -> $OUT/train$TRAIN_TAG.json (with build/peer_wheels
#             carried, MaxText's training mode beside ours: --peer maxtext where it imports)
#   stack     bench/stack.py --size flash $STACK_ARGS -> $OUT/stack$STACK_TAG.json
#   run       bench/run.py --size flash $RUN_ARGS -> $OUT/run$RUN_TAG.json
#   topk      bench/topk.py $TOPK_ARGS: the selection alone, device time -> $OUT/topk$TOPK_TAG.json
#   sharded   (kind nvidia-h200-x2) bench/sharded.py --size flash $SHARDED_ARGS -> $OUT/h200x2_sharded.json,
#             with the command-buffer pass's log and XLA's thunk dumps (which collectives run in graphs)
#   maxtext   the MaxText and HF peers beside `none` (bench/run.py --peers hf-torch,maxtext-jax), from
#             wheel folders carried with the call (PEER_WHEELS, default build/peer_wheels; HF_WHEELS,
#             default build/hf_wheels; made here with internet: docs/benchmarks.md); LAYERS, BATCHES
#   overlap   the overlap A/B (dsv4_jax.step.overlap) in one call: bench/stack.py's decode stacks with each
#             setting in turn per shape (OVERLAPS, default "on,off"; STACKS, BATCHES, CONTEXTS) and the
#             module call -> $OUT/overlap_stack.json; then the PR-like decode (bench/run.py decode_pr,
#             MODES, PR_BATCHES) in one process per setting, ORDER (default "on off on")
#   fp8       FP8 caches (dsv4_jax.cache.quantized): their GPU tests (bit for bit against the bf16
#             cache), then the decode stacks with --numerics official and each cache format in turn
#             per shape (KV_DTYPES, default "auto,fp8"; STACKS, BATCHES, CONTEXTS) -> $OUT/fp8_stack.json
#   ab        bench/stack.py's decode stacks of the tree against the tree with files swapped in, one
#             process per variant on one machine: ORDER (default "new old new"), AB_DIR (the files of
#             "old" at their paths, default build/ab_old; any other tag T: build/ab_T), STACKS,
#             BATCHES, CONTEXTS, ARGS_T (stack.py arguments of tag T), FLAGS_T (XLA flags of tag T),
#             STACK_TIMEOUT (a process's limit; default 30 s + 10 s a case);
#             AUTOTUNE_DUMP=1: XLA's autotuning results per process -> $OUT/autotune_<i>_<tag>.textproto
#             (bench/deviceless.py --autotune compiles with them on a machine without the GPU)
#   census    bench/deviceless.py --target attached: the launches of the decode stacks' programs as
#             compiled here (autotuned), by stage and in a chain -> $OUT/census_attached.json (the CPU's
#             deviceless census of the same cases is in bench/results/deviceless_census_*.json)
#   finite    the finite check's verdict by the step's flag (dsv4_jax.step.finite_flag): its tests with the
#             CUDA handler, then the module call with each finite-check way against the jitted step
#             (bench/stack.py --call-overhead-only, flash CSA decode B = 1) -> $OUT/call_overhead.json
#   loops     the decode loops side by side in one process (issue 68; bench/loops.py): same_buffers, usual,
#             own_jit (nnx.jit of the module calls), own_jit_fast (dsv4_jax.jit_modules), module_calls, per
#             (stack, B, context): STACKS (default csa,hca), BATCHES (1,8,32), CONTEXTS (2048,16384,131072),
#             LOOPS_ARGS (more bench/loops.py arguments); no cell starts past LOOPS_DEADLINE s (default 410),
#             LOOPS_TIMEOUT (default 470) -> $OUT/loops.json, $OUT/loops.log; ~20 s a cell on the H200
#   paged     paged caches against contiguous ones and an S-token verification step against a decode step,
#             side by side in one process (issue 67; bench/paged.py): per (stack, B, context) the contiguous
#             cache and the same values in scattered pages of 256 tokens, one token a row, and at
#             QUERY_BATCHES (default 8) x QUERY_CONTEXTS (16384,131072) also 4 a row; STACKS (csa,hca),
#             BATCHES (1,8,32), CONTEXTS (16384,131072,1048576), PAGED_ARGS (more bench/paged.py arguments;
#             --paged-kernel: the paged cache also with the decode kernel forced; --page-order in-order: each
#             row's pages one after another in the pool, not a random order; --profile /tmp/paged_trace:
#             each variant's device time by stage, compared in the tables); no cell starts past
#             PAGED_DEADLINE s (default 400), PAGED_TIMEOUT (default 470) -> $OUT/paged.json, $OUT/paged.log.
#             PAGED_SCENARIO (default decode: the above) =prefix: a 64k prompt whose first 60k tokens are a
#             forked prefix, fork + the 4k suffix against the whole prompt's prefill, B = 1, STACKS (csa,hca;
#             ~1 min a stack), PAGED_ARGS (--prompt-len, --prefix-len, --prefill-chunk, --pool-rows, --repeats: 5);
#             =memory: the bytes of ragged rows in pages against contiguous rows (a count, no timing; the
#             CPU gives the same) -> $OUT/paged_<scenario>.json, .log; no stack or repeat starts past
#             PAGED_DEADLINE s (default 180), PAGED_TIMEOUT (default 240)
#   repro     the same bits in every process? bench/reproducibility.py three times with the defaults,
#             three times with deterministic=True (REPRO_ARGS), one process after another ->
#             $OUT/repro_<setting>_<i>.json and the summary $OUT/reproducibility.json
#   kernels   Nsight Compute on named kernels of one command (ncu's detailed set, clocks left alone): per
#             regex of NCU_KERNELS (on the demangled names; default the CSA scoring kernel on contiguous
#             and on paged keys) one launch after NCU_SKIP (default 4: the first step of a 4-layer stack) of
#             NCU_CMD (default bench/paged.py's CSA cell, B = 8 at 1M, one token a row) without command
#             buffers -> $OUT/ncu_<i>.ncu-rep, its details $OUT/ncu_<i>.txt and the headline metrics side by side
#   trainab   the same for the training step: bench/train.py --size flash $TRAIN_ARGS $ARGS_T per variant,
#             ORDER and the swapped files as in ab -> $OUT/train_ab_<i>_<tag>.json; AUTOTUNE_DUMP=1 also
#             writes what XLA's autotuner chose in each process -> $OUT/autotune_<i>_<tag>.textproto (the
#             processes of one tree differ: compare a slow one's with a fast one's)
#
# e.g. TRAIN_ARGS="--stacks csa,hca --batches 1,4 --lengths 4096,16384" bash bench/gpu.sh gates train
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
source "$(dirname "$0")/gpu_build.sh"

repro() {
  local files=()
  for setting in default deterministic; do
    for i in 1 2 3; do
      local flag=""; [ "$setting" = deterministic ] && flag="--deterministic"
      timeout "${REPRO_TIMEOUT:-150}" python3 bench/reproducibility.py --size flash $flag ${REPRO_ARGS:-} \
        --json "$OUT/repro_${setting}_$i.json" >"$OUT/repro_${setting}_$i.log" 2>&1
      echo "repro $setting $i rc=$? $(grep -o '"digest": "[0-9a-f]\{12\}' "$OUT/repro_${setting}_$i.json" 2>/dev/null)"
      [ -f "$OUT/repro_${setting}_$i.json" ] && files+=("$OUT/repro_${setting}_$i.json")
    done
  done
  python3 bench/reproducibility.py --summarize "${files[@]}" --json "$OUT/reproducibility.json"
}

gates() {
  timeout "${GATES_TIMEOUT:-420}" python3 -m pytest -q -s -p no:cacheprovider --durations=10 \
    tests/ops/test_sparse_attention_backward.py tests/ops/test_sparse_attention_backward_wgmma.py tests/step/test_gradients.py \
    tests/ops/test_sparse_attention_kernel.py \
    tests/ops/test_compressor_kernel.py tests/ops/test_indexer_kernel.py tests/ops/test_head_norm_kernel.py \
    tests/ops/test_projection_kernel.py tests/ops/test_split_merge_kernel.py ${GATES_K:+-k "$GATES_K"} \
    >"$OUT/gpu_gates.log" 2>&1
  echo "kernel gates rc=$?"
  grep -E "bf16|passed|failed|FAILED|Error" "$OUT/gpu_gates.log" | tail -40
  if [ "${GOLDEN:-1}" = 1 ]; then
    timeout "${GOLDEN_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/layer/test_attention.py \
      tests/test_numerics.py tests/cache/test_quantized_cache.py -k "(golden and none) or agree_on_csa or official_golden or gpu_fp8" \
      >"$OUT/gpu_golden.log" 2>&1
    echo "golden replays + mode agreement rc=$?"
    grep -E "passed|failed|FAILED|Error" "$OUT/gpu_golden.log" | tail -8
  fi
}

train() {
  # With the peers' wheels carried (build/peer_wheels), MaxText's training mode runs beside ours
  # (bench/train.py's --peer maxtext, its default where maxtext imports).
  local site=""
  [ -d "${PEER_WHEELS:-build/peer_wheels}" ] && site=$(install_peers)
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" timeout "${TRAIN_TIMEOUT:-480}" python3 bench/train.py --size flash \
    --json "$OUT/train${TRAIN_TAG:-}.json" ${TRAIN_ARGS:-} 2>&1 | tail -40
}

stack() {
  timeout "${STACK_TIMEOUT:-480}" python3 bench/stack.py --size flash --json "$OUT/stack${STACK_TAG:-}.json" \
    ${STACK_ARGS:-} 2>&1 | tail -40
}

run() {
  timeout "${RUN_TIMEOUT:-480}" python3 bench/run.py --size flash --no-progress --json "$OUT/run${RUN_TAG:-}.json" \
    ${RUN_ARGS:-} 2>&1 | tail -40
}

topk() {
  XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true" timeout "${TOPK_TIMEOUT:-300}" \
    python3 bench/topk.py --device-time --repeats 10 --json "$OUT/topk${TOPK_TAG:-}.json" ${TOPK_ARGS:-} 2>&1 | tail -30
}

sharded() {
  # NVLink multicast stays off (the machine's rule; the image sets these, a child keeps them).
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  nvidia-smi topo -m >"$OUT/topo.txt" 2>&1
  local dump=/tmp/sharded_xla_dump; rm -rf "$dump"
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=3 \
    timeout "${SHARDED_TIMEOUT:-420}" python3 bench/sharded.py --size flash --xla-dump "$dump" \
    --vlog "$OUT/sharded_stderr.log" --json "$OUT/h200x2_sharded.json" ${SHARDED_ARGS:-} \
    >"$OUT/sharded.log" 2>"$OUT/sharded_stderr.log"
  echo "sharded rc=$?"
  grep -v "^|" "$OUT/sharded.log" | tail -45
  ( cd "$dump" 2>/dev/null && tar czf "$OUT/sharded_thunks.tar.gz" $(ls | grep thunk_sequence_after_thunk_passes) ) || true
  gzip -9 -c "$OUT/sharded_stderr.log" >"$OUT/sharded_stderr.log.gz" && rm -f "$OUT/sharded_stderr.log"
}

install_peers() {
  # The device has no internet: the peers' packages come as carried wheels, installed without
  # dependency resolution into a folder on PYTHONPATH (jax, flax and torch are the box's own).
  # Prints that folder's absolute path; what pip said goes to $OUT/peer_install.log.
  local site=build/peer_site dir
  for dir in "${PEER_WHEELS:-build/peer_wheels}" "${HF_WHEELS:-build/hf_wheels}"; do
    [ -d "$dir" ] || { echo "$dir: not carried" >&2; continue; }
    python3 -m pip install -q --upgrade --no-index --no-deps --target "$site" "$dir"/*.whl \
      >>"$OUT/peer_install.log" 2>&1; echo "install $dir rc=$?" >&2
  done
  echo "$PWD/$site"
}

maxtext() {
  local site; site=$(install_peers)
  local name="h200_flash_maxtext_${LAYERS:-csa_hca}"; name=${name/,/_}
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 \
    timeout "${MAXTEXT_TIMEOUT:-500}" python3 bench/run.py --size flash --layers "${LAYERS:-csa,hca}" --modes none \
    --batches "${BATCHES:-1,8,32}" --peers hf-torch,maxtext-jax --hf-mem-gb 30 --no-cmdbuf --no-ceilings \
    --no-progress --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  echo "maxtext rc=$?"
  grep -v "NO-OP\|RequestsDependency\|warnings.warn\|WARNING:absl\|^ *$" "$OUT/$name.log" | tail -40
}

overlap() {
  timeout "${STACK_TIMEOUT:-420}" python3 bench/stack.py --size flash --scenarios stack_decode --same-buffers all \
    --stacks "${STACKS:-csa,hca}" --batches "${BATCHES:-1,8,32}" --contexts "${CONTEXTS:-2048,16384,65536}" \
    --overlap "${OVERLAPS:-on,off}" --call-overhead --call-overhead-size flash --json "$OUT/overlap_stack.json" \
    >"$OUT/overlap_stack.log" 2>&1
  echo "overlap stacks rc=$?"; grep "^stack_decode\|^call_overhead\|Error" "$OUT/overlap_stack.log" | tail -40
  local i=0 setting
  for setting in ${ORDER:-on off on}; do
    i=$((i + 1))
    timeout "${RUN_TIMEOUT:-150}" python3 bench/run.py --size flash --scenarios decode_pr --layers csa,hca \
      --modes "${MODES:-none,narrow-device}" --batches "${PR_BATCHES:-1,32}" --no-peer --no-cmdbuf --no-ceilings \
      --no-progress --no-plot --overlap "$setting" --json "$OUT/overlap_pr_${i}_$setting.json" \
      >"$OUT/overlap_pr_${i}_$setting.log" 2>&1
    echo "PR-like $i $setting rc=$?"; grep "decode_pr\|Error" "$OUT/overlap_pr_${i}_$setting.log" | head -12
  done
}

fp8() {
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider tests/cache/test_quantized_cache.py -k gpu \
    >"$OUT/fp8_tests.log" 2>&1
  echo "fp8 tests rc=$?"; tail -3 "$OUT/fp8_tests.log"
  timeout "${STACK_TIMEOUT:-420}" python3 bench/stack.py --size flash --scenarios stack_decode --same-buffers all \
    --numerics official --kv-cache-dtype "${KV_DTYPES:-auto,fp8}" --stacks "${STACKS:-csa,hca}" \
    --batches "${BATCHES:-1,8}" --contexts "${CONTEXTS:-16384,131072,1048576}" --json "$OUT/fp8_stack.json" \
    >"$OUT/fp8_stack.log" 2>&1
  echo "fp8 stacks rc=$?"; grep "^stack_decode\|Error" "$OUT/fp8_stack.log" | tail -40
}

# The A/B variants' files: "new" is the tree, "old" AB_DIR (default build/ab_old), any other tag T
# build/ab_T (files at their paths). `ab_prepare ORDER` saves the tree's version of every file some
# variant replaces; `ab_use TAG` puts that variant's files in place (and rebuilds if csrc/ changed).
ab_saved=/tmp/ab_tree_saved
ab_variant_dir() {
  local d
  case $1 in new) d="" ;; old) d="${AB_DIR:-build/ab_old}" ;; *) d="build/ab_$1" ;; esac
  if [ -n "$d" ] && [ -d "$d" ]; then echo "$d"; fi
}
ab_prepare() {
  local tag d f
  rm -rf "$ab_saved"; mkdir -p "$ab_saved"
  for tag in $1; do
    d=$(ab_variant_dir "$tag"); [ -n "$d" ] || continue
    (cd "$d" && find . -type f) | while read -r f; do mkdir -p "$ab_saved/$(dirname "$f")"; cp "$f" "$ab_saved/$f"; done
  done
}
ab_use() {
  local d f
  (cd "$ab_saved" && find . -type f) | while read -r f; do cp "$ab_saved/$f" "$f"; done
  d=$(ab_variant_dir "$1")
  if [ -n "$d" ]; then (cd "$d" && find . -type f) | while read -r f; do cp "$d/$f" "$f"; done; fi
  if (cd "$ab_saved" && find . -type f) | grep -q "^./csrc/"; then
    python3 -m pip install -q --no-build-isolation --no-deps -e . -Ccmake.define.DSV4_CUDA=ON >"$OUT/build_$1.log" 2>&1
  fi
}

ab() {
  local order=${ORDER:-new old new} tag i=0 cases
  # A process's limit by default: ~30 s to start, ~10 s a case (compile ~4 s, then the timed steps).
  cases=$(( $(echo "${STACKS:-csa}" | tr ',' ' ' | wc -w) * $(echo "${BATCHES:-1,32}" | tr ',' ' ' | wc -w) \
            * $(echo "${CONTEXTS:-16384}" | tr ',' ' ' | wc -w) ))
  ab_prepare "$order"
  for tag in $order; do
    i=$((i + 1)); ab_use "$tag"
    local extra_flags extra_args xla_flags
    extra_flags=$(eval echo "\${FLAGS_$tag:-}"); extra_args=$(eval echo "\${ARGS_$tag:-}")
    # XLA reads a non-empty XLA_FLAGS that does not start with "--" as a file name.
    xla_flags=$(echo ${XLA_FLAGS:-} $extra_flags)
    if [ "${AUTOTUNE_DUMP:-0}" = 1 ]; then  # what XLA's autotuner chose (bench/deviceless.py --autotune)
      xla_flags=$(echo $xla_flags --xla_gpu_dump_autotune_results_to="$OUT/autotune_${i}_$tag.textproto")
    fi
    ( if [ -n "$xla_flags" ]; then export XLA_FLAGS="$xla_flags"; else unset XLA_FLAGS; fi
      timeout "${STACK_TIMEOUT:-$(( 30 + 10 * cases ))}" python3 bench/stack.py $extra_args --size flash --scenarios stack_decode \
        --stacks "${STACKS:-csa}" --batches "${BATCHES:-1,32}" --contexts "${CONTEXTS:-16384}" \
        --json "$OUT/h200_stack_ab_${i}_$tag.json" >"$OUT/stack_ab_${i}_$tag.log" 2>&1 )
    echo "$i $tag rc=$?"; grep "^stack_decode\|Error" "$OUT/stack_ab_${i}_$tag.log" | head -20
  done
  ab_use new
}

trainab() {
  local order=${ORDER:-new old new} tag i=0 extra_args
  ab_prepare "$order"
  for tag in $order; do
    i=$((i + 1)); ab_use "$tag"
    extra_args=$(eval echo "\${ARGS_$tag:-}")
    ( if [ "${AUTOTUNE_DUMP:-0}" = 1 ]; then  # what XLA's autotuner chose, per process (variance hunts)
        export XLA_FLAGS=$(echo ${XLA_FLAGS:-} --xla_gpu_dump_autotune_results_to="$OUT/autotune_${i}_$tag.textproto")
      fi
      timeout "${TRAIN_TIMEOUT:-240}" python3 bench/train.py --size flash ${TRAIN_ARGS:-} $extra_args \
        --json "$OUT/train_ab_${i}_$tag.json" >"$OUT/train_ab_${i}_$tag.log" 2>&1 )
    echo "$i $tag rc=$?"; grep -v "^ *$" "$OUT/train_ab_${i}_$tag.log" | tail -8
  done
  ab_use new
}

census() {  # bench/deviceless.py's census of the H200's own (autotuned) programs, to hold the CPU's against
  timeout "${CENSUS_TIMEOUT:-400}" python3 bench/deviceless.py --target attached --scenario decode \
    --stacks csa,hca --batches 1,8,32 --json "$OUT/census_attached.json" 2>&1 | grep "^|" | tail -8
}

finite() {
  timeout "${FINITE_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider tests/step/test_finite_flag.py \
    tests/layer/test_call_path.py -k "finite" >"$OUT/gpu_finite.log" 2>&1
  echo "finite flag tests rc=$?"
  grep -E "passed|failed|FAILED|Error|Warning" "$OUT/gpu_finite.log" | tail -12
  timeout "${OVERHEAD_TIMEOUT:-240}" python3 bench/stack.py --call-overhead-only --call-overhead-size flash \
    --steps "${OVERHEAD_STEPS:-200}" --repeats 5 --json "$OUT/call_overhead.json" 2>&1 | tail -5
}

loops() {
  timeout "${LOOPS_TIMEOUT:-470}" python3 bench/loops.py --size flash --stacks "${STACKS:-csa,hca}" \
    --batches "${BATCHES:-1,8,32}" --contexts "${CONTEXTS:-2048,16384,131072}" --deadline-s "${LOOPS_DEADLINE:-410}" \
    --json "$OUT/loops.json" ${LOOPS_ARGS:-} >"$OUT/loops.log" 2>&1
  echo "loops rc=$?"
  # the table where the run finished, else the lines it printed as it went
  if grep -q "^| stack" "$OUT/loops.log"; then grep "^|" "$OUT/loops.log" | cut -d"|" -f2-9; else grep "^loops\|Error" "$OUT/loops.log" | cut -c1-140 | tail -90; fi
}

paged() {
  if [ "${PAGED_SCENARIO:-decode}" != decode ]; then paged_scenario "$PAGED_SCENARIO"; return; fi
  timeout "${PAGED_TIMEOUT:-470}" python3 bench/paged.py --size flash --stacks "${STACKS:-csa,hca}" \
    --batches "${BATCHES:-1,8,32}" --contexts "${CONTEXTS:-16384,131072,1048576}" \
    --query-batches "${QUERY_BATCHES:-8}" --query-contexts "${QUERY_CONTEXTS:-16384,131072}" \
    --deadline-s "${PAGED_DEADLINE:-400}" --json "$OUT/paged.json" ${PAGED_ARGS:-} >"$OUT/paged.log" 2>&1
  echo "paged rc=$?"
  # the table where the run finished, else the lines it printed as it went
  if grep -q "^| stack" "$OUT/paged.log"; then grep "^|" "$OUT/paged.log"; else grep "^paged\|Error" "$OUT/paged.log" | cut -c1-160 | tail -60; fi
}

# PAGED_SCENARIO=prefix|memory: bench/paged.py --scenario prefix|memory (the subcommand's comment above)
paged_scenario() {
  local name="paged_$1"
  timeout "${PAGED_TIMEOUT:-240}" python3 bench/paged.py --scenario "$1" --size flash --stacks "${STACKS:-csa,hca}" \
    --deadline-s "${PAGED_DEADLINE:-180}" --json "$OUT/$name.json" ${PAGED_ARGS:-} >"$OUT/$name.log" 2>&1
  echo "$name rc=$?"
  if grep -q "^| " "$OUT/$name.log"; then grep "^|" "$OUT/$name.log"; else grep "^$name\|Error" "$OUT/$name.log" | cut -c1-200 | tail -20; fi
}

kernels() {
  local ncu_bin cmd i=0 k
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
  [ -n "$ncu_bin" ] || { echo "kernels: no ncu on this machine"; return; }
  cmd=${NCU_CMD:-python3 bench/paged.py --size flash --stacks csa --batches 8 --contexts 1048576 --query-batches 8 \
    --query-contexts 1048576 --queries 1 --steps 2 --repeats 1}
  for k in ${NCU_KERNELS:-"ScoreKernelMma<64.*ContiguousRows" "ScoreKernelMma<64.*PagedRows"}; do
    i=$((i + 1))
    XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout "${NCU_TIMEOUT:-240}" "$ncu_bin" --clock-control none \
      --kernel-name-base demangled --kernel-name "regex:$k" --launch-skip "${NCU_SKIP:-4}" --launch-count 1 \
      --kill yes --set detailed -f -o "$OUT/ncu_$i" $cmd >"$OUT/ncu_$i.log" 2>&1
    echo "ncu $i ($k) rc=$?"; grep "==PROF==\|==ERROR==\|==WARNING==" "$OUT/ncu_$i.log" | head -5
    "$ncu_bin" --import "$OUT/ncu_$i.ncu-rep" --page details >"$OUT/ncu_$i.txt" 2>&1
    "$ncu_bin" --import "$OUT/ncu_$i.ncu-rep" --page raw --csv >"$OUT/ncu_$i.csv" 2>&1
  done
  # the headline rows of every report, one column per kernel
  python3 - "$OUT"/ncu_*.txt <<'PY'
import re, sys
keys = ("Duration", "Memory Throughput", "DRAM Throughput", "L2 Hit Rate", "L1/TEX Hit Rate", "Achieved Occupancy",
        "Registers Per Thread", "Executed Ipc Active", "Issue Slots Busy", "No Eligible", "Warp Cycles Per Issued Instruction",
        "Executed Instructions", "Mem Busy", "Max Bandwidth", "Block Limit Shared Mem", "Waves Per SM")
cols = []
for path in sys.argv[1:]:
    rows = {}
    for line in open(path, errors="replace"):
        m = re.match(r"\s{4}(\S.*?)\s{2,}(\S+)\s+(\S+)\s*$", line)
        if m and m.group(1) in keys and m.group(1) not in rows:
            rows[m.group(1)] = f"{m.group(3)} {m.group(2)}"
    cols.append((path, rows))
for key in keys:
    print(f"{key:36s}" + "".join(f"{c[1].get(key, '-'):>22s}" for c in cols))
# the warps' stall reasons (cycles a warp waits per issued instruction), largest first
import csv
stalls = []
for path, _ in cols:
    try:
        head, _units, *values = list(csv.reader(open(path[:-4] + ".csv")))
    except (OSError, ValueError):
        head, values = [], []
    row = dict(zip(head, values[0])) if values else {}
    pat = re.compile(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")
    stalls.append({m.group(1): float(v.replace(",", "")) for k, v in row.items()
                   if (m := pat.match(k)) and v.replace(",", "").replace(".", "", 1).isdigit()})
for reason in sorted(set().union(*stalls), key=lambda r: -max(s.get(r, 0) for s in stalls))[:12]:
    print(f"stall {reason:30s}" + "".join(f"{s.get(reason, 0):>22.2f}" for s in stalls))
PY
}

for cmd in "$@"; do
  echo "== $cmd ($(( $(date +%s) - t0 )) s)"
  "$cmd"
done
echo "total: $(( $(date +%s) - t0 )) s"
