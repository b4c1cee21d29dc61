"""What the benchmark runs: model sizes, scenarios and the list of cases for a run.

Scenarios (every one for the CSA layer, the one with the indexer, and the HCA layer):

``decode_pr``    the PR's decode-heavy shape: a 2-token prompt (its latency is the time to first
                 token), then ``steps`` single-token decode steps. With so short a context the
                 CSA indexer has fewer compressed entries than ``index_topk``: it picks everything.
``decode_long``  decode at long context: a ``context``-token prefix is prefilled once (not
                 timed, chunked), then ``steps`` decode steps are timed. ``context / 4`` compressed
                 entries >> ``index_topk``, so the indexer really selects.
``prefill``      one prompt of ``prompt_len`` tokens into an empty cache (time to first token
                 of a long prompt).

The cache is sized per case: ``max_seq_len`` = tokens the case needs, rounded up to 128 (the
indexer scores every entry slot, ``max_seq_len // 4``, so an oversized cache would cost time).
"""

from __future__ import annotations

import dataclasses
import math

import dsv4_jax
from dsv4_jax.config import CSA, HCA, SLIDING

MODES = ("none", "none-xla", "narrow", "narrow-device", "wide")
# What each benchmarked mode sets on the layer. "none" takes the native graph-compatible
# selection where it is built (else it equals "none-xla", which always uses `lax.top_k`);
# "narrow" is the host break (`jax.pure_callback`), "narrow-device" the native eager break.
MODE_SETTINGS = {
    "none": dict(break_mode="none", break_on="auto", kernels="auto"),
    "none-xla": dict(break_mode="none", break_on="auto", kernels="xla"),
    "narrow": dict(break_mode="narrow", break_on="host", kernels="auto"),
    "narrow-device": dict(break_mode="narrow", break_on="device", kernels="auto"),
    "wide": dict(break_mode="wide", break_on="host", kernels="auto"),
}
NATIVE_MODES = ("narrow-device",)


def apply_mode(attn, mode: str) -> None:
    """Set a benchmarked mode's break_mode / break_on / kernels on the layer."""
    for name, value in MODE_SETTINGS[mode].items():
        setattr(attn, name, value)
PEER = "hf-torch"
LAYER_NAMES = {"csa": CSA, "hca": HCA}
SHORT = {CSA: "CSA", HCA: "HCA", SLIDING: "SWA"}


def config_for(size: str) -> dsv4_jax.DeepseekV4Config:
    """The attention config of a size.

    tiny:  `DeepseekV4Config.tiny()`, the CPU test config (window 8, top-k 4), for the smoke test.
    small: `DeepseekV4Config.small()`, a scaled-down V4 for the 2-core CPU box: hidden 1024,
           16 heads x 128, q_lora 256, 4 output groups x 256, window 128, indexer 16 x 64,
           top-k 128, ratios 4 / 128.
    flash: the published V4-Flash sizes (hidden 4096, 64 heads x 512, q_lora 1024, 8 groups x
           1024, window 128, indexer 64 x 128, top-k 512, ratios 4 / 128).
    """
    if size == "tiny":
        return dsv4_jax.DeepseekV4Config.tiny()
    if size == "small":
        return dsv4_jax.DeepseekV4Config.small()
    if size == "flash":
        return dsv4_jax.DeepseekV4Config.flash()
    raise ValueError(f"--size: expected tiny, small or flash, got {size!r}")


def layer_index(cfg: dsv4_jax.DeepseekV4Config, layer: str) -> int:
    """The first layer of the given type (flash: CSA = 2, HCA = 3; small/tiny: 1, 2)."""
    return cfg.layer_types.index(LAYER_NAMES[layer])


