// CUDA handlers of the indexer's selection (contract in select_topk.h), and the Python module
// `dsv4_jax._native_cuda` that hands their XLA FFI capsules to dsv4_jax/native.py.
//
// Two kernels per call, on the stream XLA gives the handler:
//   ScoreKernel     one block per (query row, tile of 64 entries); the row's queries live in
//                   shared memory as float32, each thread scores one entry: head dots over c
//                   channels, relu, scale, head weight, sum (the reference's order per head).
//   ScoreKernelMma  the same scores for bfloat16 inputs with 16, 32 or 64 heads and dim a
//                   multiple of 16: a tensor-core GEMM (mma.sync) over cp.async-pipelined key
//                   tiles, the relu / weight / head sum in the epilogue (see the kernel).
//                   Both scoring kernels also read an FP8 cache's packed FP4 keys (the _fp4
//                   targets: codes and scale bytes, dequantized to bf16 where they are loaded),
//                   and a paged cache's pool through its page table (the _paged targets: each
//                   key row's address looked up on its own, a row's channels read contiguously).
//   TopkKernel      one block per query row (its keys staged in shared memory up to 32k slots),
//                   or, for a few long rows, one block per segment of a row and a second launch
//                   that merges the segments' K best (the workspace output holds them):
//                   a linear histogram over the row's score range finds the bin of the K-th
//                   largest entry; that bin and everything above it are sorted as (score key,
//                   complemented index) composites (a register bitonic sort), so equal scores
//                   go to the lower entry index. Rows whose threshold bin is too full (masses
//                   of ties) take a 4-pass radix select with an index-ordered tie gather.
//                   Every composite is distinct: deterministic, never a full sort of the row.
// No allocation, no host sync: the same code is registered twice, as an eager break (no
// traits: XLA closes its CUDA graph around it) and as a command-buffer-compatible target.
#include <Python.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "finite_flag.h"
#include "mma_sm80.h"
#include "python_module.h"
#include "select_topk.h"
#include "sparse_attention_backward.h"

namespace ffi = xla::ffi;

namespace dsv4 {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kScoreThreads = 64;       // entries scored per block (small: many blocks for short rows)
constexpr int kFastHeads = 64;          // nI of V4-Flash / V4-Pro: the register-tiled path
constexpr int kMaxSortSize = 4096;      // largest power of two the sort holds (index_topk <= 4096)

// OrderedKeyHost's map (select_topk.h) on the device: -0.0 gets the key of +0.0.
__device__ __forceinline__ uint32_t OrderedKey(float value) {
  uint32_t bits = __float_as_uint(value);
  if (bits == 0x80000000u) bits = 0u;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ uint64_t Composite(uint32_t key, int64_t index) {
  return (static_cast<uint64_t>(key) << 32) | static_cast<uint64_t>(0xFFFFFFFFu - static_cast<uint32_t>(index));
}

__device__ __forceinline__ float ToF32(float x) { return x; }
__device__ __forceinline__ float ToF32(__nv_bfloat16 x) { return __bfloat162float(x); }

// Eight consecutive channels of a key row as float32 (16-byte aligned loads).
__device__ __forceinline__ void Load8(const float* p, float* out) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
__device__ __forceinline__ void Load8(const __nv_bfloat16* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(pairs[j]);
    out[2 * j] = f.x;
    out[2 * j + 1] = f.y;
  }
}

__device__ __forceinline__ int64_t VisibleCount(int32_t visible, int64_t slots) {
  return min(static_cast<int64_t>(max(visible, 0)), slots);
}

// How the scoring kernels read key channels as float32: dense keys of the queries' dtype, or an
// FP8 cache's packed FP4 keys (select_topk.h: codes two a byte and a UE8M0 scale byte a block
// of 32 channels; the product is exact, the bf16 cache's value). `Row(b, t)` is key t of batch
// row b's row among the key rows given (the address functor `Rows`: contiguous [rows, slots, .]
// or a paged pool's rows, select_topk.h; -1 for a missing page, which the kernels read as a zero
// key); `At` and `Load8` read channels of a row so found: one lookup a key, the row's channels
// contiguous (coalesced within a row whatever the layout).
template <typename In, typename Rows>
struct DenseKeys {
  static constexpr bool kMayMiss = Rows::kMayMiss;
  const In* keys;  // [key rows, dim]
  Rows rows;
  int dim;
  __device__ __forceinline__ int64_t Row(int64_t b, int64_t t) const { return rows(b, t); }
  __device__ __forceinline__ int64_t Run(int64_t b, int64_t t0, int64_t n) const { return rows.Run(b, t0, n); }
  __device__ __forceinline__ float At(int64_t key, int i) const { return ToF32(keys[key * dim + i]); }
  __device__ __forceinline__ void Load8(int64_t key, int i0, float* out) const {
    dsv4::Load8(keys + key * dim + i0, out);
  }
};

template <typename Rows>
struct Fp4Keys {
  static constexpr bool kMayMiss = Rows::kMayMiss;
  const uint8_t* codes;   // [key rows, dim / 2]
  const uint8_t* scales;  // [key rows, ceil(dim / 32)]
  Rows rows;
  int dim;
  __device__ __forceinline__ int64_t Row(int64_t b, int64_t t) const { return rows(b, t); }
  __device__ __forceinline__ int64_t Run(int64_t b, int64_t t0, int64_t n) const { return rows.Run(b, t0, n); }
  __device__ __forceinline__ float Scale(int64_t key, int i) const {
    return __uint_as_float(Fp4ScaleBits(scales[key * ((dim + kFp4Block - 1) / kFp4Block) + i / kFp4Block]));
  }
  __device__ __forceinline__ float At(int64_t key, int i) const {
    const uint32_t code = (codes[key * (dim / 2) + i / 2] >> (4 * (i & 1))) & 0xFu;
    return __uint_as_float(Fp4ValueBits(code)) * Scale(key, i);
  }
  // i0 % 8 == 0 and dim % 8 == 0: one aligned 4-byte load, one scale.
  __device__ __forceinline__ void Load8(int64_t key, int i0, float* out) const {
    const uint32_t word = *reinterpret_cast<const uint32_t*>(codes + key * (dim / 2) + i0 / 2);
    const float scale = Scale(key, i0);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = __uint_as_float(Fp4ValueBits((word >> (4 * j)) & 0xFu)) * scale;
  }
};

template <typename Keys>
struct IsFp4Keys : std::false_type {};
template <typename Rows>
struct IsFp4Keys<Fp4Keys<Rows>> : std::true_type {};

// grid (rows * seq, ceil(slots / kScoreThreads)), block kScoreThreads, shared (heads*dim + heads) floats.
// kHeads > 0: heads == kHeads and dim % 8 == 0 (register-tiled); kHeads == 0: any sizes.
template <typename In, typename Keys, int kHeads>
__global__ void ScoreKernel(const In* __restrict__ queries, const float* __restrict__ weights,
                            const Keys keys, const int32_t* __restrict__ visible,
                            float* __restrict__ scores, int64_t seq, int heads, int dim, int64_t slots,
                            float scale) {
  extern __shared__ float smem[];
  float* q = smem;                 // [heads, dim]
  float* w = smem + heads * dim;   // [heads]
  const int64_t row = blockIdx.x;  // b * seq + s
  const int64_t b = row / seq;
  const In* q_row = queries + row * heads * dim;
  if constexpr (kHeads > 0) {  // 16-byte loads, several in flight per thread (dim % 8 == 0)
    const int vectors = heads * dim / 8;
#pragma unroll 4
    for (int v = threadIdx.x; v < vectors; v += blockDim.x) Load8(q_row + 8 * v, q + 8 * v);
  } else {
    for (int i = threadIdx.x; i < heads * dim; i += blockDim.x) q[i] = ToF32(q_row[i]);
  }
  for (int i = threadIdx.x; i < heads; i += blockDim.x) w[i] = weights[row * heads + i];
  __syncthreads();

  const int64_t t = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (t >= slots) return;
  float* out = scores + row * slots;
  if (t >= VisibleCount(visible[row], slots)) {
    out[t] = -INFINITY;
    return;
  }
  const int64_t key = keys.Row(b, t);
  if (Keys::kMayMiss && key < 0) {  // a missing page (paged keys only): a zero key, whose score is 0
    out[t] = 0.0f;
    return;
  }
  float total = 0.0f;
  if constexpr (kHeads > 0) {
    float acc[kHeads];
#pragma unroll
    for (int h = 0; h < kHeads; ++h) acc[h] = 0.0f;
    for (int i0 = 0; i0 < dim; i0 += 8) {
      float kv[8];
      keys.Load8(key, i0, kv);
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        const float4 qa = *reinterpret_cast<const float4*>(q + h * dim + i0);
        const float4 qb = *reinterpret_cast<const float4*>(q + h * dim + i0 + 4);
        float a = acc[h];
        a = fmaf(qa.x, kv[0], a); a = fmaf(qa.y, kv[1], a); a = fmaf(qa.z, kv[2], a); a = fmaf(qa.w, kv[3], a);
        a = fmaf(qb.x, kv[4], a); a = fmaf(qb.y, kv[5], a); a = fmaf(qb.z, kv[6], a); a = fmaf(qb.w, kv[7], a);
        acc[h] = a;
      }
    }
#pragma unroll
    for (int h = 0; h < kHeads; ++h) total += __fmul_rn(__fmul_rn(fmaxf(acc[h], 0.0f), scale), w[h]);
  } else {
    for (int h = 0; h < heads; ++h) {
      float dot = 0.0f;
      for (int i = 0; i < dim; ++i) dot = fmaf(q[h * dim + i], keys.At(key, i), dot);
      total += __fmul_rn(__fmul_rn(fmaxf(dot, 0.0f), scale), w[h]);
    }
  }
  out[t] = total == 0.0f ? 0.0f : total;  // fold -0.0 into +0.0: ties must compare equal
}

