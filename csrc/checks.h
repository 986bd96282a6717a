// Argument checks shared by the CPU kernels and the CUDA torch glue: one rule, one message.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>

namespace ssf {

inline bool is_value_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// A selection input: float32/float16/bfloat16, contiguous, on the expected device type.
inline void check_values(const at::Tensor& x, const char* op, c10::DeviceType device) {
  TORCH_CHECK(x.device().type() == device, op, ": expected a ", c10::DeviceTypeName(device),
              " tensor, got ", x.device());
  TORCH_CHECK(is_value_dtype(x.scalar_type()), op, ": unsupported dtype ", x.scalar_type(),
              " (float32, float16, bfloat16)");
  TORCH_CHECK(x.is_contiguous(), op, ": input must be contiguous");
}

// A sparse record: 1-D values and int32/int64 indices of equal length.
inline void check_record(const at::Tensor& values, const at::Tensor& indices, const char* op) {
  TORCH_CHECK(values.dim() == 1 && indices.dim() == 1 && values.numel() == indices.numel(), op,
              ": values and indices must be 1-D of equal length (got ", values.sizes(), " and ",
              indices.sizes(), ")");
  TORCH_CHECK(indices.scalar_type() == at::kInt || indices.scalar_type() == at::kLong, op,
              ": indices must be int32 or int64, got ", indices.scalar_type());
}

// Index dtype of selections from n elements (ops.h).
inline at::ScalarType index_dtype_for(int64_t n) {
  return n <= std::numeric_limits<int32_t>::max() ? at::kInt : at::kLong;
}

}  // namespace ssf
