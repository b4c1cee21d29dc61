// A few token rows against a large weight (contract in project_few_rows.h): a decode step's
// projections as one weight stream, for 1-8 rows.
//
// At 1-8 rows a projection reads each weight once and does 2-16 FLOPs a weight, so its time is
// the weights' bytes over the memory bandwidth; what matters is how many reads are in flight.
// A block of 256 threads owns 64 output columns of one group and 1/S of K:
//
//   thread t   column vector v = t % 8 (8 columns, one 16-byte load a weight row), K lane t / 8
//              (32 lanes: lane l reads rows l, l + 32, ...; a warp reads 4 rows of 128 bytes)
//   x          the block's rows of x staged in shared memory as float32 [M, K / S]
//   loop       8 weight loads in flight a thread, then 8 M float32 FMAs a load
//   sums       the 32 lanes' partial sums: shuffles within a warp, then the 8 warps in order
//              through shared memory -> [M, 64] float32 a block
//   K splits   the S blocks of a column block form a thread block cluster (S <= 8); after a
//              cluster barrier each block sums its share of the [M, 64] outputs over the S
//              blocks' shared memory (distributed shared memory), in rank order, and rounds once
//
// Every sum runs in a fixed order, so a call gives the same bits every time; against XLA's GEMM
// only the order of the float32 sums differs (one rounding to bf16 in both).
// S is the caller's (dsv4_jax/projection_kernel.py `cuda_splits`: enough blocks for the card,
// the staged rows within 32 KiB).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "project_few_rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace cg = cooperative_groups;

namespace dsv4 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVectors = 8;                      // 16-byte column vectors a block
constexpr int kColumns = 8 * kVectors;           // output columns a block
constexpr int kLanes = kThreads / kVectors;      // K lanes a block
constexpr int kUnroll = 8;                       // weight loads in flight a thread
constexpr int kStagedFloats = 8192;              // x staged: M * K / S floats (32 KiB)
constexpr int kMaxSplits = 8;                    // a portable cluster
constexpr int64_t kRowsStep = kLanes * kUnroll;  // K / S must be a multiple of it

struct Args {
  const __nv_bfloat16* x;  // [rows, groups * k]
  const uint4* w;          // [groups, k, n] as 16-byte vectors
  __nv_bfloat16* out;      // [rows, groups * n]
  int64_t k, n;
  int groups, rows, splits;
};

// A weight vector read once: not kept in L1 (the stream never comes back to it).
__device__ __forceinline__ uint4 LoadStream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float Low(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float High(uint32_t pair) { return __uint_as_float(pair & 0xffff0000u); }

template <int M>
__global__ void __launch_bounds__(kThreads) ProjectKernel(Args a) {
  __shared__ float staged[kStagedFloats];  // x [M, kb]; after the loop the warps' sums [kWarps, M, 64]
  __shared__ float partial[M * kColumns];  // the block's sums [M, 64]
  const int t = threadIdx.x, v = t % kVectors, lane = t / kVectors;
  const int split = static_cast<int>(blockIdx.x % a.splits);  // the block's rank in its cluster
  const int64_t column_block = blockIdx.x / a.splits;
  const int g = blockIdx.y;
  const int64_t kb = a.k / a.splits, k0 = split * kb;
  const int64_t x_stride = static_cast<int64_t>(a.groups) * a.k;

  for (int64_t i = t; i < M * kb; i += kThreads) {
    const int m = static_cast<int>(i / kb);
    staged[i] = m < a.rows ? __bfloat162float(a.x[m * x_stride + g * a.k + k0 + (i - m * kb)]) : 0.0f;
  }
  __syncthreads();

  float acc[M][8];
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[m][j] = 0.0f;
  }
  const int64_t n0 = column_block * kColumns;
  const int64_t row_vectors = a.n / 8;
  const uint4* wp = a.w + (static_cast<int64_t>(g) * a.k + k0 + lane) * row_vectors + n0 / 8 + v;
  const int64_t lane_step = kLanes * row_vectors;
  for (int64_t s = 0; s < kb / kLanes; s += kUnroll) {
    uint4 wv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) wv[u] = LoadStream(wp + (s + u) * lane_step);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t kk = lane + (s + u) * kLanes;
      const float wf[8] = {Low(wv[u].x), High(wv[u].x), Low(wv[u].y), High(wv[u].y),
                           Low(wv[u].z), High(wv[u].z), Low(wv[u].w), High(wv[u].w)};
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float xv = staged[m * kb + kk];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[m][j] = fmaf(xv, wf[j], acc[m][j]);
      }
    }
  }

  // The 4 lanes of a warp (threads 8 apart), then the 8 warps in order.
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      acc[m][j] += __shfl_xor_sync(0xffffffffu, acc[m][j], 8);
      acc[m][j] += __shfl_xor_sync(0xffffffffu, acc[m][j], 16);
    }
  }
  __syncthreads();  // every thread is done with the staged rows
  const int warp = t / 32;
  if (t % 32 < kVectors) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int j = 0; j < 8; ++j) staged[(warp * M + m) * kColumns + v * 8 + j] = acc[m][j];
    }
  }
  __syncthreads();
  for (int p = t; p < M * kColumns; p += kThreads) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += staged[w * M * kColumns + p];
    partial[p] = sum;
  }

  const int64_t out_stride = static_cast<int64_t>(a.groups) * a.n;
  __nv_bfloat16* out = a.out + g * a.n + n0;
  if (a.splits == 1) {
    __syncthreads();
    for (int p = t; p < M * kColumns; p += kThreads) {
      const int m = p / kColumns;
      if (m < a.rows) out[m * out_stride + p % kColumns] = __float2bfloat16_rn(partial[p]);
    }
    return;
  }
  // K splits: block `split` sums outputs [split * share, (split + 1) * share) over the cluster.
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int share = M * kColumns / a.splits;
  for (int p = split * share + t; p < (split + 1) * share; p += kThreads) {
    float sum = 0.0f;
    for (int r = 0; r < a.splits; ++r) sum += cluster.map_shared_rank(partial, r)[p];
    const int m = p / kColumns;
    if (m < a.rows) out[m * out_stride + p % kColumns] = __float2bfloat16_rn(sum);
  }
  cluster.sync();  // no block leaves while another still reads its shared memory
}

