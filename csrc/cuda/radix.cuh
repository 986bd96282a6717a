// Device pieces of the radix select and of the stable compaction, shared by select.cu (one
// buffer) and segmented.cu (per segment); the two files' headers describe the algorithm.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace ssf {
namespace cuda {

// Magnitude key of raw value bits U: the bits without the sign bit (31 for float32, 15 for
// float16/bfloat16), so NaN ranks above +Inf.
template <typename U>
struct KeyOf {
  static constexpr int kBits = int(sizeof(U)) * 8 - 1;
  static constexpr uint32_t kMask = (uint32_t(1) << kBits) - 1;
  static constexpr int kMaxBins = sizeof(U) == 4 ? 2048 : 256;  // the widest digit's bins
};

// Result of the radix passes, kept on the device (no host round trip between passes).
struct RadixState {
  uint32_t prefix;  // key digits found so far; after the last pass the k-th key `kth`
  uint32_t unused;
  long long k_rem;  // rank of the k-th key among the keys matching the prefix; after the
                    // last pass `need`, the number of keys equal to kth to take
};

// One pass's pivot step, run by a block of THREADS threads: hist[0, 2^BITS) counts the keys
// matching `prefix` by their digit at `shift`; suffix sums from the top digit down locate
// the digit holding the krem-th largest of them, and *st gets the prefix extended by that
// digit and the rank left inside it. CLEAR: zero every bin once read (for the next pass).
template <int BITS, int THREADS, bool CLEAR, typename Hist>
__device__ __forceinline__ void radix_pivot(Hist* hist, int shift, uint32_t prefix,
                                            unsigned long long krem, RadixState* st) {
  constexpr int kBins = 1 << BITS;
  constexpr int kItems = kBins / THREADS;
  static_assert(kBins % THREADS == 0, "bins must split evenly over the block");
  using Scan = cub::BlockScan<unsigned long long, THREADS>;
  __shared__ typename Scan::TempStorage tmp;
  unsigned long long cnt[kItems], incl[kItems];
  for (int it = 0; it < kItems; ++it) {
    const int b = kBins - 1 - (threadIdx.x * kItems + it);
    cnt[it] = hist[b];
    if constexpr (CLEAR) hist[b] = 0;  // each bin is read and cleared by the same thread
  }
  Scan(tmp).InclusiveSum(cnt, incl);
  __syncthreads();  // every thread has read *st before the winner overwrites it
  for (int it = 0; it < kItems; ++it) {
    const unsigned long long above = incl[it] - cnt[it];
    if (above < krem && incl[it] >= krem) {  // exactly one (digit, thread) matches
      const uint32_t digit = uint32_t(kBins - 1 - (threadIdx.x * kItems + it));
      st->prefix = prefix | (digit << shift);
      st->k_rem = (long long)(krem - above);
    }
  }
}

// Compaction classes: 0 dropped, 1 selected (key > kth, or key >= key_min in threshold
// mode), 2 tie (key == kth). A thread's counts of both are packed into one word, selected in
// the low and ties in the high 32 bits, so one block scan or reduction ranks both.
__device__ __forceinline__ unsigned long long class_count(int c) {
  return c == 1 ? 1ull : (c == 2 ? (1ull << 32) : 0ull);
}

// Class of a magnitude key in top-k mode, kth being the k-th key.
__device__ __forceinline__ int topk_class(uint32_t key, uint32_t kth) {
  return key > kth ? 1 : (key == kth ? 2 : 0);
}

// Counts of one compaction tile of THREADS * ITEMS elements from `base` (those at or past
// `end` are dropped), by classify(magnitude key): the block reads them striped (coalesced;
// order is irrelevant for counting) and thread 0 stores #selected into gcnt[blockIdx.x] and
// #ties into tcnt[blockIdx.x] (tcnt may be null: no ties in threshold mode).
template <int THREADS, int ITEMS, typename U, typename Classify>
__device__ __forceinline__ void count_tile(const U* __restrict__ x, int64_t base, int64_t end,
                                           const Classify& classify,
                                           long long* __restrict__ gcnt,
                                           long long* __restrict__ tcnt) {
  using Reduce = cub::BlockReduce<unsigned long long, THREADS>;
  __shared__ typename Reduce::TempStorage tmp;
  unsigned long long packed = 0;
  for (int it = 0; it < ITEMS; ++it) {
    const int64_t i = base + int64_t(it) * THREADS + threadIdx.x;
    if (i < end) packed += class_count(classify(uint32_t(x[i]) & KeyOf<U>::kMask));
  }
  const unsigned long long total = Reduce(tmp).Sum(packed);
  if (threadIdx.x == 0) {
    gcnt[blockIdx.x] = (long long)(total & 0xffffffffull);
    if (tcnt) tcnt[blockIdx.x] = (long long)(total >> 32);
  }
}

// Loads a thread's ITEMS consecutive elements first, first + 1, ... (those at or past `end`
// are dropped) with their classes, classify(magnitude key), and ranks them in the tile:
// returns the packed counts of the tile's elements before this thread's first one (a block
// scan over the THREADS threads, which must all call it).
template <int THREADS, int ITEMS, typename U, typename Classify>
__device__ __forceinline__ unsigned long long rank_items(const U* __restrict__ x, int64_t first,
                                                         int64_t end, const Classify& classify,
                                                         U (&v)[ITEMS], int (&cls)[ITEMS]) {
  using Scan = cub::BlockScan<unsigned long long, THREADS>;
  __shared__ typename Scan::TempStorage tmp;
  unsigned long long packed = 0;
  for (int it = 0; it < ITEMS; ++it) {
    const int64_t i = first + it;
    v[it] = i < end ? x[i] : U(0);
    cls[it] = i < end ? classify(uint32_t(v[it]) & KeyOf<U>::kMask) : 0;
    packed += class_count(cls[it]);
  }
  unsigned long long pre;
  Scan(tmp).ExclusiveSum(packed, pre);
  return pre;
}

// Stable write of a thread's ITEMS consecutive elements first, first + 1, ... (values v,
// classes cls): g and t are the selected elements and the ties before the first one. Every
// selected element is taken, ties only while fewer than `need` were taken before them; an
// element goes to out[g + min(t, need)], so the output is in index order.
template <int ITEMS, typename U, typename I>
__device__ __forceinline__ void place_items(const U (&v)[ITEMS], const int (&cls)[ITEMS],
                                            int64_t first, long long g, long long t,
                                            long long need, U* __restrict__ out_v,
                                            I* __restrict__ out_i) {
  for (int it = 0; it < ITEMS; ++it) {
    long long pos = -1;
    if (cls[it] == 1) {
      pos = g + (t < need ? t : need);  // ties before it that are taken
      ++g;
    } else if (cls[it] == 2) {
      if (t < need) pos = g + t;
      ++t;
    }
    if (pos >= 0) {
      out_v[pos] = v[it];
      out_i[pos] = static_cast<I>(first + it);
    }
  }
}

}  // namespace cuda
}  // namespace ssf
