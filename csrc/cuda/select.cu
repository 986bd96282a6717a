// Selection kernels on CUDA: exact magnitude top-k and threshold select (see kernels.cuh).
//
// Top-k is a radix select on the magnitude key (31 bits for float32, 15 for 16-bit types),
// never a sort, and never synchronizes the host (k, hence the output size, is known):
//   passes: digits of 11/11/9 bits (float32) or 8/7 bits (16-bit), most significant
//           first. Each pass histograms the digit of the keys whose higher digits equal
//           the pivot prefix found so far (shared-memory histogram per block, merged into
//           a global one with atomics), then one block scans the histogram from the top
//           digit down on the device to find the digit holding the k-th key, appends it
//           to the prefix and subtracts the count above it from k. After the last pass
//           the prefix is the exact k-th key `kth`, and the remaining k is `need`, the
//           number of keys equal to kth to take (1 <= need <= #ties).
//   compaction: per tile of 2048 elements count (key > kth, key == kth); exclusive scans
//           of both counts (cub::DeviceScan) give, for every element, G = #greater and
//           T = #ties before it. An element is selected iff key > kth or (key == kth and
//           T < need); it goes to position G + min(T, need). That is a stable compaction,
//           so the output is in index order and the ties taken are the lowest indices.
//   small inputs (n <= kSmallMax): the same passes and compaction in one block and one
//           launch (topk_small_kernel), where the launches above are the whole cost.
// Threshold select is the same compaction with one class: key >= key_min, where key_min
// is the smallest key satisfying isnan(v) || (double)|v| >= thr (threshold_key).
// Error feedback (ef_topk_f32) is top-k whose first radix pass forms residual + grad,
// writes it back as the residual and histograms it in registers; the other passes and the
// compaction read the residual as top-k reads its input; a last launch writes the selected
// entries' wire error (apply_wire_error, also the composed ops' last step).
#include "kernels.cuh"
#include "common.cuh"
#include "radix.cuh"
#include "values.cuh"

#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace ssf {
namespace cuda {
namespace {

constexpr int kTileThreads = 256;
constexpr int kTileItems = 8;
constexpr int64_t kTile = int64_t(kTileThreads) * kTileItems;  // elements per tile
constexpr int kHistThreads = 256;
constexpr int kHistMaxBlocks = 1024;  // per-block counts stay < 2^32 up to n = 2^42
constexpr int kPivotThreads = 128;

// Which elements a tile kernel selects: top-k mode when `st` is set, else key >= key_min.
struct TileRule {
  uint32_t key_min;
  const RadixState* st;
};

// Tile counts and their scans; the same layout for top-k and threshold (top-k adds more
// after it), so threshold_count_result finds the total from n alone.
struct TileLayout {
  int64_t tiles = 0;
  long long *gcnt = nullptr, *goff = nullptr, *tcnt = nullptr, *toff = nullptr;
  void* scan_tmp = nullptr;
  size_t scan_bytes = 0;
};

int64_t num_tiles(int64_t n) {
  const int64_t t = (n + kTile - 1) / kTile;
  if (t + 1 > int64_t(std::numeric_limits<int>::max()))
    throw std::runtime_error("ssfusion_hvd CUDA: input too large for the tile scan");
  return t;
}

TileLayout carve_tiles(Carver& c, int64_t n, bool with_ties) {
  TileLayout L;
  L.tiles = num_tiles(n);
  const size_t m = size_t(L.tiles) + 1;  // the extra zero entry makes goff[tiles] the total
  L.gcnt = c.take<long long>(m);
  L.goff = c.take<long long>(m);
  SSF_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, L.scan_bytes, L.gcnt, L.goff, int(m)));
  L.scan_tmp = c.take<char>(L.scan_bytes);
  if (with_ties) {
    L.tcnt = c.take<long long>(m);
    L.toff = c.take<long long>(m);
  }
  return L;
}

// ------------------------------------------------------------------ radix select passes

template <typename U, int BITS>
__global__ void __launch_bounds__(kHistThreads)
    radix_hist_kernel(const U* __restrict__ x, int64_t n, int shift, int pass,
                      const RadixState* st, unsigned long long* __restrict__ hist) {
  constexpr int kBins = 1 << BITS;
  __shared__ unsigned int sh[kBins];
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) sh[b] = 0;
  __syncthreads();
  const int hi = shift + BITS;  // bits above the current digit: already decided
  const uint32_t want = pass ? (st->prefix >> hi) : 0u;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint32_t key = uint32_t(x[i]) & KeyOf<U>::kMask;
    if ((key >> hi) == want) atomicAdd(&sh[(key >> shift) & (kBins - 1)], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += blockDim.x)
    if (sh[b]) atomicAdd(&hist[b], (unsigned long long)sh[b]);
}