ffi::Error Fail(const std::string& what) {
  return ffi::Error::InvalidArgument("dsv4 project_few_rows (CUDA): " + what);
}

template <int M>
cudaError_t Launch(cudaStream_t stream, const Args& a) {
  const dim3 grid(static_cast<unsigned>(a.n / kColumns * a.splits), static_cast<unsigned>(a.groups));
  if (a.splits == 1) {
    ProjectKernel<M><<<grid, kThreads, 0, stream>>>(a);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = static_cast<unsigned>(a.splits);
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, ProjectKernel<M>, a);
}

ffi::Error ProjectImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                       ffi::Result<ffi::Buffer<ffi::BF16>> out, int64_t splits) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || od.size() != 2) return Fail("expected x [M, G K], w [G, K, N], out [M, G N]");
  const int64_t rows = xd[0], groups = wd[0], k = wd[1], n = wd[2];
  if (rows < 1 || rows > 8) return Fail("x must have 1 to 8 rows, got " + std::to_string(rows));
  if (xd[1] != groups * k || od[0] != rows || od[1] != groups * n) return Fail("x, w and out disagree on G, K or N");
  if (n % kColumns != 0) return Fail("N must be a multiple of 64, got " + std::to_string(n));
  if (groups < 1 || groups > 65535) return Fail("G out of range");
  const int padded = rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8;
  if (splits < 1 || splits > kMaxSplits || (splits & (splits - 1)) != 0 || k % splits != 0 ||
      (k / splits) % kRowsStep != 0 || padded * (k / splits) > kStagedFloats) {
    return Fail("splits " + std::to_string(splits) + " does not fit K = " + std::to_string(k) +
                " (a power of two <= 8, K / splits a multiple of 256 with M K / splits <= 8192 staged)");
  }
  Args a;
  a.x = reinterpret_cast<const __nv_bfloat16*>(x.typed_data());
  a.w = reinterpret_cast<const uint4*>(w.typed_data());
  a.out = reinterpret_cast<__nv_bfloat16*>(out->typed_data());
  a.k = k;
  a.n = n;
  a.groups = static_cast<int>(groups);
  a.rows = static_cast<int>(rows);
  a.splits = static_cast<int>(splits);
  const cudaError_t err = padded == 1   ? Launch<1>(stream, a)
                          : padded == 2 ? Launch<2>(stream, a)
                          : padded == 4 ? Launch<4>(stream, a)
                                        : Launch<8>(stream, a);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("dsv4 project_few_rows (CUDA): ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace dsv4

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4ProjectFewRows, dsv4::ProjectImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("splits"),
                              {ffi::Traits::kCmdBufferCompatible});
