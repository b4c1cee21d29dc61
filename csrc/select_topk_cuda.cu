// CUDA handlers of the indexer's selection (contract in select_topk.h), and the Python module
// `dsv4_jax._native_cuda` that hands their XLA FFI capsules to dsv4_jax/native.py.
//
// Two kernels per call, on the stream XLA gives the handler:
//   ScoreKernel  one block per (query row, tile of 64 entries); the row's queries live in
//                shared memory as float32, each thread scores one entry: 64 head dots over c
//                channels, relu, scale, head weight, sum (the reference's order per head).
//   ScoreKernelTc  the same scores for bfloat16 inputs with heads and dim multiples of 16, on the
//                tensor cores (wmma m16n16k16, float32 accumulation): see the kernel.
//   TopkKernel   one block per query row (its keys staged in shared memory up to 32k slots):
//                a 4-pass radix select (8 bits a pass) finds the
//                K-th largest score key; the entries above it, and the lowest-index entries
//                equal to it (a block prefix scan in index order), are the picks; a bitonic
//                sort of (score key, complemented index) orders them. Every candidate's sort
//                key is distinct, so the result is deterministic, never a full sort of the row.
// No allocation, no host sync: the same code is registered twice, as an eager break (no
// traits: XLA closes its CUDA graph around it) and as a command-buffer-compatible target.
#include <Python.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"
#include "python_module.h"
#include "select_topk.h"

namespace ffi = xla::ffi;