// One block: suffix sums of the histogram (from the top digit down) locate the digit
// holding the k_rem-th largest key among the prefix-matching ones (the first pass starts
// from prefix 0 and k).
template <int BITS>
__global__ void __launch_bounds__(kPivotThreads)
    radix_pivot_kernel(const unsigned long long* __restrict__ hist, int shift, int pass,
                       long long k, RadixState* st) {
  const uint32_t prefix = pass ? st->prefix : 0u;
  const unsigned long long krem = (unsigned long long)(pass ? st->k_rem : k);
  radix_pivot<BITS, kPivotThreads, /*CLEAR=*/false>(hist, shift, prefix, krem, st);
}

// ------------------------------------------------------------------ tile compaction

// A TileRule as a tile kernel reads it: in top-k mode, the k-th key and how many of its
// ties to take from the radix state; in threshold mode, key_min.
struct LoadedRule {
  bool topk;
  uint32_t lo, kth;
  long long need;
};

__device__ __forceinline__ LoadedRule load_rule(const TileRule& r) {
  const bool topk = r.st != nullptr;
  return {topk, r.key_min, topk ? r.st->prefix : 0u, topk ? r.st->k_rem : 0};
}

// Class of an element: 0 dropped, 1 selected, 2 tie (key == kth; top-k only).
__device__ __forceinline__ int classify(uint32_t key, const LoadedRule& r) {
  return r.topk ? topk_class(key, r.kth) : (key >= r.lo ? 1 : 0);
}

// Per tile: (#selected, #ties), packed as low/high 32 bits (a tile has 2048 elements).
template <typename U>
__global__ void __launch_bounds__(kTileThreads)
    tile_count_kernel(const U* __restrict__ x, int64_t n, TileRule rule,
                      long long* __restrict__ gcnt, long long* __restrict__ tcnt) {
  const LoadedRule r = load_rule(rule);
  count_tile<kTileThreads, kTileItems>(x, int64_t(blockIdx.x) * kTile, n,
                                       [&](uint32_t key) { return classify(key, r); }, gcnt,
                                       tcnt);
}

// Stable write: each thread owns kTileItems consecutive elements (blocked order), so a
// block scan of the packed per-thread counts gives every element's rank in index order.
template <typename U, typename I>
__global__ void __launch_bounds__(kTileThreads)
    tile_write_kernel(const U* __restrict__ x, int64_t n, TileRule rule,
                      const long long* __restrict__ goff, const long long* __restrict__ toff,
                      U* __restrict__ out_v, I* __restrict__ out_i) {
  const LoadedRule r = load_rule(rule);
  const int64_t first = int64_t(blockIdx.x) * kTile + int64_t(threadIdx.x) * kTileItems;
  U v[kTileItems];
  int cls[kTileItems];
  const unsigned long long pre = rank_items<kTileThreads>(
      x, first, n, [&](uint32_t key) { return classify(key, r); }, v, cls);
  long long g = goff[blockIdx.x] + (long long)(pre & 0xffffffffull);  // selected before
  long long t = (toff ? toff[blockIdx.x] : 0) + (long long)(pre >> 32);  // ties before
  place_items(v, cls, first, g, t, r.need, out_v, out_i);
}

// Scans the tile counts and writes the compaction (shared by top-k and threshold).
template <typename U>
void tile_count_and_scan(const U* x, int64_t n, TileRule rule, const TileLayout& L,
                         cudaStream_t s) {
  const size_t m = size_t(L.tiles) + 1;
  SSF_CUDA_CHECK(cudaMemsetAsync(L.gcnt + L.tiles, 0, sizeof(long long), s));
  if (L.tcnt) SSF_CUDA_CHECK(cudaMemsetAsync(L.tcnt + L.tiles, 0, sizeof(long long), s));
  if (L.tiles > 0) {
    tile_count_kernel<U><<<unsigned(L.tiles), kTileThreads, 0, s>>>(x, n, rule, L.gcnt, L.tcnt);
    SSF_CUDA_CHECK_LAUNCH();
  }
  size_t bytes = L.scan_bytes;
  SSF_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(L.scan_tmp, bytes, L.gcnt, L.goff, int(m), s));
  if (L.tcnt) {
    bytes = L.scan_bytes;
    SSF_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(L.scan_tmp, bytes, L.tcnt, L.toff, int(m), s));
  }
}

