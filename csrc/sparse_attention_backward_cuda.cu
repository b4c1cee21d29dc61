// The CUDA backward of CSA's sparse attention (contract in sparse_attention_backward.h): the
// gradient of `sparse_attention_kernel` for bf16, 64 heads of 512 channels, keys by index.
//
// One block of 8 warps a query row r (launched in the Triton kernel's spread order), all 64
// heads, so a key's gradient is summed over every head before its one atomic add: half the
// Triton kernel's float32 adds (whose programs take 32 heads; its adds were ~38% of its time
// at CSA B = 4 4k). The keys come in blocks of 32 by index (the window's, then the picked
// entries'), gathered with cp.async into padded shared rows one block ahead:
//
//   shared   q, do [64, D] (the row's), keys [2][32, D], ds and p [64, 32] bf16
//   per key block, on mma.sync m16n8k16 (bf16 in, float32 accumulate):
//     s, dp   [64, 32]   q k^T, do k^T (warp w: heads 16 (w % 4).., keys 16 (w / 4)..)
//     p       exp(round(round(s) * scale) - lse), 0 for a key of index -1 (the forward's rounding)
//     ds      p (dp - delta) scale, rounded to bf16, and p rounded, into shared memory
//     dq     += ds k         [64, D] float32 in registers (warp w: channels 64 w .. 64 w + 63)
//     dk      = ds^T q + p^T do   [32, D] (warp w: the same channels), 16 keys at a time, added
//                                  with relaxed 4-wide float atomics at the key's index
//   delta = sum(do o) over the unrotated channels + delta_rotated, from global memory at the start.
// The numerics are the Triton kernel's (dsv4_jax/sparse_attention_backward.py) up to the order
// of float32 sums: the same roundings of s, ds and p, dq rounded once.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "mma_sm80.h"
#include "sparse_attention_backward.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace dsv4 {
namespace {

constexpr int kHeads = 64;
constexpr int kDim = 512;
constexpr int kKeys = 32;                // keys a block
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kLd = kDim + 8;            // bf16 a shared row of q, do, keys: conflict-free ldmatrix
constexpr int kLdS = kKeys + 8;          // bf16 a shared row of ds, p
constexpr int kChunks = kDim / 8;         // 16-byte chunks a row
constexpr unsigned kAll = 0xffffffffu;

constexpr size_t kSharedBytes =
    sizeof(__nv_bfloat16) * (2 * kHeads * kLd + 2 * kKeys * kLd + 2 * kHeads * kLdS) +
    sizeof(float) * 2 * kHeads + sizeof(int32_t) * 2 * kKeys;

struct Args {
  const __nv_bfloat16* q;
  const __nv_bfloat16* dout;
  const __nv_bfloat16* o;
  const float* lse;
  const float* delta_rotated;
  const __nv_bfloat16* pool;
  const int32_t* window;
  const __nv_bfloat16* entries;
  const int32_t* picks;
  __nv_bfloat16* dq;
  float* dpool;
  float* dentries;
  float* delta;
  int64_t rows, rows_per_source, pool_slots, entry_slots;
  int window_len, picks_len, groups, rotated, stretches;
  float scale;
};

__device__ __forceinline__ float RoundBf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ void RelaxedAdd4(float* p, float a, float b, float c, float d) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c),
               "f"(d)
               : "memory");
}