// Tensor-core scoring (bfloat16 queries and keys, kHeads in {16, 32, 64}, dim a multiple of
// 16): a GEMM of the row's keys [T, c] against its queries [nI, c] on `mma.sync` m16n8k16
// (bf16 products are exact in float32, float32 accumulation), with relu, scale, head weights
// and the sum over heads folded into the epilogue in registers. Each warp scores 16 entries
// against every head; the block's tile of kMmaEntries keys is copied with `cp.async` into
// padded shared rows (conflict-free `ldmatrix`) while the previous tile is scored. Only the
// summation order differs from the FMA kernel (heads are summed per lane, then across the
// four lanes of a quad): ~1e-7 relative. Entries at t >= visible are never loaded.
// grid (rows * seq, ceil(slots / (kMmaEntries * tiles))), block kMmaWarps * 32.
constexpr int kMmaWarps = 4;
constexpr int kMmaEntries = 16 * kMmaWarps;  // entries per tile
constexpr int kMmaPad = 8;                   // bf16 per shared row beyond dim: row stride = 4 banks mod 32
constexpr int kMmaMaxTiles = 8;              // tiles a block scores at most (LaunchScores)

size_t MmaSharedBytes(int heads, int dim) {
  // q [heads, dim + pad] | keys [2 buffers][kMmaEntries, dim + pad], bfloat16
  return sizeof(__nv_bfloat16) * static_cast<size_t>(heads + 2 * kMmaEntries) * (dim + kMmaPad);
}

// FP4 keys (Fp4Keys) are not copied with cp.async: a tile's codes (8 bytes = 16 channels a
// load) and scale bytes are loaded into registers before the previous tile is scored, and
// dequantized into the bf16 shared rows after it (kLoads loads a thread: dim <= 128 takes 4,
// dim <= kFp4MaxStaged 8); wider keys are loaded and stored after the tile is scored
// (kLoads = 0: no registers held across the MMAs, the loads' latency not hidden).
constexpr int kFp4MaxStaged = 256;
constexpr int Fp4Loads(int max_dim) { return kMmaEntries * (max_dim / 16) / (kMmaWarps * 32); }

// Eight e2m1 codes (a 32-bit word, channel i in bits 4i..4i+3) as four bf16 pairs, unscaled.
// Byte permutes look the values up (the scoring kernel is bound by this conversion, not by its
// MMAs, when it is done with float arithmetic): the three magnitude bits of a code select the
// low and the high byte of its bf16 value from 8-entry tables, its sign bit 0x00 or 0x80.
__device__ __forceinline__ void Fp4CodesAsBf16(uint32_t codes, uint32_t (&out)[4]) {
  // bf16 of 0, 0.5, 1, 1.5, 2, 3, 4, 6: 0000 3F00 3F80 3FC0 4000 4040 4080 40C0.
  constexpr uint32_t kLow0 = 0xC0800000u, kLow1 = 0xC0804000u, kHigh0 = 0x3F3F3F00u, kHigh1 = 0x40404040u;
  const uint32_t magnitude = codes & 0x77777777u, sign = (codes >> 3) & 0x11111111u;
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // channels 4 half .. 4 half + 3
    const uint32_t m = magnitude >> (16 * half), s = sign >> (16 * half);
    const uint32_t low = __byte_perm(kLow0, kLow1, m);
    const uint32_t high = __byte_perm(kHigh0, kHigh1, m) | __byte_perm(0x8000u, 0u, s);
    out[2 * half] = __byte_perm(low, high, 0x5140);      // channels 4 half, 4 half + 1
    out[2 * half + 1] = __byte_perm(low, high, 0x7362);  // channels 4 half + 2, 4 half + 3
  }
}

