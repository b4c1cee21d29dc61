#!/usr/bin/env bash
# One nvidia-h200-x2 call for the sharded layer (issue 13): build the native handlers, record how
# the two GPUs are linked, then bench/sharded.py at V4-Flash sizes in bf16: CSA in none / narrow
# (host) / narrow (device), HCA in none; decode B = 8, 32 from a 16k context, prefill 4k at B = 2;
# one GPU against batch over two GPUs (2x1) and heads over two GPUs (1x2). The command-buffer
# pass's log and XLA's thunk dumps say which collectives run inside the CUDA graphs.
#                                       device run (kind nvidia-h200-x2):  bash bench/gpu_sharded.sh
# SHARDED_ARGS adds arguments (e.g. --runs csa:none --batches 8 for a shorter run).
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
# NVLink multicast stays off (the machine's rule; the image sets these, a child keeps them).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/gpu_build.sh"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1; cat "$OUT/topo.txt"
python3 -c "import jax; print(jax.devices())"
DUMP=/tmp/sharded_xla_dump; rm -rf "$DUMP"
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=3 \
  timeout ${SHARDED_TIMEOUT:-420} python3 bench/sharded.py --size flash --xla-dump "$DUMP" \
  --vlog "$OUT/sharded_stderr.log" --json "$OUT/h200x2_sharded.json" ${SHARDED_ARGS:-} \
  >"$OUT/sharded.log" 2>"$OUT/sharded_stderr.log"
echo "sharded rc=$?"
grep -v "^|" "$OUT/sharded.log" | tail -45
grep -m3 "CommandBufferConfig" "$OUT/sharded_stderr.log" | cut -c1-400
grep -v "command_buffer_conversion_pass\|@@BENCH" "$OUT/sharded_stderr.log" | tail -15
# The thunk sequences (small) and one program's optimized HLO per mesh, for the record.
( cd "$DUMP" 2>/dev/null && tar czf "$OUT/sharded_thunks.tar.gz" $(ls | grep thunk_sequence_after_thunk_passes) ) || true
gzip -9 -c "$OUT/sharded_stderr.log" > "$OUT/sharded_stderr.log.gz" && rm -f "$OUT/sharded_stderr.log"
echo "total: $(( $(date +%s) - t0 )) s"
