// Sparse record codec on the CPU: pack (values, indices) into a flat buffer, scatter-add
// decode. The record layout is defined once, in ../record.h.
#include "../ops.h"
#include "../checks.h"
#include "../record.h"
#include "common.h"

#include <c10/util/Exception.h>

#include <cstring>

namespace ssf {

std::tuple<int64_t, int64_t> record_spans(int64_t k, at::ScalarType value_dtype,
                                          at::ScalarType index_dtype) {
  check_index_dtype(index_dtype, "record");
  const int64_t vb = c10::elementSize(value_dtype), ib = c10::elementSize(index_dtype);
  TORCH_CHECK(ib % vb == 0 || vb % ib == 0, "record: incompatible element sizes");
  const RecordSpans spans = record_layout(k, vb, ib);
  return {spans.values, spans.indices};
}

namespace {

template <typename I>
void check_bounds(const I* idx, int64_t k, int64_t n, const char* op) {
  for (int64_t j = 0; j < k; ++j)
    TORCH_CHECK(idx[j] >= 0 && idx[j] < n, op, ": index ", int64_t(idx[j]), " out of range [0, ",
                n, ")");
}

}  // namespace

int64_t pack_cpu(const at::Tensor& values, const at::Tensor& indices, at::Tensor& out,
                 int64_t offset) {
  check_record(values, indices, "pack");
  check_pack_out(values, out, at::kCPU);
  auto [vspan, ispan] = check_pack_fits(values, indices, out, offset);
  const int64_t k = values.numel();
  const at::Tensor v = values.contiguous(), ix = indices.contiguous();
  const int64_t vb = out.element_size();
  char* base = static_cast<char*>(out.data_ptr()) + offset * vb;
  std::memcpy(base, v.const_data_ptr(), k * vb);
  std::memset(base + k * vb, 0, (vspan - k) * vb);
  std::memcpy(base + vspan * vb, ix.const_data_ptr(), k * ix.element_size());
  return offset + vspan + ispan;
}

void scatter_add_cpu(at::Tensor& dense, const at::Tensor& values, const at::Tensor& indices) {
  check_scatter_add(dense, values, indices, at::kCPU);
  const at::Tensor v = values.contiguous(), ix = indices.contiguous();
  const int64_t n = dense.numel(), k = v.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dense.scalar_type(), "scatter_add", [&] {
    scalar_t* d = dense.data_ptr<scalar_t>();
    const scalar_t* pv = v.const_data_ptr<scalar_t>();
    AT_DISPATCH_INDEX_TYPES(ix.scalar_type(), "scatter_add", [&] {
      const index_t* pi = ix.const_data_ptr<index_t>();
      check_bounds(pi, k, n, "scatter_add");
      for (int64_t j = 0; j < k; ++j) d[pi[j]] += pv[j];  // in order: duplicates add in order
    });
  });
}

namespace {

// Adds each chunk's record (values of val_t) into dense (acc_t): acc_t == val_t, or a
// float32 sum of float16/bfloat16 values (each add converts the value, then rounds in
// float32, as the CUDA kernel does).
template <typename acc_t, typename val_t, typename index_t>
void add_chunks(acc_t* d, int64_t n, const char* g, int64_t nchunks, int64_t chunk_len,
                int64_t offset, int64_t k, int64_t vspan) {
  const int64_t vb = sizeof(val_t);
  for (int64_t p = 0; p < nchunks; ++p) {  // chunk order fixes the summation order
    const char* rec = g + (p * chunk_len + offset) * vb;
    const val_t* pv = reinterpret_cast<const val_t*>(rec);
    const char* pib = rec + vspan * vb;
    auto idx_at = [&](int64_t j) {
      index_t i;
      std::memcpy(&i, pib + j * sizeof(index_t), sizeof(index_t));
      return i;
    };
    for (int64_t j = 0; j < k; ++j) {
      const index_t i = idx_at(j);
      TORCH_CHECK(i >= 0 && i < n, "scatter_add_chunks: index ", int64_t(i),
                  " out of range in chunk ", p);
    }
    // Indices are distinct within a chunk, so its adds can run in parallel.
    at::parallel_for(0, k, int64_t(1) << 14, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) d[idx_at(j)] += static_cast<acc_t>(pv[j]);
    });
  }
}

}  // namespace

void scatter_add_chunks_cpu(at::Tensor& dense, const at::Tensor& gathered, int64_t nchunks,
                            int64_t chunk_len, int64_t offset, int64_t k,
                            at::ScalarType index_dtype) {
  auto [vspan, ispan] =
      check_chunks(dense, gathered, nchunks, chunk_len, offset, k, index_dtype, at::kCPU);
  (void)ispan;
  const int64_t n = dense.numel();
  const char* g = static_cast<const char*>(gathered.const_data_ptr());
  const bool widen = dense.scalar_type() != gathered.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gathered.scalar_type(), "scatter_add_chunks", [&] {
    using val_t = scalar_t;
    AT_DISPATCH_INDEX_TYPES(index_dtype, "scatter_add_chunks", [&] {
      if (widen)
        add_chunks<float, val_t, index_t>(dense.data_ptr<float>(), n, g, nchunks, chunk_len,
                                          offset, k, vspan);
      else
        add_chunks<val_t, val_t, index_t>(dense.data_ptr<val_t>(), n, g, nchunks, chunk_len,
                                          offset, k, vspan);
    });
  });
}

}  // namespace ssf