// Sixteen FP4 channels (8 code bytes) times their scale (a UE8M0 byte) as bf16 into 32 bytes of
// shared memory. The bf16 product is exact (a grid value times a power of two; 0 -> +-0, 255 ->
// +-inf or NaN), so it equals Fp4Keys::At rounded to bf16, as the dense kernel reads the
// dequantized cache.
__device__ __forceinline__ void StoreFp4AsBf16(__nv_bfloat16* dst, uint2 codes, uint32_t scale_byte) {
  const uint32_t scale_bits = (scale_byte << 7) | (scale_byte << 23);
  const __nv_bfloat162 scale = *reinterpret_cast<const __nv_bfloat162*>(&scale_bits);
  uint32_t packed[8];
  Fp4CodesAsBf16(codes.x, reinterpret_cast<uint32_t(&)[4]>(packed[0]));
  Fp4CodesAsBf16(codes.y, reinterpret_cast<uint32_t(&)[4]>(packed[4]));
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const __nv_bfloat162 product = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&packed[j]), scale);
    packed[j] = *reinterpret_cast<const uint32_t*>(&product);
  }
  reinterpret_cast<uint4*>(dst)[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  reinterpret_cast<uint4*>(dst)[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

// kLoads: FP4 code loads a thread per tile (Fp4Loads of the widest dim it stages; 0: FP4 keys
// loaded without staging, and dense keys).
template <int kHeads, typename Keys, int kLoads>
__global__ void __launch_bounds__(kMmaWarps * 32)
    ScoreKernelMma(const __nv_bfloat16* __restrict__ queries, const float* __restrict__ weights,
                   const Keys keys, const int32_t* __restrict__ visible,
                   float* __restrict__ scores, int64_t seq, int dim, int64_t slots, float scale, int tiles) {
  static_assert(kHeads % 16 == 0, "heads come in pairs of 8-wide MMA tiles");
  constexpr bool kFp4 = IsFp4Keys<Keys>::value;
  constexpr int kHeadTiles = kHeads / 8;
  extern __shared__ __align__(128) unsigned char mma_smem[];
  const int ld = dim + kMmaPad;
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(mma_smem);  // [kHeads, ld]
  __nv_bfloat16* k_s = q_s + kHeads * ld;                             // [2, kMmaEntries, ld]
  const int64_t row = blockIdx.x;  // b * seq + s
  const int64_t b = row / seq;
  const int64_t n_visible = VisibleCount(visible[row], slots);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int chunks = dim / 8;  // 16-byte chunks per row
  float* out = scores + row * slots;

  // This block's entries [first, end); tiles wholly past the visible entries are not loaded.
  const int64_t first = static_cast<int64_t>(blockIdx.y) * tiles * kMmaEntries;
  const int64_t end = min(first + static_cast<int64_t>(tiles) * kMmaEntries, slots);
  const int64_t loaded_end = min(end, n_visible);
  const int n_tiles = loaded_end > first ? static_cast<int>((loaded_end - first + kMmaEntries - 1) / kMmaEntries) : 0;
  for (int64_t t = first + static_cast<int64_t>(n_tiles) * kMmaEntries + tid; t < end; t += blockDim.x) {
    out[t] = -INFINITY;
  }
  if (n_tiles == 0) return;  // uniform across the block

  // The queries first: their copies are in flight while a paged pool's table is read.
  const __nv_bfloat16* q_row = queries + row * kHeads * dim;
  for (int v = tid; v < kHeads * chunks; v += blockDim.x) {
    const int h = v / chunks, c = v % chunks;
    CpAsync16(q_s + h * ld + 8 * c, q_row + h * dim + 8 * c, true);
  }

  // Each tile's first key row (keys.Run). A paged pool's is a page-table read, done here for
  // every tile at once so that the tile loop issues key loads only (it did not change the
  // paged kernel's time on the H100: bench/RESULTS.md, "Paged caches").
  __shared__ int64_t tile_runs[kMmaMaxTiles];
  if constexpr (Keys::kMayMiss) {
    if (tid < n_tiles) tile_runs[tid] = keys.Run(b, first + static_cast<int64_t>(tid) * kMmaEntries, kMmaEntries);
    __syncthreads();
  }
  auto tile_run = [&](int i, int64_t t0) -> int64_t {
    if constexpr (Keys::kMayMiss) {
      return tile_runs[i];
    } else {
      return keys.Run(b, t0, kMmaEntries);
    }
  };

  auto load_tile = [&](int i) {  // dense bf16 keys: cp.async into buffer i & 1
    if constexpr (!kFp4) {
      const int64_t t0 = first + static_cast<int64_t>(i) * kMmaEntries;
      __nv_bfloat16* dst = k_s + (i & 1) * kMmaEntries * ld;
      // The tile's rows from one address where they are consecutive (contiguous keys; a paged
      // pool's tile on one page: one table lookup a tile, not one a 16-byte load), else each key
      // row's address on its own; a row past `slots` or on a missing page is zero-filled.
      // Two loops, not one with a per-load choice: the run's loop is then the contiguous
      // kernel's, load for load.
      const int64_t run = tile_run(i, t0);
      if (!Keys::kMayMiss || run >= 0) {
        for (int v = tid; v < kMmaEntries * chunks; v += blockDim.x) {
          const int e = v / chunks, c = v % chunks;
          const bool inside = t0 + e < slots;
          CpAsync16(dst + e * ld + 8 * c, keys.keys + (inside ? run + e : 0) * dim + 8 * c, inside);
        }
      } else {
        for (int v = tid; v < kMmaEntries * chunks; v += blockDim.x) {
          const int e = v / chunks, c = v % chunks;
          const int64_t key = t0 + e < slots ? keys.Row(b, t0 + e) : -1;
          CpAsync16(dst + e * ld + 8 * c, keys.keys + (key >= 0 ? key : 0) * dim + 8 * c, key >= 0);
        }
      }
    }
  };
  // FP4 keys: tile i's codes and scales into registers (fetch), then as bf16 into buffer i & 1
  // (store); entries past `slots` are zeros, as cp.async fills them.
  const int units = dim / 16;  // 16-channel loads a key
  const int scale_stride = (dim + kFp4Block - 1) / kFp4Block;
  uint2 fp4_codes[kLoads > 0 ? kLoads : 1];
  uint32_t fp4_scales[kLoads > 0 ? kLoads : 1];
  auto fp4_load = [&](int64_t t0, int64_t run, int v, uint2* codes, uint32_t* scale) {  // load v of a tile
    if constexpr (kFp4) {  // from t0 (run: keys.Run of the tile, as in load_tile)
      const int e = v / units, u = v % units;
      const bool inside = v < kMmaEntries * units && t0 + e < slots;
      const int64_t key = !inside ? 0 : run >= 0 ? run + e : keys.Row(b, t0 + e);
      const bool valid = inside && (!Keys::kMayMiss || key >= 0);
      *codes = valid ? *reinterpret_cast<const uint2*>(keys.codes + key * (dim / 2) + 8 * u) : make_uint2(0, 0);
      *scale = valid ? keys.scales[key * scale_stride + (16 * u) / kFp4Block] : 0u;
    }
  };
  auto fetch_fp4 = [&](int i) {  // staged (kLoads > 0): tile i's codes into registers
    if constexpr (kFp4 && kLoads > 0) {
      const int64_t t0 = first + static_cast<int64_t>(i) * kMmaEntries;
      const int64_t run = tile_run(i, t0);
#pragma unroll
      for (int j = 0; j < kLoads; ++j) fp4_load(t0, run, tid + j * kMmaWarps * 32, &fp4_codes[j], &fp4_scales[j]);
    }
  };
  auto store_fp4 = [&](int i) {  // ... and from there into buffer i & 1; kLoads == 0: straight from memory
    if constexpr (kFp4) {
      __nv_bfloat16* dst = k_s + (i & 1) * kMmaEntries * ld;
      if constexpr (kLoads > 0) {
#pragma unroll
        for (int j = 0; j < kLoads; ++j) {
          const int v = tid + j * kMmaWarps * 32;
          if (v < kMmaEntries * units) StoreFp4AsBf16(dst + (v / units) * ld + 16 * (v % units), fp4_codes[j], fp4_scales[j]);
        }
      } else {
        const int64_t t0 = first + static_cast<int64_t>(i) * kMmaEntries;
        const int64_t run = tile_run(i, t0);
        for (int v = tid; v < kMmaEntries * units; v += kMmaWarps * 32) {
          uint2 codes;
          uint32_t scale;
          fp4_load(t0, run, v, &codes, &scale);
          StoreFp4AsBf16(dst + (v / units) * ld + 16 * (v % units), codes, scale);
        }
      }
    }
  };
  if constexpr (kFp4) {
    CpAsyncCommit();  // group 0: the queries
    fetch_fp4(0);
    store_fp4(0);
    CpAsyncWait<0>();
    __syncthreads();
  } else {
    load_tile(0);
    CpAsyncCommit();  // group 0: the queries and the first tile
  }

  // This lane's accumulator columns are heads 8 n + 2 (lane % 4) + {0, 1}.
  float w[kHeadTiles][2];
#pragma unroll
  for (int n = 0; n < kHeadTiles; ++n) {
    w[n][0] = weights[row * kHeads + 8 * n + 2 * (lane & 3)];
    w[n][1] = weights[row * kHeads + 8 * n + 2 * (lane & 3) + 1];
  }

  for (int i = 0; i < n_tiles; ++i) {
    if constexpr (kFp4) {
      if (i + 1 < n_tiles) fetch_fp4(i + 1);  // in flight while tile i is scored
    } else {
      if (i + 1 < n_tiles) {
        load_tile(i + 1);  // into the buffer tile i - 1 used: released by the barrier ending it
        CpAsyncCommit();
        CpAsyncWait<1>();
      } else {
        CpAsyncWait<0>();
      }
      __syncthreads();
    }

    // acc[n] = keys[16 entries of this warp] . q[heads 8n .. 8n + 7]^T
    const __nv_bfloat16* k_warp = k_s + (i & 1) * kMmaEntries * ld + warp * 16 * ld;
    float acc[kHeadTiles][4];
#pragma unroll
    for (int n = 0; n < kHeadTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    for (int d0 = 0; d0 < dim; d0 += 16) {
      uint32_t a[4];
      LdMatrixX4(a, k_warp + (lane & 15) * ld + d0 + (lane >> 4) * 8);
#pragma unroll
      for (int n2 = 0; n2 < kHeadTiles / 2; ++n2) {
        uint32_t bq[4];  // b0, b1 of head tile 2 n2, then of 2 n2 + 1
        LdMatrixX4(bq, q_s + (16 * n2 + (lane >> 4) * 8 + (lane & 7)) * ld + d0 + ((lane >> 3) & 1) * 8);
        MmaBf16(acc[2 * n2], a, bq[0], bq[1]);
        MmaBf16(acc[2 * n2 + 1], a, bq[2], bq[3]);
      }
    }
    // Lane holds entries g = lane / 4 (acc[.][0..1]) and g + 8 (acc[.][2..3]).
    float part_lo = 0.0f, part_hi = 0.0f;
#pragma unroll
    for (int n = 0; n < kHeadTiles; ++n) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        part_lo += __fmul_rn(__fmul_rn(fmaxf(acc[n][j], 0.0f), scale), w[n][j]);
        part_hi += __fmul_rn(__fmul_rn(fmaxf(acc[n][2 + j], 0.0f), scale), w[n][j]);
      }
    }
    part_lo += __shfl_xor_sync(kFullMask, part_lo, 1);
    part_hi += __shfl_xor_sync(kFullMask, part_hi, 1);
    part_lo += __shfl_xor_sync(kFullMask, part_lo, 2);
    part_hi += __shfl_xor_sync(kFullMask, part_hi, 2);
    if ((lane & 3) == 0) {
      const int64_t t = first + static_cast<int64_t>(i) * kMmaEntries + warp * 16 + (lane >> 2);
      if (t < slots) out[t] = t < n_visible ? (part_lo == 0.0f ? 0.0f : part_lo) : -INFINITY;  // fold -0.0
      if (t + 8 < slots) out[t + 8] = t + 8 < n_visible ? (part_hi == 0.0f ? 0.0f : part_hi) : -INFINITY;
    }
    if constexpr (kFp4) {
      if (i + 1 < n_tiles) store_fp4(i + 1);  // into the buffer tile i - 1 used (released by its barrier)
    }
    __syncthreads();  // dense: this tile's buffer is reloaded next; FP4: tile i + 1 is in place
  }
}

// ---------------------------------------------------------------------------- top-k
// One block of kTopkThreads per query row. Rows up to kMaxStagedSlots entries are read from
// global memory once, into shared memory; every later pass reads them there.
//
// Fast path (any row whose threshold neighbourhood is small, i.e. real scores):
//   1. the row's finite minimum and maximum;
//   2. a histogram of kBins linear bins over [min, max] (monotone in the score: a higher score
//      never lands in a lower bin), and the bin holding the K-th largest entry;
//   3. every entry in that bin or above (K plus the threshold bin's other entries) is gathered
//      as (score key, complemented index) composites and ordered: the first K are the picks.
//      Composites are distinct, so equal scores fall to the lower index exactly as in the
//      reference, whatever the gather order. Ordered by placement where every gathered bin
//      holds at most kRankMaxBin entries (real scores: the bins above the threshold are
//      sparse): the histogram's descending prefix is each bin's first output position, an
//      entry's position that plus the entries of its own bin above it; no sort, two passes and
//      one barrier where a bitonic sort of 1,024 takes 55 stages. Otherwise a bitonic sort.
// Fallback (the threshold bin holds more than the candidate capacity: masses of exact ties, or
// one outlier squeezing the row into a few bins): a 4-pass radix select (8 bits a pass) finds
// the K-th largest score key; the entries above it, and the lowest-index entries equal to it
// (a block prefix count in index order), are the picks, sorted the same way.
constexpr int kTopkThreads = 512;   // threads per query row
constexpr int kBins = 2048;         // linear bins of the fast path
constexpr uint32_t kRankMaxBin = 32;  // fullest gathered bin that is ordered by placement, not sorted
constexpr int kMinCapacity = 1024;  // candidates the fast path may sort (2x the sort size of K, <= kMaxSortSize)
constexpr uint32_t kMinusInfKey = 0x007FFFFFu;  // OrderedKey(-inf): finite keys lie strictly between
constexpr uint32_t kPlusInfKey = 0xFF800000u;   // OrderedKey(+inf)

__device__ __forceinline__ float KeyToFloat(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// The linear bin of a score key; keys at or below the row's finite minimum go to bin 0, at or
// above its maximum to the last bin (infinities and NaNs included), so the map is monotone in
// the key order. inv == 0 (no spread) puts every key strictly inside into bin 0.
__device__ __forceinline__ uint32_t LinearBin(uint32_t key, uint32_t key_min, uint32_t key_max, float lo, float inv) {
  if (key <= key_min) return 0;
  if (key >= key_max) return kBins - 1;
  if (!(inv > 0.0f)) return 0;
  const float v = __fmul_rn(__fsub_rn(KeyToFloat(key), lo), inv);  // >= 0: round-to-nearest is monotone
  return min(__float2uint_rz(v), static_cast<uint32_t>(kBins - 1));
}

// Exclusive prefix count of `flag` over the block in thread order; `total` gets the block's sum.
// Every thread of the block must call it (it holds two barriers).
__device__ __forceinline__ uint32_t BlockExclusiveCount(bool flag, uint32_t* warp_counts, uint32_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const uint32_t ballot = __ballot_sync(kFullMask, flag);
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  uint32_t before = 0, sum = 0;
  for (int v = 0; v < warps; ++v) {
    const uint32_t c = warp_counts[v];
    before += v < warp ? c : 0;
    sum += c;
  }
  __syncthreads();
  *total = sum;
  return before + __popc(ballot & ((1u << lane) - 1u));
}

// Inclusive prefix sum of `value` over the block in thread order (two barriers, all threads).
__device__ __forceinline__ uint32_t BlockInclusiveSum(uint32_t value, uint32_t* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const uint32_t v = __shfl_up_sync(kFullMask, value, offset);
    if (lane >= offset) value += v;
  }
  if (lane == 31) warp_sums[warp] = value;
  __syncthreads();
  for (int v = 0; v < warp; ++v) value += warp_sums[v];
  (void)warps;
  __syncthreads();
  return value;
}

// Appends the composites of the lanes with `take` at cand[counter++] (one atomic per warp).
// Every lane of the warp must call it.
__device__ __forceinline__ void AppendCandidate(bool take, uint64_t composite, uint64_t* cand, uint32_t* counter) {
  const uint32_t ballot = __ballot_sync(kFullMask, take);
  if (ballot == 0) return;  // uniform across the warp
  const int lane = threadIdx.x & 31, leader = __ffs(ballot) - 1;
  uint32_t base = 0;
  if (lane == leader) base = atomicAdd(counter, static_cast<uint32_t>(__popc(ballot)));
  base = __shfl_sync(kFullMask, base, leader);
  if (take) cand[base + __popc(ballot & ((1u << lane) - 1u))] = composite;
}

constexpr int kLoadBatch = 8;  // row elements each thread loads before using them (latency hiding)

// This thread's elements base + j * stride + tid (j < kLoadBatch) of a row as ordered keys
// (0 past the row's end): all loads are issued before any is used. From global memory
// (float scores) or from the keys staged in shared memory.
__device__ __forceinline__ void LoadKeyBatch(const float* __restrict__ row, int64_t base, int64_t stride, int64_t n,
                                             uint32_t (&keys)[kLoadBatch]) {
#pragma unroll
  for (int j = 0; j < kLoadBatch; ++j) {
    const int64_t i = base + j * stride + threadIdx.x;
    keys[j] = i < n ? OrderedKey(row[i]) : 0u;
  }
}
__device__ __forceinline__ void LoadKeyBatch(const uint32_t* staged, int64_t base, int64_t stride, int64_t n,
                                             uint32_t (&keys)[kLoadBatch]) {
#pragma unroll
  for (int j = 0; j < kLoadBatch; ++j) {
    const int64_t i = base + j * stride + threadIdx.x;
    keys[j] = i < n ? staged[i] : 0u;
  }
}

constexpr int64_t kMaxStagedSlots = 32768;

// One bitonic stage whose partners are in the same thread: elements r and r ^ q (q = kQ, or the
// next power of two up to kPer / 2), compile-time register indices (no local memory).
template <int kPer, int kQ>
__device__ __forceinline__ void CompareInThread(uint64_t (&v)[kPer], int q, int span, int tid, int threads) {
  if constexpr (kQ < kPer) {
    if (q == kQ) {
#pragma unroll
      for (int r = 0; r < kPer; ++r) {
        if ((r & kQ) == 0) {
          const bool descending = ((r * threads + tid) & span) == 0;
          const uint64_t a = v[r], b = v[r | kQ];
          if (descending ? a < b : a > b) {
            v[r] = b;
            v[r | kQ] = a;
          }
        }
      }
    } else {
      CompareInThread<kPer, 2 * kQ>(v, q, span, tid, threads);
    }
  }
}

// Bitonic sort, descending, of cand[0, size) (size = kPer * blockDim, or at most blockDim with
// kPer == 1): each thread keeps its kPer elements (tid + r * blockDim) in registers; strides
// below 32 are exchanged by warp shuffles, strides of a whole block inside the thread, the rest
// through shared memory. Every thread of the block must call it.
template <int kPer>
__device__ void SortDescending(uint64_t* cand, int size) {
  const int tid = threadIdx.x, threads = blockDim.x;
  uint64_t v[kPer];
#pragma unroll
  for (int r = 0; r < kPer; ++r) v[r] = r * threads + tid < size ? cand[r * threads + tid] : 0;
  for (int span = 2; span <= size; span <<= 1) {
    for (int stride = span >> 1; stride > 0; stride >>= 1) {
      if (stride >= threads) {  // partner in this thread: element r ^ (stride / threads)
        CompareInThread<kPer, 1>(v, stride / threads, span, tid, threads);
        continue;
      }
      uint64_t partner[kPer];
      if (stride >= 32) {
        __syncthreads();  // the previous exchange's reads are done
#pragma unroll
        for (int r = 0; r < kPer; ++r) cand[r * threads + tid] = v[r];
        __syncthreads();
#pragma unroll
        for (int r = 0; r < kPer; ++r) partner[r] = cand[(r * threads + tid) ^ stride];
      } else {
#pragma unroll
        for (int r = 0; r < kPer; ++r) partner[r] = __shfl_xor_sync(kFullMask, v[r], stride);
      }
#pragma unroll
      for (int r = 0; r < kPer; ++r) {
        const int e = r * threads + tid;
        const bool keep_max = ((e & stride) == 0) == ((e & span) == 0);
        v[r] = keep_max ? max(v[r], partner[r]) : min(v[r], partner[r]);
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    if (r * threads + tid < size) cand[r * threads + tid] = v[r];
  }
  __syncthreads();
}

// What one launch of TopkKernel reads and writes. Three uses:
//   a row a block:   scores [rows, slots] -> picks [rows, K]             (segment == slots)
//   segments:        block (row, p) takes entries [p * segment, (p + 1) * segment) of the row and
//                    writes its K best as (score, entry index) pairs, best first, padded with
//                    (kPadScore, -1), at seg_scores / seg_index [row * out_stride + p * K + i]
//   the merge:       a row is the P * K pairs of its segments (scores at row * row_stride,
//                    visible == nullptr: every slot), picks are mapped through `index_map`.
// The merge's ties fall to the lower entry index because the pairs are laid out by segment in
// entry order and each segment's pairs are sorted with equal scores in index order: among equal
// scores the lower slot is the lower entry index, and the composites order by slot.
struct TopkArgs {
  const float* scores = nullptr;
  const int32_t* visible = nullptr;  // [rows]; nullptr: every slot of the row is visible
  int64_t slots = 0;                 // entries of a row
  int64_t row_stride = 0;            // floats between rows of `scores`
  int64_t segment = 0;               // entries a block takes (== slots: one block a row)
  int top_k = 0, sort_size = 0, capacity = 0;
  int32_t* picks = nullptr;            // [rows, K], unless seg_scores
  const int32_t* index_map = nullptr;  // the merge: entry index of each slot (same layout as scores)
  float* seg_scores = nullptr;         // segments: [rows, out_stride] pairs' scores ...
  int32_t* seg_index = nullptr;        // ... and entry indices
  int64_t out_stride = 0;
};

// A padding pair's score: the float whose ordered key is 0, below every real score's key
// (-inf included), so padding sorts after every entry and never displaces one.
constexpr uint32_t kPadScoreBits = 0xFFFFFFFFu;

// Output position `place` of the row (block) gets the composite `c` of entry `first + slot`:
// a segment's pair (score, entry index), or a pick (mapped through index_map by the merge).
__device__ __forceinline__ void WritePick(const TopkArgs& a, int64_t row, uint32_t place, int64_t first, uint64_t c) {
  const uint32_t slot = 0xFFFFFFFFu - static_cast<uint32_t>(c & 0xFFFFFFFFu);
  if (a.seg_scores != nullptr) {
    const int64_t out = row * a.out_stride + static_cast<int64_t>(blockIdx.y) * a.top_k + place;
    a.seg_scores[out] = KeyToFloat(static_cast<uint32_t>(c >> 32));
    a.seg_index[out] = static_cast<int32_t>(first + slot);
    return;
  }
  a.picks[row * a.top_k + place] = a.index_map != nullptr ? a.index_map[row * a.row_stride + slot] : static_cast<int32_t>(slot);
}

// Output position `place` past the row's entries: padding.
__device__ __forceinline__ void WritePad(const TopkArgs& a, int64_t row, int place) {
  if (a.seg_scores != nullptr) {
    const int64_t out = row * a.out_stride + static_cast<int64_t>(blockIdx.y) * a.top_k + place;
    a.seg_scores[out] = __uint_as_float(kPadScoreBits);
    a.seg_index[out] = -1;
    return;
  }
  a.picks[row * a.top_k + place] = -1;
}

// grid (rows * seq, segments), block kTopkThreads, shared: capacity uint64 (+ segment uint32 when kStaged).
template <bool kStaged>
__global__ void __launch_bounds__(kTopkThreads, 1) TopkKernel(const TopkArgs a) {
  extern __shared__ __align__(16) unsigned char topk_smem[];
  const int capacity = a.capacity, top_k = a.top_k, sort_size = a.sort_size;
  uint64_t* cand = reinterpret_cast<uint64_t*>(topk_smem);          // [capacity] candidate composites
  uint32_t* staged = reinterpret_cast<uint32_t*>(cand + capacity);  // kStaged: [n] ordered keys of the row
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t bin_next[kBins];  // placement: the next output position of each gathered bin
  __shared__ uint32_t warp_counts[kTopkThreads / 32], warp_min[kTopkThreads / 32], warp_max[kTopkThreads / 32];
  __shared__ uint32_t chosen_bin, above_bin, equal_count, slot_counter;
  const int64_t row = blockIdx.x, first = static_cast<int64_t>(blockIdx.y) * a.segment;
  const float* s = a.scores + row * a.row_stride + first;
  const int64_t visible = a.visible ? VisibleCount(a.visible[row], a.slots) : a.slots;
  const int64_t n = min(max(visible - first, int64_t{0}), a.segment);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t stride = blockDim.x, batch_span = stride * kLoadBatch;
  auto load = [&](int64_t base, uint32_t(&keys)[kLoadBatch]) {
    if constexpr (kStaged) LoadKeyBatch(staged, base, stride, n, keys); else LoadKeyBatch(s, base, stride, n, keys);
  };
  // A pass over the row: batches of kLoadBatch keys a thread, all loaded before any is used, then
  // body(key, i) for each, i the entry's index (>= n past the row's end, where the key is
  // padding: the trip count is uniform across the block, for the passes that vote or count).
  auto each_entry = [&](auto&& load_batch, auto&& body) {
    for (int64_t base = 0; base < n; base += batch_span) {
      uint32_t keys[kLoadBatch];
      load_batch(base, keys);
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) body(keys[j], base + j * stride + tid);
    }
  };
  if (tid == 0) slot_counter = 0;
  int n_cand = 0;
  bool sorted_fast = n == 0;  // nothing visible: only padding
  // Entries the picks take: K, or the whole row where it is shorter.
  const uint32_t wanted = static_cast<uint32_t>(min(static_cast<int64_t>(top_k), n));

  if (n > 0) {
    // 1. Stage the row; its finite minimum and maximum keys.
    uint32_t key_min = 0xFFFFFFFFu, key_max = 0u;
    auto load_row = [&](int64_t base, uint32_t(&keys)[kLoadBatch]) { LoadKeyBatch(s, base, stride, n, keys); };
    each_entry(load_row, [&](uint32_t key, int64_t i) {
      if (i < n) {
        if constexpr (kStaged) staged[i] = key;
        if (key > kMinusInfKey && key < kPlusInfKey) {
          key_min = min(key_min, key);
          key_max = max(key_max, key);
        }
      }
    });
    key_min = __reduce_min_sync(kFullMask, key_min);
    key_max = __reduce_max_sync(kFullMask, key_max);
    if (lane == 0) {
      warp_min[warp] = key_min;
      warp_max[warp] = key_max;
    }
    for (int i = tid; i < kBins; i += stride) hist[i] = 0;
    __syncthreads();  // staged keys, warp extremes, cleared histogram
    for (int v = 0; v < static_cast<int>(blockDim.x >> 5); ++v) {
      key_min = min(key_min, warp_min[v]);
      key_max = max(key_max, warp_max[v]);
    }
    const float lo = KeyToFloat(key_min), range = KeyToFloat(key_max) - lo;
    float inv = key_min < key_max ? static_cast<float>(kBins) / range : 0.0f;
    if (!(inv > 0.0f) || isinf(inv)) inv = 0.0f;  // no spread, an infinite range or a subnormal one

    // 2. Histogram; the bin holding the K-th largest entry (thread t owns bins kBins-1-4t ...).
    each_entry(load, [&](uint32_t key, int64_t i) {
      if (i < n) atomicAdd(&hist[LinearBin(key, key_min, key_max, lo, inv)], 1u);
    });
    __syncthreads();
    constexpr int kBinsPerThread = kBins / kTopkThreads;
    uint32_t local[kBinsPerThread], sum = 0;
#pragma unroll
    for (int j = 0; j < kBinsPerThread; ++j) {
      local[j] = hist[kBins - 1 - kBinsPerThread * tid - j];
      sum += local[j];
    }
    uint32_t above = BlockInclusiveSum(sum, warp_counts) - sum;
    // Each bin's first output position (the entries of higher bins), and the fullest bin among
    // those gathered (a bin is gathered when entries before it are fewer than `wanted`).
    uint32_t fullest = 0;
#pragma unroll
    for (int j = 0; j < kBinsPerThread; ++j) {
      bin_next[kBins - 1 - kBinsPerThread * tid - j] = above;
      if (above < wanted && wanted <= above + local[j]) {
        chosen_bin = kBins - 1 - kBinsPerThread * tid - j;
        above_bin = above;
        equal_count = local[j];
      }
      if (above < wanted) fullest = max(fullest, local[j]);
      above += local[j];
    }
    fullest = __reduce_max_sync(kFullMask, fullest);
    if (lane == 0) warp_max[warp] = fullest;
    __syncthreads();
    for (int v = 0; v < static_cast<int>(blockDim.x >> 5); ++v) fullest = max(fullest, warp_max[v]);
    const uint32_t threshold_bin = chosen_bin;
    n_cand = static_cast<int>(above_bin + equal_count);

    // 3a. Placement: every gathered entry to its bin's range, then to its place in the range.
    if (n_cand <= capacity && fullest <= kRankMaxBin) {  // uniform across the block
      each_entry(load, [&](uint32_t key, int64_t i) {
        if (i < n) {
          const uint32_t bin = LinearBin(key, key_min, key_max, lo, inv);
          if (bin >= threshold_bin) cand[atomicAdd(&bin_next[bin], 1u)] = Composite(key, i);
        }
      });
      __syncthreads();  // bin_next[b] is now the end of bin b's range
      for (int i = tid; i < n_cand; i += blockDim.x) {
        const uint64_t c = cand[i];
        const uint32_t bin = LinearBin(static_cast<uint32_t>(c >> 32), key_min, key_max, lo, inv);
        const uint32_t end = bin_next[bin];
        uint32_t place = end - hist[bin];
        for (uint32_t j = place; j < end; ++j) place += cand[j] > c ? 1u : 0u;
        if (place < static_cast<uint32_t>(top_k)) WritePick(a, row, place, first, c);
      }
      for (int i = n_cand + tid; i < top_k; i += blockDim.x) WritePad(a, row, i);
      return;
    }

    // 3b. Gather the chosen bin and everything above it for the sort, when that fits.
    if (n_cand <= capacity) {  // uniform across the block
      each_entry(load, [&](uint32_t key, int64_t i) {
        const bool take = i < n && LinearBin(key, key_min, key_max, lo, inv) >= threshold_bin;
        AppendCandidate(take, Composite(key, i), cand, &slot_counter);
      });
      sorted_fast = true;
    }
  }

  if (!sorted_fast) {
    // Fallback: radix select. After the four passes, `prefix` is the key of the K-th largest
    // score and `need` the number of entries with exactly that key that belong to the top K.
    uint32_t prefix = 0, mask = 0, need = static_cast<uint32_t>(top_k);  // here n > capacity >= K
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += stride) hist[i] = 0;
      __syncthreads();
      each_entry(load, [&](uint32_t key, int64_t i) {  // every lane votes
        const uint32_t bin = (i < n && (key & mask) == prefix) ? (key >> shift) & 255u : 256u;
        const uint32_t peers = __match_any_sync(kFullMask, bin);
        if (bin < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], static_cast<uint32_t>(__popc(peers)));
      });
      __syncthreads();
      if (tid < 32) {  // warp 0: lane l owns bins 255-8l .. 248-8l, highest first
        uint32_t local[8], sum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          local[j] = hist[255 - 8 * lane - j];
          sum += local[j];
        }
        uint32_t inclusive = sum;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
          const uint32_t v = __shfl_up_sync(kFullMask, inclusive, offset);
          if (lane >= offset) inclusive += v;
        }
        uint32_t above = inclusive - sum;
        if (above < need && need <= inclusive) {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (above < need && need <= above + local[j]) {
              chosen_bin = 255 - 8 * lane - j;
              above_bin = above;
              equal_count = local[j];  // after the last pass: the entries equal to the threshold
            }
            above += local[j];
          }
        }
      }
      __syncthreads();
      prefix |= chosen_bin << shift;
      mask |= 255u << shift;
      need -= above_bin;
    }
    // Gather: entries above the threshold in any slot order (the sort below fixes the order).
    // Entries equal to it: all of them when they are exactly `need`; otherwise the first `need`
    // in index order (the lower index wins the tie), found by block prefix counts.
    const bool all_equal_in = equal_count == need;
    const uint32_t n_above = static_cast<uint32_t>(top_k) - need;
    uint32_t eq_seen = 0;
    each_entry(load, [&](uint32_t key, int64_t i) {
      const bool valid = i < n;
      AppendCandidate(valid && (key > prefix || (all_equal_in && key == prefix)), Composite(key, i), cand,
                      &slot_counter);
      if (!all_equal_in) {  // uniform across the block
        uint32_t eq_total;
        const uint32_t rank = BlockExclusiveCount(valid && key == prefix, warp_counts, &eq_total);
        if (valid && key == prefix && eq_seen + rank < need) cand[n_above + eq_seen + rank] = Composite(key, i);
        eq_seen += eq_total;
      }
    });
    n_cand = top_k;
  }

  // Sort the n_cand candidates (zeros after them sort last) and write the first K.
  int size = sort_size;
  while (size < n_cand) size <<= 1;
  __syncthreads();
  for (int i = n_cand + tid; i < size; i += blockDim.x) cand[i] = 0;
  __syncthreads();
  switch (size <= kTopkThreads ? 1 : size / kTopkThreads) {
    case 1: SortDescending<1>(cand, size); break;
    case 2: SortDescending<2>(cand, size); break;
    case 4: SortDescending<4>(cand, size); break;
    default: SortDescending<8>(cand, size); break;
  }
  for (int i = tid; i < top_k; i += blockDim.x) {
    if (i < n_cand) WritePick(a, row, i, first, cand[i]); else WritePad(a, row, i);
  }
}