template <typename U>
struct TopkLayout {
  TileLayout tiles;
  RadixState* state = nullptr;
  unsigned long long* hist = nullptr;  // all passes' histograms, back to back
  size_t hist_bins = 0;
};

template <typename U>
TopkLayout<U> carve_topk(Carver& c, int64_t n) {
  TopkLayout<U> L;
  L.tiles = carve_tiles(c, n, /*with_ties=*/true);
  L.state = c.take<RadixState>(1);
  L.hist_bins = sizeof(U) == 4 ? (2048 + 2048 + 512) : (256 + 128);
  L.hist = c.take<unsigned long long>(L.hist_bins);
  return L;
}

template <typename U, int BITS>
void radix_pass(const U* x, int64_t n, int64_t k, int shift, int pass, RadixState* st,
                unsigned long long* hist, cudaStream_t s) {
  const unsigned grid = grid_for(n, kHistThreads * 16, kHistMaxBlocks);
  radix_hist_kernel<U, BITS><<<grid, kHistThreads, 0, s>>>(x, n, shift, pass, st, hist);
  SSF_CUDA_CHECK_LAUNCH();
  radix_pivot_kernel<BITS><<<1, kPivotThreads, 0, s>>>(hist, shift, pass, (long long)k, st);
  SSF_CUDA_CHECK_LAUNCH();
}

// The compaction that ends a top-k: the keys above the k-th and its first ties, in index order.
template <typename U, typename I>
void topk_compact(const U* x, int64_t n, const TopkLayout<U>& L, U* out_v, I* out_i,
                  cudaStream_t s) {
  const TileRule rule{0u, L.state};
  tile_count_and_scan<U>(x, n, rule, L.tiles, s);
  tile_write_kernel<U, I><<<unsigned(L.tiles.tiles), kTileThreads, 0, s>>>(
      x, n, rule, L.tiles.goff, L.tiles.toff, out_v, out_i);
  SSF_CUDA_CHECK_LAUNCH();
}

// A float32 top-k once its first pass (digit 30..20) has set the radix state: the passes
// over digits 19..9 and 8..0, then the compaction (topk; ef_topk_f32, whose first pass
// histograms the sums as it forms them).
template <typename I>
void topk_after_first_pass(const uint32_t* x, int64_t n, int64_t k,
                           const TopkLayout<uint32_t>& L, uint32_t* out_v, I* out_i,
                           cudaStream_t s) {
  radix_pass<uint32_t, 11>(x, n, k, 9, 1, L.state, L.hist + 2048, s);
  radix_pass<uint32_t, 9>(x, n, k, 0, 2, L.state, L.hist + 4096, s);
  topk_compact<uint32_t, I>(x, n, L, out_v, out_i, s);
}

// ------------------------------------------------------------------ small inputs

// Up to kSmallMax elements the multi-block top-k is all fixed cost: about 14 launches,
// memsets and scans whose host-side enqueueing the GPU waits on (an H100 spent 26 us of
// kernels but 72 us of host time per call at n = 1000). One block then does everything in
// one launch: the same radix passes with the histogram in shared memory and the pivot
// found in the block, then the same stable compaction in chunks of THREADS * kSmallItems
// elements, the running counts of the chunks before carried along. Same result bit for bit.
// The bound: measured 29 us against 103 us at n = 1e4 (H100); and on one SM the
// histogram's shared-memory atomics serialize where many keys share a bin (all-equal
// input: n atomics on one address per pass), which at 2^14 still stays within the
// multi-block path's fixed cost. Larger sizes are unmeasured, so they keep that path.
constexpr int64_t kSmallMax = int64_t(1) << 14;
constexpr int kSmallItems = 8;

// The block's threads: the pivot's scan needs the bins to split evenly over them (2048,
// 2048, 512 bins for float32's digits; 256, 128 for 16-bit).
template <typename U>
constexpr int small_threads() { return sizeof(U) == 4 ? 512 : 128; }