@dataclasses.dataclass
class Case:
    """One measurement setting; every mode (and the peer) runs it with the same inputs."""

    scenario: str  # decode_pr | decode_long | prefill
    layer: str  # csa | hca
    batch: int
    prompt_len: int  # decode_pr: the prompt; decode_long: the prefilled context; prefill: the prompt
    steps: int = 0  # timed decode steps (decode_*)
    repeats: int = 3  # timed repetitions (decode: sequences of `steps`; prefill: calls)
    warmup_steps: int = 2  # decode steps of the untimed warm-up sequence
    modes: tuple[str, ...] = MODES
    peer: bool = True
    picks_check: bool = False  # also compare the indexer picks (return_intermediates pass)
    # Caps for the slow modes: None = same as the others.
    wide_steps: int | None = None
    wide_repeats: int | None = None
    skip: dict = dataclasses.field(default_factory=dict)  # impl -> reason (decided by the plan)
    slow_repeats: dict = dataclasses.field(default_factory=dict)  # mode -> repeats cap (slow host breaks)

    @property
    def max_seq_len(self) -> int:
        total = self.prompt_len + self.steps  # warm-up and timed sequences both start from the snapshot
        return max(128, int(math.ceil(total / 128) * 128))

    @property
    def key(self) -> str:
        return f"{self.scenario}/{self.layer}/B{self.batch}/L{self.prompt_len}"

    def steps_for(self, mode: str) -> int:
        return self.wide_steps if (mode == "wide" and self.wide_steps is not None) else self.steps

    def repeats_for(self, mode: str) -> int:
        reps = self.wide_repeats if (mode == "wide" and self.wide_repeats is not None) else self.repeats
        return min(reps, self.slow_repeats.get(mode, reps))


def host_seconds(cfg, case: Case, mode: str, host_gflops: float, host_gbps: float) -> float:
    """Rough host time of one call of the narrow / wide break (NumPy float32 on the host).

    narrow (CSA only): the indexer scoring, a GEMM of nI x c dots against every entry slot per
    query (at `host_gflops`) plus ~5 float32 passes over the [S, nI, T] scores (at `host_gbps`);
    wide: that plus the host-side wq_b (and indexer q) projection and the round trip of the
    weights and the cache. Only used to cap what is run; recorded in the skip reason.
    """
    if mode not in ("narrow", "wide"):
        return 0.0  # in-graph or on the device
    s = case.prompt_len if case.scenario == "prefill" else 1
    b = case.batch
    slots = cfg.entry_slots(CSA, case.max_seq_len)
    gemm = moved = 0.0
    if case.layer == "csa":
        gemm += 2.0 * cfg.index_n_heads * cfg.index_head_dim * slots * s * b
        moved += 20.0 * cfg.index_n_heads * slots * s * b
    if mode == "wide":
        gemm += 2.0 * cfg.q_lora_rank * cfg.num_attention_heads * cfg.head_dim * s * b
        if case.layer == "csa":
            gemm += 2.0 * cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim * s * b
        # weights (~2/3 of them cross the break) and the cache, down and back up
        params = cfg.hidden_size * cfg.q_lora_rank + 3 * cfg.q_lora_rank * cfg.num_attention_heads * cfg.head_dim
        cache = b * cfg.entry_slots(LAYER_NAMES[case.layer], case.max_seq_len) * (cfg.head_dim + cfg.index_head_dim)
        moved += 4.0 * (params + 2 * cache + 2 * s * b * cfg.num_attention_heads * cfg.head_dim)
    return gemm / (host_gflops * 1e9) + moved / (host_gbps * 1e9)


def _hf_bytes(cfg, case: Case, dtype_bytes: int) -> float:
    """Rough peak memory of HF's eager attention on the largest call of the case (dense masks).

    HF concatenates every compressed entry to the keys and builds [B, H, S, keys] logits, mask and
    probabilities; ~4 such tensors live at the peak (a 8k bf16 prefill measured 32 GB on the H200,
    this formula gives 43 GB).
    """
    if case.scenario == "prefill":
        s = case.prompt_len
        keys = s + s // (cfg.csa_compress_rate if case.layer == "csa" else cfg.hca_compress_rate)
    else:  # decode_long prefix chunks are bounded by `hf_chunk`; decode steps are tiny
        s = hf_chunk(case.batch) if case.scenario == "decode_long" else case.prompt_len
        keys = s + cfg.sliding_window + case.max_seq_len // cfg.csa_compress_rate
    return 4.0 * case.batch * cfg.num_attention_heads * s * keys * max(dtype_bytes, 2)


def hf_chunk(batch: int) -> int:
    """Chunk length of the HF prefix prefill of decode_long (bounds its dense attention)."""
    return 2048 if batch == 1 else (512 if batch <= 8 else 256)


JAX_PREFIX_CHUNK = 2048


