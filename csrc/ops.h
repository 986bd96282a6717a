// ssfusion_hvd native ops: one declaration per op, CPU and CUDA share the semantics.
//
// Conventions shared by every op (also implemented by the pure-torch fallback in
// ssfusion_hvd/ops.py; the tests hold the two to identical results):
//   * Inputs are flattened; values are float32, float16 or bfloat16.
//   * Magnitude order is a total order on |x|: it is IEEE order of |x| for numbers and
//     puts NaN above +Inf, so a NaN gradient is always selected (never dropped silently).
//     Formally: key(x) = bits(x) with the sign bit cleared, compared as unsigned ints.
//   * Ties are broken by the lower index; selections come out in ascending index order.
//   * Indices are int32 when numel < 2^31, else int64.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace ssf {

// Exact top-k of x.flatten() by magnitude. Returns (values with sign, indices).
std::tuple<at::Tensor, at::Tensor> topk_cpu(const at::Tensor& x, int64_t k);
// Per-segment top-k: segment s is flat[offsets[s], offsets[s+1]), ks[s] elements are taken
// from it; results are concatenated in segment order, indices are positions in flat.
std::tuple<at::Tensor, at::Tensor> segmented_topk_cpu(const at::Tensor& flat,
                                                      const at::Tensor& offsets,
                                                      const at::Tensor& ks);
// DGC's sampled threshold: the magnitude that keeps about k of x's n elements, estimated from
// `samples` evenly strided elements (NaN counts as +Inf).
double sampled_threshold_cpu(const at::Tensor& x, int64_t k, int64_t samples);
// All elements with |x| >= thr (compared in float64) plus every NaN, in index order.
std::tuple<at::Tensor, at::Tensor> threshold_select_cpu(const at::Tensor& x, double thr);
// Number of elements threshold_select_cpu would return.
int64_t threshold_count_cpu(const at::Tensor& x, double thr);

// Sparse record codec. A record of k elements inside a flat 1-D buffer `out` whose dtype is
// the values' dtype holds k values, zero padding up to index alignment, then k indices
// stored bit for bit (see record_spans). Returns the offset just past the record.
int64_t pack_cpu(const at::Tensor& values, const at::Tensor& indices, at::Tensor& out,
                 int64_t offset);
// dense.view(-1)[indices[j]] += values[j] for j in order (duplicates add, in order).
void scatter_add_cpu(at::Tensor& dense, const at::Tensor& values, const at::Tensor& indices);
// Decodes the record at `offset` of each of the `nchunks` equal chunks of `gathered`
// (an allgather of per-rank buffers of chunk_len elements) into dense: chunk 0 first, so
// every rank accumulates in the same order. Indices must be distinct within one chunk.
void scatter_add_chunks_cpu(at::Tensor& dense, const at::Tensor& gathered, int64_t nchunks,
                            int64_t chunk_len, int64_t offset, int64_t k,
                            at::ScalarType index_dtype);

// Elements of a buffer of dtype `value_dtype` taken by the values (padded) and by the
// indices of a record of k elements.
std::tuple<int64_t, int64_t> record_spans(int64_t k, at::ScalarType value_dtype,
                                          at::ScalarType index_dtype);

#ifdef SSF_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> topk_cuda(const at::Tensor& x, int64_t k);
std::tuple<at::Tensor, at::Tensor> segmented_topk_cuda(const at::Tensor& flat,
                                                       const at::Tensor& offsets,
                                                       const at::Tensor& ks);
double sampled_threshold_cuda(const at::Tensor& x, int64_t k, int64_t samples);
std::tuple<at::Tensor, at::Tensor> threshold_select_cuda(const at::Tensor& x, double thr);
int64_t threshold_count_cuda(const at::Tensor& x, double thr);
int64_t pack_cuda(const at::Tensor& values, const at::Tensor& indices, at::Tensor& out,
                  int64_t offset);
void scatter_add_cuda(at::Tensor& dense, const at::Tensor& values, const at::Tensor& indices);
void scatter_add_chunks_cuda(at::Tensor& dense, const at::Tensor& gathered, int64_t nchunks,
                             int64_t chunk_len, int64_t offset, int64_t k,
                             at::ScalarType index_dtype);
#endif

}  // namespace ssf
