// Device conversions of raw value bits (csrc/cuda/*.cu): float16/bfloat16 widen to float32
// exactly, float32 rounds to them to nearest even, as c10::Half / c10::BFloat16 do on the
// CPU. Shared by the codec (decode arithmetic) and the error-feedback ops (the sum of a
// 16-bit gradient into a float32 residual, the wire error).
#pragma once

#include "kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace ssf {
namespace cuda {

template <int KIND>
struct RawOf {  // the raw bits of a value kind
  using type = uint16_t;
};
template <>
struct RawOf<int(ValueKind::kFloat32)> {
  using type = uint32_t;
};

template <int KIND>
__device__ __forceinline__ float widen(uint16_t u);

template <>
__device__ __forceinline__ float widen<int(ValueKind::kFloat16)>(uint16_t u) {
  return __half2float(__ushort_as_half(u));
}

template <>
__device__ __forceinline__ float widen<int(ValueKind::kBFloat16)>(uint16_t u) {
  return __uint_as_float(uint32_t(u) << 16);
}

template <int KIND>
__device__ __forceinline__ float to_float(typename RawOf<KIND>::type u) {
  if constexpr (KIND == int(ValueKind::kFloat32)) return __uint_as_float(u);
  else return widen<KIND>(u);
}

// Rounds to nearest even, as c10::Half / c10::BFloat16 do.
template <int KIND>
__device__ __forceinline__ typename RawOf<KIND>::type from_float(float v) {
  if constexpr (KIND == int(ValueKind::kFloat32)) return __float_as_uint(v);
  else if constexpr (KIND == int(ValueKind::kFloat16)) return __half_as_ushort(__float2half_rn(v));
  else return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

}  // namespace cuda
}  // namespace ssf
