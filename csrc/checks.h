// Argument checks shared by the CPU kernels and the CUDA torch glue: one rule, one message.
// Also the few torch-side steps both do alike (flattening, output allocation, index dispatch).
#pragma once

#include <optional>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "hash.h"
#include "ops.h"  // record_spans

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace ssf {

inline bool is_value_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline void check_value_dtype(const at::Tensor& x, const char* op) {
  TORCH_CHECK(is_value_dtype(x.scalar_type()), op, ": unsupported dtype ", x.scalar_type(),
              " (float32, float16, bfloat16)");
}

inline void check_device(const at::Tensor& x, const char* op, c10::DeviceType device) {
  TORCH_CHECK(x.device().type() == device, op, ": expected a ", c10::DeviceTypeName(device),
              " tensor, got ", x.device());
}

inline void check_index_dtype(at::ScalarType t, const char* op) {
  TORCH_CHECK(t == at::kInt || t == at::kLong, op, ": indices must be int32 or int64, got ", t);
}

// A selection input: float32/float16/bfloat16, contiguous, on the expected device type.
inline void check_values(const at::Tensor& x, const char* op, c10::DeviceType device) {
  check_device(x, op, device);
  check_value_dtype(x, op);
  TORCH_CHECK(x.is_contiguous(), op, ": input must be contiguous");
}

// A selection input, checked (check_values) and flattened.
inline at::Tensor flat_values(const at::Tensor& x, const char* op, c10::DeviceType device) {
  check_values(x, op, device);
  return x.reshape({-1});
}

// The k of a selection from n elements: in [lo, n] (topk: lo = 0; sampled_threshold: 1).
inline void check_k(int64_t k, int64_t lo, int64_t n, const char* op) {
  TORCH_CHECK(k >= lo && k <= n, op, ": k=", k, " out of range [", lo, ", ", n, "]");
}

// The input of threshold_select / threshold_count, checked (check_values, and a threshold
// that is not NaN) and flattened.
inline at::Tensor threshold_values(const at::Tensor& x, double thr, const char* op,
                                   c10::DeviceType device) {
  check_values(x, op, device);
  TORCH_CHECK(!std::isnan(thr), op, ": threshold is NaN");
  return x.reshape({-1});
}

// A sparse record: 1-D values and int32/int64 indices of equal length.
inline void check_record(const at::Tensor& values, const at::Tensor& indices, const char* op) {
  TORCH_CHECK(values.dim() == 1 && indices.dim() == 1 && values.numel() == indices.numel(), op,
              ": values and indices must be 1-D of equal length (got ", values.sizes(), " and ",
              indices.sizes(), ")");
  check_index_dtype(indices.scalar_type(), op);
}

// The output buffer of pack: 1-D, contiguous, on the expected device, of the values' dtype.
inline void check_pack_out(const at::Tensor& values, const at::Tensor& out, c10::DeviceType device) {
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous() && out.device().type() == device,
              "pack: out must be a contiguous 1-D ", c10::DeviceTypeName(device), " tensor");
  TORCH_CHECK(out.scalar_type() == values.scalar_type(), "pack: out dtype ", out.scalar_type(),
              " differs from values dtype ", values.scalar_type());
}

// The record of pack must fit in `out` at `offset`; returns its (value span, index span).
inline std::tuple<int64_t, int64_t> check_pack_fits(const at::Tensor& values,
                                                    const at::Tensor& indices,
                                                    const at::Tensor& out, int64_t offset) {
  const int64_t k = values.numel();
  auto spans = record_spans(k, values.scalar_type(), indices.scalar_type());
  TORCH_CHECK(offset >= 0 && offset + std::get<0>(spans) + std::get<1>(spans) <= out.numel(),
              "pack: record of ", k, " elements at offset ", offset,
              " does not fit in a buffer of ", out.numel());
  return spans;
}

