// The indexer's selection (dsv4_jax.indexer.select_topk), shared by the CPU and CUDA handlers.
//
// Contract (the same as the XLA and NumPy twins in dsv4_jax/indexer.py):
//   queries [..., S, nI, c]  float32 or bfloat16
//   weights [..., S, nI]     float32 (head weights, nI^-1/2 already folded in)
//   keys    [..., T, c]      same dtype as queries (the indexer's compressed keys)
//   visible [..., S]         int32: query s may see entries t < visible[s]
// ->
//   picks   [..., S, K]      int32: the K best visible entries, descending score, equal scores
//                            to the lower entry index, then -1 padding
//   scores  [..., S, T]      float32: sum_h w_h * relu(q_h . k_t) * c^-1/2, -0.0 folded into
//                            +0.0, -inf where t >= visible
// Leading dims "..." are any batch dims (the layer's batch, plus vmap's), equal on all operands.
//
// The top-k-only entry point takes scores [..., S, T] float32 and visible [..., S] and gives
// the picks, with the same ordering rule (scores at t >= visible are ignored).
//
// The selection over an FP8 cache's indexer keys (dsv4_jax.quantized_cache, grid "fp4") takes
// the keys in their stored form instead of keys [..., T, c]:
//   key_codes  [..., T, c / 2]       uint8: e2m1 codes two a byte, channel 2i in the low nibble
//   key_scales [..., T, ceil(c / 32)] uint8: UE8M0 exponent bytes, one a block of 32 channels
//                                    (2 ** (byte - 127); byte 0 is a zero scale)
// A key channel is e2m1(code) * scale, computed in float32: exact, and exactly the value the
// bf16 (or float32) cache holds, so the scores and picks equal those of the dequantized keys.
//
// The _paged targets read the keys straight from a paged cache's pool (dsv4_jax.cache.paged)
// instead of keys [..., T, c] (or codes / scales [..., T, .]):
//   keys       [N, c] (or key_codes [N, c / 2], key_scales [N, ceil(c / 32)]): the pool's
//              pages, flattened (N = pages * E, E = the attribute page_entries)
//   table      [..., P_row] int32: key t of batch row b is pool row table[b, t / E] * E + t % E;
//              a page -1 (or outside the pool) reads as a zero key (score 0), as the pages'
//              gathered view holds it. P_row * E >= T, T given by the scores output.
// One reader for both layouts: the key-row address functors below (contiguous: the identity).
//
// Both targets have a last output, workspace [..., S, W] int32, for the CUDA top-k: W = 0 (one
// block a row) or 2 * P * K, P > 1 segments a row, each taken by its own block (their K best
// pairs are merged after). The caller chooses P (dsv4_jax.native.topk_segments); the CPU
// handlers leave it untouched.
#pragma once

#include <cstdint>
#include <cstring>

namespace dsv4 {

// Order-preserving map of a float to uint32: a > b (as floats) iff key(a) > key(b), and -0.0
// has the key of +0.0 (they compare equal, so the lower index must win between them too).
// -inf maps to 0x007FFFFF, below every finite value; NaN with the sign bit set maps lower still.
inline uint32_t OrderedKeyHost(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if (bits == 0x80000000u) bits = 0u;  // -0.0 -> +0.0
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// A candidate's sort key: score key in the high half, the complemented index in the low half,
// so that a larger composite means "better" and equal scores put the lower index first. All
// composites of a row are distinct, which makes every selection below deterministic.
inline uint64_t CompositeKey(uint32_t score_key, uint32_t index) {
  return (static_cast<uint64_t>(score_key) << 32) | static_cast<uint64_t>(0xFFFFFFFFu - index);
}

inline int32_t IndexOfComposite(uint64_t composite) {
  return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(composite & 0xFFFFFFFFu));
}

#ifdef __CUDACC__
#define DSV4_HOST_DEVICE __host__ __device__
#else
#define DSV4_HOST_DEVICE
#endif

constexpr int kFp4Block = 32;  // channels a key scale byte covers

// float32 bits of an e2m1 code's value (bit 3 sign, bits 2-1 exponent with bias 1, bit 0
// mantissa): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code 8 is -0.0).
DSV4_HOST_DEVICE inline uint32_t Fp4ValueBits(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const uint32_t magnitude = e == 0 ? (m ? 0x3F000000u : 0u) : (((126u + e) << 23) | (m << 22));
  return magnitude | ((code & 8u) << 28);
}

// float32 bits of a UE8M0 scale byte: 2 ** (byte - 127); 0 gives +0.0 (an empty cache row).
DSV4_HOST_DEVICE inline uint32_t Fp4ScaleBits(uint32_t byte) { return byte << 23; }

// Where key t of batch row b lives among the key rows a handler was given: contiguous keys
// [rows, T, .] at row b * T + t (never missing)...
struct ContiguousRows {
  static constexpr bool kMayMiss = false;
  int64_t slots = 0;
  DSV4_HOST_DEVICE int64_t operator()(int64_t b, int64_t t) const { return b * slots + t; }
  // The row of key t0 where keys t0 .. t0 + n - 1 are consecutive rows, else -1: always here.
  DSV4_HOST_DEVICE int64_t Run(int64_t b, int64_t t0, int64_t /*n*/) const { return b * slots + t0; }
};

// ...or a paged pool [pages * E, .] at table[b, t / E] * E + t % E; -1 where the row holds no
// page there (or the table points outside the pool): the readers take a zero key.
struct PagedRows {
  static constexpr bool kMayMiss = true;
  const int32_t* table = nullptr;  // [rows, pages_per_row]
  int64_t pages_per_row = 0;
  int64_t entries = 1;  // E, entries a page
  int64_t pages = 0;    // pages in the pool
  DSV4_HOST_DEVICE int64_t operator()(int64_t b, int64_t t) const {
    const int64_t page = table[b * pages_per_row + t / entries];
    return page < 0 || page >= pages ? -1 : page * entries + t % entries;
  }
  // One table lookup for a run of n keys on one page that the row holds (a kernel's tile of
  // keys, page-aligned where E is a multiple of the tile): the row of key t0, else -1 (the run
  // crosses a page boundary or its page is missing: read key by key).
  DSV4_HOST_DEVICE int64_t Run(int64_t b, int64_t t0, int64_t n) const {
    const int64_t within = t0 % entries;
    if (within + n > entries) return -1;
    const int64_t page = table[b * pages_per_row + t0 / entries];
    return page < 0 || page >= pages ? -1 : page * entries + within;
  }
};

}  // namespace dsv4