// One radix pass of the single block: histogram of the digit at `shift` (BITS wide) of the
// keys whose higher bits equal prefix's, then the pivot; prefix and krem are updated.
template <typename U, int BITS, int THREADS>
__device__ __forceinline__ void small_pass(const U* __restrict__ x, int n, int shift,
                                           unsigned int* hist, RadixState* st,
                                           uint32_t& prefix, unsigned long long& krem) {
  constexpr int kBins = 1 << BITS;
  for (int b = threadIdx.x; b < kBins; b += THREADS) hist[b] = 0;
  __syncthreads();
  const int hi = shift + BITS;
  const uint32_t want = prefix >> hi;
  for (int base = threadIdx.x; base < n; base += THREADS * kSmallItems) {
    uint32_t key[kSmallItems];
#pragma unroll
    for (int it = 0; it < kSmallItems; ++it) {  // loads first: kSmallItems in flight
      const int i = base + it * THREADS;
      key[it] = i < n ? (uint32_t(x[i]) & KeyOf<U>::kMask) : 0u;
    }
#pragma unroll
    for (int it = 0; it < kSmallItems; ++it)
      if (base + it * THREADS < n && (key[it] >> hi) == want)
        atomicAdd(&hist[(key[it] >> shift) & (kBins - 1)], 1u);
  }
  __syncthreads();
  radix_pivot<BITS, THREADS, /*CLEAR=*/false>(hist, shift, prefix, krem, st);
  __syncthreads();
  prefix = st->prefix;
  krem = (unsigned long long)st->k_rem;
}

template <typename U, typename I, int THREADS>
__global__ void __launch_bounds__(THREADS)
    topk_small_kernel(const U* __restrict__ x, int n, int k, U* __restrict__ out_v,
                      I* __restrict__ out_i) {
  __shared__ unsigned int hist[KeyOf<U>::kMaxBins];
  __shared__ RadixState st;
  __shared__ unsigned long long chunk_total;
  uint32_t prefix = 0;
  unsigned long long krem = (unsigned long long)k;
  if constexpr (sizeof(U) == 4) {  // digits 30..20, 19..9, 8..0
    small_pass<U, 11, THREADS>(x, n, 20, hist, &st, prefix, krem);
    small_pass<U, 11, THREADS>(x, n, 9, hist, &st, prefix, krem);
    small_pass<U, 9, THREADS>(x, n, 0, hist, &st, prefix, krem);
  } else {  // digits 14..7, 6..0
    small_pass<U, 8, THREADS>(x, n, 7, hist, &st, prefix, krem);
    small_pass<U, 7, THREADS>(x, n, 0, hist, &st, prefix, krem);
  }
  const uint32_t kth = prefix;
  const long long need = (long long)krem;
  long long g = 0, t = 0;  // selected and ties in the chunks before this one
  for (int base = 0; base < n; base += THREADS * kSmallItems) {
    const int64_t first = int64_t(base) + int64_t(threadIdx.x) * kSmallItems;
    U v[kSmallItems];
    int cls[kSmallItems];
    const unsigned long long pre = rank_items<THREADS, kSmallItems>(
        x, first, n, [&](uint32_t key) { return topk_class(key, kth); }, v, cls);
    place_items(v, cls, first, g + (long long)(pre & 0xffffffffull),
                t + (long long)(pre >> 32), need, out_v, out_i);
    if (threadIdx.x == THREADS - 1) {  // the last thread's prefix plus its own counts
      unsigned long long own = 0;
      for (int it = 0; it < kSmallItems; ++it) own += class_count(cls[it]);
      chunk_total = pre + own;
    }
    __syncthreads();  // also: rank_items's scan storage is free again
    g += (long long)(chunk_total & 0xffffffffull);
    t += (long long)(chunk_total >> 32);
    __syncthreads();
  }
}

template <typename U, typename I>
void topk_small(const U* x, int64_t n, int64_t k, U* out_v, I* out_i, cudaStream_t s) {
  constexpr int kThreads = small_threads<U>();
  topk_small_kernel<U, I, kThreads><<<1, kThreads, 0, s>>>(x, int(n), int(k), out_v, out_i);
  SSF_CUDA_CHECK_LAUNCH();
}

// ------------------------------------------------------------------ error feedback