int SortSize(int64_t top_k) {
  int size = 1;
  while (size < top_k) size <<= 1;
  return size;
}

// Candidates the fast path may sort: twice the sort size of K, at least kMinCapacity, at most
// kMaxSortSize (the register sort holds 8 per thread).
int Capacity(int sort_size) { return std::min(kMaxSortSize, std::max(kMinCapacity, 2 * sort_size)); }

// Opts `kernel` in to `dynamic` bytes of dynamic shared memory where its static and dynamic
// shared memory together pass the 48 KiB a launch gets without asking (past it the launch fails
// with "invalid argument"). False if the device cannot give that much.
template <typename Kernel>
bool ReserveDynamicShared(Kernel kernel, size_t dynamic) {
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) return false;
  if (dynamic + attributes.sharedSizeBytes <= 48 * 1024) return true;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dynamic)) ==
         cudaSuccess;
}

ffi::Error LaunchTopkKernel(cudaStream_t stream, const TopkArgs& args, dim3 grid) {
  const size_t cand_bytes = args.capacity * sizeof(uint64_t);
  auto launch = [&](auto kernel, size_t shared) -> ffi::Error {
    if (!ReserveDynamicShared(kernel, shared)) {
      return ffi::Error::Internal("dsv4 select_topk (CUDA): cannot reserve shared memory for the top-k");
    }
    kernel<<<grid, kTopkThreads, shared, stream>>>(args);
    return ffi::Error::Success();
  };
  if (args.segment <= kMaxStagedSlots) return launch(TopkKernel<true>, cand_bytes + args.segment * sizeof(uint32_t));
  return launch(TopkKernel<false>, cand_bytes);
}

