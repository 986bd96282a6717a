// ssfusion_hvd native ops: one declaration per op, CPU and CUDA share the semantics.
//
// Conventions shared by every op (also implemented by the pure-torch fallback in
// ssfusion_hvd/ops.py; the tests hold the two to identical results):
//   * Inputs are flattened; values are float32, float16 or bfloat16.
//   * Magnitude order is a total order on |x|: it is IEEE order of |x| for numbers and
//     puts NaN above +Inf, so a NaN gradient is always selected (never dropped silently).
//     Formally: key(x) = bits(x) with the sign bit cleared, compared as unsigned ints.
//     NaNs therefore rank among themselves by payload. An op that adds (the error-feedback
//     ops) gets the payload from its hardware: x86 keeps an input NaN's, a GPU returns the
//     canonical NaN. So when more than k float32 NaNs of different payloads compete, CPU
//     and CUDA may pick different ones; with at most k NaNs both select all of them.
//   * Ties are broken by the lower index; selections come out in ascending index order.
//   * Indices are int32 when numel < 2^31, else int64.
#pragma once

#include <optional>

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace ssf {

// Every op below exists for the CPU (name_cpu, csrc/cpu/) and, with SSF_WITH_CUDA, for CUDA
// (name_cuda, csrc/cuda/), with the same semantics: SSF_DEVICE_OPS(dev) declares one
// device's set (and bindings.cpp binds it), so the list is written once. In its order:
//
// Selection
//   topk(x, k): exact top-k of x.flatten() by magnitude. Returns (values with sign, indices).
//   segmented_topk(flat, offsets, ks): per-segment top-k: segment s is
//     flat[offsets[s], offsets[s+1]), ks[s] elements are taken from it; results are
//     concatenated in segment order, indices are positions in flat.
//   sampled_threshold(x, k, samples, seed): DGC's sampled threshold, the magnitude that keeps
//     about k of x's n elements: the ceil(k * samples / n)-th largest magnitude (NaN counts as
//     +Inf) of `samples` elements (clamped to [1, n]), sample j drawn uniformly from the j-th
//     of `samples` equal strata of x by a hash of (seed, j) (sampling.h). The positions
//     depend on n, samples and seed only, so every rank and backend passing the same seed
//     samples alike; a random rather than a fixed-stride sample cannot alias with a weight
//     layout (a stride equal to a row length reads one column only). `seed` is the bits of
//     a uint64 (as for the hash ops).
//   threshold_select(x, thr): all elements with |x| >= thr (compared in float64) plus every
//     NaN, in index order.
//   threshold_count(x, thr): the number of elements threshold_select would return.
//
// Error feedback fused with the selection (one pass over gradient and residual on the CPU)
//   ef_topk(grad, residual, k, wire_dtype): residual += grad in place (in the residual's
//     dtype: float32, or the 16-bit dtype gradient and wire share), then the exact top-k of
//     the sum as topk returns it (values in the residual's dtype); the selected entries of
//     the residual become what the wire dtype loses of them: 0, or v - (v rounded to the
//     wire dtype) for a float32 residual sent as 16-bit. Equal, bit for bit, to
//     residual.add_(grad); topk(residual, k); residual[indices] = that loss.
//   segmented_ef_topk(grad, residual, offsets, ks, wire_dtype): the same per segment of
//     segmented_topk, in one call; elements outside every segment are accumulated only.
//   segmented_ef_topk_tensors (CPU only): the same with the gradient given as its
//     segments, one tensor each (a fusion group's .grad tensors, read where they lie):
//     grads[s] holds offsets[s + 1] - offsets[s] elements, the segments tile the residual
//     (offsets[0] = 0, offsets[nseg] = its size). Equal to segmented_ef_topk on their
//     concatenation, without writing that concatenation first.
//   ef_topk_tensors (CPU only): ef_topk with the gradient given as tensors laid back to
//     back (grads[s]'s elements at [n_0 + ... + n_{s-1}, ... + n_s) of the residual,
//     which they tile): equal to ef_topk on their concatenation, one k over all of them,
//     without writing that concatenation first.
//   group_ef_topk(grad, residual, offsets, floors, k, wire_dtype) (CPU; and
//   group_ef_topk_tensors with the gradient as segments): one budget of k over the
//     segments, shared by magnitude: segmented_ef_topk with the floors as ks, then the
//     k - sum(floors) largest of the segments' other elements (ties to the lower index),
//     their residual entries replaced by their wire error too; values and indices of both
//     in index order. sum(floors) <= k <= the segments' elements, checked first.
//   All take an optional DGC velocity (momentum correction; velocity, gradient and
//   residual of one dtype): first velocity = momentum * velocity + grad (a product and a
//   sum, each rounded, as velocity.mul_(momentum).add_(grad)), then the above with the
//   velocity for the gradient, and with mask_velocity the selected entries of the
//   velocity set to 0 (velocity.index_fill_(0, indices, 0)).
//
// Sparse record codec. A record of k elements inside a flat 1-D buffer `out` whose dtype is
// the values' dtype holds k values, zero padding up to index alignment, then k indices
// stored bit for bit (layout in record.h).
//   pack(values, indices, out, offset): writes the record at `offset` of out; returns the
//     offset just past the record.
//   scatter_add(dense, values, indices): dense.view(-1)[indices[j]] += values[j] for j in
//     order (duplicates add, in order).
//   scatter_add_chunks(dense, gathered, nchunks, chunk_len, offset, k, index_dtype): decodes
//     the record at `offset` of each of the `nchunks` equal chunks of `gathered` (an
//     allgather of per-rank buffers of chunk_len elements) into dense: chunk 0 first, so
//     every rank accumulates in the same order. Indices must be distinct within one chunk.
//   deliver_chunks(out, tensors, gathered, nchunks, chunk_len, offset, k, index_dtype, scale):
//     the rest of a sparse decode after scatter_add_chunks(out, ...) on the same records,
//     into tensors the caller has zeroed: moves the sums at the positions the records name
//     out of `out` into a LIST of tensors, scaled, and leaves +0 behind, so `out` is all
//     zero again without a pass over it.
//     `tensors` (contiguous, one dtype: the records'; numels n_0, n_1, ...) lie back to back
//     in out's layout: position i in [b_t, b_{t+1}) of bounds b_0 = 0, b_{t+1} = b_t + n_t
//     is element i - b_t of tensors[t] (found by binary search over the bounds; empty
//     tensors take no position). Positions in [b_T, out.numel()) are the sink of padding
//     entries: cleared, never delivered. For the records of chunk 0, 1, ... in order, every
//     entry's position i where out still holds a value (bits not all zero) is cleared and,
//     if i < b_T, delivered:
//       tensors[t].view(-1)[i - b_t] = G(A(float(out[i]) * float(scale))),
//     A being out's dtype and G the tensors' (the product skipped when scale == 1). Later
//     chunks naming i find +0 there and skip it: each position is delivered once, whole.
//     A position whose sum is +0 is not written; the tensors hold +0 there already, which is
//     also what the full decode gives, as scale must be finite and >= 0. So the tensors end
//     bit for bit as out.mul_(scale) and a copy of out into zeroed tensors leave them (NaN
//     payloads aside). Elements no record names are not written. out's dtype is the
//     tensors' dtype, or float32 for float16/bfloat16 tensors. Every index must lie in
//     [0, out.numel()) (checked before anything is written on the CPU; a device-side
//     assertion on CUDA). Returns a 0-d int64 tensor on out's device: the number of
//     delivered values that are NaN or +-Inf.
//
// ZEN's hierarchical hashing ("ZEN: Empowering Distributed Training with Sparsity-driven
// Data Synchronization", OSDI'25, §3.2, Algorithm 1); the hash functions are in hash.h.
//   hash_partition(indices, nparts, seed, table_size, rounds):
//     `indices` is 1-D int32/int64 (any values; normally a gradient's selected positions).
//     Index j goes to partition p_j = h_0(indices[j]) in [0, nparts): the same seed gives the
//     same partition on every rank. Each partition has a parallel memory of `table_size`
//     slots and a serial memory without bound. Insertion runs `rounds` rounds: in round
//     i = 1..rounds every index not yet placed tries slot h_i(indices[j]) of its partition; a
//     slot empty at the start of the round goes to the lowest j among the indices trying it,
//     the others stay pending (the paper's read-after-write collision check, made
//     deterministic). Indices still pending after the last round are appended to their
//     partition's serial memory in ascending j (the paper's atomic counter, in input order):
//     nothing is lost, whatever the table size.
//     Returns (order, counts, overflow):
//       order    int64[m]: the positions j grouped by partition 0..nparts-1; inside
//                partition p the occupied slots of its parallel memory in slot order, then
//                its serial memory;
//       counts   int64[nparts]: entries per partition;
//       overflow int64[nparts]: entries that went to each partition's serial memory.
//     nparts and table_size in [1, 2^31), rounds in [0, 64]; duplicate indices are each
//     placed.
//   hash_owner(indices, nparts, seed): h_0 of every index (int32): its partition.
//     {idx : h_0(idx) = p} is the index set I_p that ZEN's hash bitmap (§3.3, Algorithm 2)
//     is laid over.
// Selection by the pending step (ssfusion_hvd/recipe.py, docs/recipe.md "Selecting by the step")
//   ef_step_key (ef_step_key_cpu, ef_step_key_cuda): a fusion group's error-feedback sum and the
//     size of the step the shared Adam rule would take with it, in one pass over the group's
//     tensors where they lie: grads[s] (float32) holds the elements [n_0 + ... + n_{s-1},
//     ... + n_s) of `residual` and `key` (float32, contiguous), which the tensors tile, and
//     exp_avg_sqs[s] (float32) their Adam second moment v. Per element, each operation
//     rounded once in this order (square root correctly rounded):
//       residual = residual + grad;  key = |residual| / (sqrt(v) / bias2_sqrt[s] + eps),
//     the denominator of moments.h's adam_element (bias2_sqrt[s] = (1 - beta2^t)^(1/2) at
//     tensor s's step count t). The keys are >= 0 (NaN where the sum or v is NaN), so the
//     magnitude top-k of `key` is the top-k by the pending step. With `root`, the
//     denominator's square root is taken (one more correctly rounded operation): key =
//     |residual| / sqrt(sqrt(v) / bias2_sqrt[s] + eps), whose order is that of
//     residual^2 / (sqrt(v) / bias2_sqrt[s] + eps), the pending sum times the step it would
//     take: the first-order decrease of the loss (docs/recipe.md, "Selecting by the gain").
//   step_denominator (step_denominator_cpu, step_denominator_cuda): the denominator alone,
//     sqrt(v) / bias2_sqrt[s] + eps per element of exp_avg_sqs laid back to back (with
//     `root`, its square root), into `out` (float32, contiguous), rounded as ef_step_key
//     rounds it (for the schemes that divide partial sums by it: SparDL, ExDyna).
// Shared moments (ssfusion_hvd/moments.py, moments="shared" without senders' waits): the
// step of the sparsified tensors, one pass per tensor over parameter, synchronized
// gradient, optimizer state and ages, in place; float32 contiguous tensors, lists of one
// length whose entries at each position have one element count. Per element (moments.h):
//   shared_momentum_step(params, grads, bufs, ages, lr, momentum, dampening, nesterov): SGD
//     with momentum's buffer moved by a gradient that waited `age + 1` steps.
//   shared_adam_step(params, grads, exp_avgs, exp_avg_sqs, ages, lr, beta1, beta2, eps,
//     bias1, bias2_sqrt): Adam's moments alike; bias1[i] = 1 - beta1^t and bias2_sqrt[i] =
//     (1 - beta2^t)^(1/2) at tensor i's step count t.
// Every age is then advanced by one step, or reset to 0 where the gradient is non-zero.

#define SSF_DEVICE_OPS(dev)                                                                 \
  std::tuple<at::Tensor, at::Tensor> topk_##dev(const at::Tensor& x, int64_t k);            \
  std::tuple<at::Tensor, at::Tensor> segmented_topk_##dev(                                  \
      const at::Tensor& flat, const at::Tensor& offsets, const at::Tensor& ks);             \
  double sampled_threshold_##dev(const at::Tensor& x, int64_t k, int64_t samples,           \
                                int64_t seed);                                              \
  std::tuple<at::Tensor, at::Tensor> threshold_select_##dev(const at::Tensor& x, double thr); \
  std::tuple<at::Tensor, at::Tensor> ef_topk_##dev(                                         \
      const at::Tensor& grad, at::Tensor& residual, int64_t k, at::ScalarType wire_dtype,   \
      const std::optional<at::Tensor>& velocity, double momentum, bool mask_velocity);      \
  std::tuple<at::Tensor, at::Tensor> segmented_ef_topk_##dev(                               \
      const at::Tensor& grad, at::Tensor& residual, const at::Tensor& offsets,              \
      const at::Tensor& ks, at::ScalarType wire_dtype,                                      \
      const std::optional<at::Tensor>& velocity, double momentum, bool mask_velocity);      \
  int64_t threshold_count_##dev(const at::Tensor& x, double thr);                           \
                                                                                            \
  int64_t pack_##dev(const at::Tensor& values, const at::Tensor& indices, at::Tensor& out,  \
                     int64_t offset);                                                       \
  void scatter_add_##dev(at::Tensor& dense, const at::Tensor& values,                       \
                         const at::Tensor& indices);                                        \
  void scatter_add_chunks_##dev(at::Tensor& dense, const at::Tensor& gathered,              \
                                int64_t nchunks, int64_t chunk_len, int64_t offset,         \
                                int64_t k, at::ScalarType index_dtype);                     \
  at::Tensor deliver_chunks_##dev(at::Tensor& out, const std::vector<at::Tensor>& tensors,  \
                                  const at::Tensor& gathered, int64_t nchunks,              \
                                  int64_t chunk_len, int64_t offset, int64_t k,             \
                                  at::ScalarType index_dtype, double scale);                \
                                                                                            \
  std::tuple<at::Tensor, at::Tensor, at::Tensor> hash_partition_##dev(                      \
      const at::Tensor& indices, int64_t nparts, int64_t seed, int64_t table_size,          \
      int64_t rounds);                                                                      \
  at::Tensor hash_owner_##dev(const at::Tensor& indices, int64_t nparts, int64_t seed);      \
                                                                                            \
  void shared_momentum_step_##dev(std::vector<at::Tensor> params,                           \
                                  const std::vector<at::Tensor>& grads,                     \
                                  std::vector<at::Tensor> bufs, std::vector<at::Tensor> ages, \
                                  double lr, double momentum, double dampening,             \
                                  bool nesterov);                                           \
  void shared_adam_step_##dev(std::vector<at::Tensor> params,                               \
                              const std::vector<at::Tensor>& grads,                         \
                              std::vector<at::Tensor> exp_avgs,                             \
                              std::vector<at::Tensor> exp_avg_sqs,                          \
                              std::vector<at::Tensor> ages, double lr, double beta1,        \
                              double beta2, double eps, const std::vector<double>& bias1,   \
                              const std::vector<double>& bias2_sqrt);

