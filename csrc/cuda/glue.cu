// Torch glue of the CUDA ops (the *_cuda functions of ../ops.h): validates tensors (the rules
// of ../checks.h, shared with the CPU ops), allocates outputs and workspaces from torch's
// caching allocator and runs the raw kernels of kernels.cuh on torch's current stream.
// Compiled only with SSF_WITH_CUDA (torch has CUDA); without it the raw kernels in
// select.cu, segmented.cu, codec.cu and hash.cu still build with nvcc alone.
#ifdef SSF_WITH_CUDA
#include "../checks.h"
#include "../ops.h"
#include "kernels.cuh"

// c10::cuda::getCurrentCUDAStream is what at::cuda::getCurrentCUDAStream forwards to;
// ATen/cuda/CUDAContext.h would also pull in cuBLAS/cuSPARSE headers the kernels do not need.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace ssf {
namespace {

// The op's device scope: makes `t`'s device current until the op returns and names torch's
// current stream there, which all of the op's work goes to.
struct OnDevice {
  const c10::cuda::CUDAGuard guard;
  const cudaStream_t stream;
  explicit OnDevice(const at::Tensor& t)
      : guard(t.device()), stream(c10::cuda::getCurrentCUDAStream().stream()) {}
};

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
  dispatch_index(idt, [&](auto i) {
    if (value_bytes == 4) fn(uint32_t{}, i); else fn(uint16_t{}, i);
  });
}

}  // namespace

// --------------------------------------------------------------------- selection (select.cu)

std::tuple<at::Tensor, at::Tensor> topk_cuda(const at::Tensor& x_in, int64_t k) {
  const at::Tensor x = flat_values(x_in, "topk", at::kCUDA);
  const int64_t n = x.numel();
  check_k(k, 0, n, "topk");
  const OnDevice on(x);
  const auto idt = index_dtype_for(n);
  at::Tensor values = at::empty({k}, x.options());
  at::Tensor indices = at::empty({k}, x.options().dtype(idt));
  dispatch_bits_index(x.element_size(), idt, [&](auto u, auto i) {
    using U = decltype(u);
    using I = decltype(i);
    const size_t bytes = cuda::topk_workspace_bytes<U>(n, k);
    at::Tensor ws = bytes ? workspace_for(x, bytes) : at::Tensor();  // none for small inputs
    cuda::topk<U, I>(static_cast<const U*>(x.const_data_ptr()), n, k,
                     static_cast<U*>(values.data_ptr()), indices.data_ptr<I>(),
                     bytes ? ws.data_ptr() : nullptr, bytes, on.stream);
  });
  return {values, indices};
}

int64_t threshold_count_cuda(const at::Tensor& x_in, double thr) {
  const at::Tensor x = threshold_values(x_in, thr, "threshold_count", at::kCUDA);
  const int64_t n = x.numel();
  if (n == 0) return 0;
  const OnDevice on(x);
  const uint32_t key_min = cuda::threshold_key(thr, kind_of(x.scalar_type()));
  int64_t total = 0;
  dispatch_bits_index(x.element_size(), at::kInt, [&](auto u, auto) {
    using U = decltype(u);
    at::Tensor ws = workspace_for(x, cuda::threshold_workspace_bytes<U>(n));
    cuda::threshold_prepare<U>(static_cast<const U*>(x.const_data_ptr()), n, key_min,
                               ws.data_ptr(), size_t(ws.numel()), on.stream);
    total = cuda::threshold_count_result(ws.data_ptr(), n, on.stream);
  });
  return total;
}

