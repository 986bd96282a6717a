// Torch-side helpers shared by the CUDA glue of select.cu, segmented.cu and codec.cu
// (included only under SSF_WITH_CUDA: the raw kernels never see ATen).
#pragma once

#include "../checks.h"
#include "../ops.h"
#include "kernels.cuh"

// c10::cuda::getCurrentCUDAStream is what at::cuda::getCurrentCUDAStream forwards to;
// ATen/cuda/CUDAContext.h would also pull in cuBLAS/cuSPARSE headers the kernels do not need.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace ssf {
namespace glue {

inline cuda::ValueKind kind_of(at::ScalarType t) {
  return t == at::kFloat ? cuda::ValueKind::kFloat32
                         : (t == at::kHalf ? cuda::ValueKind::kFloat16 : cuda::ValueKind::kBFloat16);
}

// Scratch memory for a kernel, from torch's caching allocator on x's device.
inline at::Tensor workspace_for(const at::Tensor& x, size_t bytes) {
  return at::empty({int64_t(std::max<size_t>(bytes, 1))}, x.options().dtype(at::kByte));
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(b.device() == a.device(), op, ": expected all tensors on ", a.device(), ", got ",
              b.device());
}

// Calls fn(U{}, I{}) with the raw bits type of values of `value_bytes` bytes and the index type.
template <typename F>
void dispatch_bits_index(int64_t value_bytes, at::ScalarType idt, const F& fn) {
  if (value_bytes == 4) {
    if (idt == at::kInt) fn(uint32_t{}, int32_t{}); else fn(uint32_t{}, int64_t{});
  } else {
    if (idt == at::kInt) fn(uint16_t{}, int32_t{}); else fn(uint16_t{}, int64_t{});
  }
}

}  // namespace glue
}  // namespace ssf