def build_plan(size: str, quick: bool, platform: str, *, layers=("csa", "hca"), modes=MODES, peer=True,
               batches=None, scenarios=None, host_gflops=None, host_gbps=None, hf_mem_gb=None,
               dtype_bytes=4) -> list[Case]:
    """The cases of a run (see the module docstring); caps are decided here and recorded as skips.

    platform: "cpu" or "gpu" (GPU plans have larger batches and contexts).
    host_gflops, host_gbps: assumed NumPy GEMM rate and memory rate of the host break, for the
        caps (defaults: 40 GFLOP/s and 4 GB/s on CPU, 200 and 4 on GPU hosts).
    hf_mem_gb: memory HF may use (default: 8 on CPU, 100 on GPU).
    """
    gpu = platform == "gpu"
    host_gflops = host_gflops or (200.0 if gpu else 40.0)
    host_gbps = host_gbps or 4.0
    hf_mem_gb = hf_mem_gb or (100.0 if gpu else 8.0)
    cfg = config_for(size)
    tiny = size == "tiny"

    if tiny:  # the smoke test: seconds, every code path
        spec = dict(dec_batches=[2], dec_steps=3, reps=1, long_ctx=64, long_steps=2, prefills=[24], pre_batches=[2])
    elif quick:
        spec = dict(dec_batches=[1], dec_steps=8, reps=2, long_ctx=4096 if gpu else 1024, long_steps=4,
                    prefills=[1024 if gpu else 512], pre_batches=[1])
    elif gpu:
        spec = dict(dec_batches=[1, 8, 32], dec_steps=64, reps=3, long_ctx=16384, long_steps=32,
                    prefills=[1024, 4096, 16384], pre_batches=[1, 8])
    else:
        spec = dict(dec_batches=[1, 8], dec_steps=32, reps=3, long_ctx=4096, long_steps=16,
                    prefills=[1024, 4096], pre_batches=[1, 8])
    if batches:
        spec["dec_batches"] = spec["pre_batches"] = list(batches)

    cases: list[Case] = []
    for layer in layers:
        for b in spec["dec_batches"]:
            cases.append(Case("decode_pr", layer, b, prompt_len=2, steps=spec["dec_steps"], repeats=spec["reps"],
                              wide_steps=min(spec["dec_steps"], 8), wide_repeats=1))
        for i, b in enumerate(spec["dec_batches"]):
            cases.append(Case("decode_long", layer, b, prompt_len=spec["long_ctx"], steps=spec["long_steps"],
                              repeats=spec["reps"], wide_steps=min(spec["long_steps"], 4), wide_repeats=1,
                              picks_check=(layer == "csa" and i == 0)))
        for length in spec["prefills"]:
            for i, b in enumerate(spec["pre_batches"]):
                reps = spec["reps"] if length * b <= 8192 else max(1, spec["reps"] - 1)
                cases.append(Case("prefill", layer, b, prompt_len=length, steps=0, repeats=reps,
                                  wide_repeats=1, picks_check=(layer == "csa" and i == 0 and length <= 4096)))

    # Most telling first (a run cut off by a time limit keeps those): decode at long context,
    # the PR-like decode, then prefill by length.
    order = {"decode_long": 0, "decode_pr": 1, "prefill": 2}
    cases.sort(key=lambda c: (order[c.scenario], c.prompt_len if c.scenario == "prefill" else 0, c.batch))
    scen = set(scenarios) if scenarios else None
    out = []
    for case in cases:
        if scen and case.scenario not in scen:
            continue
        case.modes = tuple(m for m in MODES if m in modes)
        case.peer = bool(peer)
        for mode in NATIVE_MODES:
            if mode in case.modes and not dsv4_jax.native.available(platform):
                case.skip[mode] = f"native handlers not usable: {dsv4_jax.native.unavailable_reason(platform)}"
        # Caps: host breaks that would take too long per call; HF calls that would not fit.
        for mode in ("narrow", "wide"):
            est = host_seconds(cfg, case, mode, host_gflops, host_gbps)
            limit = 8.0 if case.scenario == "prefill" else 1.0
            if mode in case.modes and est > limit:
                case.skip[mode] = f"capped: host break est. {est:.1f} s/call > {limit:.0f} s"
            elif mode in case.modes and est > 1.0 and case.scenario == "prefill":
                case.slow_repeats[mode] = 1
        if case.peer:
            est_gb = _hf_bytes(cfg, case, dtype_bytes) / 1e9
            if est_gb > hf_mem_gb:
                case.skip[PEER] = f"capped: HF dense attention est. {est_gb:.0f} GB > {hf_mem_gb:.0f} GB"
        out.append(case)
    return out