// residual[i] += grad[i] for a float32 residual (GK: the gradient's kind, 16-bit widened
// exactly; one float32 add, as the CPU and torch's add do), written back. HIST: also
// histogram the sums' top digit, bits 30..20 (top-k's first pass, float32 digits 11/11/9),
// so the sums are counted from registers instead of being read again.
template <int GK, bool HIST>
__global__ void __launch_bounds__(kHistThreads)
    accumulate_kernel(const typename RawOf<GK>::type* __restrict__ grad,
                      float* __restrict__ residual, int64_t n,
                      unsigned long long* __restrict__ hist) {
  __shared__ unsigned int sh[HIST ? 2048 : 1];
  if constexpr (HIST) {
    for (int b = threadIdx.x; b < 2048; b += blockDim.x) sh[b] = 0;
    __syncthreads();
  }
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float a = __fadd_rn(residual[i], to_float<GK>(grad[i]));
    residual[i] = a;
    if constexpr (HIST) atomicAdd(&sh[(__float_as_uint(a) & KeyOf<uint32_t>::kMask) >> 20], 1u);
  }
  if constexpr (HIST) {
    __syncthreads();
    for (int b = threadIdx.x; b < 2048; b += blockDim.x)
      if (sh[b]) atomicAdd(&hist[b], (unsigned long long)sh[b]);
  }
}

template <int GK>
void accumulate(const void* grad, float* residual, int64_t n, unsigned long long* hist,
                cudaStream_t s) {
  if (n == 0) return;
  const unsigned grid = grid_for(n, kHistThreads * 16, kHistMaxBlocks);
  const auto* g = static_cast<const typename RawOf<GK>::type*>(grad);
  if (hist) accumulate_kernel<GK, true><<<grid, kHistThreads, 0, s>>>(g, residual, n, hist);
  else accumulate_kernel<GK, false><<<grid, kHistThreads, 0, s>>>(g, residual, n, nullptr);
  SSF_CUDA_CHECK_LAUNCH();
}

// What the wire (WK) loses of a sent value a of kind AK: +0 when it carries AK exactly,
// else a - a rounded to WK (a float32 residual sent as float16/bfloat16), like the CPU's
// wire_error and ops.py's torch composition.
template <int AK, int WK>
__device__ __forceinline__ typename RawOf<AK>::type wire_error(typename RawOf<AK>::type a) {
  if constexpr (AK == WK) {
    return 0;
  } else {
    const float f = to_float<AK>(a);
    return from_float<AK>(__fsub_rn(f, to_float<WK>(from_float<WK>(f))));
  }
}

template <int AK, int WK, typename I>
__global__ void wire_error_kernel(typename RawOf<AK>::type* __restrict__ residual,
                                  const typename RawOf<AK>::type* __restrict__ values,
                                  const I* __restrict__ indices, int64_t k) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride)
    residual[indices[j]] = wire_error<AK, WK>(values[j]);
}

// Calls fn(std::integral_constant<int, kind>{}) for a ValueKind known at run time.
template <typename F>
void dispatch_kind(ValueKind kind, const F& fn) {
  switch (kind) {
    case ValueKind::kFloat32: fn(std::integral_constant<int, int(ValueKind::kFloat32)>{}); return;
    case ValueKind::kFloat16: fn(std::integral_constant<int, int(ValueKind::kFloat16)>{}); return;
    case ValueKind::kBFloat16: fn(std::integral_constant<int, int(ValueKind::kBFloat16)>{}); return;
  }
  throw std::runtime_error("ssfusion_hvd CUDA: bad value kind");
}

}  // namespace

// ------------------------------------------------------------------ public API

template <typename U>
size_t topk_workspace_bytes(int64_t n, int64_t k) {
  if (k == 0 || k == n || n <= kSmallMax) return 0;  // nothing, or topk_small
  Carver c(nullptr);
  carve_topk<U>(c, n);
  return c.off;
}

