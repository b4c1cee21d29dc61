#!/usr/bin/env bash
# One nvidia-h200-x2 call (issue 13, follow-up of bench/gpu_sharded.sh): does the heads-sharded
# decode step gain when its all-reduce runs inside the CUDA graph? XLA 0.11.2 by default does the
# all-reduce with its own one-shot kernel (kCollectiveKernel), which the command-buffer pass cannot
# record, and leaves NCCL collectives out of the graphs (COLLECTIVES is not among the enabled
# commands); so the step is graph, all-reduce, graph. Variants, each a separate process (XLA flags
# are read once), decode only, one GPU against heads over two (1x2):
#   default  XLA's defaults (= bench/gpu_sharded.sh)
#   nccl     --xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false: NCCL's all-reduce, outside
#   graphs   the same plus COLLECTIVES among the command-buffer commands: NCCL inside the graph
# then `default` again, to read the drift of the machine over the call.
#                                 device run (kind nvidia-h200-x2):  bash bench/gpu_sharded_graphs.sh
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/gpu_build.sh"
CMDS=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,DYNAMIC_SLICE_FUSION
declare -A FLAGS=(
  [default]=""
  [nccl]="--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false"
  [graphs]="--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false --xla_gpu_enable_command_buffer=$CMDS,COLLECTIVES"
)
n=0
for variant in ${VARIANTS:-default nccl graphs default}; do
  n=$((n + 1)); tag="${n}_${variant}"; dump=/tmp/dump_$tag; rm -rf "$dump"
  # An unknown flag aborts XLA: check the variant's flags start a backend before the run.
  if ! XLA_FLAGS="${FLAGS[$variant]}" python3 -c "import jax; jax.devices()" >/dev/null 2>"$OUT/flags_$tag.err"; then
    echo "$tag: XLA refused the flags: $(tail -2 "$OUT/flags_$tag.err")"; continue
  fi
  XLA_FLAGS="${FLAGS[$variant]}" TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=3 \
    timeout ${VARIANT_TIMEOUT:-130} python3 bench/sharded.py --size flash --meshes 1x2 --prefills "" \
    --runs csa:none,csa:narrow-device,hca:none --xla-dump "$dump" --vlog "$OUT/stderr_$tag.log" \
    --json "$OUT/h200x2_sharded_graphs_$tag.json" >"$OUT/sharded_$tag.log" 2>"$OUT/stderr_$tag.log"
  echo "== $tag rc=$? ($(( $(date +%s) - t0 )) s)"; grep -v "^|" "$OUT/sharded_$tag.log" | grep "ms" | cut -c1-200
  grep -m2 "Unsupported thunk kind\|not enabled by the user" "$OUT/stderr_$tag.log" | cut -c1-200
  ( cd "$dump" 2>/dev/null && tar czf "$OUT/thunks_$tag.tar.gz" $(ls | grep thunk_sequence_after_thunk_passes) ) || true
  gzip -9 "$OUT/stderr_$tag.log"
done
# The device call returns only a few files: everything of the call in one archive.
( cd "$OUT" && tar czf sharded_graphs_all.tar.gz --remove-files *_default* *_nccl* *_graphs* 2>/dev/null ) || true
echo "total: $(( $(date +%s) - t0 )) s"
