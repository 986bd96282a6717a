// Sparse record codec on the CPU: pack (values, indices) into a flat buffer, scatter-add
// decode, delivery of the touched positions into the gradients. The record layout is
// defined once, in ../record.h.
#include "../ops.h"
#include "../checks.h"
#include "../record.h"
#include "common.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

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
    // Indices are distinct within a chunk, so its adds can run in parallel. The accesses are
    // random: each starts its load kAhead entries early.
    constexpr int64_t kAhead = 32;
    at::parallel_for(0, k, int64_t(1) << 14, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        if (j + kAhead < e) __builtin_prefetch(d + idx_at(j + kAhead), 1);
        d[idx_at(j)] += static_cast<acc_t>(pv[j]);
      }
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

namespace {

// Index j of a record whose index area starts at byte `pib` (read bytewise: a record may
// start at any value-aligned element).
template <typename index_t>
inline index_t record_index(const char* pib, int64_t j) {
  index_t i;
  std::memcpy(&i, pib + j * sizeof(index_t), sizeof(index_t));
  return i;
}

// The value deliver_chunks writes for an element a of out: out.mul_(scale) (the product in
// float, rounded to acc_t) then a copy into grad_t, as torch does them.
template <typename acc_t, typename grad_t>
inline grad_t delivered(acc_t a, float scale, bool scaled) {
  if (scaled) a = static_cast<acc_t>(static_cast<float>(a) * scale);
  return static_cast<grad_t>(a);
}

// Whether out still holds a value: any bits but +0's (-0.0 included).
template <typename acc_t>
inline bool holds(acc_t x) {
  using bits_t = std::conditional_t<sizeof(acc_t) == 8, uint64_t,
                                    std::conditional_t<sizeof(acc_t) == 4, uint32_t, uint16_t>>;
  static_assert(sizeof(bits_t) == sizeof(acc_t), "a 2-, 4- or 8-byte value");
  bits_t bits;
  std::memcpy(&bits, &x, sizeof(acc_t));
  return bits != 0;
}

// deliver_chunks on raw pointers (ops.h): out of acc_t, tensors of grad_t (records of
// grad_t). One pass over the records, chunk by chunk, parallel within a chunk, where
// indices are distinct: the first entry to meet a position still holding a value delivers
// and clears it; the entries after it (later chunks) find +0 there and skip it.
template <typename acc_t, typename grad_t, typename index_t>
int64_t deliver(acc_t* out, int64_t out_n, const std::vector<int64_t>& bounds,
                const std::vector<grad_t*>& dst, const char* g, int64_t nchunks,
                int64_t chunk_len, int64_t offset, int64_t k, int64_t vspan, double scale) {
  const int64_t vb = sizeof(grad_t);
  auto index_area = [&](int64_t p) { return g + (p * chunk_len + offset + vspan) * vb; };
  constexpr int64_t kGrain = int64_t(1) << 14, kAhead = 32;
  for (int64_t p = 0; p < nchunks; ++p) {  // every index checked before anything is written
    const char* pib = index_area(p);
    const bool ok = at::parallel_reduce(
        0, k, kGrain, true,
        [&](int64_t b, int64_t e, bool acc) {
          for (int64_t j = b; j < e; ++j) {
            const index_t i = record_index<index_t>(pib, j);
            acc = acc && i >= 0 && int64_t(i) < out_n;
          }
          return acc;
        },
        [](bool x, bool y) { return x && y; });
    for (int64_t j = 0; !ok && j < k; ++j) {  // name the first bad index
      const index_t i = record_index<index_t>(pib, j);
      TORCH_CHECK(i >= 0 && int64_t(i) < out_n, "deliver_chunks: index ", int64_t(i),
                  " out of range [0, ", out_n, ") in chunk ", p);
    }
  }
  const int64_t ntensors = int64_t(dst.size()), numel = bounds.back();
  const int64_t* bd = bounds.data();
  const float s = static_cast<float>(scale);
  const bool scaled = scale != 1.0;
  int64_t nonfinite = 0;
  for (int64_t p = 0; p < nchunks; ++p) {
    const char* pib = index_area(p);
    nonfinite += at::parallel_reduce(
        0, k, kGrain, int64_t(0),
        [&](int64_t b, int64_t e, int64_t count) {
          // Where position i < numel goes; t: the tensor of the last position asked for
          // (records run tensor by tensor), else the last t with bounds[t] <= i.
          auto dest = [&](int64_t i, int64_t& t) {
            if (i < bd[t] || i >= bd[t + 1])
              t = std::upper_bound(bd + 1, bd + ntensors + 1, i) - bd - 1;
            return dst[t] + (i - bd[t]);
          };
          int64_t t = 0, t_ahead = 0;
          for (int64_t j = b; j < e; ++j) {
            if (j + kAhead < e) {  // random accesses: start the loads kAhead entries early
              const int64_t ia = record_index<index_t>(pib, j + kAhead);
              __builtin_prefetch(out + ia, 1);
              if (ia < numel) __builtin_prefetch(dest(ia, t_ahead), 1);
            }
            const int64_t i = record_index<index_t>(pib, j);
            const acc_t a = out[i];
            if (!holds(a)) continue;  // delivered by an earlier chunk, or a +0 sum
            out[i] = acc_t(0);
            if (i >= numel) continue;  // the sink
            const grad_t v = delivered<acc_t, grad_t>(a, s, scaled);
            *dest(i, t) = v;
            if (!std::isfinite(static_cast<float>(v))) ++count;
          }
          return count;
        },
        [](int64_t x, int64_t y) { return x + y; });
  }
  return nonfinite;
}

}  // namespace

at::Tensor deliver_chunks_cpu(at::Tensor& out, const std::vector<at::Tensor>& tensors,
                              const at::Tensor& gathered, int64_t nchunks, int64_t chunk_len,
                              int64_t offset, int64_t k, at::ScalarType index_dtype,
                              double scale) {
  const std::vector<int64_t> bounds = check_deliver(out, tensors, gathered, nchunks, chunk_len,
                                                    offset, k, index_dtype, scale, at::kCPU);
  const int64_t vspan = std::get<0>(record_spans(k, gathered.scalar_type(), index_dtype));
  const char* g = static_cast<const char*>(gathered.const_data_ptr());
  const bool widen = out.scalar_type() != gathered.scalar_type();
  int64_t nonfinite = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gathered.scalar_type(), "deliver_chunks", [&] {
    using grad_t = scalar_t;
    std::vector<grad_t*> dst;
    for (const at::Tensor& x : tensors) dst.push_back(static_cast<grad_t*>(x.data_ptr()));
    AT_DISPATCH_INDEX_TYPES(index_dtype, "deliver_chunks", [&] {
      if (widen)
        nonfinite = deliver<float, grad_t, index_t>(out.data_ptr<float>(), out.numel(), bounds,
                                                    dst, g, nchunks, chunk_len, offset, k,
                                                    vspan, scale);
      else
        nonfinite = deliver<grad_t, grad_t, index_t>(out.data_ptr<grad_t>(), out.numel(),
                                                     bounds, dst, g, nchunks, chunk_len, offset,
                                                     k, vspan, scale);
    });
  });
  return at::scalar_tensor(nonfinite, out.options().dtype(at::kLong));
}

}  // namespace ssf