template <typename U, typename I>
void topk(const U* x, int64_t n, int64_t k, U* out_v, I* out_i, void* workspace,
          size_t workspace_bytes, cudaStream_t s) {
  if (k < 0 || k > n) throw std::runtime_error("ssfusion_hvd CUDA topk: k out of range");
  if (k == 0) return;
  if (k == n) {  // everything, in index order
    SSF_CUDA_CHECK(cudaMemcpyAsync(out_v, x, size_t(n) * sizeof(U), cudaMemcpyDeviceToDevice, s));
    iota_kernel<I><<<grid_for(n, 256, 4096), 256, 0, s>>>(out_i, n);
    SSF_CUDA_CHECK_LAUNCH();
    return;
  }
  if (n <= kSmallMax) {
    topk_small<U, I>(x, n, k, out_v, out_i, s);
    return;
  }
  Carver c(workspace);
  const TopkLayout<U> L = carve_topk<U>(c, n);
  c.require(workspace_bytes, "topk");
  SSF_CUDA_CHECK(cudaMemsetAsync(L.hist, 0, L.hist_bins * sizeof(unsigned long long), s));
  if constexpr (sizeof(U) == 4) {  // 31-bit key: digits 30..20, 19..9, 8..0
    radix_pass<U, 11>(x, n, k, 20, 0, L.state, L.hist, s);
    topk_after_first_pass<I>(x, n, k, L, out_v, out_i, s);
  } else {  // 15-bit key: digits 14..7, 6..0
    radix_pass<U, 8>(x, n, k, 7, 0, L.state, L.hist, s);
    radix_pass<U, 7>(x, n, k, 0, 1, L.state, L.hist + 256, s);
    topk_compact<U, I>(x, n, L, out_v, out_i, s);
  }
}

template <typename U, typename I>
void apply_wire_error(U* residual, ValueKind acc_kind, ValueKind wire_kind, const U* values,
                      const I* indices, int64_t k, cudaStream_t s) {
  if ((acc_kind == ValueKind::kFloat32) != (sizeof(U) == 4) ||
      (acc_kind != ValueKind::kFloat32 && wire_kind != acc_kind))
    throw std::runtime_error("ssfusion_hvd CUDA: a 16-bit residual is sent in its own dtype");
  if (k == 0) return;
  const unsigned grid = grid_for(k, 256, 4096);
  if constexpr (sizeof(U) == 4) {
    dispatch_kind(wire_kind, [&](auto wk) {
      constexpr int AK = int(ValueKind::kFloat32), WK = decltype(wk)::value;
      wire_error_kernel<AK, WK, I><<<grid, 256, 0, s>>>(residual, values, indices, k);
    });
  } else {  // both kinds store the same +0 bits
    constexpr int K = int(ValueKind::kFloat16);
    wire_error_kernel<K, K, I><<<grid, 256, 0, s>>>(residual, values, indices, k);
  }
  SSF_CUDA_CHECK_LAUNCH();
}

template <typename I>
void ef_topk_f32(const void* grad, ValueKind grad_kind, float* residual, int64_t n, int64_t k,
                 ValueKind wire_kind, uint32_t* out_v, I* out_i, void* workspace,
                 size_t workspace_bytes, cudaStream_t s) {
  if (k < 0 || k > n) throw std::runtime_error("ssfusion_hvd CUDA ef_topk: k out of range");
  auto* r = reinterpret_cast<uint32_t*>(residual);
  if (k == 0 || k == n || n <= kSmallMax) {  // accumulate, then take nothing, everything
    dispatch_kind(grad_kind, [&](auto gk) {  // or run topk_small (no workspace)
      accumulate<decltype(gk)::value>(grad, residual, n, nullptr, s);
    });
    topk<uint32_t, I>(r, n, k, out_v, out_i, nullptr, 0, s);
  } else {
    Carver c(workspace);
    const TopkLayout<uint32_t> L = carve_topk<uint32_t>(c, n);
    c.require(workspace_bytes, "ef_topk");
    SSF_CUDA_CHECK(cudaMemsetAsync(L.hist, 0, L.hist_bins * sizeof(unsigned long long), s));
    dispatch_kind(grad_kind, [&](auto gk) {  // pass 0's histogram, from the sums
      accumulate<decltype(gk)::value>(grad, residual, n, L.hist, s);
    });
    radix_pivot_kernel<11><<<1, kPivotThreads, 0, s>>>(L.hist, 20, 0, (long long)k, L.state);
    SSF_CUDA_CHECK_LAUNCH();
    topk_after_first_pass<I>(r, n, k, L, out_v, out_i, s);
  }
  apply_wire_error<uint32_t, I>(r, ValueKind::kFloat32, wire_kind, out_v, out_i, k, s);
}