// The top-k of every row. `segments` <= 1: one block a row. Otherwise (long rows, few of them:
// dsv4_jax.native.topk_segments decides) each row is cut into `segments` pieces taken by as many
// blocks, whose K best pairs land in `workspace` [rows, 2 * segments * K] (scores, then entry
// indices), and a second launch merges each row's pairs: the same picks, the row spread over
// many SMs instead of one.
ffi::Error LaunchTopk(cudaStream_t stream, const float* scores, const int32_t* visible, int32_t* picks,
                      const SelectDims& d, int32_t* workspace, int64_t segments) {
  if (d.top_k > kMaxSortSize) {
    return ffi::Error::InvalidArgument("dsv4 select_topk (CUDA): index_topk " + std::to_string(d.top_k) +
                                       " is above the kernel's limit of " + std::to_string(kMaxSortSize));
  }
  TopkArgs args;
  args.top_k = static_cast<int>(d.top_k);
  args.sort_size = SortSize(d.top_k);
  args.capacity = Capacity(args.sort_size);
  const unsigned rows = static_cast<unsigned>(d.rows * d.seq);
  if (segments <= 1) {
    args.scores = scores;
    args.visible = visible;
    args.slots = args.row_stride = args.segment = d.slots;
    args.picks = picks;
    return LaunchTopkKernel(stream, args, dim3(rows));
  }
  const int64_t pairs = segments * d.top_k;
  TopkArgs seg = args;
  seg.scores = scores;
  seg.visible = visible;
  seg.slots = seg.row_stride = d.slots;
  seg.segment = (d.slots + segments - 1) / segments;
  seg.seg_scores = reinterpret_cast<float*>(workspace);
  seg.seg_index = workspace + pairs;
  seg.out_stride = 2 * pairs;
  if (ffi::Error e = LaunchTopkKernel(stream, seg, dim3(rows, static_cast<unsigned>(segments))); e.failure()) return e;
  TopkArgs merge = args;
  merge.scores = reinterpret_cast<const float*>(workspace);
  merge.slots = merge.segment = pairs;
  merge.row_stride = 2 * pairs;
  merge.index_map = workspace + pairs;
  merge.picks = picks;
  return LaunchTopkKernel(stream, merge, dim3(rows));
}

