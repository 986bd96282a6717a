// Sparse record codec on CUDA: pack, scatter-add decode (see kernels.cuh).
//
//   pack: three stream-ordered copies (values, zero padding, index bytes); the index bytes
//         are copied as bytes, so a record may start anywhere (as on the CPU, memcpy).
//   scatter_add: duplicates must add in index-list order, rounding after every add, to
//         match the CPU bit for bit; float atomics would add in an arbitrary order. So the
//         (index, position) pairs are stably radix-sorted by index (cub::DeviceRadixSort)
//         and one thread per distinct index adds its values in ascending position. Costs a
//         sort of k pairs; a pathological input with many duplicates of one index is
//         serial in that index (correct, just slow).
//   scatter_add_chunks: indices are distinct within a chunk, so a chunk is one kernel with
//         a plain read-add-write per element; chunks are launched in order on one stream,
//         which is the CPU's summation order.
//   deliver_chunks: one launch per chunk, in order; a thread per record entry takes its
//         position if out still holds a value there (earlier chunks clear what they take),
//         clears it, finds its tensor by binary search over the bounds and writes the
//         scaled, converted value there; non-finite values counted with one integer atomic
//         per thread (deterministic).
// Adds round like the CPU: float32 adds in float32; float16/bfloat16 convert both operands
// to float32, add, and round to nearest even (c10::Half / c10::BFloat16 arithmetic).
#include "kernels.cuh"
#include "common.cuh"
#include "values.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cassert>
#include <limits>
#include <type_traits>

namespace ssf {
namespace cuda {
namespace {

// Device-side check that survives NDEBUG (Release builds), like torch's CUDA_KERNEL_ASSERT:
// a bad index stops the kernel with a message instead of corrupting memory.
#define SSF_KERNEL_ASSERT(cond)                                             \
  do {                                                                      \
    if (!(cond)) __assert_fail(#cond, __FILE__, __LINE__, __func__);        \
  } while (0)

template <int KIND>
__device__ __forceinline__ uint32_t add_bits(uint32_t a, uint32_t b);

template <>
__device__ __forceinline__ uint32_t add_bits<int(ValueKind::kFloat32)>(uint32_t a, uint32_t b) {
  return __float_as_uint(__fadd_rn(__uint_as_float(a), __uint_as_float(b)));
}

template <>
__device__ __forceinline__ uint32_t add_bits<int(ValueKind::kFloat16)>(uint32_t a, uint32_t b) {
  const float s = __fadd_rn(__half2float(__ushort_as_half((unsigned short)a)),
                            __half2float(__ushort_as_half((unsigned short)b)));
  return __half_as_ushort(__float2half_rn(s));
}

template <>
__device__ __forceinline__ uint32_t add_bits<int(ValueKind::kBFloat16)>(uint32_t a, uint32_t b) {
  const float s = __fadd_rn(__uint_as_float(a << 16), __uint_as_float(b << 16));
  return __bfloat16_as_ushort(__float2bfloat16_rn(s));
}

// Index j of a record whose index area starts at `words` (value-sized words): assembled
// word by word (little endian), so any value-aligned record start works.
template <typename U, typename I>
__device__ __forceinline__ I load_index(const U* __restrict__ words, int64_t j) {
  constexpr int kWords = int(sizeof(I) / sizeof(U));
  static_assert(kWords >= 1 && sizeof(I) % sizeof(U) == 0, "index must span whole words");
  unsigned long long r = 0;
  for (int w = 0; w < kWords; ++w)
    r |= (unsigned long long)words[j * kWords + w] << (8 * sizeof(U) * w);
  using UI = typename std::conditional<sizeof(I) == 4, uint32_t, unsigned long long>::type;
  return static_cast<I>(static_cast<UI>(r));
}

// How scatter_add_chunks adds a record value v into a dense value d.
template <int KIND>
struct SameTypeAdd {  // dense of the records' type: raw bits, rounded to it after the add
  template <typename U>
  static __device__ __forceinline__ U apply(U d, U v) {
    return static_cast<U>(add_bits<KIND>(uint32_t(d), uint32_t(v)));
  }
};
template <int KIND>
struct WidenAdd {  // float32 dense, float16/bfloat16 records: v converted exactly, float32 add
  static __device__ __forceinline__ float apply(float d, uint16_t v) {
    return __fadd_rn(d, widen<KIND>(v));
  }
};

// One chunk's record into dense (D: the dense element, U: the records' raw bits): indices
// are distinct within a chunk, so a plain read-add-write per element (Add::apply).
template <typename Add, typename I, typename D, typename U>
__global__ void chunk_add_kernel(D* __restrict__ dense, int64_t n, const U* __restrict__ vals,
                                 const U* __restrict__ idx_words, int64_t k) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride) {
    const I i = load_index<U, I>(idx_words, j);
    SSF_KERNEL_ASSERT(i >= 0 && int64_t(i) < n);
    if (i < 0 || int64_t(i) >= n) continue;
    dense[i] = Add::apply(dense[i], vals[j]);
  }
}

// Sorted by index (stable, so positions ascend within an index): the first position of
// each run of equal indices adds the whole run, in order.
template <typename U, typename I, int KIND>
__global__ void run_add_kernel(U* __restrict__ dense, int64_t n, const U* __restrict__ vals,
                               const I* __restrict__ sorted_idx,
                               const long long* __restrict__ sorted_pos, int64_t k) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < k; p += stride) {
    const I i = sorted_idx[p];
    if (p > 0 && sorted_idx[p - 1] == i) continue;  // not the head of its run
    SSF_KERNEL_ASSERT(i >= 0 && int64_t(i) < n);
    if (i < 0 || int64_t(i) >= n) continue;
    uint32_t acc = uint32_t(dense[i]);
    for (int64_t q = p; q < k && sorted_idx[q] == i; ++q)
      acc = add_bits<KIND>(acc, uint32_t(vals[sorted_pos[q]]));
    dense[i] = static_cast<U>(acc);
  }
}

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