// scatter_add: a record (check_record) added into a contiguous `dense` of the values' dtype
// on the expected device.
inline void check_scatter_add(const at::Tensor& dense, const at::Tensor& values,
                              const at::Tensor& indices, c10::DeviceType device) {
  check_record(values, indices, "scatter_add");
  TORCH_CHECK(dense.is_contiguous() && dense.device().type() == device,
              "scatter_add: dense must be a contiguous ", c10::DeviceTypeName(device), " tensor");
  TORCH_CHECK(dense.scalar_type() == values.scalar_type(), "scatter_add: dtype mismatch (",
              dense.scalar_type(), " vs ", values.scalar_type(), ")");
}

// The optional DGC velocity of an error-feedback op: the residual's device, dtype and size,
// contiguous, and the gradient's dtype too; neither the residual's nor the gradient's memory.
inline void check_velocity(const std::optional<at::Tensor>& velocity, const at::Tensor& grad,
                           const at::Tensor& residual, const char* op) {
  if (!velocity.has_value()) return;
  const at::Tensor& v = *velocity;
  TORCH_CHECK(v.device() == residual.device(), op, ": velocity on ", v.device(), ", residual on ",
              residual.device());
  TORCH_CHECK(v.scalar_type() == residual.scalar_type() && grad.scalar_type() == residual.scalar_type(),
              op, ": velocity, gradient and residual need one dtype (got ", v.scalar_type(), ", ",
              grad.scalar_type(), ", ", residual.scalar_type(), ")");
  TORCH_CHECK(v.numel() == residual.numel(), op, ": velocity has ", v.numel(),
              " elements, residual ", residual.numel());
  TORCH_CHECK(v.is_contiguous(), op, ": the velocity must be contiguous (it is updated in place)");
  // contiguous, so each spans [data_ptr, data_ptr + nbytes): any overlap is a shared byte
  auto overlaps = [](const at::Tensor& a, const at::Tensor& b) {
    const auto* pa = static_cast<const char*>(a.data_ptr());
    const auto* pb = static_cast<const char*>(b.data_ptr());
    return a.numel() && b.numel() && pa < pb + b.nbytes() && pb < pa + a.nbytes();
  };
  TORCH_CHECK(!overlaps(v, residual) && !overlaps(v, grad), op,
              ": the velocity must not share memory with the residual or the gradient");
}

// A gradient (or a segment's) of `numel` elements and its residual on one device.
inline void check_feedback_pair(const at::Tensor& grad, const at::Tensor& residual,
                                int64_t numel, const char* op) {
  TORCH_CHECK(residual.device() == grad.device(), op, ": residual on ", residual.device(),
              ", gradient on ", grad.device());
  TORCH_CHECK(grad.numel() == numel, op, ": ", numel, " residual elements, gradient ",
              grad.numel());
}

// The dtypes of an error-feedback op: a float32 residual (the accumulation) with a gradient
// and a wire dtype of any value dtype, or a 16-bit dtype shared by all three.
inline void check_feedback_dtypes(at::ScalarType grad, at::ScalarType acc, at::ScalarType wire,
                                  const char* op) {
  TORCH_CHECK(is_value_dtype(wire), op, ": unsupported wire dtype ", wire);
  TORCH_CHECK(acc == at::kFloat || (grad == acc && wire == acc), op, ": a ", acc,
              " residual needs a gradient and a wire of the same dtype (got ", grad, ", ", wire,
              "); accumulate 16-bit gradients in float32");
}

// The inputs of the fused error-feedback ops (ef_topk, segmented_ef_topk): a gradient and
// a residual of as many elements, contiguous, on one device of the expected type; the
// residual (the accumulation) is float32 with a gradient and a wire dtype of any value
// dtype, or a 16-bit dtype shared by all three; and the optional velocity (check_velocity).
// Returns the gradient flattened.
inline at::Tensor check_feedback(const at::Tensor& grad, const at::Tensor& residual,
                                 at::ScalarType wire, const std::optional<at::Tensor>& velocity,
                                 const char* op, c10::DeviceType device) {
  check_values(grad, op, device);
  check_values(residual, op, device);
  check_feedback_pair(grad, residual, grad.numel(), op);
  check_feedback_dtypes(grad.scalar_type(), residual.scalar_type(), wire, op);
  check_velocity(velocity, grad, residual, op);
  return grad.reshape({-1});
}

