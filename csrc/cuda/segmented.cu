// Segmented top-k and DGC's sampled threshold on CUDA (see kernels.cuh).
//
// Segmented top-k selects ks[s] elements from every segment [off[s], off[s+1]) of one flat
// buffer in ONE call: a fixed number of launches whatever the number of segments, so
// per-tensor sparsification of a fusion buffer costs about one selection over the whole
// buffer. It is the radix select of select.cu made per segment:
//   plan (host, from the CPU offsets/ks): output offsets (prefix sum of ks), and two block
//           maps: every radix segment (0 < k < len) is cut into histogram chunks of
//           kHistChunk elements, every segment with k > 0 into compaction tiles of kTile
//           elements; a chunk or tile never spans two segments. The plan travels to the
//           device in one non-blocking copy; a block finds its segment by binary search
//           over the per-segment first-block numbers.
//   init:   per segment, the radix state {prefix = 0, k_rem = k}; segments without radix
//           passes get a state that selects everything (k == len) or nothing (k == 0).
//   passes: digits of 11/11/9 bits (float32) or 8/7 bits (16-bit), most significant first.
//           One launch histograms the current digit of every segment's prefix-matching
//           keys (shared-memory histogram per chunk, added into the segment's global one);
//           one launch with a block per segment scans its histogram from the top digit
//           down, extends the prefix and lowers k_rem, and zeroes the histogram for the
//           next pass. After the last pass prefix = the segment's k-th key `kth` and
//           k_rem = `need`, the number of keys equal to kth to take.
//   compaction: per tile (#greater, #ties); two global exclusive scans over all tiles, and
//           a tile's counts relative to its segment are its scan minus the scan at the
//           segment's first tile. An element goes to out_off[s] + G + min(T, need) exactly
//           as in select.cu, so each segment comes out in index order with the lowest-index
//           ties, and segments are concatenated in order.
// No host synchronization: k_total is known on the host from the CPU ks.
//
// Sampled threshold: a gather kernel writes the float magnitudes of the samples at
// sampling.h's seeded stratified positions, the CPU's, (NaN -> +Inf, as the CPU) as float32
// bits, which order like the values since they are non-negative; the single-segment radix
// passes above find the kk-th largest bit pattern, i.e. exactly the float nth_element finds
// on the CPU. Its value is copied to the host:
// the one sync this op has (it returns a number to the host).
#include "kernels.cuh"
#include "common.cuh"
#include "radix.cuh"

#include "../sampling.h"

#include <cuda_fp16.h>

#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace ssf {
namespace cuda {
namespace {

constexpr int kThreads = 256;                     // histogram and tile blocks
constexpr int kTileItems = 8;                     // per thread, consecutive (stable writes)
constexpr int64_t kTile = int64_t(kThreads) * kTileItems;
constexpr int64_t kHistChunk = 16384;             // elements per histogram block
constexpr int kPivotThreads = 128;

// Device views of the plan (layout of segmented_plan): all int64, back to back.
struct Meta {
  const int64_t *off, *ks, *out_off, *hstart, *tstart;
};

Meta meta_views(const int64_t* m, int64_t nseg) {
  Meta v;
  v.off = m;
  v.ks = v.off + (nseg + 1);
  v.out_off = v.ks + nseg;
  v.hstart = v.out_off + (nseg + 1);
  v.tstart = v.hstart + (nseg + 1);
  return v;
}

// Largest s in [0, nseg) with start[s] <= b: the segment owning block b (start is
// non-decreasing; segments with no blocks are skipped because their successor starts at
// the same number).
__device__ __forceinline__ int64_t segment_of(const int64_t* __restrict__ start, int64_t nseg,
                                              int64_t b) {
  int64_t lo = 0, hi = nseg - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (start[mid] <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename U>
struct SegLayout {
  RadixState* st = nullptr;
  unsigned long long* hist = nullptr;  // nseg x KeyOf<U>::kMaxBins, reused by every pass
  long long *gcnt = nullptr, *goff = nullptr, *tcnt = nullptr, *toff = nullptr;
  void* scan_tmp = nullptr;
  size_t scan_bytes = 0;
};

// with_tiles: the compaction's arrays too (sampled_threshold only runs the passes).
template <typename U>
SegLayout<U> carve_seg(Carver& c, const SegmentedPlan& p, bool with_tiles) {
  SegLayout<U> L;
  L.st = c.take<RadixState>(size_t(std::max<int64_t>(p.nseg, 1)));
  L.hist = c.take<unsigned long long>(size_t(p.nseg) * KeyOf<U>::kMaxBins);
  if (with_tiles) {
    const size_t m = size_t(p.tiles) + 1;  // the extra zero entry makes goff[tiles] a total
    L.gcnt = c.take<long long>(m);
    L.goff = c.take<long long>(m);
    L.tcnt = c.take<long long>(m);
    L.toff = c.take<long long>(m);
    SSF_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, L.scan_bytes, L.gcnt, L.goff, int(m)));
    L.scan_tmp = c.take<char>(L.scan_bytes);
  }
  return L;
}

// ------------------------------------------------------------------ radix passes

// Segments with radix blocks start from {0, k}; the others select all (k == len: every
// key is > 0 or a tie with 0, and need = len) or nothing (k == 0: no key reaches ~0u).
__global__ void seg_init_kernel(Meta m, int64_t nseg, RadixState* __restrict__ st) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < nseg; s += stride) {
    const long long k = m.ks[s];
    const bool radix = m.hstart[s + 1] > m.hstart[s];
    st[s].prefix = (k == 0 && !radix) ? ~0u : 0u;
    st[s].unused = 0;
    st[s].k_rem = k;
  }
}