__global__ void __launch_bounds__(kThreads, 1) BackwardKernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem);  // [64][kLd]
  __nv_bfloat16* do_s = q_s + kHeads * kLd;                       // [64][kLd]
  __nv_bfloat16* k_s = do_s + kHeads * kLd;                       // [2][32][kLd]
  __nv_bfloat16* ds_s = k_s + 2 * kKeys * kLd;                    // [64][kLdS]
  __nv_bfloat16* p_s = ds_s + kHeads * kLdS;                      // [64][kLdS]
  float* lse_s = reinterpret_cast<float*>(p_s + kHeads * kLdS);   // [64]
  float* delta_s = lse_s + kHeads;                                // [64]
  int32_t* idx_s = reinterpret_cast<int32_t*>(delta_s + kHeads);  // [2][32]
  __shared__ int last_pick;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t launch = blockIdx.x;
  const int64_t r = a.stretches == 1 ? launch : (launch % a.stretches) * (a.rows / a.stretches) + launch / a.stretches;
  const int64_t src = r / a.rows_per_source;
  const int hpg = kHeads / a.groups;
  auto dout_row = [&](int h) { return a.dout + ((static_cast<int64_t>(h / hpg) * a.rows + r) * hpg + h % hpg) * kDim; };

  // The row's queries and cotangent into shared memory (the first cp.async group, with key block 0).
  for (int v = tid; v < kHeads * kChunks; v += kThreads) {
    const int h = v / kChunks, c = v % kChunks;
    CpAsync16(q_s + h * kLd + 8 * c, a.q + (r * kHeads + h) * kDim + 8 * c, true);
    CpAsync16(do_s + h * kLd + 8 * c, dout_row(h) + 8 * c, true);
  }
  if (tid == 0) last_pick = 0;
  __syncthreads();
  for (int t = tid; t < a.picks_len; t += kThreads) {
    if (a.picks[r * a.picks_len + t] >= 0) atomicMax(&last_pick, t + 1);
  }
  __syncthreads();
  const int window_blocks = (a.window_len + kKeys - 1) / kKeys;
  const int n_blocks = window_blocks + (last_pick + kKeys - 1) / kKeys;

  // Key block `blk` (the window's first, then the picks') into buffer `buf`, its indices into idx_s.
  auto load_block = [&](int blk, int buf) {
    const bool win = blk < window_blocks;
    const int first = (win ? blk : blk - window_blocks) * kKeys;
    const int32_t* idx = win ? a.window + r * a.window_len : a.picks + r * a.picks_len;
    const int len = win ? a.window_len : a.picks_len;
    const __nv_bfloat16* base = win ? a.pool + src * a.pool_slots * kDim : a.entries + src * a.entry_slots * kDim;
    __nv_bfloat16* dst = k_s + buf * kKeys * kLd;
    for (int v = tid; v < kKeys * kChunks; v += kThreads) {
      const int e = v / kChunks, c = v % kChunks;
      const int32_t id = first + e < len ? __ldg(idx + first + e) : -1;
      CpAsync16(dst + e * kLd + 8 * c, base + static_cast<int64_t>(id < 0 ? 0 : id) * kDim + 8 * c, id >= 0);
    }
    if (tid < kKeys) idx_s[buf * kKeys + tid] = first + tid < len ? idx[first + tid] : -1;
  };
  if (n_blocks > 0) load_block(0, 0);
  CpAsyncCommit();

  // delta = do . o over the unrotated channels (+ the rotated ones' share), from global memory.
  for (int h = warp; h < kHeads; h += kWarps) {
    const __nv_bfloat16* dp = dout_row(h);
    const __nv_bfloat16* op = a.o + (r * kHeads + h) * kDim;
    float sum = 0.0f;
    for (int c = lane; c < kChunks; c += 32) {
      const uint4 x = *reinterpret_cast<const uint4*>(dp + 8 * c);
      const uint4 y = *reinterpret_cast<const uint4*>(op + 8 * c);
      const __nv_bfloat162* xs = reinterpret_cast<const __nv_bfloat162*>(&x);
      const __nv_bfloat162* ys = reinterpret_cast<const __nv_bfloat162*>(&y);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 xf = __bfloat1622float2(xs[j]), yf = __bfloat1622float2(ys[j]);
        if (8 * c + 2 * j < kDim - a.rotated) sum = fmaf(xf.x, yf.x, sum);
        if (8 * c + 2 * j + 1 < kDim - a.rotated) sum = fmaf(xf.y, yf.y, sum);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(kAll, sum, off);
    if (lane == 0) {
      if (a.rotated > 0) sum += a.delta_rotated[r * kHeads + h];
      delta_s[h] = sum;
      a.delta[r * kHeads + h] = sum;
    }
  }
  if (tid < kHeads) lse_s[tid] = a.lse[r * kHeads + tid];

  const float scale = a.scale;
  const float scale_bf16 = RoundBf16(scale);
  float dq[4][8][4];  // heads 16 m + .., channels 64 warp + 8 n + ..
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int n = 0; n < 8; ++n) dq[m][n][0] = dq[m][n][1] = dq[m][n][2] = dq[m][n][3] = 0.0f;

  for (int blk = 0; blk < n_blocks; ++blk) {
    const int buf = blk & 1;
    if (blk + 1 < n_blocks) {
      load_block(blk + 1, buf ^ 1);  // into the buffer block blk - 1 used (released by the loop's last barrier)
      CpAsyncCommit();
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();  // block blk's keys and indices (and q, do, delta, lse) in place
    const __nv_bfloat16* keys = k_s + buf * kKeys * kLd;
    const int32_t* ids = idx_s + buf * kKeys;

    // s and dp: heads 16 mt .. 16 mt + 15, keys 16 nh .. 16 nh + 15 (two 8-key tiles).
    {
      const int mt = warp & 3, nh = warp >> 2;
      float s_acc[2][4] = {}, dp_acc[2][4] = {};
      const __nv_bfloat16* qa = q_s + (16 * mt + (lane & 15)) * kLd + (lane >> 4) * 8;
      const __nv_bfloat16* da = do_s + (16 * mt + (lane & 15)) * kLd + (lane >> 4) * 8;
      const __nv_bfloat16* kb = keys + (16 * nh + (lane >> 4) * 8 + (lane & 7)) * kLd + ((lane >> 3) & 1) * 8;
#pragma unroll 4
      for (int d0 = 0; d0 < kDim; d0 += 16) {
        uint32_t aq[4], ad[4], bk[4];
        LdMatrixX4(aq, qa + d0);
        LdMatrixX4(ad, da + d0);
        LdMatrixX4(bk, kb + d0);
        MmaBf16(s_acc[0], aq, bk[0], bk[1]);
        MmaBf16(s_acc[1], aq, bk[2], bk[3]);
        MmaBf16(dp_acc[0], ad, bk[0], bk[1]);
        MmaBf16(dp_acc[1], ad, bk[2], bk[3]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // rows lane / 4 and lane / 4 + 8
          const int h = 16 * mt + (lane >> 2) + 8 * half;
          const int key = 16 * nh + 8 * nt + 2 * (lane & 3);
          float ds_v[2], p_v[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float s = RoundBf16(RoundBf16(s_acc[nt][2 * half + j]) * scale_bf16);
            const float p = ids[key + j] >= 0 ? expf(s - lse_s[h]) : 0.0f;
            p_v[j] = p;
            ds_v[j] = p * (dp_acc[nt][2 * half + j] - delta_s[h]) * scale;
          }
          *reinterpret_cast<uint32_t*>(ds_s + h * kLdS + key) = PackBf16(ds_v[0], ds_v[1]);
          *reinterpret_cast<uint32_t*>(p_s + h * kLdS + key) = PackBf16(p_v[0], p_v[1]);
        }
      }
    }
    __syncthreads();  // ds and p of every head and key in place

    // dq += ds k: this warp's 64 channels, every head.
#pragma unroll
    for (int ks = 0; ks < kKeys / 16; ++ks) {
      uint32_t bk[4][4];
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        LdMatrixX4Trans(bk[np], keys + (16 * ks + ((lane >> 3) & 1) * 8 + (lane & 7)) * kLd + 64 * warp + 16 * np +
                                    (lane >> 4) * 8);
      }
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        uint32_t af[4];
        LdMatrixX4(af, ds_s + (16 * m + (lane & 15)) * kLdS + 16 * ks + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          MmaBf16(dq[m][2 * np], af, bk[np][0], bk[np][1]);
          MmaBf16(dq[m][2 * np + 1], af, bk[np][2], bk[np][3]);
        }
      }
    }

    // dk = ds^T q + p^T do for 16 keys at a time, this warp's 64 channels; one add a key.