// ---------------------------------------------------------------------------- shapes
// Included after the XLA FFI headers by each handler's translation unit.
#ifdef XLA_FFI_API_FFI_H_
#include <string>
#include <vector>

namespace dsv4 {

struct SelectDims {
  int64_t rows = 1;   // product of the leading batch dims
  int64_t seq = 0;    // S: queries per batch row
  int64_t heads = 0;  // nI
  int64_t dim = 0;    // c
  int64_t slots = 0;  // T
  int64_t top_k = 0;  // K
};

inline std::string DimsToString(xla::ffi::Span<const int64_t> dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

// Validates the operands of the selection (or, with `queries` == nullptr, of the top-k alone:
// then `keys_or_scores` is scores [..., S, T]) and returns their sizes.
inline xla::ffi::Error ParseDims(const xla::ffi::AnyBuffer* queries, xla::ffi::Span<const int64_t> weights,
                                 xla::ffi::Span<const int64_t> keys_or_scores, xla::ffi::Span<const int64_t> visible,
                                 xla::ffi::Span<const int64_t> picks, xla::ffi::Span<const int64_t> scores_out,
                                 SelectDims* d) {
  using xla::ffi::Error;
  const size_t lead = visible.size() - 1;
  if (visible.size() < 2) return Error::InvalidArgument("dsv4 select_topk: visible must be [..., S], got " + DimsToString(visible));
  auto same_lead = [&](xla::ffi::Span<const int64_t> dims, size_t rank, const char* name) -> Error {
    if (dims.size() != rank) {
      return Error::InvalidArgument(std::string("dsv4 select_topk: ") + name + " has rank " + std::to_string(dims.size()) +
                                    ", expected " + std::to_string(rank) + " (visible is " + DimsToString(visible) + ")");
    }
    for (size_t i = 0; i < lead; ++i) {
      if (dims[i] != visible[i]) {
        return Error::InvalidArgument(std::string("dsv4 select_topk: leading dims of ") + name + " " + DimsToString(dims) +
                                      " differ from visible's " + DimsToString(visible));
      }
    }
    return Error::Success();
  };
  d->rows = 1;
  for (size_t i = 0; i < lead; ++i) d->rows *= visible[i];
  d->seq = visible[lead];
  if (Error e = same_lead(picks, lead + 2, "picks"); e.failure()) return e;
  if (picks[lead] != d->seq) return Error::InvalidArgument("dsv4 select_topk: picks " + DimsToString(picks) + " vs visible " + DimsToString(visible));
  d->top_k = picks[lead + 1];
  if (queries == nullptr) {  // top-k alone: keys_or_scores is scores [..., S, T]
    if (Error e = same_lead(keys_or_scores, lead + 2, "scores"); e.failure()) return e;
    if (keys_or_scores[lead] != d->seq) return Error::InvalidArgument("dsv4 topk: scores " + DimsToString(keys_or_scores) + " vs visible " + DimsToString(visible));
    d->slots = keys_or_scores[lead + 1];
    return Error::Success();
  }
  auto q = queries->dimensions();
  if (Error e = same_lead(q, lead + 3, "queries"); e.failure()) return e;
  if (Error e = same_lead(weights, lead + 2, "weights"); e.failure()) return e;
  if (Error e = same_lead(keys_or_scores, lead + 2, "keys"); e.failure()) return e;
  if (Error e = same_lead(scores_out, lead + 2, "scores"); e.failure()) return e;
  d->heads = q[lead + 1];
  d->dim = q[lead + 2];
  d->slots = keys_or_scores[lead];
  if (q[lead] != d->seq || weights[lead] != d->seq || weights[lead + 1] != d->heads ||
      keys_or_scores[lead + 1] != d->dim || scores_out[lead] != d->seq || scores_out[lead + 1] != d->slots) {
    return Error::InvalidArgument("dsv4 select_topk: inconsistent shapes: queries " + DimsToString(q) + ", weights " +
                                  DimsToString(weights) + ", keys " + DimsToString(keys_or_scores) + ", visible " +
                                  DimsToString(visible) + ", scores " + DimsToString(scores_out));
  }
  return Error::Success();
}

// The workspace output [..., S, W]: W = 0 (one block a row) or 2 * P * K; `segments` gets P.
inline xla::ffi::Error ParseWorkspace(xla::ffi::Span<const int64_t> workspace, const SelectDims& d, int64_t* segments) {
  using xla::ffi::Error;
  *segments = 1;
  if (workspace.size() < 2) return Error::InvalidArgument("dsv4 select_topk: workspace must be [..., S, W], got " + DimsToString(workspace));
  const int64_t width = workspace[workspace.size() - 1];
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < workspace.size(); ++i) rows *= workspace[i];
  if (rows != d.rows * d.seq || (width != 0 && (d.top_k == 0 || width % (2 * d.top_k) != 0))) {
    return Error::InvalidArgument("dsv4 select_topk: workspace " + DimsToString(workspace) + " is not [..., S, 0] or [..., S, 2 * P * " +
                                  std::to_string(d.top_k) + "] for " + std::to_string(d.rows * d.seq) + " query rows");
  }
  if (width != 0) *segments = width / (2 * d.top_k);
  return Error::Success();
}

// The packed keys' operands of the FP4 targets: codes [..., T, c / 2] and scales
// [..., T, ceil(c / 32)]. `keys` gets the dims of the keys they stand for, [..., T, c].
inline xla::ffi::Error ParseFp4Keys(xla::ffi::Span<const int64_t> codes, xla::ffi::Span<const int64_t> scales,
                                    std::vector<int64_t>* keys) {
  using xla::ffi::Error;
  if (codes.size() < 2 || scales.size() != codes.size()) {
    return Error::InvalidArgument("dsv4 select_topk: key codes " + DimsToString(codes) + " and key scales " +
                                  DimsToString(scales) + " must be [..., T, c / 2] and [..., T, ceil(c / 32)]");
  }
  keys->assign(codes.begin(), codes.end());
  keys->back() *= 2;
  const int64_t expected = (keys->back() + kFp4Block - 1) / kFp4Block;
  for (size_t i = 0; i + 1 < codes.size(); ++i) {
    if (codes[i] != scales[i]) {
      return Error::InvalidArgument("dsv4 select_topk: key codes " + DimsToString(codes) + " and key scales " +
                                    DimsToString(scales) + " differ in their leading dims");
    }
  }
  if (scales.back() != expected) {
    return Error::InvalidArgument("dsv4 select_topk: key scales " + DimsToString(scales) + " must have " +
                                  std::to_string(expected) + " bytes a key for " + std::to_string(keys->back()) +
                                  " channels");
  }
  return Error::Success();
}

// The operands of a _paged target: a pool of key rows [N, width] (the keys' own width, or the
// codes' and scales'), its table [..., P_row] and page_entries E, and the scores output
// [..., S, T]. `keys` gets the dims of the keys the pool stands for, [..., T, c] (c: `channels`,
// the keys' width), `rows` the address functor.
inline xla::ffi::Error ParsePagedKeys(xla::ffi::Span<const int64_t> pool, int64_t channels,
                                      xla::ffi::Span<const int64_t> table, int64_t page_entries,
                                      xla::ffi::Span<const int64_t> scores_out, const int32_t* table_data,
                                      std::vector<int64_t>* keys, PagedRows* rows) {
  using xla::ffi::Error;
  if (pool.size() != 2 || page_entries < 1 || pool[0] % page_entries != 0) {
    return Error::InvalidArgument("dsv4 select_topk: a paged pool must be [pages * page_entries, .], got " +
                                  DimsToString(pool) + " with page_entries " + std::to_string(page_entries));
  }
  if (table.size() < 2 || scores_out.size() != table.size() + 1) {
    return Error::InvalidArgument("dsv4 select_topk: page table " + DimsToString(table) +
                                  " must be [..., P_row] for scores " + DimsToString(scores_out));
  }
  const int64_t slots = scores_out.back();
  if (table.back() * page_entries < slots) {
    return Error::InvalidArgument("dsv4 select_topk: page table " + DimsToString(table) + " of " +
                                  std::to_string(page_entries) + " entries a page holds fewer than " +
                                  std::to_string(slots) + " entries a row");
  }
  keys->assign(table.begin(), table.end() - 1);
  keys->push_back(slots);
  keys->push_back(channels);
  *rows = PagedRows{table_data, table.back(), page_entries, pool[0] / page_entries};
  return Error::Success();
}

}  // namespace dsv4
#endif  // XLA_FFI_API_FFI_H_