// Workspace of scatter_add: sorted indices, positions in/out, radix sort temp storage.
template <typename I>
struct SortLayout {
  I* keys_out = nullptr;
  long long *pos_in = nullptr, *pos_out = nullptr;
  void* sort_tmp = nullptr;
  size_t sort_bytes = 0;
};

template <typename I>
SortLayout<I> carve_sort(Carver& c, int64_t k) {
  SortLayout<I> L;
  L.keys_out = c.take<I>(size_t(k));
  L.pos_in = c.take<long long>(size_t(k));
  L.pos_out = c.take<long long>(size_t(k));
  SSF_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, L.sort_bytes, (const I*)nullptr,
                                                 (I*)nullptr, (const long long*)nullptr,
                                                 (long long*)nullptr, k));
  L.sort_tmp = c.take<char>(L.sort_bytes);
  return L;
}

// The record at element `offset` of each of nchunks chunks of `gathered`, added into dense
// by chunk_add_kernel<Add>: one launch per chunk, in order on s (the summation order).
template <typename Add, typename I, typename D, typename U>
void add_chunks(D* dense, int64_t n, const U* gathered, int64_t nchunks, int64_t chunk_len,
                int64_t offset, int64_t k, cudaStream_t s) {
  const int64_t vspan = record_layout(k, sizeof(U), sizeof(I)).values;
  const unsigned grid = grid_for(k, kThreads, kMaxBlocks);
  for (int64_t p = 0; p < nchunks; ++p) {
    const U* rec = gathered + p * chunk_len + offset;
    chunk_add_kernel<Add, I><<<grid, kThreads, 0, s>>>(dense, n, rec, rec + vspan, k);
    SSF_CUDA_CHECK_LAUNCH();
  }
}

template <typename U, typename I, typename F>
void dispatch_kind(ValueKind kind, const F& fn) {
  switch (kind) {
    case ValueKind::kFloat32:
      if (sizeof(U) != 4) break;
      fn(std::integral_constant<int, int(ValueKind::kFloat32)>{});
      return;
    case ValueKind::kFloat16:
      if (sizeof(U) != 2) break;
      fn(std::integral_constant<int, int(ValueKind::kFloat16)>{});
      return;
    case ValueKind::kBFloat16:
      if (sizeof(U) != 2) break;
      fn(std::integral_constant<int, int(ValueKind::kBFloat16)>{});
      return;
  }
  throw std::runtime_error("ssfusion_hvd CUDA: value kind does not match the value width");
}

// ------------------------------------------------------------------- deliver_chunks

// What out.mul_(scale) (product in float, rounded to AK) then a copy into GK make of a.
template <int AK, int GK>
__device__ __forceinline__ typename RawOf<GK>::type delivered(typename RawOf<AK>::type a,
                                                              float scale, bool scaled) {
  float v = to_float<AK>(a);
  if (scaled) v = to_float<AK>(from_float<AK>(__fmul_rn(v, scale)));
  return from_float<GK>(v);
}