std::tuple<at::Tensor, at::Tensor> threshold_select_cuda(const at::Tensor& x_in, double thr) {
  const at::Tensor x = threshold_values(x_in, thr, "threshold_select", at::kCUDA);
  const int64_t n = x.numel();
  const auto idt = index_dtype_for(n);
  if (n == 0) return {at::empty({0}, x.options()), at::empty({0}, x.options().dtype(idt))};
  const OnDevice on(x);
  const uint32_t key_min = cuda::threshold_key(thr, kind_of(x.scalar_type()));
  at::Tensor values, indices;
  dispatch_bits_index(x.element_size(), idt, [&](auto u, auto i) {
    using U = decltype(u);
    using I = decltype(i);
    const U* px = static_cast<const U*>(x.const_data_ptr());
    at::Tensor ws = workspace_for(x, cuda::threshold_workspace_bytes<U>(n));
    cuda::threshold_prepare<U>(px, n, key_min, ws.data_ptr(), size_t(ws.numel()), on.stream);
    const int64_t total = cuda::threshold_count_result(ws.data_ptr(), n, on.stream);
    values = at::empty({total}, x.options());
    indices = at::empty({total}, x.options().dtype(idt));
    cuda::threshold_write<U, I>(px, n, key_min, static_cast<U*>(values.data_ptr()),
                                indices.data_ptr<I>(), ws.data_ptr(), on.stream);
  });
  return {values, indices};
}

// ------------------------------------------------------------------ segmented (segmented.cu)

