// CUDA handler of `dsv4_finite_flag` (contract in finite_flag.h): one thread of a kernel on
// XLA's stream copies the verdict to the step's output and writes (seq << 1) | finite into the
// device's slot of mapped pinned host memory, where the calling Python thread polls it. The
// counter is a __device__ global (one per device); the slots are allocated once, by
// finite_flag_slots(), before any step that calls the handler is compiled. Registered
// command-buffer compatible: a kernel launch with fixed pointers, no allocation, no sync.
#include <Python.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "finite_flag.h"

namespace ffi = xla::ffi;

namespace dsv4 {
namespace {

__device__ unsigned long long g_finite_counter;  // this device's handler runs so far
uint64_t* g_host_slots = nullptr;                // mapped pinned host memory, kFiniteFlagSlots words
uint64_t* g_device_slots = nullptr;              // the same memory as the device addresses it
std::mutex g_alloc;

__global__ void FiniteFlagKernel(const bool* finite, bool* out, volatile unsigned long long* slot) {
  const bool ok = *finite;
  *out = ok;
  const unsigned long long seq = ++g_finite_counter;  // one thread: the step's only writer
  *slot = (seq << 1) | (ok ? 1ull : 0ull);
  __threadfence_system();  // the word leaves for host memory before the step's later kernels run
}

ffi::Error FiniteFlagImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::PRED> finite,
                          ffi::Result<ffi::Buffer<ffi::PRED>> out) {
  if (finite.element_count() != 1 || out->element_count() != 1) {
    return ffi::Error::InvalidArgument("dsv4_finite_flag: expected a bool scalar in and out");
  }
  if (g_device_slots == nullptr) {
    return ffi::Error::Internal(
        "dsv4_finite_flag (CUDA): the flag slots are not allocated (dsv4_jax.native.finite_flag_slots "
        "allocates them before a step that writes the flag is traced)");
  }
  const int slot = ((device % kFiniteFlagSlots) + kFiniteFlagSlots) % kFiniteFlagSlots;
  FiniteFlagKernel<<<1, 1, 0, stream>>>(finite.typed_data(), out->typed_data(),
                                        reinterpret_cast<unsigned long long*>(g_device_slots + slot));
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("dsv4_finite_flag (CUDA): ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace dsv4

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4FiniteFlag, dsv4::FiniteFlagImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>(),
                              {ffi::Traits::kCmdBufferCompatible});

PyObject* Dsv4FiniteFlagSlots(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> lock(dsv4::g_alloc);
  if (dsv4::g_host_slots == nullptr) {
    void* host = nullptr;
    void* device = nullptr;
    cudaError_t err = cudaHostAlloc(&host, sizeof(uint64_t) * dsv4::kFiniteFlagSlots,
                                    cudaHostAllocMapped | cudaHostAllocPortable);
    if (err == cudaSuccess) {
      std::memset(host, 0, sizeof(uint64_t) * dsv4::kFiniteFlagSlots);
      err = cudaHostGetDevicePointer(&device, host, 0);
      if (err != cudaSuccess) cudaFreeHost(host);
    }
    if (err != cudaSuccess) {
      PyErr_Format(PyExc_RuntimeError, "dsv4_jax: cannot allocate the finite flag's mapped host memory: %s",
                   cudaGetErrorString(err));
      return nullptr;
    }
    dsv4::g_host_slots = static_cast<uint64_t*>(host);
    dsv4::g_device_slots = static_cast<uint64_t*>(device);
  }
  return Py_BuildValue("(Ki)", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(dsv4::g_host_slots)),
                       dsv4::kFiniteFlagSlots);
}