// deliver_chunks for one chunk's record: entry j takes position i = idx[j] if out still
// holds a value there (not +0 bits: earlier chunks have not delivered it), clears it, and
// writes it into tensor t, the last with bounds[t] <= i (meta: bounds[0..T], then the T
// data pointers). Indices are distinct within a chunk: no two threads share a position.
template <int AK, int GK, typename I>
__global__ void deliver_kernel(typename RawOf<AK>::type* __restrict__ out, int64_t out_n,
                               const int64_t* __restrict__ meta, int64_t ntensors, int64_t numel,
                               const typename RawOf<GK>::type* __restrict__ idx_words, int64_t k,
                               float scale, bool scaled, unsigned long long* __restrict__ nonfinite) {
  using A = typename RawOf<AK>::type;
  using G = typename RawOf<GK>::type;
  const int64_t* bounds = meta;
  const int64_t* ptrs = meta + ntensors + 1;
  unsigned long long mine = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride) {
    const int64_t i = int64_t(load_index<G, I>(idx_words, j));
    SSF_KERNEL_ASSERT(i >= 0 && i < out_n);
    if (i < 0 || i >= out_n) continue;
    const A a = out[i];
    if (a == A(0)) continue;  // delivered by an earlier chunk, or a +0 sum
    out[i] = A(0);
    if (i >= numel) continue;  // the sink
    int64_t lo = 0, hi = ntensors;  // bounds[lo] <= i < bounds[hi]
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (bounds[mid] <= i) lo = mid; else hi = mid;
    }
    const G v = delivered<AK, GK>(a, scale, scaled);
    reinterpret_cast<G*>(static_cast<uintptr_t>(ptrs[lo]))[i - bounds[lo]] = v;
    if (!isfinite(to_float<GK>(v))) ++mine;
  }
  if (mine) atomicAdd(nonfinite, mine);
}