// The gradient of a fused error-feedback op given as segments (segmented_ef_topk_tensors):
// one tensor per segment, each holding its segment's elements, all of one dtype, segments
// that tile the residual, and check_feedback's rules for each of them.
inline void check_feedback_segments(const std::vector<at::Tensor>& grads,
                                    const at::Tensor& residual, at::ScalarType wire,
                                    const std::optional<at::Tensor>& velocity,
                                    const std::vector<int64_t>& offsets, const char* op,
                                    c10::DeviceType device) {
  const int64_t nseg = int64_t(offsets.size()) - 1;
  check_values(residual, op, device);
  TORCH_CHECK(int64_t(grads.size()) == nseg, op, ": ", grads.size(), " gradient tensors for ",
              nseg, " segments");
  TORCH_CHECK(nseg >= 1 && offsets[0] == 0 && offsets[nseg] == residual.numel(), op,
              ": the segments must tile the residual (offsets from 0 to ", residual.numel(), ")");
  check_feedback_dtypes(grads[0].scalar_type(), residual.scalar_type(), wire, op);
  for (int64_t s = 0; s < nseg; ++s) {
    check_values(grads[s], op, device);
    TORCH_CHECK(grads[s].scalar_type() == grads[0].scalar_type(), op,
                ": the gradient tensors must share one dtype (", grads[s].scalar_type(), " and ",
                grads[0].scalar_type(), ")");
    TORCH_CHECK(grads[s].numel() == offsets[s + 1] - offsets[s], op, ": gradient tensor ", s,
                " has ", grads[s].numel(), " elements, its segment ", offsets[s + 1] - offsets[s],
                " (the tensors must tile the residual)");
    check_feedback_pair(grads[s], residual, grads[s].numel(), op);
    check_velocity(velocity, grads[s], residual, op);
  }
}

// The tensors of a shared-moments step (shared_momentum_step, shared_adam_step): lists of
// one length, each entry float32, contiguous, all on one device of type `device` (the op
// runs on the first's), with one element count across the lists at each position (a
// parameter, its gradient, its state and its ages).
inline void check_moment_lists(const std::vector<std::vector<at::Tensor>>& lists,
                               const char* op, c10::DeviceType device) {
  const size_t n = lists[0].size();
  for (const auto& l : lists)
    TORCH_CHECK(l.size() == n, op, ": lists of different lengths (", l.size(), " and ", n, ")");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& first = lists[0][i];
    for (const auto& l : lists) {
      const at::Tensor& t = l[i];
      TORCH_CHECK(t.device().type() == device, op, ": expected ", device, " tensors, got ",
                  t.device());
      TORCH_CHECK(t.device() == lists[0][0].device(), op, ": every tensor on one device, got ",
                  t.device(), " and ", lists[0][0].device());
      TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": float32 tensors only, got ",
                  t.scalar_type(), " at ", i);
      TORCH_CHECK(t.is_contiguous(), op, ": tensor ", i, " is not contiguous");
      TORCH_CHECK(t.numel() == first.numel(), op, ": tensor ", i, " has ", t.numel(),
                  " elements in one list and ", first.numel(), " in another");
    }
  }
}