template <typename In, typename Keys>
ffi::Error LaunchScores(cudaStream_t stream, const void* queries, const float* weights, const Keys& keys,
                        const int32_t* visible, float* scores, const SelectDims& d) {
  const float scale = static_cast<float>(std::pow(static_cast<double>(d.dim), -0.5));
  if constexpr (std::is_same_v<In, __nv_bfloat16>) {
    if ((d.heads == 16 || d.heads == 32 || d.heads == 64) && d.dim % 16 == 0) {  // the tensor-core path
      // FP4 keys: registers staging a tile sized for dim <= 128 (V4's index_head_dim), for dim <=
      // 256, or no staging; dense keys: cp.async (kLoads unused).
      constexpr bool kFp4 = IsFp4Keys<Keys>::value;
      constexpr int kNarrow = kFp4 ? Fp4Loads(128) : 0, kWide = kFp4 ? Fp4Loads(kFp4MaxStaged) : 0;
      const int staging = !kFp4 || d.dim <= 128 ? 0 : d.dim <= kFp4MaxStaged ? 1 : 2;
      auto pick = [&](auto narrow, auto wide, auto direct) { return staging == 0 ? narrow : staging == 1 ? wide : direct; };
      auto kernel = d.heads == 64   ? pick(ScoreKernelMma<64, Keys, kNarrow>, ScoreKernelMma<64, Keys, kWide>,
                                           ScoreKernelMma<64, Keys, 0>)
                    : d.heads == 32 ? pick(ScoreKernelMma<32, Keys, kNarrow>, ScoreKernelMma<32, Keys, kWide>,
                                           ScoreKernelMma<32, Keys, 0>)
                                    : pick(ScoreKernelMma<16, Keys, kNarrow>, ScoreKernelMma<16, Keys, kWide>,
                                           ScoreKernelMma<16, Keys, 0>);
      const size_t shared = MmaSharedBytes(static_cast<int>(d.heads), static_cast<int>(d.dim));
      if (!ReserveDynamicShared(kernel, shared)) {
        return ffi::Error::InvalidArgument("dsv4 select_topk (CUDA): index_n_heads * index_head_dim too large");
      }
      // Enough blocks to fill the card (~4 per SM of an H200), each as many tiles as that allows (<= 8).
      const int64_t rows = d.rows * d.seq, tiles_total = (d.slots + kMmaEntries - 1) / kMmaEntries;
      const int tiles = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMmaMaxTiles, rows * tiles_total / 528)));
      const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>((tiles_total + tiles - 1) / tiles));
      kernel<<<grid, kMmaWarps * 32, shared, stream>>>(static_cast<const __nv_bfloat16*>(queries), weights, keys,
                                                       visible, scores, d.seq, static_cast<int>(d.dim), d.slots, scale,
                                                       tiles);
      return ffi::Error::Success();
    }
  }
  const size_t shared = static_cast<size_t>(d.heads * d.dim + d.heads) * sizeof(float);
  const bool fast = d.heads == kFastHeads && d.dim % 8 == 0;
  auto kernel = fast ? ScoreKernel<In, Keys, kFastHeads> : ScoreKernel<In, Keys, 0>;
  if (!ReserveDynamicShared(kernel, shared)) {
    return ffi::Error::InvalidArgument("dsv4 select_topk (CUDA): index_n_heads * index_head_dim too large");
  }
  const dim3 grid(static_cast<unsigned>(d.rows * d.seq), static_cast<unsigned>((d.slots + kScoreThreads - 1) / kScoreThreads));
  kernel<<<grid, kScoreThreads, shared, stream>>>(static_cast<const In*>(queries), weights, keys,
                                                  visible, scores, d.seq, static_cast<int>(d.heads),
                                                  static_cast<int>(d.dim), d.slots, scale);
  return ffi::Error::Success();
}