#pragma unroll 1
    for (int mk = 0; mk < kKeys / 16; ++mk) {
      float dk[8][4] = {};
#pragma unroll
      for (int term = 0; term < 2; ++term) {
        const __nv_bfloat16* lhs = term == 0 ? ds_s : p_s;  // [heads][keys]: A^T
        const __nv_bfloat16* rhs = term == 0 ? q_s : do_s;  // [heads][channels]
#pragma unroll
        for (int hs = 0; hs < kHeads / 16; ++hs) {
          uint32_t af[4];
          LdMatrixX4Trans(af, lhs + (16 * hs + (lane >> 4) * 8 + (lane & 7)) * kLdS + 16 * mk + ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            uint32_t bf[4];
            LdMatrixX4Trans(bf, rhs + (16 * hs + ((lane >> 3) & 1) * 8 + (lane & 7)) * kLd + 64 * warp + 16 * np +
                                    (lane >> 4) * 8);
            MmaBf16(dk[2 * np], af, bf[0], bf[1]);
            MmaBf16(dk[2 * np + 1], af, bf[2], bf[3]);
          }
        }
      }
      // Lanes 2i and 2i + 1 swap halves: the even lane adds row lane / 4's four channels, the
      // odd lane row lane / 4 + 8's.
      const bool odd = lane & 1;
      const int key = 16 * mk + (lane >> 2) + (odd ? 8 : 0);
      const int32_t id = ids[key];
      const bool win = blk < window_blocks;
      float* acc = win ? a.dpool + src * a.pool_slots * kDim : a.dentries + src * a.entry_slots * kDim;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const float send0 = odd ? dk[nt][0] : dk[nt][2];
        const float send1 = odd ? dk[nt][1] : dk[nt][3];
        const float got0 = __shfl_xor_sync(kAll, send0, 1);
        const float got1 = __shfl_xor_sync(kAll, send1, 1);
        const int col = 64 * warp + 8 * nt + 4 * ((lane & 3) >> 1);
        if (id >= 0) {
          float* dst = acc + static_cast<int64_t>(id) * kDim + col;
          if (odd) {
            RelaxedAdd4(dst, got0, got1, dk[nt][2], dk[nt][3]);
          } else {
            RelaxedAdd4(dst, dk[nt][0], dk[nt][1], got0, got1);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with this block's keys, ds and p
  }

  // dq, rounded once.
#pragma unroll
  for (int m = 0; m < 4; ++m) {
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int h = 16 * m + (lane >> 2) + 8 * half;
        const int col = 64 * warp + 8 * n + 2 * (lane & 3);
        *reinterpret_cast<uint32_t*>(a.dq + (r * kHeads + h) * kDim + col) =
            PackBf16(dq[m][n][2 * half], dq[m][n][2 * half + 1]);
      }
    }
  }
}

