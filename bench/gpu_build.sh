# Sourced by bench/gpu.sh (the device entry point): the common start of one H200 call. Sets OUT
# (default /tmp/dsv4_out) and t0, records the card (gpu.txt), builds the package with its CUDA
# handlers (build.log; the call stops with the log's tail if the build fails) and prints what
# was built.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dsv4_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
t0=$(date +%s)
# Several scripts in one call build once: the editable install is redone only when the
# native sources changed since this machine last built them (Python files need no build).
built_mark="/tmp/dsv4_built_$(find csrc CMakeLists.txt pyproject.toml -type f -exec sha1sum {} + 2>/dev/null | sort | sha1sum | cut -c1-12)"
if [ ! -f "$built_mark" ]; then
  python3 -m pip install -q --no-build-isolation --no-deps -e . -Ccmake.define.DSV4_CUDA=ON >"$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  touch "$built_mark"
fi
echo "build: $(( $(date +%s) - t0 )) s"
python3 -c "import dsv4_jax, json; print(json.dumps(dsv4_jax.native_info()['cuda']))"