ffi::Error LastLaunchError() {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("dsv4 select_topk (CUDA): ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// Scores with the key reader `keys_for(In{})` gives for the queries' dtype In, then the top-k:
// one dtype switch for both key forms.
template <typename KeysFor>
ffi::Error ScoreThenSelect(cudaStream_t stream, ffi::AnyBuffer& queries, ffi::Buffer<ffi::F32>& weights,
                           ffi::Buffer<ffi::S32>& visible, ffi::Result<ffi::Buffer<ffi::S32>>& picks,
                           ffi::Result<ffi::Buffer<ffi::F32>>& scores, ffi::Result<ffi::Buffer<ffi::S32>>& workspace,
                           const SelectDims& d, int64_t segments, KeysFor keys_for) {
  ffi::Error launched = ffi::Error::Success();
  switch (queries.element_type()) {
    case ffi::DataType::F32:
      launched = LaunchScores<float>(stream, queries.untyped_data(), weights.typed_data(), keys_for(float{}),
                                     visible.typed_data(), scores->typed_data(), d);
      break;
    case ffi::DataType::BF16:
      launched = LaunchScores<__nv_bfloat16>(stream, queries.untyped_data(), weights.typed_data(),
                                             keys_for(__nv_bfloat16{}), visible.typed_data(), scores->typed_data(), d);
      break;
    default:
      return ffi::Error::InvalidArgument("dsv4 select_topk: queries must be float32 or bfloat16");
  }
  if (launched.failure()) return launched;
  if (ffi::Error e = LaunchTopk(stream, scores->typed_data(), visible.typed_data(), picks->typed_data(), d,
                                workspace->typed_data(), segments);
      e.failure()) {
    return e;
  }
  return LastLaunchError();
}

// The selection over keys [..., T, c], or (`table` given) over a paged pool [N, c] with its
// table [..., P_row] and `page_entries` (select_topk.h): one set of kernels, two address functors.
ffi::Error SelectDense(cudaStream_t stream, ffi::AnyBuffer& queries, ffi::Buffer<ffi::F32>& weights,
                       ffi::AnyBuffer& keys, ffi::Buffer<ffi::S32>& visible, ffi::Result<ffi::Buffer<ffi::S32>>& picks,
                       ffi::Result<ffi::Buffer<ffi::F32>>& scores, ffi::Result<ffi::Buffer<ffi::S32>>& workspace,
                       const ffi::Buffer<ffi::S32>* table, int64_t page_entries) {
  auto dims = keys.dimensions();
  std::vector<int64_t> key_dims(dims.begin(), dims.end());
  PagedRows paged;
  if (table != nullptr) {
    if (ffi::Error e = ParsePagedKeys(dims, dims.size() == 0 ? 0 : dims.back(), table->dimensions(), page_entries,
                                      scores->dimensions(), table->typed_data(), &key_dims, &paged);
        e.failure()) {
      return e;
    }
  }
  SelectDims d;
  if (ffi::Error e = ParseDims(&queries, weights.dimensions(), key_dims, visible.dimensions(),
                               picks->dimensions(), scores->dimensions(), &d);
      e.failure()) {
    return e;
  }
  int64_t segments = 1;
  if (ffi::Error e = ParseWorkspace(workspace->dimensions(), d, &segments); e.failure()) return e;
  if (queries.element_type() != keys.element_type()) {
    return ffi::Error::InvalidArgument("dsv4 select_topk: queries and keys must share a dtype");
  }
  if (d.rows * d.seq == 0 || d.slots == 0) return ffi::Error::Success();
  const int dim = static_cast<int>(d.dim);
  if (table != nullptr) {
    return ScoreThenSelect(stream, queries, weights, visible, picks, scores, workspace, d, segments, [&](auto in) {
      using In = decltype(in);
      return DenseKeys<In, PagedRows>{static_cast<const In*>(keys.untyped_data()), paged, dim};
    });
  }
  return ScoreThenSelect(stream, queries, weights, visible, picks, scores, workspace, d, segments, [&](auto in) {
    using In = decltype(in);
    return DenseKeys<In, ContiguousRows>{static_cast<const In*>(keys.untyped_data()), ContiguousRows{d.slots}, dim};
  });
}

// The selection over an FP8 cache's packed FP4 keys (select_topk.h), contiguous or paged: the
// scoring kernels dequantize each key where they load it (68 bytes a V4 key instead of a bf16
// copy's 256).
ffi::Error SelectFp4(cudaStream_t stream, ffi::AnyBuffer& queries, ffi::Buffer<ffi::F32>& weights,
                     ffi::Buffer<ffi::U8>& codes, ffi::Buffer<ffi::U8>& key_scales, ffi::Buffer<ffi::S32>& visible,
                     ffi::Result<ffi::Buffer<ffi::S32>>& picks, ffi::Result<ffi::Buffer<ffi::F32>>& scores,
                     ffi::Result<ffi::Buffer<ffi::S32>>& workspace, const ffi::Buffer<ffi::S32>* table,
                     int64_t page_entries) {
  std::vector<int64_t> key_dims;
  if (ffi::Error e = ParseFp4Keys(codes.dimensions(), key_scales.dimensions(), &key_dims); e.failure()) return e;
  PagedRows paged;
  if (table != nullptr) {
    const int64_t channels = key_dims.back();
    if (ffi::Error e = ParsePagedKeys(codes.dimensions(), channels, table->dimensions(), page_entries,
                                      scores->dimensions(), table->typed_data(), &key_dims, &paged);
        e.failure()) {
      return e;
    }
  }
  SelectDims d;
  if (ffi::Error e = ParseDims(&queries, weights.dimensions(), key_dims, visible.dimensions(), picks->dimensions(),
                               scores->dimensions(), &d);
      e.failure()) {
    return e;
  }
  int64_t segments = 1;
  if (ffi::Error e = ParseWorkspace(workspace->dimensions(), d, &segments); e.failure()) return e;
  if (d.rows * d.seq == 0 || d.slots == 0) return ffi::Error::Success();
  const int dim = static_cast<int>(d.dim);
  if (table != nullptr) {
    const Fp4Keys<PagedRows> keys{codes.typed_data(), key_scales.typed_data(), paged, dim};
    return ScoreThenSelect(stream, queries, weights, visible, picks, scores, workspace, d, segments,
                           [&](auto) { return keys; });
  }
  const Fp4Keys<ContiguousRows> keys{codes.typed_data(), key_scales.typed_data(), ContiguousRows{d.slots}, dim};
  return ScoreThenSelect(stream, queries, weights, visible, picks, scores, workspace, d, segments,
                         [&](auto) { return keys; });
}

ffi::Error SelectTopkImpl(cudaStream_t stream, ffi::AnyBuffer queries, ffi::Buffer<ffi::F32> weights,
                          ffi::AnyBuffer keys, ffi::Buffer<ffi::S32> visible, ffi::Result<ffi::Buffer<ffi::S32>> picks,
                          ffi::Result<ffi::Buffer<ffi::F32>> scores, ffi::Result<ffi::Buffer<ffi::S32>> workspace) {
  return SelectDense(stream, queries, weights, keys, visible, picks, scores, workspace, nullptr, 0);
}

ffi::Error SelectTopkPagedImpl(cudaStream_t stream, ffi::AnyBuffer queries, ffi::Buffer<ffi::F32> weights,
                               ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> visible,
                               ffi::Result<ffi::Buffer<ffi::S32>> picks, ffi::Result<ffi::Buffer<ffi::F32>> scores,
                               ffi::Result<ffi::Buffer<ffi::S32>> workspace, int64_t page_entries) {
  return SelectDense(stream, queries, weights, pool, visible, picks, scores, workspace, &table, page_entries);
}

ffi::Error SelectTopkFp4Impl(cudaStream_t stream, ffi::AnyBuffer queries, ffi::Buffer<ffi::F32> weights,
                             ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::U8> key_scales, ffi::Buffer<ffi::S32> visible,
                             ffi::Result<ffi::Buffer<ffi::S32>> picks, ffi::Result<ffi::Buffer<ffi::F32>> scores,
                             ffi::Result<ffi::Buffer<ffi::S32>> workspace) {
  return SelectFp4(stream, queries, weights, codes, key_scales, visible, picks, scores, workspace, nullptr, 0);
}

ffi::Error SelectTopkFp4PagedImpl(cudaStream_t stream, ffi::AnyBuffer queries, ffi::Buffer<ffi::F32> weights,
                                  ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::U8> key_scales,
                                  ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> visible,
                                  ffi::Result<ffi::Buffer<ffi::S32>> picks, ffi::Result<ffi::Buffer<ffi::F32>> scores,
                                  ffi::Result<ffi::Buffer<ffi::S32>> workspace, int64_t page_entries) {
  return SelectFp4(stream, queries, weights, codes, key_scales, visible, picks, scores, workspace, &table,
                   page_entries);
}

ffi::Error TopkImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> scores, ffi::Buffer<ffi::S32> visible,
                    ffi::Result<ffi::Buffer<ffi::S32>> picks, ffi::Result<ffi::Buffer<ffi::S32>> workspace) {
  SelectDims d;
  if (ffi::Error e = ParseDims(nullptr, {}, scores.dimensions(), visible.dimensions(), picks->dimensions(), {}, &d);
      e.failure()) {
    return e;
  }
  int64_t segments = 1;
  if (ffi::Error e = ParseWorkspace(workspace->dimensions(), d, &segments); e.failure()) return e;
  if (d.rows * d.seq == 0 || d.slots == 0) return ffi::Error::Success();
  if (ffi::Error e = LaunchTopk(stream, scores.typed_data(), visible.typed_data(), picks->typed_data(), d,
                                workspace->typed_data(), segments);
      e.failure()) {
    return e;
  }
  return LastLaunchError();
}

}  // namespace
}  // namespace dsv4

