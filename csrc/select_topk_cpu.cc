// CPU handlers of the indexer's selection (contract in select_topk.h; dense keys or an FP8
// cache's packed FP4 keys, contiguous or in a paged cache's pool), and the Python module
// `dsv4_jax._native_cpu` that hands their XLA FFI capsules to dsv4_jax/native.py.
//
// On the CPU there are no command buffers, so the "eager" and "graph" targets are one handler.
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "finite_flag.h"
#include "python_module.h"
#include "select_topk.h"

namespace ffi = xla::ffi;

namespace dsv4 {
namespace {

inline float LoadF32(const float* p, int64_t i) { return p[i]; }
inline float LoadF32(const uint16_t* p, int64_t i) {  // bfloat16 -> float32 is exact
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The K best of scores[0, n) into picks[0, K): descending score, ties to the lower index, -1 after.
void SelectRow(const float* scores, int64_t n, int64_t top_k, int32_t* picks, std::vector<uint64_t>& buf) {
  buf.resize(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) buf[t] = CompositeKey(OrderedKeyHost(scores[t]), static_cast<uint32_t>(t));
  const int64_t k = std::min(n, top_k);
  if (k < n) std::nth_element(buf.begin(), buf.begin() + k, buf.end(), std::greater<uint64_t>());
  std::sort(buf.begin(), buf.begin() + k, std::greater<uint64_t>());
  for (int64_t i = 0; i < k; ++i) picks[i] = IndexOfComposite(buf[i]);
  for (int64_t i = k; i < top_k; ++i) picks[i] = -1;
}

inline int64_t VisibleCount(int32_t visible, int64_t slots) {
  return std::min<int64_t>(std::max<int32_t>(visible, 0), slots);
}

inline float BitsToFloat(uint32_t bits) {
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Key rows as float32, read at the address `rows` gives (select_topk.h: contiguous keys, or a
// paged pool's rows; a missing page reads as zeros): dense keys of the queries' dtype...
template <typename In, typename Rows>
struct DenseKeys {
  const In* keys;  // [key rows, dim]
  Rows rows;
  void operator()(const SelectDims& d, int64_t b, int64_t t, float* out) const {
    const int64_t key = rows(b, t);
    if (Rows::kMayMiss && key < 0) return std::fill(out, out + d.dim, 0.0f);
    const In* row = keys + key * d.dim;
    for (int64_t i = 0; i < d.dim; ++i) out[i] = LoadF32(row, i);
  }
};

// ...or an FP8 cache's packed FP4 keys (select_topk.h): code value times the block's scale.
template <typename Rows>
struct Fp4Keys {
  const uint8_t* codes;   // [key rows, dim / 2]
  const uint8_t* scales;  // [key rows, ceil(dim / 32)]
  Rows rows;
  void operator()(const SelectDims& d, int64_t b, int64_t t, float* out) const {
    const int64_t key = rows(b, t);
    if (Rows::kMayMiss && key < 0) return std::fill(out, out + d.dim, 0.0f);
    const uint8_t* c = codes + key * (d.dim / 2);
    const uint8_t* s = scales + key * ((d.dim + kFp4Block - 1) / kFp4Block);
    for (int64_t i = 0; i < d.dim; ++i) {
      const uint32_t code = (c[i / 2] >> (4 * (i & 1))) & 0xFu;
      out[i] = BitsToFloat(Fp4ValueBits(code)) * BitsToFloat(Fp4ScaleBits(s[i / kFp4Block]));
    }
  }
};

template <typename In, typename Keys>
void Select(const In* queries, const float* weights, const Keys& key_row, const int32_t* visible, int32_t* picks,
            float* scores, const SelectDims& d) {
  const float scale = static_cast<float>(std::pow(static_cast<double>(d.dim), -0.5));  // c^-1/2 as float32
  std::vector<float> q(static_cast<size_t>(d.heads * d.dim));
  std::vector<float> k(static_cast<size_t>(d.dim));
  std::vector<uint64_t> buf;
  for (int64_t b = 0; b < d.rows; ++b) {
    for (int64_t s = 0; s < d.seq; ++s) {
      const int64_t row = b * d.seq + s;
      const In* q_row = queries + row * d.heads * d.dim;
      const float* w_row = weights + row * d.heads;
      float* out = scores + row * d.slots;
      for (int64_t i = 0; i < d.heads * d.dim; ++i) q[i] = LoadF32(q_row, i);
      const int64_t n = VisibleCount(visible[row], d.slots);
      for (int64_t t = 0; t < n; ++t) {
        key_row(d, b, t, k.data());
        const float* kt = k.data();
        float total = 0.0f;
        for (int64_t h = 0; h < d.heads; ++h) {
          const float* qh = q.data() + h * d.dim;
          float dot = 0.0f;
          // A vectorized float32 sum (its order, like BLAS's or XLA's, is not the sequential one).
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < d.dim; ++i) dot += qh[i] * kt[i];
          total += std::max(dot, 0.0f) * scale * w_row[h];  // the reference's order of operations
        }
        out[t] = total == 0.0f ? 0.0f : total;  // fold -0.0 into +0.0: ties must compare equal
      }
      std::fill(out + n, out + d.slots, -std::numeric_limits<float>::infinity());
      SelectRow(out, n, d.top_k, picks + row * d.top_k, buf);
    }
  }
}

// Scores and picks with the key reader `keys_for(In{})` gives for the queries' dtype In
// (float32 or bfloat16 bits): one dtype switch for both key forms.
template <typename KeysFor>
ffi::Error SelectFor(ffi::AnyBuffer& queries, ffi::Buffer<ffi::F32>& weights, ffi::Buffer<ffi::S32>& visible,
                     ffi::Result<ffi::Buffer<ffi::S32>>& picks, ffi::Result<ffi::Buffer<ffi::F32>>& scores,
                     const SelectDims& d, KeysFor keys_for) {
  switch (queries.element_type()) {
    case ffi::DataType::F32:
      Select(static_cast<const float*>(queries.untyped_data()), weights.typed_data(), keys_for(float{}),
             visible.typed_data(), picks->typed_data(), scores->typed_data(), d);
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      Select(static_cast<const uint16_t*>(queries.untyped_data()), weights.typed_data(), keys_for(uint16_t{}),
             visible.typed_data(), picks->typed_data(), scores->typed_data(), d);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("dsv4 select_topk: queries must be float32 or bfloat16");
  }
}

// The selection over keys [..., T, c], or (`table` given) over a paged pool [N, c] with its
// table [..., P_row] and `page_entries` (select_topk.h): one reader, two address functors.
ffi::Error SelectDense(ffi::AnyBuffer& queries, ffi::Buffer<ffi::F32>& weights, ffi::AnyBuffer& keys,
                       ffi::Buffer<ffi::S32>& visible, ffi::Result<ffi::Buffer<ffi::S32>>& picks,
                       ffi::Result<ffi::Buffer<ffi::F32>>& scores, const ffi::Buffer<ffi::S32>* table,
                       int64_t page_entries) {
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
  if (ffi::Error e = ParseDims(&queries, weights.dimensions(), key_dims, visible.dimensions(), picks->dimensions(),
                               scores->dimensions(), &d);
      e.failure()) {
    return e;
  }
  if (queries.element_type() != keys.element_type()) {
    return ffi::Error::InvalidArgument("dsv4 select_topk: queries and keys must share a dtype");
  }
  if (table != nullptr) {
    return SelectFor(queries, weights, visible, picks, scores, d, [&](auto in) {
      using In = decltype(in);
      return DenseKeys<In, PagedRows>{static_cast<const In*>(keys.untyped_data()), paged};
    });
  }
  return SelectFor(queries, weights, visible, picks, scores, d, [&](auto in) {
    using In = decltype(in);
    return DenseKeys<In, ContiguousRows>{static_cast<const In*>(keys.untyped_data()), ContiguousRows{d.slots}};
  });
}

// The same over packed FP4 keys (select_topk.h): the scores of the keys they stand for, dequantized.
ffi::Error SelectFp4(ffi::AnyBuffer& queries, ffi::Buffer<ffi::F32>& weights, ffi::Buffer<ffi::U8>& codes,
                     ffi::Buffer<ffi::U8>& key_scales, ffi::Buffer<ffi::S32>& visible,
                     ffi::Result<ffi::Buffer<ffi::S32>>& picks, ffi::Result<ffi::Buffer<ffi::F32>>& scores,
                     const ffi::Buffer<ffi::S32>* table, int64_t page_entries) {
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
  if (table != nullptr) {
    const Fp4Keys<PagedRows> keys{codes.typed_data(), key_scales.typed_data(), paged};
    return SelectFor(queries, weights, visible, picks, scores, d, [&](auto) { return keys; });
  }
  const Fp4Keys<ContiguousRows> keys{codes.typed_data(), key_scales.typed_data(), ContiguousRows{d.slots}};
  return SelectFor(queries, weights, visible, picks, scores, d, [&](auto) { return keys; });
}

ffi::Error SelectTopkImpl(ffi::AnyBuffer queries, ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer keys,
                          ffi::Buffer<ffi::S32> visible, ffi::Result<ffi::Buffer<ffi::S32>> picks,
                          ffi::Result<ffi::Buffer<ffi::F32>> scores,
                          ffi::Result<ffi::AnyBuffer> /*workspace*/) {
  return SelectDense(queries, weights, keys, visible, picks, scores, nullptr, 0);
}

ffi::Error SelectTopkPagedImpl(ffi::AnyBuffer queries, ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer pool,
                               ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> visible,
                               ffi::Result<ffi::Buffer<ffi::S32>> picks, ffi::Result<ffi::Buffer<ffi::F32>> scores,
                               ffi::Result<ffi::AnyBuffer> /*workspace*/, int64_t page_entries) {
  return SelectDense(queries, weights, pool, visible, picks, scores, &table, page_entries);
}

ffi::Error SelectTopkFp4Impl(ffi::AnyBuffer queries, ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::U8> codes,
                             ffi::Buffer<ffi::U8> key_scales, ffi::Buffer<ffi::S32> visible,
                             ffi::Result<ffi::Buffer<ffi::S32>> picks, ffi::Result<ffi::Buffer<ffi::F32>> scores,
                             ffi::Result<ffi::AnyBuffer> /*workspace*/) {
  return SelectFp4(queries, weights, codes, key_scales, visible, picks, scores, nullptr, 0);
}

ffi::Error SelectTopkFp4PagedImpl(ffi::AnyBuffer queries, ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::U8> codes,
                                  ffi::Buffer<ffi::U8> key_scales, ffi::Buffer<ffi::S32> table,
                                  ffi::Buffer<ffi::S32> visible, ffi::Result<ffi::Buffer<ffi::S32>> picks,
                                  ffi::Result<ffi::Buffer<ffi::F32>> scores,
                                  ffi::Result<ffi::AnyBuffer> /*workspace*/, int64_t page_entries) {
  return SelectFp4(queries, weights, codes, key_scales, visible, picks, scores, &table, page_entries);
}

ffi::Error TopkImpl(ffi::Buffer<ffi::F32> scores, ffi::Buffer<ffi::S32> visible,
                    ffi::Result<ffi::Buffer<ffi::S32>> picks,
                    ffi::Result<ffi::AnyBuffer> /*workspace*/) {
  SelectDims d;
  if (ffi::Error e = ParseDims(nullptr, {}, scores.dimensions(), visible.dimensions(), picks->dimensions(), {}, &d);
      e.failure()) {
    return e;
  }
  std::vector<uint64_t> buf;
  for (int64_t row = 0; row < d.rows * d.seq; ++row) {
    SelectRow(scores.typed_data() + row * d.slots, VisibleCount(visible.typed_data()[row], d.slots), d.top_k,
              picks->typed_data() + row * d.top_k, buf);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace dsv4

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SelectTopkCpu, dsv4::SelectTopkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());  // the CUDA top-k's workspace: unused

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SelectTopkFp4Cpu, dsv4::SelectTopkFp4Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());

// The _paged targets: the keys' operand is a paged pool [N, .], then the table [..., P_row].
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SelectTopkPagedCpu, dsv4::SelectTopkPagedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("page_entries"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SelectTopkFp4PagedCpu, dsv4::SelectTopkFp4PagedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("page_entries"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4TopkCpu, dsv4::TopkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());  // the CUDA top-k's workspace: unused

// ---------------------------------------------------------------------------- Python module
namespace {

PyObject* Registrations(PyObject*, PyObject*) {
  // On the CPU there are no command buffers: both names of a target run one handler.
  static const dsv4::Target targets[] = {
      {"dsv4_select_topk", reinterpret_cast<void*>(&Dsv4SelectTopkCpu)},
      {"dsv4_select_topk_graph", reinterpret_cast<void*>(&Dsv4SelectTopkCpu)},
      {"dsv4_select_topk_fp4", reinterpret_cast<void*>(&Dsv4SelectTopkFp4Cpu)},
      {"dsv4_select_topk_fp4_graph", reinterpret_cast<void*>(&Dsv4SelectTopkFp4Cpu)},
      {"dsv4_select_topk_paged", reinterpret_cast<void*>(&Dsv4SelectTopkPagedCpu)},
      {"dsv4_select_topk_paged_graph", reinterpret_cast<void*>(&Dsv4SelectTopkPagedCpu)},
      {"dsv4_select_topk_fp4_paged", reinterpret_cast<void*>(&Dsv4SelectTopkFp4PagedCpu)},
      {"dsv4_select_topk_fp4_paged_graph", reinterpret_cast<void*>(&Dsv4SelectTopkFp4PagedCpu)},
      {"dsv4_topk", reinterpret_cast<void*>(&Dsv4TopkCpu)},
      {"dsv4_topk_graph", reinterpret_cast<void*>(&Dsv4TopkCpu)},
      {"dsv4_finite_flag", reinterpret_cast<void*>(&Dsv4FiniteFlag)},  // finite_flag_cpu.cc
  };
  return dsv4::CapsuleDict(targets);
}

PyObject* BuildInfo(PyObject*, PyObject*) {
  return Py_BuildValue("{s:s,s:s,s:s}", "ffi_api",
                       (std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR)).c_str(),
                       "compiler", __VERSION__, "platform", "cpu");
}

PyMethodDef kMethods[] = {
    {"registrations", Registrations, METH_NOARGS, "FFI target name -> handler capsule."},
    {"build_info", BuildInfo, METH_NOARGS, "How this module was built."},
    {"finite_flag_slots", Dsv4FiniteFlagSlots, METH_NOARGS,
     "(address, count) of the finite flag's host slots (finite_flag.h)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_cpu", "dsv4_jax CPU FFI handlers", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__native_cpu(void) { return PyModule_Create(&kModule); }