template <typename U, int BITS>
__global__ void __launch_bounds__(kThreads)
    seg_hist_kernel(const U* __restrict__ x, Meta m, int64_t nseg, int shift,
                    const RadixState* __restrict__ st, unsigned long long* __restrict__ hist) {
  constexpr int kBins = 1 << BITS;
  __shared__ unsigned int sh[kBins];  // counts of one chunk: <= kHistChunk, fits 32 bits
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) sh[b] = 0;
  const int64_t s = segment_of(m.hstart, nseg, blockIdx.x);
  const int64_t lo = m.off[s] + (int64_t(blockIdx.x) - m.hstart[s]) * kHistChunk;
  const int64_t hi = m.off[s + 1] < lo + kHistChunk ? m.off[s + 1] : lo + kHistChunk;
  const int above = shift + BITS;  // key bits above this digit: fixed by the prefix
  const uint32_t want = st[s].prefix >> above;
  __syncthreads();
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const uint32_t key = uint32_t(x[i]) & KeyOf<U>::kMask;
    if ((key >> above) == want) atomicAdd(&sh[(key >> shift) & (kBins - 1)], 1u);
  }
  __syncthreads();
  unsigned long long* h = hist + s * KeyOf<U>::kMaxBins;
  for (int b = threadIdx.x; b < kBins; b += blockDim.x)
    if (sh[b]) atomicAdd(&h[b], (unsigned long long)sh[b]);
}

// Block per segment: locates the digit holding the k_rem-th largest prefix-matching key
// (suffix sums from the top digit down), and zeroes the histogram for the next pass.
template <int BITS, int MAX_BINS>
__global__ void __launch_bounds__(kPivotThreads)
    seg_pivot_kernel(Meta m, int shift, RadixState* __restrict__ st,
                     unsigned long long* __restrict__ hist) {
  const int64_t s = blockIdx.x;
  if (m.hstart[s + 1] == m.hstart[s]) return;  // no radix passes for this segment
  const uint32_t prefix = st[s].prefix;
  const unsigned long long krem = (unsigned long long)st[s].k_rem;
  radix_pivot<BITS, kPivotThreads, /*CLEAR=*/true>(hist + s * MAX_BINS, shift, prefix, krem,
                                                   st + s);
}

template <typename U, int BITS>
void seg_pass(const U* x, const SegmentedPlan& p, const Meta& m, int shift, RadixState* st,
              unsigned long long* hist, cudaStream_t s) {
  seg_hist_kernel<U, BITS><<<unsigned(p.hist_blocks), kThreads, 0, s>>>(x, m, p.nseg, shift, st,
                                                                        hist);
  SSF_CUDA_CHECK_LAUNCH();
  seg_pivot_kernel<BITS, KeyOf<U>::kMaxBins><<<unsigned(p.nseg), kPivotThreads, 0, s>>>(
      m, shift, st, hist);
  SSF_CUDA_CHECK_LAUNCH();
}