std::tuple<at::Tensor, at::Tensor> segmented_topk_cuda(const at::Tensor& flat_in,
                                                       const at::Tensor& offsets_in,
                                                       const at::Tensor& ks_in) {
  const at::Tensor flat = flat_values(flat_in, "segmented_topk", at::kCUDA);
  // The plan is made on the host from CPU offsets/ks (ops.py passes CPU tensors).
  const at::Tensor offsets = offsets_in.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor ks = ks_in.to(at::kCPU, at::kLong).contiguous();
  const int64_t nseg = ks.numel(), n = flat.numel();
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  const int64_t* kp = ks.const_data_ptr<int64_t>();
  check_segments(offsets, ks, n);
  const auto idt = index_dtype_for(n);
  const OnDevice on(flat);
  // Pinned, so the copy below is truly asynchronous; torch's caching host allocator keeps
  // the block alive until the copy has run on the stream.
  at::Tensor meta_host = at::empty({cuda::segmented_meta_len(nseg)},
                                   at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  const cuda::SegmentedPlan plan =
      cuda::segmented_plan(off, kp, nseg, meta_host.data_ptr<int64_t>(), /*radix_all=*/false);
  at::Tensor values = at::empty({plan.k_total}, flat.options());
  at::Tensor indices = at::empty({plan.k_total}, flat.options().dtype(idt));
  if (plan.k_total == 0) return {values, indices};
  const at::Tensor meta = meta_host.to(flat.device(), at::kLong, /*non_blocking=*/true);
  dispatch_bits_index(flat.element_size(), idt, [&](auto u, auto i) {
    using U = decltype(u);
    using I = decltype(i);
    at::Tensor ws = workspace_for(flat, cuda::segmented_topk_workspace_bytes<U>(plan));
    cuda::segmented_topk<U, I>(static_cast<const U*>(flat.const_data_ptr()), plan,
                               meta.const_data_ptr<int64_t>(), static_cast<U*>(values.data_ptr()),
                               indices.data_ptr<I>(), ws.data_ptr(), size_t(ws.numel()),
                               on.stream);
  });
  return {values, indices};
}

double sampled_threshold_cuda(const at::Tensor& x_in, int64_t k, int64_t samples,
                              int64_t seed) {
  const at::Tensor x = flat_values(x_in, "sampled_threshold", at::kCUDA);
  const int64_t n = x.numel();
  check_k(k, 1, n, "sampled_threshold");
  const OnDevice on(x);
  at::Tensor ws = workspace_for(x, cuda::sampled_threshold_workspace_bytes(n, samples));
  double thr = 0.0;
  dispatch_bits_index(x.element_size(), at::kInt, [&](auto u, auto) {
    using U = decltype(u);
    thr = cuda::sampled_threshold<U>(static_cast<const U*>(x.const_data_ptr()), n, k, samples,
                                     static_cast<uint64_t>(seed), kind_of(x.scalar_type()),
                                     ws.data_ptr(), size_t(ws.numel()), on.stream);
  });
  return thr;
}

// ------------------------------------------------------- error feedback (ef_topk, ops.h)
//
// A float32 residual takes the fused op of select.cu (the sum formed in the first radix
// pass). A 16-bit residual (gradient and wire of its dtype), and the segmented op, are
// composed: torch's add writes residual + grad into the residual (float32 arithmetic,
// rounded once, as on the CPU), the radix top-k reads it, and one launch writes the
// selected entries' wire error.
namespace {

void wire_error_of(at::Tensor& residual, const at::Tensor& values, const at::Tensor& indices,
                   at::ScalarType wire, cudaStream_t stream) {
  dispatch_bits_index(residual.element_size(), indices.scalar_type(), [&](auto u, auto i) {
    using U = decltype(u);
    using I = decltype(i);
    cuda::apply_wire_error<U, I>(static_cast<U*>(residual.data_ptr()),
                                 kind_of(residual.scalar_type()), kind_of(wire),
                                 static_cast<const U*>(values.const_data_ptr()),
                                 indices.const_data_ptr<I>(), values.numel(), stream);
  });
}

// A DGC velocity, composed: velocity.mul_(m).add_(grad) (torch's kernels round the product
// and the sum, as the CPU kernel does), then it stands for the gradient. Returns the input
// the residual accumulates.
at::Tensor velocity_step(const at::Tensor& grad, const std::optional<at::Tensor>& velocity,
                         double momentum) {
  if (!velocity) return grad;
  at::Tensor v = *velocity;
  v.view({-1}).mul_(momentum).add_(grad);
  return v.view({-1});
}

// The velocity's sent entries cleared (mask_velocity): +0, as index_fill_ writes.
void mask_velocity_of(const std::optional<at::Tensor>& velocity, bool mask, const at::Tensor& values,
                      const at::Tensor& indices, cudaStream_t stream) {
  if (!velocity || !mask) return;
  at::Tensor v = *velocity;
  wire_error_of(v, values, indices, v.scalar_type(), stream);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> ef_topk_cuda(const at::Tensor& grad_in, at::Tensor& residual,
                                                int64_t k, at::ScalarType wire_dtype,
                                                const std::optional<at::Tensor>& velocity,
                                                double momentum, bool mask_velocity) {
  const at::Tensor grad_raw = check_feedback(grad_in, residual, wire_dtype, velocity, "ef_topk", at::kCUDA);
  const int64_t n = grad_raw.numel();
  check_k(k, 0, n, "ef_topk");
  const OnDevice on(residual);
  const at::Tensor grad = velocity_step(grad_raw, velocity, momentum);
  if (residual.scalar_type() != at::kFloat) {
    residual.view({-1}).add_(grad);
    auto [values, indices] = topk_cuda(residual, k);
    wire_error_of(residual, values, indices, wire_dtype, on.stream);
    mask_velocity_of(velocity, mask_velocity, values, indices, on.stream);
    return {values, indices};
  }
  const auto idt = index_dtype_for(n);
  at::Tensor values = at::empty({k}, residual.options());
  at::Tensor indices = at::empty({k}, residual.options().dtype(idt));
  const size_t bytes = cuda::topk_workspace_bytes<uint32_t>(n, k);  // 0: none needed
  at::Tensor ws = bytes ? workspace_for(residual, bytes) : at::Tensor();
  dispatch_index(idt, [&](auto i) {
    using I = decltype(i);
    cuda::ef_topk_f32<I>(grad.const_data_ptr(), kind_of(grad.scalar_type()),
                         residual.data_ptr<float>(), n, k, kind_of(wire_dtype),
                         static_cast<uint32_t*>(values.data_ptr()), indices.data_ptr<I>(),
                         bytes ? ws.data_ptr() : nullptr, bytes, on.stream);
  });
  mask_velocity_of(velocity, mask_velocity, values, indices, on.stream);
  return {values, indices};
}

std::tuple<at::Tensor, at::Tensor> segmented_ef_topk_cuda(const at::Tensor& grad_in,
                                                          at::Tensor& residual,
                                                          const at::Tensor& offsets,
                                                          const at::Tensor& ks,
                                                          at::ScalarType wire_dtype,
                                                          const std::optional<at::Tensor>& velocity,
                                                          double momentum, bool mask_velocity) {
  const at::Tensor grad_raw =
      check_feedback(grad_in, residual, wire_dtype, velocity, "segmented_ef_topk", at::kCUDA);
  // every check before the residual changes (segmented_topk_cuda checks them again)
  check_segments(offsets.to(at::kCPU, at::kLong).contiguous(), ks.to(at::kCPU, at::kLong).contiguous(),
                 grad_raw.numel());
  const OnDevice on(residual);
  const at::Tensor grad = velocity_step(grad_raw, velocity, momentum);
  residual.view({-1}).add_(grad.to(residual.scalar_type()));
  auto [values, indices] = segmented_topk_cuda(residual, offsets, ks);
  wire_error_of(residual, values, indices, wire_dtype, on.stream);
  mask_velocity_of(velocity, mask_velocity, values, indices, on.stream);
  return {values, indices};
}

// -------------------------------------------------------------------------- codec (codec.cu)

int64_t pack_cuda(const at::Tensor& values, const at::Tensor& indices, at::Tensor& out,
                  int64_t offset) {
  check_record(values, indices, "pack");
  check_pack_out(values, out, at::kCUDA);
  check_value_dtype(out, "pack");
  check_same_device(out, values, "pack");
  check_same_device(out, indices, "pack");
  check_pack_fits(values, indices, out, offset);
  const int64_t k = values.numel();
  const OnDevice on(out);
  const at::Tensor v = values.contiguous(), ix = indices.contiguous();
  int64_t next = 0;
  dispatch_bits_index(out.element_size(), ix.scalar_type(), [&](auto u, auto i) {
    using U = decltype(u);
    using I = decltype(i);
    next = cuda::pack<U, I>(static_cast<const U*>(v.const_data_ptr()), ix.const_data_ptr<I>(),
                            k, static_cast<U*>(out.data_ptr()), offset, on.stream);
  });
  return next;
}

void scatter_add_cuda(at::Tensor& dense, const at::Tensor& values, const at::Tensor& indices) {
  check_scatter_add(dense, values, indices, at::kCUDA);
  check_value_dtype(dense, "scatter_add");
  check_same_device(dense, values, "scatter_add");
  check_same_device(dense, indices, "scatter_add");
  const int64_t n = dense.numel(), k = values.numel();
  if (k == 0) return;
  const OnDevice on(dense);
  const at::Tensor v = values.contiguous(), ix = indices.contiguous();
  dispatch_bits_index(dense.element_size(), ix.scalar_type(), [&](auto u, auto i) {
    using U = decltype(u);
    using I = decltype(i);
    const size_t bytes = cuda::scatter_add_workspace_bytes<I>(k);
    at::Tensor ws = workspace_for(dense, bytes);
    cuda::scatter_add<U, I>(static_cast<U*>(dense.data_ptr()), n, kind_of(dense.scalar_type()),
                            static_cast<const U*>(v.const_data_ptr()), ix.const_data_ptr<I>(), k,
                            ws.data_ptr(), size_t(ws.numel()), on.stream);
  });
}

void scatter_add_chunks_cuda(at::Tensor& dense, const at::Tensor& gathered, int64_t nchunks,
                             int64_t chunk_len, int64_t offset, int64_t k,
                             at::ScalarType index_dtype) {
  check_chunks(dense, gathered, nchunks, chunk_len, offset, k, index_dtype, at::kCUDA);
  if (k == 0 || nchunks == 0) return;
  const OnDevice on(dense);
  if (dense.scalar_type() != gathered.scalar_type()) {  // float32 sum of 16-bit records
    const auto* g = static_cast<const uint16_t*>(gathered.const_data_ptr());
    dispatch_index(index_dtype, [&](auto i) {
      cuda::scatter_add_chunks_widen<decltype(i)>(dense.data_ptr<float>(), dense.numel(),
                                                  kind_of(gathered.scalar_type()), g, nchunks,
                                                  chunk_len, offset, k, on.stream);
    });
    return;
  }
  dispatch_bits_index(dense.element_size(), index_dtype, [&](auto u, auto i) {
    using U = decltype(u);
    using I = decltype(i);
    cuda::scatter_add_chunks<U, I>(static_cast<U*>(dense.data_ptr()), dense.numel(),
                                   kind_of(dense.scalar_type()),
                                   static_cast<const U*>(gathered.const_data_ptr()), nchunks,
                                   chunk_len, offset, k, on.stream);
  });
}

at::Tensor deliver_chunks_cuda(at::Tensor& out, const std::vector<at::Tensor>& tensors,
                               const at::Tensor& gathered, int64_t nchunks, int64_t chunk_len,
                               int64_t offset, int64_t k, at::ScalarType index_dtype,
                               double scale) {
  const std::vector<int64_t> bounds = check_deliver(out, tensors, gathered, nchunks, chunk_len,
                                                    offset, k, index_dtype, scale, at::kCUDA);
  const OnDevice on(out);
  at::Tensor nonfinite = at::zeros({}, out.options().dtype(at::kLong));
  if (k == 0 || nchunks == 0) return nonfinite;
  const int64_t ntensors = int64_t(tensors.size());
  // bounds, then data pointers; pinned, so the copy is asynchronous (as segmented_topk's meta)
  at::Tensor meta_host = at::empty({cuda::deliver_meta_len(ntensors)},
                                   at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* m = meta_host.data_ptr<int64_t>();
  std::copy(bounds.begin(), bounds.end(), m);
  for (int64_t t = 0; t < ntensors; ++t)
    m[ntensors + 1 + t] = int64_t(reinterpret_cast<uintptr_t>(tensors[t].data_ptr()));
  const at::Tensor meta = meta_host.to(out.device(), at::kLong, /*non_blocking=*/true);
  dispatch_index(index_dtype, [&](auto i) {
    cuda::deliver_chunks<decltype(i)>(out.data_ptr(), kind_of(out.scalar_type()), out.numel(),
                                      kind_of(gathered.scalar_type()),
                                      meta.const_data_ptr<int64_t>(), ntensors, bounds.back(),
                                      gathered.const_data_ptr(), nchunks, chunk_len, offset, k,
                                      scale, nonfinite.data_ptr<int64_t>(), on.stream);
  });
  return nonfinite;
}

// ---------------------------------------------------------------------------- hash (hash.cu)

std::tuple<at::Tensor, at::Tensor, at::Tensor> hash_partition_cuda(const at::Tensor& indices_in,
                                                                   int64_t nparts, int64_t seed,
                                                                   int64_t table_size,
                                                                   int64_t rounds) {
  check_hash_args(indices_in, nparts, table_size, rounds, at::kCUDA, "hash_partition");
  const at::Tensor indices = indices_in.contiguous();
  const int64_t m = indices.numel();
  at::Tensor order, counts, overflow;
  std::tie(order, counts, overflow) = hash_partition_outputs(indices, nparts);
  // The device keeps every partition's table at once: 16 bytes a slot (the CPU kernel, a
  // table per thread). Refused here, before a size that wraps or no GPU holds is computed.
  TORCH_CHECK(m == 0 || double(nparts) * double(table_size) * 16.0 <= double(int64_t(1) << 40),
              "hash_partition: ", nparts, " partitions of ", table_size,
              " slots need more than 1 TiB of GPU workspace; lower table_size");
  const OnDevice on(indices);
  at::Tensor ws =
      workspace_for(indices, cuda::hash_partition_workspace_bytes(m, nparts, table_size));
  dispatch_index(indices.scalar_type(), [&](auto tag) {
    using I = decltype(tag);
    cuda::hash_partition<I>(indices.const_data_ptr<I>(), m, nparts, static_cast<uint64_t>(seed),
                            table_size, rounds, order.data_ptr<int64_t>(),
                            counts.data_ptr<int64_t>(), overflow.data_ptr<int64_t>(),
                            ws.data_ptr(), size_t(ws.numel()), on.stream);
  });
  return {order, counts, overflow};
}

at::Tensor hash_owner_cuda(const at::Tensor& indices_in, int64_t nparts, int64_t seed) {
  check_hash_args(indices_in, nparts, 1, 0, at::kCUDA, "hash_owner");
  const at::Tensor indices = indices_in.contiguous();
  const int64_t m = indices.numel();
  at::Tensor out = at::empty({m}, indices.options().dtype(at::kInt));
  const OnDevice on(indices);
  dispatch_index(indices.scalar_type(), [&](auto tag) {
    using I = decltype(tag);
    cuda::hash_owner<I>(indices.const_data_ptr<I>(), m, nparts, static_cast<uint64_t>(seed),
                        out.data_ptr<int32_t>(), on.stream);
  });
  return out;
}

namespace {
// Fills `batch` with tensors [lo, lo + count) of the lists (s2 and the biases where given).
void fill_batch(cuda::MomentBatch& batch, size_t lo, size_t count, std::vector<at::Tensor>& p,
                const std::vector<at::Tensor>& g, std::vector<at::Tensor>& s1,
                std::vector<at::Tensor>* s2, std::vector<at::Tensor>& age,
                const std::vector<double>* bias1, const std::vector<double>* bias2_sqrt) {
  batch.count = int(count);
  for (size_t i = 0; i < count; ++i) {
    const size_t t = lo + i;
    batch.p[i] = p[t].data_ptr<float>();
    batch.g[i] = g[t].const_data_ptr<float>();
    batch.s1[i] = s1[t].data_ptr<float>();
    batch.s2[i] = s2 ? (*s2)[t].data_ptr<float>() : nullptr;
    batch.age[i] = age[t].data_ptr<float>();
    batch.n[i] = p[t].numel();
    batch.bias1[i] = bias1 ? float((*bias1)[t]) : 1.0f;
    batch.bias2_sqrt[i] = bias2_sqrt ? float((*bias2_sqrt)[t]) : 1.0f;
  }
}
}  // namespace

void shared_momentum_step_cuda(std::vector<at::Tensor> params, const std::vector<at::Tensor>& grads,
                               std::vector<at::Tensor> bufs, std::vector<at::Tensor> ages,
                               double lr, double momentum, double dampening, bool nesterov) {
  check_moment_lists({params, grads, bufs, ages}, "shared_momentum_step", at::kCUDA);
  if (params.empty()) return;
  const OnDevice on(params[0]);
  for (size_t lo = 0; lo < params.size(); lo += cuda::kMomentBatch) {
    cuda::MomentBatch batch;
    fill_batch(batch, lo, std::min<size_t>(cuda::kMomentBatch, params.size() - lo), params, grads,
               bufs, nullptr, ages, nullptr, nullptr);
    cuda::shared_momentum(batch, float(lr), float(momentum), float(dampening), nesterov, on.stream);
  }
}

void shared_adam_step_cuda(std::vector<at::Tensor> params, const std::vector<at::Tensor>& grads,
                           std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
                           std::vector<at::Tensor> ages, double lr, double beta1, double beta2,
                           double eps, const std::vector<double>& bias1,
                           const std::vector<double>& bias2_sqrt) {
  check_adam_step(params, grads, exp_avgs, exp_avg_sqs, ages, bias1.size(), bias2_sqrt.size(), at::kCUDA);
  if (params.empty()) return;
  const OnDevice on(params[0]);
  for (size_t lo = 0; lo < params.size(); lo += cuda::kMomentBatch) {
    cuda::MomentBatch batch;
    fill_batch(batch, lo, std::min<size_t>(cuda::kMomentBatch, params.size() - lo), params, grads,
               exp_avgs, &exp_avg_sqs, ages, &bias1, &bias2_sqrt);
    cuda::shared_adam(batch, float(lr), float(beta1), float(beta2), float(eps), on.stream);
  }
}

namespace {
// ef_step_key / step_denominator on CUDA: the checks are the CPU kernel's (checks.h), then
// one launch per kKeyBatch tensors; empty tensors are skipped (no block row for them).
void step_key_launch(const char* op, const std::vector<at::Tensor>* grads, at::Tensor* residual,
                     const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::vector<double>& bias2_sqrt, double eps, at::Tensor& out,
                     bool root) {
  const std::vector<int64_t> off =
      check_step_key(op, grads, residual, exp_avg_sqs, bias2_sqrt, out, at::kCUDA);
  const OnDevice on(out);
  float* r = residual ? residual->data_ptr<float>() : nullptr;
  cuda::KeyBatch batch;
  batch.count = 0;
  for (size_t s = 0; s < exp_avg_sqs.size(); ++s) {
    if (exp_avg_sqs[s].numel() == 0) continue;
    const int i = batch.count++;
    batch.g[i] = grads ? (*grads)[s].const_data_ptr<float>() : nullptr;
    batch.v[i] = exp_avg_sqs[s].const_data_ptr<float>();
    batch.off[i] = off[s];
    batch.n[i] = exp_avg_sqs[s].numel();
    batch.bias2_sqrt[i] = float(bias2_sqrt[s]);
    if (batch.count == cuda::kKeyBatch) {
      cuda::step_key(batch, r, out.data_ptr<float>(), float(eps), root, on.stream);
      batch.count = 0;
    }
  }
  cuda::step_key(batch, r, out.data_ptr<float>(), float(eps), root, on.stream);
}
}  // namespace

void ef_step_key_cuda(const std::vector<at::Tensor>& grads, at::Tensor& residual,
                      const std::vector<at::Tensor>& exp_avg_sqs,
                      const std::vector<double>& bias2_sqrt, double eps, at::Tensor& key,
                      bool root) {
  step_key_launch("ef_step_key", &grads, &residual, exp_avg_sqs, bias2_sqrt, eps, key, root);
}

void step_denominator_cuda(const std::vector<at::Tensor>& exp_avg_sqs,
                           const std::vector<double>& bias2_sqrt, double eps, at::Tensor& out,
                           bool root) {
  step_key_launch("step_denominator", nullptr, nullptr, exp_avg_sqs, bias2_sqrt, eps, out, root);
}

// Every CUDA op that ops.h declares is defined above with the declared signature: a
// definition whose parameters drifted would be a second overload beside the undefined
// declaration (a link error on GPU machines only), and taking the address of an overloaded
// name without a target type does not compile, here and in CI.
namespace {
[[maybe_unused]] const auto kDefinedAsDeclared = std::make_tuple(
    &topk_cuda, &segmented_topk_cuda, &sampled_threshold_cuda, &threshold_select_cuda,
    &ef_topk_cuda, &segmented_ef_topk_cuda, &threshold_count_cuda, &pack_cuda, &scatter_add_cuda,
    &scatter_add_chunks_cuda, &deliver_chunks_cuda, &hash_partition_cuda, &hash_owner_cuda,
    &shared_momentum_step_cuda, &shared_adam_step_cuda, &ef_step_key_cuda,
    &step_denominator_cuda);
}  // namespace

}  // namespace ssf
#endif  // SSF_WITH_CUDA