SSF_DEVICE_OPS(cpu)
std::tuple<at::Tensor, at::Tensor> ef_topk_tensors_cpu(
    const std::vector<at::Tensor>& grads, at::Tensor& residual, int64_t k,
    at::ScalarType wire_dtype, const std::optional<at::Tensor>& velocity, double momentum,
    bool mask_velocity);
std::tuple<at::Tensor, at::Tensor> segmented_ef_topk_tensors_cpu(
    const std::vector<at::Tensor>& grads, at::Tensor& residual, const at::Tensor& offsets,
    const at::Tensor& ks, at::ScalarType wire_dtype, const std::optional<at::Tensor>& velocity,
    double momentum, bool mask_velocity);
std::tuple<at::Tensor, at::Tensor> group_ef_topk_cpu(
    const at::Tensor& grad, at::Tensor& residual, const at::Tensor& offsets,
    const at::Tensor& floors, int64_t k, at::ScalarType wire_dtype,
    const std::optional<at::Tensor>& velocity, double momentum, bool mask_velocity);
void ef_step_key_cpu(const std::vector<at::Tensor>& grads, at::Tensor& residual,
                     const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::vector<double>& bias2_sqrt, double eps, at::Tensor& key,
                     bool root);
void step_denominator_cpu(const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<double>& bias2_sqrt, double eps, at::Tensor& out,
                          bool root);