namespace dsv4 {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kScoreThreads = 64;       // entries scored per block (small: many blocks for short rows)
constexpr int kTopkThreads = 512;       // threads per query row in the selection
constexpr int kFastHeads = 64;          // nI of V4-Flash / V4-Pro: the register-tiled path
constexpr int kMaxSortSize = 4096;      // largest power of two the sort holds (index_topk <= 4096)

__device__ __forceinline__ uint32_t OrderedKey(float value) {
  const uint32_t bits = __float_as_uint(value);
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

// grid (rows * seq, ceil(slots / kScoreThreads)), block kScoreThreads, shared (heads*dim + heads) floats.
// kHeads > 0: heads == kHeads and dim % 8 == 0 (register-tiled); kHeads == 0: any sizes.
template <typename In, int kHeads>
__global__ void ScoreKernel(const In* __restrict__ queries, const float* __restrict__ weights,
                            const In* __restrict__ keys, const int32_t* __restrict__ visible,
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
  const In* k = keys + (b * slots + t) * dim;
  float total = 0.0f;
  if constexpr (kHeads > 0) {
    float acc[kHeads];
#pragma unroll
    for (int h = 0; h < kHeads; ++h) acc[h] = 0.0f;
    for (int i0 = 0; i0 < dim; i0 += 8) {
      float kv[8];
      Load8(k + i0, kv);
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
      for (int i = 0; i < dim; ++i) dot = fmaf(q[h * dim + i], ToF32(k[i]), dot);
      total += __fmul_rn(__fmul_rn(fmaxf(dot, 0.0f), scale), w[h]);
    }
  }
  out[t] = total == 0.0f ? 0.0f : total;  // fold -0.0 into +0.0: ties must compare equal
}

// Tensor-core scoring (bfloat16 queries and keys, heads and dim multiples of 16): each warp
// scores 16 entries against every head with m16n16k16 bf16 MMAs accumulating in float32 (the
// products of bf16 values are exact in float32; only the summation order differs from the FMA
// kernel, ~1e-7 relative), then folds relu, scale and the head weights per entry in head order.
// A block stages the row's queries once and scores `tiles` consecutive tiles of kTcEntries
// entries (more tiles per block when there are many rows: fewer reloads of the queries).
// grid (rows * seq, ceil(slots / (kTcEntries * tiles))), block kTcWarps * 32.
constexpr int kTcWarps = 4;
constexpr int kTcEntries = 16 * kTcWarps;
constexpr int kTcPad = 4;  // acc row stride heads + 4 floats: the per-entry head sums avoid bank conflicts

size_t TcSharedBytes(int heads, int dim) {
  // q [heads, dim] bf16 | k [kTcEntries, dim] bf16 | acc [kTcEntries, heads + pad] f32 | w [heads] f32
  auto up = [](size_t n) { return (n + 127) / 128 * 128; };
  return up(sizeof(__nv_bfloat16) * heads * dim) + up(sizeof(__nv_bfloat16) * kTcEntries * dim) +
         up(sizeof(float) * kTcEntries * (heads + kTcPad)) + up(sizeof(float) * heads);
}

__global__ void ScoreKernelTc(const __nv_bfloat16* __restrict__ queries, const float* __restrict__ weights,
                              const __nv_bfloat16* __restrict__ keys, const int32_t* __restrict__ visible,
                              float* __restrict__ scores, int64_t seq, int heads, int dim, int64_t slots,
                              float scale, int tiles) {
  namespace wmma = nvcuda::wmma;
  extern __shared__ __align__(128) unsigned char tc_smem[];
  auto up = [](size_t n) { return (n + 127) / 128 * 128; };
  __nv_bfloat16* q = reinterpret_cast<__nv_bfloat16*>(tc_smem);
  __nv_bfloat16* k = reinterpret_cast<__nv_bfloat16*>(tc_smem + up(sizeof(__nv_bfloat16) * heads * dim));
  float* acc = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(k) + up(sizeof(__nv_bfloat16) * kTcEntries * dim));
  float* w = acc + up(sizeof(float) * kTcEntries * (heads + kTcPad)) / sizeof(float);
  const int ld_acc = heads + kTcPad;
  const int64_t row = blockIdx.x;  // b * seq + s
  const int64_t b = row / seq;
  const int64_t n_visible = VisibleCount(visible[row], slots);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int vec_per_entry = dim / 8;

  // Stage the row's queries and head weights once (16-byte loads).
  const uint4* q_src = reinterpret_cast<const uint4*>(queries + row * heads * dim);
  for (int v = tid; v < heads * dim / 8; v += blockDim.x) reinterpret_cast<uint4*>(q)[v] = q_src[v];
  for (int i = tid; i < heads; i += blockDim.x) w[i] = weights[row * heads + i];

  for (int tile = 0; tile < tiles; ++tile) {
    const int64_t t0 = (static_cast<int64_t>(blockIdx.y) * tiles + tile) * kTcEntries;
    if (t0 >= slots) break;  // uniform across the block
    __syncthreads();  // the previous tile's k and acc are consumed (and, first, q and w are staged)
    for (int v = tid; v < kTcEntries * vec_per_entry; v += blockDim.x) {  // zeros past the row's slots
      const int e = v / vec_per_entry, c = v % vec_per_entry;
      const int64_t t = t0 + e;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (t < slots) val = reinterpret_cast<const uint4*>(keys + (b * slots + t) * dim)[c];
      reinterpret_cast<uint4*>(k)[v] = val;
    }
    __syncthreads();

    // acc[e, h] = k[e] . q[h] for this warp's 16 entries, 16 heads at a time.
    const __nv_bfloat16* k_warp = k + warp * 16 * dim;
    for (int h0 = 0; h0 < heads; h0 += 16) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
      wmma::fill_fragment(c, 0.0f);
      for (int d0 = 0; d0 < dim; d0 += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> bq;
        wmma::load_matrix_sync(a, k_warp + d0, dim);         // [16 entries, 16 dims]
        wmma::load_matrix_sync(bq, q + h0 * dim + d0, dim);  // [16 dims, 16 heads], q row-major by head
        wmma::mma_sync(c, a, bq, c);
      }
      wmma::store_matrix_sync(acc + warp * 16 * ld_acc + h0, c, ld_acc, wmma::mem_row_major);
    }
    __syncwarp();
    if (lane < 16) {
      const int64_t t = t0 + warp * 16 + lane;
      if (t < slots) {
        float total = -INFINITY;
        if (t < n_visible) {
          const float* a_row = acc + (warp * 16 + lane) * ld_acc;
          total = 0.0f;
          for (int h = 0; h < heads; ++h) total += __fmul_rn(__fmul_rn(fmaxf(a_row[h], 0.0f), scale), w[h]);
          total = total == 0.0f ? 0.0f : total;  // fold -0.0 into +0.0: ties must compare equal
        }
        scores[row * slots + t] = total;
      }
    }
  }
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

constexpr int kLoadBatch = 8;  // row elements each thread loads before using them (latency hiding)

// This thread's elements base + j * stride + tid (j < kLoadBatch) of a row as ordered keys
// (0 past the row's end): all loads are issued before any is used.
__device__ __forceinline__ void LoadKeyBatch(const float* __restrict__ row, int64_t base, int64_t stride, int64_t n,
                                             uint32_t (&keys)[kLoadBatch]) {
#pragma unroll
  for (int j = 0; j < kLoadBatch; ++j) {
    const int64_t i = base + j * stride + threadIdx.x;
    keys[j] = i < n ? OrderedKey(row[i]) : 0u;
  }
}

// The same batch from the row's keys staged in shared memory.
__device__ __forceinline__ void LoadKeyBatch(const uint32_t* staged, int64_t base, int64_t stride, int64_t n,
                                             uint32_t (&keys)[kLoadBatch]) {
#pragma unroll
  for (int j = 0; j < kLoadBatch; ++j) {
    const int64_t i = base + j * stride + threadIdx.x;
    keys[j] = i < n ? staged[i] : 0u;
  }
}

// Rows up to this many slots are read from global memory once, into shared memory, and the
// five passes over the row (four radix passes and the gather) read them there.
constexpr int64_t kMaxStagedSlots = 32768;

// grid (rows * seq), block kTopkThreads, shared sort_size uint64 (+ slots uint32 when kStaged).
template <bool kStaged>
__global__ void TopkKernel(const float* __restrict__ scores, const int32_t* __restrict__ visible,
                           int32_t* __restrict__ picks, int64_t slots, int top_k, int sort_size) {
  extern __shared__ __align__(16) unsigned char topk_smem[];
  uint64_t* cand = reinterpret_cast<uint64_t*>(topk_smem);  // [sort_size] composite keys of the candidates
  uint32_t* staged = reinterpret_cast<uint32_t*>(cand + sort_size);  // kStaged: [n] ordered keys of the row
  __shared__ uint32_t hist[256];
  __shared__ uint32_t warp_counts[kTopkThreads / 32];
  __shared__ uint32_t chosen_bin, above_bin, equal_count, slot_counter;
  const int64_t row = blockIdx.x;
  const float* s = scores + row * slots;
  const int64_t n = VisibleCount(visible[row], slots);
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t stride = blockDim.x, batch_span = stride * kLoadBatch;
  int64_t n_cand;

  if (n <= top_k) {
    for (int64_t i = tid; i < n; i += stride) cand[i] = Composite(OrderedKey(s[i]), i);
    n_cand = n;
  } else {
    // Radix select: after the four passes, `prefix` is the key of the K-th largest score and
    // `need` the number of entries with exactly that key that belong to the top K.
    uint32_t prefix = 0, mask = 0, need = static_cast<uint32_t>(top_k);
    if constexpr (kStaged) {
      for (int64_t base = 0; base < n; base += batch_span) {
        uint32_t keys[kLoadBatch];
        LoadKeyBatch(s, base, stride, n, keys);
#pragma unroll
        for (int j = 0; j < kLoadBatch; ++j) {
          const int64_t i = base + j * stride + tid;
          if (i < n) staged[i] = keys[j];
        }
      }
      __syncthreads();
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += stride) hist[i] = 0;
      __syncthreads();
      for (int64_t base = 0; base < n; base += batch_span) {  // uniform trip count: all lanes vote
        uint32_t keys[kLoadBatch];
        if constexpr (kStaged) LoadKeyBatch(staged, base, stride, n, keys); else LoadKeyBatch(s, base, stride, n, keys);
#pragma unroll
        for (int j = 0; j < kLoadBatch; ++j) {
          const int64_t i = base + j * stride + tid;
          const uint32_t bin = (i < n && (keys[j] & mask) == prefix) ? (keys[j] >> shift) & 255u : 256u;
          const uint32_t peers = __match_any_sync(kFullMask, bin);
          if (bin < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], static_cast<uint32_t>(__popc(peers)));
        }
      }
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
    if (tid == 0) slot_counter = 0;
    __syncthreads();
    const uint32_t n_above = static_cast<uint32_t>(top_k) - need;
    uint32_t eq_seen = 0;
    for (int64_t base = 0; base < n; base += batch_span) {
      uint32_t keys[kLoadBatch];
      if constexpr (kStaged) LoadKeyBatch(staged, base, stride, n, keys); else LoadKeyBatch(s, base, stride, n, keys);
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) {
        const int64_t i = base + j * stride + tid;
        const bool valid = i < n;
        if (valid && (keys[j] > prefix || (all_equal_in && keys[j] == prefix))) {
          cand[atomicAdd(&slot_counter, 1u)] = Composite(keys[j], i);
        }
        if (!all_equal_in) {  // uniform across the block
          uint32_t eq_total;
          const uint32_t rank = BlockExclusiveCount(valid && keys[j] == prefix, warp_counts, &eq_total);
          if (valid && keys[j] == prefix && eq_seen + rank < need) cand[n_above + eq_seen + rank] = Composite(keys[j], i);
          eq_seen += eq_total;
        }
      }
    }
    n_cand = top_k;
  }
  for (int64_t i = n_cand + tid; i < sort_size; i += blockDim.x) cand[i] = 0;  // sorts last
  __syncthreads();

  // Bitonic sort, descending, of the sort_size composites.
  for (int size = 2; size <= sort_size; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < sort_size; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const uint64_t a = cand[i], b = cand[j];
          const bool descending = (i & size) == 0;
          if (descending ? a < b : a > b) {
            cand[i] = b;
            cand[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  int32_t* out = picks + row * top_k;
  for (int i = tid; i < top_k; i += blockDim.x) {
    out[i] = i < n_cand ? static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(cand[i] & 0xFFFFFFFFu)) : -1;
  }
}

int SortSize(int64_t top_k) {
  int size = 1;
  while (size < top_k) size <<= 1;
  return size;
}

ffi::Error LaunchTopk(cudaStream_t stream, const float* scores, const int32_t* visible, int32_t* picks,
                      const SelectDims& d) {
  if (d.top_k > kMaxSortSize) {
    return ffi::Error::InvalidArgument("dsv4 select_topk (CUDA): index_topk " + std::to_string(d.top_k) +
                                       " is above the kernel's limit of " + std::to_string(kMaxSortSize));
  }
  const int sort_size = SortSize(d.top_k);
  const unsigned blocks = static_cast<unsigned>(d.rows * d.seq);
  const size_t cand_bytes = sort_size * sizeof(uint64_t);
  if (d.slots <= kMaxStagedSlots) {
    const size_t shared = cand_bytes + d.slots * sizeof(uint32_t);
    if (shared > 48 * 1024 && cudaFuncSetAttribute(TopkKernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(shared)) != cudaSuccess) {
      return ffi::Error::Internal("dsv4 select_topk (CUDA): cannot reserve shared memory for the staged top-k");
    }
    TopkKernel<true><<<blocks, kTopkThreads, shared, stream>>>(scores, visible, picks, d.slots,
                                                               static_cast<int>(d.top_k), sort_size);
  } else {
    TopkKernel<false><<<blocks, kTopkThreads, cand_bytes, stream>>>(scores, visible, picks, d.slots,
                                                                    static_cast<int>(d.top_k), sort_size);
  }
  return ffi::Error::Success();
}

template <typename In>
ffi::Error LaunchScores(cudaStream_t stream, const void* queries, const float* weights, const void* keys,
                        const int32_t* visible, float* scores, const SelectDims& d) {
  const float scale = static_cast<float>(std::pow(static_cast<double>(d.dim), -0.5));
  if constexpr (std::is_same_v<In, __nv_bfloat16>) {
    if (d.heads % 16 == 0 && d.dim % 16 == 0) {  // the tensor-core path
      const size_t tc_shared = TcSharedBytes(static_cast<int>(d.heads), static_cast<int>(d.dim));
      if (tc_shared > 48 * 1024 &&
          cudaFuncSetAttribute(ScoreKernelTc, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(tc_shared)) != cudaSuccess) {
        return ffi::Error::InvalidArgument("dsv4 select_topk (CUDA): index_n_heads * index_head_dim too large");
      }
      // Enough blocks to fill the card (~4 per SM of an H200), each as many tiles as that allows (<= 8).
      const int64_t rows = d.rows * d.seq, tiles_total = (d.slots + kTcEntries - 1) / kTcEntries;
      const int tiles = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(8, rows * tiles_total / 528)));
      const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>((tiles_total + tiles - 1) / tiles));
      ScoreKernelTc<<<grid, kTcWarps * 32, tc_shared, stream>>>(
          static_cast<const __nv_bfloat16*>(queries), weights, static_cast<const __nv_bfloat16*>(keys), visible,
          scores, d.seq, static_cast<int>(d.heads), static_cast<int>(d.dim), d.slots, scale, tiles);
      return ffi::Error::Success();
    }
  }
  const size_t shared = static_cast<size_t>(d.heads * d.dim + d.heads) * sizeof(float);
  const bool fast = d.heads == kFastHeads && d.dim % 8 == 0;
  auto kernel = fast ? ScoreKernel<In, kFastHeads> : ScoreKernel<In, 0>;
  if (shared > 48 * 1024) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)) !=
        cudaSuccess) {
      return ffi::Error::InvalidArgument("dsv4 select_topk (CUDA): index_n_heads * index_head_dim too large");
    }
  }
  const dim3 grid(static_cast<unsigned>(d.rows * d.seq), static_cast<unsigned>((d.slots + kScoreThreads - 1) / kScoreThreads));
  kernel<<<grid, kScoreThreads, shared, stream>>>(static_cast<const In*>(queries), weights, static_cast<const In*>(keys),
                                                  visible, scores, d.seq, static_cast<int>(d.heads),
                                                  static_cast<int>(d.dim), d.slots, scale);
  return ffi::Error::Success();
}

