// CPU handler of `dsv4_finite_flag` (contract in finite_flag.h): the slots are a static array
// of atomics in this extension; the handler runs in XLA's executor thread while the calling
// Python thread polls its slot.
#include <atomic>
#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "finite_flag.h"

namespace ffi = xla::ffi;

namespace dsv4 {
namespace {

static_assert(sizeof(std::atomic<uint64_t>) == sizeof(uint64_t) && std::atomic<uint64_t>::is_always_lock_free,
              "the host reads the slots as plain uint64");
std::atomic<uint64_t> g_slots[kFiniteFlagSlots];
std::atomic<uint64_t> g_counters[kFiniteFlagSlots];

ffi::Error FiniteFlagImpl(int32_t device, ffi::Buffer<ffi::PRED> finite, ffi::Result<ffi::Buffer<ffi::PRED>> out) {
  if (finite.element_count() != 1 || out->element_count() != 1) {
    return ffi::Error::InvalidArgument("dsv4_finite_flag: expected a bool scalar in and out");
  }
  const bool ok = *finite.typed_data();
  *out->typed_data() = ok;
  const int slot = ((device % kFiniteFlagSlots) + kFiniteFlagSlots) % kFiniteFlagSlots;
  const uint64_t seq = g_counters[slot].fetch_add(1, std::memory_order_relaxed) + 1;
  g_slots[slot].store((seq << 1) | (ok ? 1u : 0u), std::memory_order_release);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace dsv4

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4FiniteFlag, dsv4::FiniteFlagImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>());

PyObject* Dsv4FiniteFlagSlots(PyObject*, PyObject*) {
  return Py_BuildValue("(Ki)", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(dsv4::g_slots)),
                       dsv4::kFiniteFlagSlots);
}