// Leaves every segment's (kth, need) in st.
template <typename U>
void seg_radix(const U* x, const SegmentedPlan& p, const Meta& m, const SegLayout<U>& L,
               cudaStream_t s) {
  seg_init_kernel<<<grid_for(p.nseg, 256, 1024), 256, 0, s>>>(m, p.nseg, L.st);
  SSF_CUDA_CHECK_LAUNCH();
  if (p.hist_blocks == 0) return;
  SSF_CUDA_CHECK(cudaMemsetAsync(
      L.hist, 0, size_t(p.nseg) * KeyOf<U>::kMaxBins * sizeof(unsigned long long), s));
  if constexpr (sizeof(U) == 4) {  // 31-bit key: digits 30..20, 19..9, 8..0
    seg_pass<U, 11>(x, p, m, 20, L.st, L.hist, s);
    seg_pass<U, 11>(x, p, m, 9, L.st, L.hist, s);
    seg_pass<U, 9>(x, p, m, 0, L.st, L.hist, s);
  } else {  // 15-bit key: digits 14..7, 6..0
    seg_pass<U, 8>(x, p, m, 7, L.st, L.hist, s);
    seg_pass<U, 7>(x, p, m, 0, L.st, L.hist, s);
  }
}

// ------------------------------------------------------------------ compaction

// Per tile: (#greater, #ties), packed as low/high 32 bits (a tile has kTile elements).
template <typename U>
__global__ void __launch_bounds__(kThreads)
    seg_tile_count_kernel(const U* __restrict__ x, Meta m, int64_t nseg,
                          const RadixState* __restrict__ st, long long* __restrict__ gcnt,
                          long long* __restrict__ tcnt) {
  const int64_t s = segment_of(m.tstart, nseg, blockIdx.x);
  const int64_t base = m.off[s] + (int64_t(blockIdx.x) - m.tstart[s]) * kTile;
  const uint32_t kth = st[s].prefix;
  count_tile<kThreads, kTileItems>(x, base, m.off[s + 1],
                                   [&](uint32_t key) { return topk_class(key, kth); }, gcnt,
                                   tcnt);
}

// Stable write: each thread owns kTileItems consecutive elements, so a block scan of the
// packed per-thread counts ranks every element in index order within the tile.
template <typename U, typename I>
__global__ void __launch_bounds__(kThreads)
    seg_tile_write_kernel(const U* __restrict__ x, Meta m, int64_t nseg,
                          const RadixState* __restrict__ st, const long long* __restrict__ goff,
                          const long long* __restrict__ toff, U* __restrict__ out_v,
                          I* __restrict__ out_i) {
  const int64_t s = segment_of(m.tstart, nseg, blockIdx.x);
  const int64_t tile0 = m.tstart[s];
  const int64_t first = m.off[s] + (int64_t(blockIdx.x) - tile0) * kTile +
                        int64_t(threadIdx.x) * kTileItems;
  const int64_t end = m.off[s + 1];
  const uint32_t kth = st[s].prefix;
  const long long need = st[s].k_rem;
  U v[kTileItems];
  int cls[kTileItems];
  const unsigned long long pre = rank_items<kThreads>(
      x, first, end, [&](uint32_t key) { return topk_class(key, kth); }, v, cls);
  // Counts before this thread's first element within the segment (scan minus the scan at
  // the segment's first tile), then the segment's place in the output.
  long long g = goff[blockIdx.x] - goff[tile0] + (long long)(pre & 0xffffffffull);
  long long t = toff[blockIdx.x] - toff[tile0] + (long long)(pre >> 32);
  const long long base = m.out_off[s];
  place_items(v, cls, first, g, t, need, out_v + base, out_i + base);
}

// ------------------------------------------------------------------ sampled threshold

// float32 bits of the magnitude of a raw value, NaN -> +Inf (the CPU's fabs / isnan).
template <int KIND>
__device__ __forceinline__ uint32_t magnitude_bits(uint32_t raw);
template <>
__device__ __forceinline__ uint32_t magnitude_bits<int(ValueKind::kFloat32)>(uint32_t raw) {
  const uint32_t m = raw & 0x7fffffffu;
  return m > 0x7f800000u ? 0x7f800000u : m;
}
template <>
__device__ __forceinline__ uint32_t magnitude_bits<int(ValueKind::kBFloat16)>(uint32_t raw) {
  return magnitude_bits<int(ValueKind::kFloat32)>(raw << 16);  // bfloat16 = top half of float
}
template <>
__device__ __forceinline__ uint32_t magnitude_bits<int(ValueKind::kFloat16)>(uint32_t raw) {
  const float f = __half2float(__ushort_as_half((unsigned short)raw));  // exact conversion
  return magnitude_bits<int(ValueKind::kFloat32)>(__float_as_uint(f));
}