ffi::Error LastLaunchError() {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("dsv4 select_topk (CUDA): ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error SelectTopkImpl(cudaStream_t stream, ffi::AnyBuffer queries, ffi::Buffer<ffi::F32> weights,
                          ffi::AnyBuffer keys, ffi::Buffer<ffi::S32> visible, ffi::Result<ffi::Buffer<ffi::S32>> picks,
                          ffi::Result<ffi::Buffer<ffi::F32>> scores) {
  SelectDims d;
  if (ffi::Error e = ParseDims(&queries, weights.dimensions(), keys.dimensions(), visible.dimensions(),
                               picks->dimensions(), scores->dimensions(), &d);
      e.failure()) {
    return e;
  }
  if (queries.element_type() != keys.element_type()) {
    return ffi::Error::InvalidArgument("dsv4 select_topk: queries and keys must share a dtype");
  }
  if (d.rows * d.seq == 0 || d.slots == 0) return ffi::Error::Success();
  ffi::Error launched = ffi::Error::Success();
  switch (queries.element_type()) {
    case ffi::DataType::F32:
      launched = LaunchScores<float>(stream, queries.untyped_data(), weights.typed_data(), keys.untyped_data(),
                                     visible.typed_data(), scores->typed_data(), d);
      break;
    case ffi::DataType::BF16:
      launched = LaunchScores<__nv_bfloat16>(stream, queries.untyped_data(), weights.typed_data(), keys.untyped_data(),
                                             visible.typed_data(), scores->typed_data(), d);
      break;
    default:
      return ffi::Error::InvalidArgument("dsv4 select_topk: queries/keys must be float32 or bfloat16");
  }
  if (launched.failure()) return launched;
  if (ffi::Error e = LaunchTopk(stream, scores->typed_data(), visible.typed_data(), picks->typed_data(), d); e.failure()) {
    return e;
  }
  return LastLaunchError();
}

ffi::Error TopkImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> scores, ffi::Buffer<ffi::S32> visible,
                    ffi::Result<ffi::Buffer<ffi::S32>> picks) {
  SelectDims d;
  if (ffi::Error e = ParseDims(nullptr, {}, scores.dimensions(), visible.dimensions(), picks->dimensions(), {}, &d);
      e.failure()) {
    return e;
  }
  if (d.rows * d.seq == 0 || d.slots == 0) return ffi::Error::Success();
  if (ffi::Error e = LaunchTopk(stream, scores.typed_data(), visible.typed_data(), picks->typed_data(), d); e.failure()) {
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
      .Ret<ffi::Buffer<ffi::F32>>()
#define DSV4_TOPK_BINDING                            \
  ffi::Ffi::Bind()                                   \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()      \
      .Arg<ffi::Buffer<ffi::F32>>()                  \
      .Arg<ffi::Buffer<ffi::S32>>()                  \
      .Ret<ffi::Buffer<ffi::S32>>()

// The eager break: no traits, so XLA ends its command buffer before this thunk.
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SelectTopkCudaEager, dsv4::SelectTopkImpl, DSV4_SELECT_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4TopkCudaEager, dsv4::TopkImpl, DSV4_TOPK_BINDING);
// Captured inside XLA's CUDA graph (no allocation, no sync in the handler).
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SelectTopkCudaGraph, dsv4::SelectTopkImpl, DSV4_SELECT_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4TopkCudaGraph, dsv4::TopkImpl, DSV4_TOPK_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});

// ---------------------------------------------------------------------------- Python module
namespace {

PyObject* Registrations(PyObject*, PyObject*) {
  // Eager: the break (XLA ends its CUDA graph around it); _graph: captured in the graph.
  static const dsv4::Target targets[] = {
      {"dsv4_select_topk", reinterpret_cast<void*>(&Dsv4SelectTopkCudaEager)},
      {"dsv4_select_topk_graph", reinterpret_cast<void*>(&Dsv4SelectTopkCudaGraph)},
      {"dsv4_topk", reinterpret_cast<void*>(&Dsv4TopkCudaEager)},
      {"dsv4_topk_graph", reinterpret_cast<void*>(&Dsv4TopkCudaGraph)},
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
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_cuda", "dsv4_jax CUDA FFI handlers", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__native_cuda(void) { return PyModule_Create(&kModule); }