// ef_step_key's and step_denominator's arguments (ops.h), on either device: exp_avg_sqs
// (with the key, grads alike) float32 contiguous on `device`, one bias correction per
// tensor, and the flat outputs (the residual with the key; `out`) contiguous float32 on
// the tensors' device, of their total count. Returns the tensors' offsets in the flat
// outputs (nseg + 1 entries).
inline std::vector<int64_t> check_step_key(const char* op, const std::vector<at::Tensor>* grads,
                                           const at::Tensor* residual,
                                           const std::vector<at::Tensor>& exp_avg_sqs,
                                           const std::vector<double>& bias2_sqrt,
                                           const at::Tensor& out, c10::DeviceType device) {
  const size_t nseg = exp_avg_sqs.size();
  TORCH_CHECK(nseg >= 1, op, ": no tensors");
  TORCH_CHECK(bias2_sqrt.size() == nseg && (!grads || grads->size() == nseg), op, ": ",
              grads ? grads->size() : nseg, " gradients, ", nseg, " exp_avg_sq tensors and ",
              bias2_sqrt.size(), " bias corrections (one of each per tensor)");
  if (grads) check_moment_lists({*grads, exp_avg_sqs}, op, device);
  else check_moment_lists({exp_avg_sqs}, op, device);
  std::vector<int64_t> off(nseg + 1, 0);
  for (size_t s = 0; s < nseg; ++s) off[s + 1] = off[s] + exp_avg_sqs[s].numel();
  for (const at::Tensor* t : {residual, &out}) {
    if (t == nullptr) continue;
    TORCH_CHECK(t->device() == exp_avg_sqs[0].device() && t->scalar_type() == at::kFloat &&
                    t->is_contiguous() && t->numel() == off[nseg],
                op, ": residual and output must be contiguous float32 tensors on the ",
                "tensors' device (", exp_avg_sqs[0].device(), ") of their ", off[nseg],
                " elements (they must tile both)");
  }
  return off;
}