// mag[j] = the magnitude bits of sample j, at sampling.h's position (the CPU's positions).
template <typename U, int KIND>
__global__ void sample_gather_kernel(const U* __restrict__ x, int64_t n, int64_t samples,
                                     uint64_t stream, uint32_t* __restrict__ mag) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < samples; j += stride)
    mag[j] = magnitude_bits<KIND>(uint32_t(x[sampling::sample_position(n, samples, j, stream)]));
}

}  // namespace

// ------------------------------------------------------------------ public API

int64_t segmented_meta_len(int64_t nseg) { return 5 * nseg + 4; }

SegmentedPlan segmented_plan(const int64_t* offsets, const int64_t* ks, int64_t nseg,
                             int64_t* meta, bool radix_all) {
  if (nseg < 0) throw std::runtime_error("ssfusion_hvd CUDA segmented_topk: negative count");
  int64_t* off = meta;
  int64_t* kk = off + (nseg + 1);
  int64_t* out_off = kk + nseg;
  int64_t* hstart = out_off + (nseg + 1);
  int64_t* tstart = hstart + (nseg + 1);
  std::copy(offsets, offsets + nseg + 1, off);
  std::copy(ks, ks + nseg, kk);
  out_off[0] = hstart[0] = tstart[0] = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t len = off[s + 1] - off[s], k = kk[s];
    if (len < 0 || k < 0 || k > len)
      throw std::runtime_error("ssfusion_hvd CUDA segmented_topk: bad segment or k");
    const bool radix = k > 0 && (k < len || radix_all);  // k == len takes all: no passes
    out_off[s + 1] = out_off[s] + k;
    hstart[s + 1] = hstart[s] + (radix ? (len + kHistChunk - 1) / kHistChunk : 0);
    tstart[s + 1] = tstart[s] + (k > 0 ? (len + kTile - 1) / kTile : 0);
  }
  SegmentedPlan p;
  p.nseg = nseg;
  p.k_total = out_off[nseg];
  p.hist_blocks = hstart[nseg];
  p.tiles = tstart[nseg];
  const int64_t lim = std::numeric_limits<int>::max();
  if (nseg > lim || p.hist_blocks > lim || p.tiles + 1 > lim)
    throw std::runtime_error("ssfusion_hvd CUDA segmented_topk: input too large");
  return p;
}

template <typename U>
size_t segmented_topk_workspace_bytes(const SegmentedPlan& plan) {
  Carver c(nullptr);
  carve_seg<U>(c, plan, /*with_tiles=*/true);
  return c.off;
}

template <typename U, typename I>
void segmented_topk(const U* x, const SegmentedPlan& p, const int64_t* meta, U* out_v, I* out_i,
                    void* workspace, size_t workspace_bytes, cudaStream_t s) {
  if (p.nseg == 0 || p.k_total == 0) return;
  Carver c(workspace);
  const SegLayout<U> L = carve_seg<U>(c, p, true);
  c.require(workspace_bytes, "segmented_topk");
  const Meta m = meta_views(meta, p.nseg);
  seg_radix<U>(x, p, m, L, s);
  const size_t mt = size_t(p.tiles) + 1;
  SSF_CUDA_CHECK(cudaMemsetAsync(L.gcnt + p.tiles, 0, sizeof(long long), s));
  SSF_CUDA_CHECK(cudaMemsetAsync(L.tcnt + p.tiles, 0, sizeof(long long), s));
  seg_tile_count_kernel<U><<<unsigned(p.tiles), kThreads, 0, s>>>(x, m, p.nseg, L.st, L.gcnt,
                                                                  L.tcnt);
  SSF_CUDA_CHECK_LAUNCH();
  size_t bytes = L.scan_bytes;
  SSF_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(L.scan_tmp, bytes, L.gcnt, L.goff, int(mt), s));
  bytes = L.scan_bytes;
  SSF_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(L.scan_tmp, bytes, L.tcnt, L.toff, int(mt), s));
  seg_tile_write_kernel<U, I><<<unsigned(p.tiles), kThreads, 0, s>>>(x, m, p.nseg, L.st, L.goff,
                                                                     L.toff, out_v, out_i);
  SSF_CUDA_CHECK_LAUNCH();
}

