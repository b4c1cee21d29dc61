// The finite check's verdict written where the host polls it (dsv4_jax/finite_flag.py).
//
// Target `dsv4_finite_flag`: finite (bool scalar) -> a copy of it, with a side effect: the
// handler writes the word (seq << 1) | finite into slot `device ordinal % kFiniteFlagSlots` of
// a host array that the Python side reads directly (no buffer read through the runtime), where
// seq counts the handler's runs on that device since the extension was loaded (1, 2, ...). The
// host knows which seq its call will get (it waits for each call's word before the next call)
// and polls the slot until that seq appears. The copy returned is what the step's later stages
// depend on, so nothing of the step that reads the input runs before the word is written.
//
// CPU: the slots are a static array of atomics, the handler runs in XLA's executor thread.
// CUDA: the slots are mapped pinned host memory (cudaHostAlloc), the counter a __device__
// global per device, and one thread of a kernel on XLA's stream writes the word (captured
// inside XLA's CUDA graph: no allocation, no sync in the handler).
#pragma once

#include <Python.h>

#include <cstdint>

#include "xla/ffi/api/c_api.h"

namespace dsv4 {

constexpr int kFiniteFlagSlots = 64;  // device ordinals modulo this

}  // namespace dsv4

// The handler symbol of the platform's extension (XLA_FFI_DEFINE_HANDLER_SYMBOL).
extern "C" XLA_FFI_Error* Dsv4FiniteFlag(XLA_FFI_CallFrame* call_frame);

// Python: finite_flag_slots() -> (address of the uint64 slots, number of slots); allocates them
// on the first call (CUDA: mapped pinned host memory; raises RuntimeError if that fails).
PyObject* Dsv4FiniteFlagSlots(PyObject*, PyObject*);
