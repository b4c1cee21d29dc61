#!/usr/bin/env bash
# The JAX peer on the H200 (issue 14): MaxText 0.2.5's DeepSeek-V4 attention beside ours (mode
# `none`) and HF transformers 5.23.0, V4-Flash sizes, bf16, B = 1, 8, 32, in one bench/run.py run
# per layer type.
#
#   here (internet):  bash bench/gpu_maxtext.sh --wheelhouse
#       -> build/peer_wheels (MaxText and its imports, 34 wheels, 54.3 MB) and build/hf_wheels
#          (transformers 5.23.0 + regex, 14.1 MB; the box's own transformers 5.17 fails in bf16)
#   device (both wheel folders and the tree exceed the 64 MiB a call carries; the install goes
#   to build/peer_site, which stays on the warm machine between calls):
#       1. carry build/peer_wheels:  bash bench/gpu_maxtext.sh --install-only        (~40 s)
#       2. carry build/hf_wheels:    LAYERS=csa bash bench/gpu_maxtext.sh            (~5.5 min)
#       3.                           LAYERS=hca bash bench/gpu_maxtext.sh            (~5 min;
#          BATCHES=1,8 for ~4 min)
#       4. optional:                 bash bench/gpu_maxtext.sh --tests   (the float32 agreement
#          tests on the box's CPU, live HF included)
#   Records: $OUT/h200_flash_maxtext_<layers>.{json,log}; without build/hf_wheels the HF peer is
#   whatever transformers the box has (recorded), and a call past its time keeps the records so far.
#
# The device has Python 3.12, jax 0.11.2, flax 0.12.10, torch and no internet: the packages
# (maxtext's wheel declares no dependencies, so its imports are listed here, as in the `[peers]`
# extra, pinned to the versions tested) go into a target folder on PYTHONPATH without dependency
# resolution (what jax/flax/torch bring is not carried). If maxtext does not import, the run
# records why and goes on without it.
set -uo pipefail
export PYTHONUNBUFFERED=1
PEER_WHEELS=${PEER_WHEELS:-build/peer_wheels}
HF_WHEELS=${HF_WHEELS:-build/hf_wheels}
SITE=${SITE:-build/peer_site}
OUT=${OUT:-/tmp/dsv4_out}; mkdir -p "$OUT"
PEER_PKGS=(
  maxtext==0.2.5 tokamax==0.0.17 qwix==0.1.8 aqtp==0.9.0 pathwaysutils==0.1.13 omegaconf==2.4.0
  packaging==26.4 jinja2==3.1.6 markupsafe==3.0.4 fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7
  anyio==4.16.0 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
  typing-extensions==4.16.0 opentelemetry-api==1.45.2 requests==2.34.2 urllib3==2.8.0 idna==3.20
  certifi==2026.10.19.post1 uvicorn==0.54.0 click==8.5.1 immutabledict==4.3.1 xprof==2.24.2 fire==0.7.1
  termcolor==3.3.0 six==1.17.0 jaxtyping==0.3.11 einshape==1.0 tqdm==4.70.1 zipp==4.1.2
)
HF_PKGS=(transformers==5.23.0 regex==2026.11.19)

if [ "${1:-}" = "--wheelhouse" ]; then  # run here, with internet: cp312 manylinux wheels, no deps
  get() {
    mkdir -p "$1"; local dir=$1; shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d "$dir" "$@" || exit 1
    echo "$dir: $(ls "$dir" | wc -l) wheels, $(du -sb "$dir" | cut -f1) bytes"
  }
  get "$PEER_WHEELS" "${PEER_PKGS[@]}"
  get "$HF_WHEELS" "${HF_PKGS[@]}"
  exit 0
fi

t0=$(date +%s)
for group in PEER HF; do  # install what was carried (a group already installed stays installed)
  dir=${group}_WHEELS; dir=${!dir}; pk=${group}_PKGS[@]
  [ -f "$SITE/.installed_$group" ] && { echo "$group: installed earlier"; continue; }
  [ -d "$dir" ] || { echo "$group wheels: $dir not carried"; continue; }
  python3 -m pip install -q --upgrade --no-index --no-deps --find-links "$dir" --target "$SITE" "${!pk}" \
    >>"$OUT/peer_install.log" 2>&1 && touch "$SITE/.installed_$group"; echo "$group install rc=$?"
done
echo "install: $(( $(date +%s) - t0 )) s, $(du -sh "$SITE" 2>/dev/null | cut -f1)"
[ "${1:-}" = "--install-only" ] && exit 0

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
export PYTHONPATH="$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"
python3 -c "from bench import peer_maxtext as p; print('maxtext peer:', p.available() or 'ok', p.versions())" \
  2>&1 | grep -v "NO-OP" | tail -3

if [ "${1:-}" = "--tests" ]; then  # the float32 agreement tests on this box's CPU (live HF here)
  JAX_PLATFORMS=cpu timeout 400 python3 -m pytest -q -rs -p no:cacheprovider tests/test_maxtext_peer.py \
    >"$OUT/maxtext_tests_cpu.log" 2>&1; echo "cpu tests rc=$?"; tail -5 "$OUT/maxtext_tests_cpu.log"
  exit 0
fi

# The benchmark: JAX gets 75% of the card (ours + MaxText share it; MaxText's dense attention is
# the big user), torch the rest; HF calls whose estimate exceeds 30 GB are capped.
LAYERS=${LAYERS:-csa,hca}; name="h200_flash_maxtext_${LAYERS/,/_}"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 timeout 500 python3 bench/run.py --size flash --layers "$LAYERS" --modes none \
  --batches ${BATCHES:-1,8,32} --peers hf-torch,maxtext-jax --hf-mem-gb 30 --no-cmdbuf --no-ceilings --no-progress \
  --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
echo "run rc=$? ($(( $(date +%s) - t0 )) s)"
grep -v "NO-OP\|RequestsDependency\|warnings.warn\|WARNING:absl\|^ *$" "$OUT/$name.log" | tail -60