ffi::Error Fail(const std::string& what) {
  return ffi::Error::InvalidArgument("dsv4 sparse_attention_backward (CUDA): " + what);
}

ffi::Error BackwardImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> dout,
                        ffi::Buffer<ffi::BF16> o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta_rotated,
                        ffi::Buffer<ffi::BF16> pool, ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::BF16> entries,
                        ffi::Buffer<ffi::S32> picks, ffi::Result<ffi::Buffer<ffi::BF16>> dq,
                        ffi::Result<ffi::Buffer<ffi::F32>> dpool, ffi::Result<ffi::Buffer<ffi::F32>> dentries,
                        ffi::Result<ffi::Buffer<ffi::F32>> delta, float scale, int64_t rotated, int64_t stretches) {
  const auto qd = q.dimensions(), dd = dout.dimensions(), pd = pool.dimensions(), ed = entries.dimensions();
  const auto wd = window.dimensions(), kd = picks.dimensions();
  if (qd.size() != 3 || qd[1] != kHeads || qd[2] != kDim) return Fail("q must be [R, 64, 512]");
  const int64_t rows = qd[0];
  if (dd.size() != 4 || dd[1] != rows || dd[3] != kDim || dd[0] * dd[2] != kHeads || kHeads % dd[0] != 0) {
    return Fail("dout must be [G, R, 64 / G, 512]");
  }
  if (pd.size() != 3 || ed.size() != 3 || pd[2] != kDim || ed[2] != kDim || pd[0] != ed[0] || pd[0] < 1 ||
      rows % pd[0] != 0) {
    return Fail("pool and entries must be [B, ., 512] with R a multiple of B");
  }
  if (wd.size() != 2 || kd.size() != 2 || wd[0] != rows || kd[0] != rows) return Fail("window, picks: [R, .]");
  if (stretches < 1 || rows % stretches != 0) return Fail("stretches must divide the rows");
  if (rotated < 0 || rotated > kDim) return Fail("rotated out of range");
  const size_t pool_bytes = static_cast<size_t>(pd[0] * pd[1] * kDim) * sizeof(float);
  const size_t entry_bytes = static_cast<size_t>(ed[0] * ed[1] * kDim) * sizeof(float);
  if (cudaMemsetAsync(dpool->typed_data(), 0, pool_bytes, stream) != cudaSuccess ||
      cudaMemsetAsync(dentries->typed_data(), 0, entry_bytes, stream) != cudaSuccess) {
    return ffi::Error::Internal("dsv4 sparse_attention_backward (CUDA): memset failed");
  }
  if (rows == 0) return ffi::Error::Success();
  Args a;
  a.q = reinterpret_cast<const __nv_bfloat16*>(q.typed_data());
  a.dout = reinterpret_cast<const __nv_bfloat16*>(dout.typed_data());
  a.o = reinterpret_cast<const __nv_bfloat16*>(o.typed_data());
  a.lse = lse.typed_data();
  a.delta_rotated = delta_rotated.typed_data();
  a.pool = reinterpret_cast<const __nv_bfloat16*>(pool.typed_data());
  a.window = window.typed_data();
  a.entries = reinterpret_cast<const __nv_bfloat16*>(entries.typed_data());
  a.picks = picks.typed_data();
  a.dq = reinterpret_cast<__nv_bfloat16*>(dq->typed_data());
  a.dpool = dpool->typed_data();
  a.dentries = dentries->typed_data();
  a.delta = delta->typed_data();
  a.rows = rows;
  a.rows_per_source = rows / pd[0];
  a.pool_slots = pd[1];
  a.entry_slots = ed[1];
  a.window_len = static_cast<int>(wd[1]);
  a.picks_len = static_cast<int>(kd[1]);
  a.groups = static_cast<int>(dd[0]);
  a.rotated = static_cast<int>(rotated);
  a.stretches = static_cast<int>(stretches);
  a.scale = scale;
  // Per launch, not once: the attribute belongs to the current device's context (the selection's
  // handlers do the same, `ReserveDynamicShared`).
  if (cudaFuncSetAttribute(BackwardKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kSharedBytes)) != cudaSuccess) {
    return ffi::Error::Internal("dsv4 sparse_attention_backward (CUDA): shared memory not available");
  }
  BackwardKernel<<<static_cast<unsigned>(rows), kThreads, kSharedBytes, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("dsv4 sparse_attention_backward (CUDA): ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace dsv4

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SparseAttentionBackward, dsv4::BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("rotated")
                                  .Attr<int64_t>("stretches"),
                              {ffi::Traits::kCmdBufferCompatible});
