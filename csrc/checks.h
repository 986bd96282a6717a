// Argument checks shared by the CPU kernels and the CUDA torch glue: one rule, one message.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>
#include <vector>

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

// The output buffer of pack: 1-D, contiguous, on the expected device, of the values' dtype.
inline void check_pack_out(const at::Tensor& values, const at::Tensor& out, c10::DeviceType device) {
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous() && out.device().type() == device,
              "pack: out must be a contiguous 1-D ", c10::DeviceTypeName(device), " tensor");
  TORCH_CHECK(out.scalar_type() == values.scalar_type(), "pack: out dtype ", out.scalar_type(),
              " differs from values dtype ", values.scalar_type());
}

// Segments of a flat buffer of n elements (int64 CPU offsets[S+1], ks[S]): validates them and
// returns the output offsets, the prefix sums of ks (S+1 entries).
inline std::vector<int64_t> check_segments(const at::Tensor& offsets, const at::Tensor& ks,
                                           int64_t n) {
  const int64_t nseg = ks.numel();
  TORCH_CHECK(offsets.dim() == 1 && offsets.numel() == nseg + 1,
              "segmented_topk: offsets must have len(ks) + 1 entries");
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  const int64_t* kp = ks.const_data_ptr<int64_t>();
  TORCH_CHECK(nseg == 0 || (off[0] >= 0 && off[nseg] <= n), "segmented_topk: offsets outside [0, ",
              n, "]");
  std::vector<int64_t> out_off(nseg + 1, 0);
  for (int64_t s = 0; s < nseg; ++s) {
    TORCH_CHECK(off[s + 1] >= off[s], "segmented_topk: offsets must be non-decreasing");
    TORCH_CHECK(kp[s] >= 0 && kp[s] <= off[s + 1] - off[s], "segmented_topk: k=", kp[s],
                " out of range for segment ", s, " of ", off[s + 1] - off[s], " elements");
    out_off[s + 1] = out_off[s] + kp[s];
  }
  return out_off;
}

// Index dtype of selections from n elements (ops.h).
inline at::ScalarType index_dtype_for(int64_t n) {
  return n <= std::numeric_limits<int32_t>::max() ? at::kInt : at::kLong;
}

}  // namespace ssf
