// A few token rows against a large weight on CUDA (project_few_rows_cuda.cu): the layer's
// projections of a decode step, whose time is the weights' bytes over the memory bandwidth.
//
// Contract (the FFI target `dsv4_project_few_rows`, command-buffer compatible), bf16 only:
//   x    bf16 [M, G * K]   the token rows, group g's K features at columns g K .. g K + K - 1
//   w    bf16 [G, K, N]    the weight of each group
// returns out bf16 [M, G * N] (group g's N outputs at columns g N ..): x_g @ w_g with float32
// accumulation rounded once to bf16, summed in a fixed order (the same bits every call).
// Takes 1 <= M <= 8, N a multiple of 64, K a multiple of 256; a call outside that is an
// InvalidArgument error (dsv4_jax/projection_kernel.py routes only calls it takes).
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* Dsv4ProjectFewRows(XLA_FFI_CallFrame* call_frame);
