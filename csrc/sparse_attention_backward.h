// The CUDA backward of CSA's sparse attention (sparse_attention_backward_cuda.cu): one block of
// threads a query row with all of its heads, so that each key's gradient is summed over the
// heads before its one atomic add (the Triton kernel adds once per 32 heads).
//
// Contract (the FFI target `dsv4_sparse_attention_backward`, command-buffer compatible), bf16
// with H = 64 heads and D = 512 channels only (V4-Flash's; other shapes, V4-Pro's 128 heads
// among them, take the Triton kernel, dsv4_jax/sparse_attention_backward.py):
//   q      bf16 [R, H, D]        the queries (R = B * S rows; row r reads batch row r / S)
//   dout   bf16 [G, R, H/G, D]   the output's cotangent by output group (head g H/G + j at [g, r, j])
//   o      bf16 [R, H, D]        the forward's output (after a linear map of its last `rotated` channels)
//   lse    f32  [R, H]           the forward's log-normaliser (keys and sink)
//   delta_rotated f32 [R, H]     the rotated channels' share of delta (unread when rotated == 0)
//   pool   bf16 [B, P, D], window int32 [R, W]    the window's keys by index (-1: none)
//   entries bf16 [B, N, D], picks int32 [R, K]    the picked entries by index (-1: none)
// returns dq bf16 [R, H, D], dpool f32 [B, P, D], dentries f32 [B, N, D], delta f32 [R, H];
// attributes scale (f32, D^-0.5), rotated (channels), stretches (launch order spread).
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* Dsv4SparseAttentionBackward(XLA_FFI_CallFrame* call_frame);
