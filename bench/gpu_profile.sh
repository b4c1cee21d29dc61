set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
export XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true"
python3 -m pip install -q --no-build-isolation --no-deps -e . -Ccmake.define.DSV4_CUDA=ON >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
timeout 200 python3 bench/stack.py --size flash --stacks mixed --scenarios stack_decode --batches 1 --contexts 16384 \
  --profile 1:16384,32:16384 --json "$OUT/h200_stack_profile.json" > "$OUT/prof.log" 2>&1; echo rc=$?
grep -v "^$" "$OUT/prof.log" | tail -100 | cut -c1-200