// shared_adam_step's arguments: check_moment_lists', and one bias correction per tensor.
inline void check_adam_step(const std::vector<at::Tensor>& params,
                            const std::vector<at::Tensor>& grads,
                            const std::vector<at::Tensor>& exp_avgs,
                            const std::vector<at::Tensor>& exp_avg_sqs,
                            const std::vector<at::Tensor>& ages, size_t bias1,
                            size_t bias2_sqrt, c10::DeviceType device) {
  check_moment_lists({params, grads, exp_avgs, exp_avg_sqs, ages}, "shared_adam_step", device);
  TORCH_CHECK(bias1 == params.size() && bias2_sqrt == params.size(),
              "shared_adam_step: one bias correction per tensor");
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

// Decode of the record (k elements at `offset`) in each of nchunks chunks of chunk_len
// elements of `gathered` into `dense` (scatter_add_chunks; deliver_chunks, `op`, reads the
// same records back out of it); returns the record's (value span, index span).
inline std::tuple<int64_t, int64_t> check_chunks(const at::Tensor& dense, const at::Tensor& gathered,
                                                 int64_t nchunks, int64_t chunk_len, int64_t offset,
                                                 int64_t k, at::ScalarType index_dtype,
                                                 c10::DeviceType device,
                                                 const char* op = "scatter_add_chunks") {
  TORCH_CHECK(dense.is_contiguous() && dense.device().type() == device &&
                  gathered.is_contiguous() && gathered.dim() == 1 &&
                  gathered.device() == dense.device(),
              op, ": contiguous ", c10::DeviceTypeName(device),
              " dense and 1-D gathered buffer on one device required");
  // Same dtype, or a float32 sum of float16/bfloat16 records (widening decode).
  TORCH_CHECK(dense.scalar_type() == gathered.scalar_type() ||
                  (dense.scalar_type() == at::kFloat && gathered.element_size() == 2),
              op, ": dense ", dense.scalar_type(), " cannot sum records of ",
              gathered.scalar_type(), " (same dtype, or float32 for float16/bfloat16)");
  check_value_dtype(dense, op);
  check_value_dtype(gathered, op);
  TORCH_CHECK(nchunks >= 0 && chunk_len >= 0 && nchunks * chunk_len == gathered.numel(),
              op, ": gathered has ", gathered.numel(), " elements, not ", nchunks, " x ",
              chunk_len);
  auto spans = record_spans(k, gathered.scalar_type(), index_dtype);
  TORCH_CHECK(offset >= 0 && offset + std::get<0>(spans) + std::get<1>(spans) <= chunk_len,
              op, ": record outside the chunk");
  return spans;
}

// deliver_chunks: the records as check_chunks takes them (`out` summed them), the tensors
// they are delivered to (contiguous, of the records' dtype, on out's device, their numels
// back to back within out) and a finite scale >= 0 (which keeps a +0 sum +0). Returns the
// bounds b_0 = 0, b_{t+1} = b_t + numel(t).
inline std::vector<int64_t> check_deliver(const at::Tensor& out,
                                          const std::vector<at::Tensor>& tensors,
                                          const at::Tensor& gathered, int64_t nchunks,
                                          int64_t chunk_len, int64_t offset, int64_t k,
                                          at::ScalarType index_dtype, double scale,
                                          c10::DeviceType device) {
  check_chunks(out, gathered, nchunks, chunk_len, offset, k, index_dtype, device,
               "deliver_chunks");
  TORCH_CHECK(std::isfinite(scale) && scale >= 0.0, "deliver_chunks: scale ", scale,
              " must be finite and >= 0");
  std::vector<int64_t> bounds(tensors.size() + 1, 0);
  for (size_t t = 0; t < tensors.size(); ++t) {
    const at::Tensor& x = tensors[t];
    TORCH_CHECK(x.defined() && x.scalar_type() == gathered.scalar_type() &&
                    x.device() == out.device() && x.is_contiguous(),
                "deliver_chunks: tensor ", t, " must be a contiguous ", gathered.scalar_type(),
                " tensor on ", out.device(), " (the records' dtype)");
    bounds[t + 1] = bounds[t] + x.numel();
  }
  TORCH_CHECK(bounds.back() <= out.numel(), "deliver_chunks: the tensors hold ", bounds.back(),
              " elements, out only ", out.numel());
  return bounds;
}

// Arguments of the hash ops (hash_partition, hash_owner): 1-D int32/int64 indices on the
// expected device, a partition count and table size the 32-bit range reduction can take.
inline void check_hash_args(const at::Tensor& indices, int64_t nparts, int64_t table_size,
                            int64_t rounds, c10::DeviceType device, const char* op) {
  check_device(indices, op, device);
  TORCH_CHECK(indices.dim() == 1, op, ": indices must be 1-D, got ", indices.sizes());
  check_index_dtype(indices.scalar_type(), op);
  TORCH_CHECK(nparts >= 1 && nparts <= hashing::kMaxRange, op, ": nparts=", nparts,
              " out of range [1, ", hashing::kMaxRange, "]");
  TORCH_CHECK(table_size >= 1 && table_size <= hashing::kMaxRange, op, ": table_size=",
              table_size, " out of range [1, ", hashing::kMaxRange, "]");
  TORCH_CHECK(rounds >= 0 && rounds <= hashing::kMaxRounds, op, ": rounds=", rounds,
              " out of range [0, ", hashing::kMaxRounds, "]");
}

// hash_partition's outputs for `indices` (on its device): order int64[m], counts and
// overflow int64[nparts].
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> hash_partition_outputs(
    const at::Tensor& indices, int64_t nparts) {
  const auto opts = indices.options().dtype(at::kLong);
  return {at::empty({indices.numel()}, opts), at::empty({nparts}, opts),
          at::empty({nparts}, opts)};
}

// Index dtype of selections from n elements (ops.h).
inline at::ScalarType index_dtype_for(int64_t n) {
  return n <= std::numeric_limits<int32_t>::max() ? at::kInt : at::kLong;
}

// Calls fn(I{}) with the C++ type of an index dtype: int32_t for int32, else int64_t.
template <typename F>
void dispatch_index(at::ScalarType idt, const F& fn) {
  if (idt == at::kInt) fn(int32_t{}); else fn(int64_t{});
}

}  // namespace ssf
