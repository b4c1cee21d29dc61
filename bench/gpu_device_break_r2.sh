#!/usr/bin/env bash
# Second H200 call for the device break (issue 8): the float32 parity gates on the GPU (every
# execution mode, golden replays included) and the selection microbenchmark with the clock
# spun up (bench/topk.py).   device run:  bash bench/gpu_device_break_r2.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dsv4_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-build-isolation --no-deps -e . -Ccmake.define.DSV4_CUDA=ON >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
python3 -c "import dsv4_jax, json; print(json.dumps(dsv4_jax.native_info()['cuda']))"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_native.py \
  tests/test_attention.py::test_replays_every_golden_call tests/test_attention.py::test_golden_scores_match_reference \
  tests/test_attention.py::test_all_execution_modes_agree_on_csa tests/test_attention.py::test_ties_go_to_the_lower_entry_index \
  >"$OUT/gpu_tests_r2.log" 2>&1; echo "tests rc=$?"; grep -E "passed|failed|FAILED" "$OUT/gpu_tests_r2.log" | tail -8
timeout 200 python3 bench/topk.py --json "$OUT/gpu_topk_r2.json" 2>&1 | tail -32