#define DSV4_SELECT_BINDING                          \
  ffi::Ffi::Bind()                                   \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()      \
      .Arg<ffi::AnyBuffer>()                         \
      .Arg<ffi::Buffer<ffi::F32>>()                  \
      .Arg<ffi::AnyBuffer>()                         \
      .Arg<ffi::Buffer<ffi::S32>>()                  \
      .Ret<ffi::Buffer<ffi::S32>>()                  \
      .Ret<ffi::Buffer<ffi::F32>>()                  \
      .Ret<ffi::Buffer<ffi::S32>>()
#define DSV4_SELECT_FP4_BINDING                      \
  ffi::Ffi::Bind()                                   \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()      \
      .Arg<ffi::AnyBuffer>()                         \
      .Arg<ffi::Buffer<ffi::F32>>()                  \
      .Arg<ffi::Buffer<ffi::U8>>()                   \
      .Arg<ffi::Buffer<ffi::U8>>()                   \
      .Arg<ffi::Buffer<ffi::S32>>()                  \
      .Ret<ffi::Buffer<ffi::S32>>()                  \
      .Ret<ffi::Buffer<ffi::F32>>()                  \
      .Ret<ffi::Buffer<ffi::S32>>()
#define DSV4_SELECT_PAGED_BINDING                    \
  ffi::Ffi::Bind()                                   \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()      \
      .Arg<ffi::AnyBuffer>()                         \
      .Arg<ffi::Buffer<ffi::F32>>()                  \
      .Arg<ffi::AnyBuffer>()                         \
      .Arg<ffi::Buffer<ffi::S32>>()                  \
      .Arg<ffi::Buffer<ffi::S32>>()                  \
      .Ret<ffi::Buffer<ffi::S32>>()                  \
      .Ret<ffi::Buffer<ffi::F32>>()                  \
      .Ret<ffi::Buffer<ffi::S32>>()                  \
      .Attr<int64_t>("page_entries")
#define DSV4_SELECT_FP4_PAGED_BINDING                \
  ffi::Ffi::Bind()                                   \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()      \
      .Arg<ffi::AnyBuffer>()                         \
      .Arg<ffi::Buffer<ffi::F32>>()                  \
      .Arg<ffi::Buffer<ffi::U8>>()                   \
      .Arg<ffi::Buffer<ffi::U8>>()                   \
      .Arg<ffi::Buffer<ffi::S32>>()                  \
      .Arg<ffi::Buffer<ffi::S32>>()                  \
      .Ret<ffi::Buffer<ffi::S32>>()                  \
      .Ret<ffi::Buffer<ffi::F32>>()                  \
      .Ret<ffi::Buffer<ffi::S32>>()                  \
      .Attr<int64_t>("page_entries")
#define DSV4_TOPK_BINDING                            \
  ffi::Ffi::Bind()                                   \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()      \
      .Arg<ffi::Buffer<ffi::F32>>()                  \
      .Arg<ffi::Buffer<ffi::S32>>()                  \
      .Ret<ffi::Buffer<ffi::S32>>()                  \
      .Ret<ffi::Buffer<ffi::S32>>()

// The eager break: no traits, so XLA ends its command buffer before this thunk.
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SelectTopkCudaEager, dsv4::SelectTopkImpl, DSV4_SELECT_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SelectTopkFp4CudaEager, dsv4::SelectTopkFp4Impl, DSV4_SELECT_FP4_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SelectTopkPagedCudaEager, dsv4::SelectTopkPagedImpl, DSV4_SELECT_PAGED_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SelectTopkFp4PagedCudaEager, dsv4::SelectTopkFp4PagedImpl,
                              DSV4_SELECT_FP4_PAGED_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4TopkCudaEager, dsv4::TopkImpl, DSV4_TOPK_BINDING);
// Captured inside XLA's CUDA graph (no allocation, no sync in the handler).
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SelectTopkCudaGraph, dsv4::SelectTopkImpl, DSV4_SELECT_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SelectTopkFp4CudaGraph, dsv4::SelectTopkFp4Impl, DSV4_SELECT_FP4_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SelectTopkPagedCudaGraph, dsv4::SelectTopkPagedImpl, DSV4_SELECT_PAGED_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SelectTopkFp4PagedCudaGraph, dsv4::SelectTopkFp4PagedImpl,
                              DSV4_SELECT_FP4_PAGED_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4TopkCudaGraph, dsv4::TopkImpl, DSV4_TOPK_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});

// ---------------------------------------------------------------------------- Python module
namespace {

PyObject* Registrations(PyObject*, PyObject*) {
  // Eager: the break (XLA ends its CUDA graph around it); _graph: captured in the graph.
  static const dsv4::Target targets[] = {
      {"dsv4_select_topk", reinterpret_cast<void*>(&Dsv4SelectTopkCudaEager)},
      {"dsv4_select_topk_graph", reinterpret_cast<void*>(&Dsv4SelectTopkCudaGraph)},
      {"dsv4_select_topk_fp4", reinterpret_cast<void*>(&Dsv4SelectTopkFp4CudaEager)},
      {"dsv4_select_topk_fp4_graph", reinterpret_cast<void*>(&Dsv4SelectTopkFp4CudaGraph)},
      {"dsv4_select_topk_paged", reinterpret_cast<void*>(&Dsv4SelectTopkPagedCudaEager)},
      {"dsv4_select_topk_paged_graph", reinterpret_cast<void*>(&Dsv4SelectTopkPagedCudaGraph)},
      {"dsv4_select_topk_fp4_paged", reinterpret_cast<void*>(&Dsv4SelectTopkFp4PagedCudaEager)},
      {"dsv4_select_topk_fp4_paged_graph", reinterpret_cast<void*>(&Dsv4SelectTopkFp4PagedCudaGraph)},
      {"dsv4_topk", reinterpret_cast<void*>(&Dsv4TopkCudaEager)},
      {"dsv4_topk_graph", reinterpret_cast<void*>(&Dsv4TopkCudaGraph)},
      {"dsv4_finite_flag", reinterpret_cast<void*>(&Dsv4FiniteFlag)},  // finite_flag_cuda.cu (graph compatible)
      // sparse_attention_backward_cuda.cu (graph compatible)
      {"dsv4_sparse_attention_backward", reinterpret_cast<void*>(&Dsv4SparseAttentionBackward)},
  };
  return dsv4::CapsuleDict(targets);
}

PyObject* BuildInfo(PyObject*, PyObject*) {
  return Py_BuildValue("{s:s,s:i,s:s,s:s}", "ffi_api",
                       (std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR)).c_str(),
                       "cuda_runtime", CUDART_VERSION, "arch", DSV4_CUDA_ARCHS, "platform", "cuda");
}

PyMethodDef kMethods[] = {
    {"registrations", Registrations, METH_NOARGS, "FFI target name -> handler capsule."},
    {"build_info", BuildInfo, METH_NOARGS, "How this module was built."},
    {"finite_flag_slots", Dsv4FiniteFlagSlots, METH_NOARGS,
     "(address, count) of the finite flag's host slots (finite_flag.h)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_cuda", "dsv4_jax CUDA FFI handlers", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__native_cuda(void) { return PyModule_Create(&kModule); }