namespace {
// The plan of sampled_threshold: one radix segment of `samples` magnitudes, k = kk.
SegmentedPlan sample_plan(int64_t samples, int64_t kk, int64_t* meta) {
  const int64_t off[2] = {0, samples};
  return segmented_plan(off, &kk, 1, meta, /*radix_all=*/true);  // kk == samples: the min
}
}  // namespace

size_t sampled_threshold_workspace_bytes(int64_t n, int64_t samples) {
  if (n <= 0) return 0;
  samples = sampling::clamp_samples(n, samples);
  std::vector<int64_t> meta(segmented_meta_len(1));
  const SegmentedPlan p = sample_plan(samples, 1, meta.data());
  Carver c(nullptr);
  c.take<uint32_t>(size_t(samples));
  c.take<int64_t>(meta.size());
  carve_seg<uint32_t>(c, p, /*with_tiles=*/false);
  return c.off;
}

template <typename U>
double sampled_threshold(const U* x, int64_t n, int64_t k, int64_t samples, uint64_t seed,
                         ValueKind kind, void* workspace, size_t workspace_bytes,
                         cudaStream_t s) {
  if (n <= 0 || k < 1 || k > n)
    throw std::runtime_error("ssfusion_hvd CUDA sampled_threshold: k out of range");
  samples = sampling::clamp_samples(n, samples);
  const int64_t kk = sampling::sample_rank(n, k, samples);
  const uint64_t stream = sampling::sample_stream(seed);
  std::vector<int64_t> meta(segmented_meta_len(1));  // alive until the sync below
  const SegmentedPlan p = sample_plan(samples, kk, meta.data());
  Carver c(workspace);
  uint32_t* mag = c.take<uint32_t>(size_t(samples));
  int64_t* meta_dev = c.take<int64_t>(meta.size());
  const SegLayout<uint32_t> L = carve_seg<uint32_t>(c, p, false);
  c.require(workspace_bytes, "sampled_threshold");
  SSF_CUDA_CHECK(cudaMemcpyAsync(meta_dev, meta.data(), meta.size() * sizeof(int64_t),
                                 cudaMemcpyHostToDevice, s));
  const unsigned grid = grid_for(samples, 256, 4096);
  switch (kind) {
    case ValueKind::kFloat32:
      sample_gather_kernel<U, int(ValueKind::kFloat32)>
          <<<grid, 256, 0, s>>>(x, n, samples, stream, mag);
      break;
    case ValueKind::kFloat16:
      sample_gather_kernel<U, int(ValueKind::kFloat16)>
          <<<grid, 256, 0, s>>>(x, n, samples, stream, mag);
      break;
    case ValueKind::kBFloat16:
      sample_gather_kernel<U, int(ValueKind::kBFloat16)>
          <<<grid, 256, 0, s>>>(x, n, samples, stream, mag);
      break;
  }
  SSF_CUDA_CHECK_LAUNCH();
  seg_radix<uint32_t>(mag, p, meta_views(meta_dev, 1), L, s);
  uint32_t bits = 0;
  SSF_CUDA_CHECK(cudaMemcpyAsync(&bits, &L.st[0].prefix, sizeof bits, cudaMemcpyDeviceToHost, s));
  SSF_CUDA_CHECK(cudaStreamSynchronize(s));  // the one sync: the result is a host number
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return double(f);
}

#define SSF_INST_U(U)                                                                   \
  template size_t segmented_topk_workspace_bytes<U>(const SegmentedPlan&);              \
  template double sampled_threshold<U>(const U*, int64_t, int64_t, int64_t, uint64_t,   \
                                       ValueKind, void*, size_t, cudaStream_t);
#define SSF_INST_UI(U, I)                                                                    \
  template void segmented_topk<U, I>(const U*, const SegmentedPlan&, const int64_t*, U*, I*, \
                                     void*, size_t, cudaStream_t);
SSF_FOR_EACH_U(SSF_INST_U)
SSF_FOR_EACH_UI(SSF_INST_UI)

}  // namespace cuda
}  // namespace ssf
