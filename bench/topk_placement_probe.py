"""Session 65 probe: the native top-k alone (its kernel time from JAX's profiler), on continuous
and on tied scores, for the A/B of the placement ordering against the bitonic sort (run once
per build of csrc/select_topk_cuda.cu), and `--ncu` for Nsight Compute. Removed from main once
its question was settled; `bench/topk.py --cases topk --device-time` measures both kinds of
scores since.

    python3 bench/topk_placement_probe.py OUT.json
    ncu --clock-control none -k regex:TopkKernel -c 2 --set full python3 bench/topk_placement_probe.py --ncu
"""

import json
import statistics
import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
import numpy as np

from bench import topk as tb
from dsv4_jax import indexer, native

UNROLL = 10


def scores(rows, slots, unroll, seed=0, tied=False):
    rng = np.random.default_rng(seed)
    s = rng.standard_normal((unroll, rows, 1, slots)).astype(np.float32)
    if tied:
        s[..., ::7] = np.round(s[..., ::7])
    return jnp.asarray(s), jnp.asarray(np.full((unroll, rows, 1), slots, np.int32))


if sys.argv[1:] == ["--ncu"]:
    for slots in (4096, 512, 16384):
        s, v = scores(1, slots, 1, tied=False)
        f = jax.jit(lambda s, v: native.topk(s[0], v[0], top_k=512, graph=True))
        for _ in range(2):
            jax.block_until_ready(f(s, v))
    sys.exit(0)

tb.DEVICE_TIME = True
recs = []
cases = ((1, 512, False), (1, 4096, False), (1, 16384, False), (8, 4096, False), (64, 4096, False),
         (1, 4096, True), (8, 4096, True), (1, 65536, False))
for rows, slots, tied in cases:
    s, v = scores(rows, slots, UNROLL, tied=tied)
    fn = tb.unrolled(lambda s, v: native.topk(s, v, top_k=512, graph=True, segments=1), UNROLL)
    picks = np.asarray(fn(s, v)[0])
    ref = np.asarray(indexer.picks_from_scores(s[0], v[0], 512))
    t = tb.time_program(fn, (s, v), 20)
    r = {"rows": rows, "slots": slots, "tied": tied, "segments": 1,
         "us_per_op_median": 1e6 * statistics.median(t) / UNROLL,
         "picks_equal": bool(np.array_equal(picks, ref)), **tb.device_time(fn, (s, v), UNROLL)}
    r.pop("device_top_ops", None)
    print(json.dumps(r))
    recs.append(r)
json.dump({"records": recs, "devices": [str(d) for d in jax.devices()]}, open(sys.argv[1], "w"), indent=1)