template <int AK, int GK, typename I>
void deliver_launch(void* out, int64_t out_n, const int64_t* meta, int64_t ntensors,
                    int64_t numel, const void* gathered, int64_t nchunks, int64_t chunk_len,
                    int64_t offset, int64_t k, double scale, int64_t* nonfinite, cudaStream_t s) {
  using A = typename RawOf<AK>::type;
  using G = typename RawOf<GK>::type;
  const int64_t vspan = record_layout(k, sizeof(G), sizeof(I)).values;
  const unsigned grid = grid_for(k, kThreads, kMaxBlocks);
  const float fs = static_cast<float>(scale);
  const bool scaled = scale != 1.0;
  const G* g = static_cast<const G*>(gathered);
  for (int64_t p = 0; p < nchunks; ++p) {  // stream order: chunk p sees what p-1 cleared
    deliver_kernel<AK, GK, I><<<grid, kThreads, 0, s>>>(
        static_cast<A*>(out), out_n, meta, ntensors, numel, g + p * chunk_len + offset + vspan,
        k, fs, scaled, reinterpret_cast<unsigned long long*>(nonfinite));
    SSF_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

template <typename U, typename I>
int64_t pack(const U* values, const I* indices, int64_t k, U* out, int64_t offset,
             cudaStream_t s) {
  const RecordSpans spans = record_layout(k, sizeof(U), sizeof(I));
  const int64_t vspan = spans.values;
  U* rec = out + offset;
  if (k > 0) {
    SSF_CUDA_CHECK(cudaMemcpyAsync(rec, values, size_t(k) * sizeof(U), cudaMemcpyDeviceToDevice, s));
    SSF_CUDA_CHECK(cudaMemcpyAsync(rec + vspan, indices, size_t(k) * sizeof(I),
                                   cudaMemcpyDeviceToDevice, s));
  }
  if (vspan > k) SSF_CUDA_CHECK(cudaMemsetAsync(rec + k, 0, size_t(vspan - k) * sizeof(U), s));
  return offset + vspan + spans.indices;
}

template <typename I>
size_t scatter_add_workspace_bytes(int64_t k) {
  if (k <= 0) return 0;
  Carver c(nullptr);
  carve_sort<I>(c, k);
  return c.off;
}

template <typename U, typename I>
void scatter_add(U* dense, int64_t n, ValueKind kind, const U* values, const I* indices,
                 int64_t k, void* workspace, size_t workspace_bytes, cudaStream_t s) {
  if (k <= 0) return;
  Carver c(workspace);
  const SortLayout<I> L = carve_sort<I>(c, k);
  c.require(workspace_bytes, "scatter_add");
  const unsigned grid = grid_for(k, kThreads, kMaxBlocks);
  iota_kernel<long long><<<grid, kThreads, 0, s>>>(L.pos_in, k);
  SSF_CUDA_CHECK_LAUNCH();
  size_t bytes = L.sort_bytes;
  SSF_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(L.sort_tmp, bytes, indices, L.keys_out,
                                                 L.pos_in, L.pos_out, k, 0,
                                                 int(sizeof(I) * 8), s));
  dispatch_kind<U, I>(kind, [&](auto kc) {
    run_add_kernel<U, I, decltype(kc)::value><<<grid, kThreads, 0, s>>>(
        dense, n, values, L.keys_out, L.pos_out, k);
    SSF_CUDA_CHECK_LAUNCH();
  });
}

template <typename U, typename I>
void scatter_add_chunks(U* dense, int64_t n, ValueKind kind, const U* gathered,
                        int64_t nchunks, int64_t chunk_len, int64_t offset, int64_t k,
                        cudaStream_t s) {
  if (k <= 0 || nchunks <= 0) return;
  dispatch_kind<U, I>(kind, [&](auto kc) {
    add_chunks<SameTypeAdd<decltype(kc)::value>, I>(dense, n, gathered, nchunks, chunk_len,
                                                    offset, k, s);
  });
}

template <typename I>
void scatter_add_chunks_widen(float* dense, int64_t n, ValueKind kind, const uint16_t* gathered,
                              int64_t nchunks, int64_t chunk_len, int64_t offset, int64_t k,
                              cudaStream_t s) {
  if (k <= 0 || nchunks <= 0) return;
  if (kind == ValueKind::kFloat32)
    throw std::runtime_error("ssfusion_hvd CUDA: widening decode takes float16/bfloat16 records");
  if (kind == ValueKind::kFloat16)
    add_chunks<WidenAdd<int(ValueKind::kFloat16)>, I>(dense, n, gathered, nchunks, chunk_len,
                                                      offset, k, s);
  else
    add_chunks<WidenAdd<int(ValueKind::kBFloat16)>, I>(dense, n, gathered, nchunks, chunk_len,
                                                       offset, k, s);
}

int64_t deliver_meta_len(int64_t ntensors) { return 2 * ntensors + 1; }

template <typename I>
void deliver_chunks(void* out, ValueKind out_kind, int64_t out_n, ValueKind tensor_kind,
                    const int64_t* meta, int64_t ntensors, int64_t numel, const void* gathered,
                    int64_t nchunks, int64_t chunk_len, int64_t offset, int64_t k, double scale,
                    int64_t* nonfinite, cudaStream_t s) {
  if (k <= 0 || nchunks <= 0) return;
  constexpr int F32 = int(ValueKind::kFloat32), F16 = int(ValueKind::kFloat16),
                BF16 = int(ValueKind::kBFloat16);
  const auto run = [&](auto ak, auto gk) {
    deliver_launch<decltype(ak)::value, decltype(gk)::value, I>(
        out, out_n, meta, ntensors, numel, gathered, nchunks, chunk_len, offset, k, scale,
        nonfinite, s);
  };
  using KF32 = std::integral_constant<int, F32>;
  using KF16 = std::integral_constant<int, F16>;
  using KBF16 = std::integral_constant<int, BF16>;
  if (out_kind == tensor_kind) {
    if (tensor_kind == ValueKind::kFloat32) run(KF32{}, KF32{});
    else if (tensor_kind == ValueKind::kFloat16) run(KF16{}, KF16{});
    else run(KBF16{}, KBF16{});
  } else if (out_kind == ValueKind::kFloat32 && tensor_kind == ValueKind::kFloat16) {
    run(KF32{}, KF16{});
  } else if (out_kind == ValueKind::kFloat32 && tensor_kind == ValueKind::kBFloat16) {
    run(KF32{}, KBF16{});
  } else {
    throw std::runtime_error(
        "ssfusion_hvd CUDA deliver_chunks: out must have the tensors' kind, or float32 for "
        "16-bit tensors");
  }
}

#define SSF_INST_I(I)                                                                       \
  template size_t scatter_add_workspace_bytes<I>(int64_t);                                  \
  template void scatter_add_chunks_widen<I>(float*, int64_t, ValueKind, const uint16_t*,    \
                                            int64_t, int64_t, int64_t, int64_t, cudaStream_t); \
  template void deliver_chunks<I>(void*, ValueKind, int64_t, ValueKind, const int64_t*,      \
                                  int64_t, int64_t, const void*, int64_t, int64_t, int64_t,  \
                                  int64_t, double, int64_t*, cudaStream_t);
#define SSF_INST_UI(U, I)                                                                   \
  template int64_t pack<U, I>(const U*, const I*, int64_t, U*, int64_t, cudaStream_t);      \
  template void scatter_add<U, I>(U*, int64_t, ValueKind, const U*, const I*, int64_t,      \
                                  void*, size_t, cudaStream_t);                             \
  template void scatter_add_chunks<U, I>(U*, int64_t, ValueKind, const U*, int64_t, int64_t, \
                                         int64_t, int64_t, cudaStream_t);
SSF_FOR_EACH_I(SSF_INST_I)
SSF_FOR_EACH_UI(SSF_INST_UI)

}  // namespace cuda
}  // namespace ssf
