// The operations of a GPT on a CUDA device, forward and backward: the functions of <loom/kernels/cpu/ops.hpp> with
// the same semantics, on device pointers, each with a trailing cudaStream_t. T is float, double, __nv_bfloat16 or
// __half (loom::bf16 and loom::fp16 name the same bytes); arithmetic is in acc_t<T> (float, double for double).
// Weight gradients accumulate (+=); input gradients are written (=). Errors throw loom::BackendError (a CUDA or
// cuBLAS code) or loom::Error (a shape the kernels do not take).
//
//   matmul.cuh          cuBLASLt products, row-major, batched by strides or with row strides of their own
//                       (matmul_ld), with a bias, a GELU or its derivative in the epilogue (matmul_bias,
//                       matmul_bias_gelu, matmul_dgelu)
//   elementwise.cuh     bias_add, bias_backward, add, accumulate, gelu_forward, gelu_backward, swiglu_forward,
//                       swiglu_backward
//   layernorm.cuh       layernorm_forward, layernorm_backward_input, layernorm_backward_weight
//   rmsnorm.cuh         rmsnorm_forward, rmsnorm_backward_input, rmsnorm_backward_weight
//   rope.cuh            rope_rotate
//   cross_entropy.cuh   ce_partials, ce_rescale, ce_target_logit, ce_losses, ce_backward, cross_entropy_forward
//   embedding.cuh       embedding_forward, embedding_backward, add_positions, positions_backward
//   dropout.cuh         dropout_uniform (host and device), dropout_forward, dropout_backward
//   attention.cuh       attention_forward, attention_backward (causal, GQA, lse kept); bf16 and fp16 at head
//                       sizes 64 and 128 run attention_mma.cuh's register-resident kernels (mma.sync, sm_80 on)
//   optim.cuh           adamw_step, sgd_step
//
// Temporary device memory (cuBLASLt workspace, reduction partials) comes from loom::CudaAllocator on the call's
// stream. Compile with nvcc for sm_90 (or sm_80 and later: bf16 WMMA, mma.sync and cp.async need it).
#pragma once

#include <loom/kernels/cuda/attention.cuh>
#include <loom/kernels/cuda/cross_entropy.cuh>
#include <loom/kernels/cuda/dropout.cuh>
#include <loom/kernels/cuda/elementwise.cuh>
#include <loom/kernels/cuda/embedding.cuh>
#include <loom/kernels/cuda/layernorm.cuh>
#include <loom/kernels/cuda/matmul.cuh>
#include <loom/kernels/cuda/optim.cuh>
#include <loom/kernels/cuda/rmsnorm.cuh>
#include <loom/kernels/cuda/rope.cuh>