std::tuple<at::Tensor, at::Tensor> group_ef_topk_tensors_cpu(
    const std::vector<at::Tensor>& grads, at::Tensor& residual, const at::Tensor& offsets,
    const at::Tensor& floors, int64_t k, at::ScalarType wire_dtype,
    const std::optional<at::Tensor>& velocity, double momentum, bool mask_velocity);
#ifdef SSF_WITH_CUDA
SSF_DEVICE_OPS(cuda)
void ef_step_key_cuda(const std::vector<at::Tensor>& grads, at::Tensor& residual,
                      const std::vector<at::Tensor>& exp_avg_sqs,
                      const std::vector<double>& bias2_sqrt, double eps, at::Tensor& key,
                      bool root);
void step_denominator_cuda(const std::vector<at::Tensor>& exp_avg_sqs,
                           const std::vector<double>& bias2_sqrt, double eps, at::Tensor& out,
                           bool root);
#endif

// Elements of a buffer of dtype `value_dtype` taken by the values (padded) and by the
// indices of a record of k elements (record.h's layout, for checked dtypes). Device-free.
std::tuple<int64_t, int64_t> record_spans(int64_t k, at::ScalarType value_dtype,
                                          at::ScalarType index_dtype);

// How many threads of ATen's intra-op pool one of the CPU kernels' parallel loops (over n
// items, grain 1) ran on: the build's proof that the kernels fork at all (they run on one
// thread when this module is compiled without the OpenMP that torch's pool uses).
int64_t cpu_parallel_threads(int64_t n);

}  // namespace ssf