namespace {
// Exact |value| of a magnitude key, NaN for NaN keys (host side, for threshold_key).
double key_value(uint32_t key, ValueKind kind) {
  switch (kind) {
    case ValueKind::kFloat32: {
      float f;
      std::memcpy(&f, &key, sizeof f);
      return double(f);
    }
    case ValueKind::kBFloat16: {
      const uint32_t bits = key << 16;  // bfloat16 is the top half of a float32
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return double(f);
    }
    case ValueKind::kFloat16: {
      const int e = int(key >> 10) & 31, m = int(key & 1023);
      if (e == 31) return m ? std::numeric_limits<double>::quiet_NaN()
                            : std::numeric_limits<double>::infinity();
      if (e == 0) return std::ldexp(double(m), -24);  // subnormal
      return std::ldexp(double(1024 + m), e - 25);
    }
  }
  throw std::runtime_error("ssfusion_hvd CUDA: bad value kind");
}
}  // namespace

uint32_t threshold_key(double thr, ValueKind kind) {
  if (std::isnan(thr)) throw std::runtime_error("ssfusion_hvd CUDA: threshold is NaN");
  // The predicate is false then true along the keys (values grow with the key up to +Inf,
  // NaN keys are above): binary-search the first key where it holds.
  uint32_t lo = 0, hi = kind == ValueKind::kFloat32 ? 0x7fffffffu : 0x7fffu;  // hi: a NaN
  auto pred = [&](uint32_t key) {
    const double v = key_value(key, kind);
    return std::isnan(v) || v >= thr;
  };
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (pred(mid)) hi = mid; else lo = mid + 1;
  }
  return lo;
}

template <typename U>
size_t threshold_workspace_bytes(int64_t n) {
  Carver c(nullptr);
  carve_tiles(c, n, /*with_ties=*/false);
  return c.off;
}

template <typename U>
void threshold_prepare(const U* x, int64_t n, uint32_t key_min, void* workspace,
                       size_t workspace_bytes, cudaStream_t s) {
  Carver c(workspace);
  const TileLayout L = carve_tiles(c, n, false);
  c.require(workspace_bytes, "threshold");
  tile_count_and_scan<U>(x, n, TileRule{key_min, nullptr}, L, s);
}

int64_t threshold_count_result(const void* workspace, int64_t n, cudaStream_t s) {
  Carver c(const_cast<void*>(workspace));
  const TileLayout L = carve_tiles(c, n, false);
  long long total = 0;
  SSF_CUDA_CHECK(cudaMemcpyAsync(&total, L.goff + L.tiles, sizeof total,
                                 cudaMemcpyDeviceToHost, s));
  SSF_CUDA_CHECK(cudaStreamSynchronize(s));  // the one sync: the output size
  return int64_t(total);
}

template <typename U, typename I>
void threshold_write(const U* x, int64_t n, uint32_t key_min, U* out_v, I* out_i,
                     const void* workspace, cudaStream_t s) {
  Carver c(const_cast<void*>(workspace));
  const TileLayout L = carve_tiles(c, n, false);
  if (L.tiles == 0) return;
  tile_write_kernel<U, I><<<unsigned(L.tiles), kTileThreads, 0, s>>>(
      x, n, TileRule{key_min, nullptr}, L.goff, nullptr, out_v, out_i);
  SSF_CUDA_CHECK_LAUNCH();
}

// Explicit instantiations: every kernel is compiled even without the torch glue.
#define SSF_INST_U(U)                                                                    \
  template size_t topk_workspace_bytes<U>(int64_t, int64_t);                             \
  template size_t threshold_workspace_bytes<U>(int64_t);                                 \
  template void threshold_prepare<U>(const U*, int64_t, uint32_t, void*, size_t, cudaStream_t);
#define SSF_INST_UI(U, I)                                                                \
  template void topk<U, I>(const U*, int64_t, int64_t, U*, I*, void*, size_t, cudaStream_t); \
  template void threshold_write<U, I>(const U*, int64_t, uint32_t, U*, I*, const void*,   \
                                      cudaStream_t);
#define SSF_INST_EF(U, I)                                                                \
  template void apply_wire_error<U, I>(U*, ValueKind, ValueKind, const U*, const I*, int64_t, \
                                       cudaStream_t);
#define SSF_INST_EF_I(I)                                                                  \
  template void ef_topk_f32<I>(const void*, ValueKind, float*, int64_t, int64_t, ValueKind, \
                               uint32_t*, I*, void*, size_t, cudaStream_t);
SSF_FOR_EACH_U(SSF_INST_U)
SSF_FOR_EACH_UI(SSF_INST_UI)
SSF_FOR_EACH_UI(SSF_INST_EF)
SSF_FOR_EACH_I(SSF_INST_EF_I)

}  // namespace cuda
}  // namespace ssf
