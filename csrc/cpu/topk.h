// Exact magnitude top-k on the CPU, shared by topk/segmented_topk (select.cpp) and the
// fused error-feedback selection ef_topk/segmented_ef_topk (feedback.cpp).
//
// Two methods, one result (ops.h: exact, ties to the lower index, index order):
//
// * radix select (`topk_bits`): per-chunk histograms of the key's top 11 bits give the
//   bin holding the k-th largest key; a second pass gathers the elements above that bin
//   and the bin's candidates; nth_element on the candidates' low bits resolves the exact
//   k-th key. Two reads of the input, a table update per element in the first.
// * filtered select (`topk_filtered`), used when k is a small share of n: a stratified
//   sample of the magnitudes gives a key that about 1.2-1.6 k elements exceed; ONE pass
//   keeps those elements (with AVX-512: blocks of 16 tested, the blocks holding any
//   listed, then their hits compressed out, no branch on the data; at the SSE2 baseline a
//   block test and an append inside the blocks that hold any), and the exact k-th among
//   them is resolved (a few thousand: bisection on the key with vectorized counts; more: a
//   radix select over the candidates' band, in parallel). The sample decides the
//   speed, never the result: when the candidates are fewer than k (the sample
//   overestimated) or far too many, the radix select runs on the whole input instead;
//   when a chunk overflows its candidate buffer, a second pass collects it into buffers
//   of the now known sizes.
//
// A *source* supplies the values: `Plain` reads x; the error-feedback source of
// feedback.cpp computes residual + grad on the fly, writing it back as it goes, so the
// selection and the accumulation share one pass over memory.
#pragma once

#include "common.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SSF_X86_DISPATCH 1
#include <immintrin.h>
#endif

namespace ssf {
namespace cpu {

// Radix select of the top k of x[0, n) into out_v/out_i (k entries, index order); indices
// are written as base + position, so a segment of a larger buffer reports positions in it.
template <typename U, typename I>
void topk_bits(const U* x, int64_t n, int64_t k, U* out_v, I* out_i, int64_t base = 0) {
  constexpr int kHiBits = Key<U>::kBits < 11 ? Key<U>::kBits : 11;
  constexpr int kShift = Key<U>::kBits - kHiBits;
  constexpr int64_t kBins = int64_t(1) << kHiBits;
  constexpr U kLowMask = static_cast<U>((U(1) << kShift) - 1);
  if (k == 0) return;
  if (k == n) {
    for (int64_t i = 0; i < n; ++i) {
      out_v[i] = x[i];
      out_i[i] = static_cast<I>(base + i);
    }
    return;
  }
  const Chunks ch(n);
  // Pass 1: histograms of the top bits.
  std::vector<int32_t> hist(ch.count * kBins, 0);
  ch.for_each([&](int64_t c) {
    int32_t* h = hist.data() + c * kBins;
    for (int64_t i = ch.begin(c), e = ch.end(c); i < e; ++i) ++h[Key<U>::of(x[i]) >> kShift];
  });
  std::vector<int64_t> total(kBins, 0);
  for (int64_t c = 0; c < ch.count; ++c)
    for (int64_t b = 0; b < kBins; ++b) total[b] += hist[c * kBins + b];
  int64_t pivot = kBins - 1, above = 0;
  for (; pivot > 0 && above + total[pivot] < k; --pivot) above += total[pivot];
  const int64_t need = k - above;  // taken from the pivot bin, 1 <= need <= total[pivot]
  // Per-chunk counts above the pivot bin and inside it, and their offsets.
  std::vector<int64_t> above_off(ch.count + 1, 0), cand_off(ch.count + 1, 0);
  for (int64_t c = 0; c < ch.count; ++c) {
    const int32_t* h = hist.data() + c * kBins;
    int64_t a = 0;
    for (int64_t b = pivot + 1; b < kBins; ++b) a += h[b];
    above_off[c] = a;
    cand_off[c] = h[pivot];
  }
  exclusive_scan(above_off.data(), ch.count + 1);
  const int64_t n_cand = exclusive_scan(cand_off.data(), ch.count + 1);
  // Pass 2: gather.
  std::vector<I> above_idx(above), cand_idx(n_cand);
  std::vector<U> cand_low(n_cand);
  ch.for_each([&](int64_t c) {
    int64_t a = above_off[c], q = cand_off[c];
    for (int64_t i = ch.begin(c), e = ch.end(c); i < e; ++i) {
      const U key = Key<U>::of(x[i]);
      const int64_t d = key >> kShift;
      if (d > pivot) {
        above_idx[a++] = static_cast<I>(i);
      } else if (d == pivot) {
        cand_idx[q] = static_cast<I>(i);
        cand_low[q++] = static_cast<U>(key & kLowMask);
      }
    }
  });
  // Resolve the exact k-th key inside the pivot bin.
  std::vector<U> tmp(cand_low);
  std::nth_element(tmp.begin(), tmp.begin() + (need - 1), tmp.end(), std::greater<U>());
  const U kth = tmp[need - 1];
  int64_t greater = 0;
  for (int64_t j = 0; j < n_cand; ++j) greater += cand_low[j] > kth;
  int64_t ties_left = need - greater;  // equal keys taken, lowest indices first
  std::vector<uint8_t> take(n_cand, 0);
  std::vector<int64_t> out_off(ch.count + 1, 0);
  for (int64_t c = 0; c < ch.count; ++c) {
    int64_t taken = 0;
    for (int64_t j = cand_off[c]; j < cand_off[c + 1]; ++j) {
      bool t = cand_low[j] > kth;
      if (!t && cand_low[j] == kth && ties_left > 0) {
        t = true;
        --ties_left;
      }
      take[j] = t;
      taken += t;
    }
    out_off[c] = (above_off[c + 1] - above_off[c]) + taken;
  }
  exclusive_scan(out_off.data(), ch.count + 1);
  // Merge both index-ordered lists of each chunk into the output.
  ch.for_each([&](int64_t c) {
    int64_t a = above_off[c], ae = above_off[c + 1], q = cand_off[c], qe = cand_off[c + 1];
    int64_t o = out_off[c];
    while (q < qe && !take[q]) ++q;
    while (a < ae || q < qe) {
      I idx;
      if (q >= qe || (a < ae && above_idx[a] < cand_idx[q])) {
        idx = above_idx[a++];
      } else {
        idx = cand_idx[q++];
        while (q < qe && !take[q]) ++q;
      }
      out_v[o] = x[idx];
      out_i[o++] = static_cast<I>(base + idx);
    }
  });
}

// Elements a filter block tests at once: the test is a vectorizable OR over the block.
constexpr int kBlock = 16;

// Appends the elements of u[0, len) (len < kBlock) whose key is >= t; as append_hits.
template <typename U>
inline int64_t append_tail(const U* u, int64_t len, U t, int64_t first, U* cv, uint32_t* cp,
                           int64_t m, int64_t cap) {
  for (int64_t j = 0; j < len; ++j) {
    if (Key<U>::of(u[j]) >= t) {
      if (m < cap) {
        cv[m] = u[j];
        cp[m] = static_cast<uint32_t>(first + j);
      }
      ++m;
    }
  }
  return m;
}

// The keys of one block tested against t: bit j of the result is set when key j >= t.
// Keys have the sign bit clear, so they compare alike as signed integers, which SSE2 (the
// x86-64 baseline) compares four or eight at a time; compilers do not vectorize this test
// on their own once it is inlined into the filter loop.
#if defined(__SSE2__)
inline uint32_t block_hits(const uint32_t* u, uint32_t t) {
  static_assert(kBlock == 16, "four vectors of four keys");
  const __m128i mask = _mm_set1_epi32(0x7FFFFFFF);
  const __m128i below = _mm_set1_epi32(static_cast<int32_t>(t) - 1);  // key >= t: key > t - 1
  const __m128i* p = reinterpret_cast<const __m128i*>(u);
  auto bits4 = [&](int v) {
    const __m128i hit = _mm_cmpgt_epi32(_mm_and_si128(_mm_loadu_si128(p + v), mask), below);
    return static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(hit))) << (4 * v);
  };
  return bits4(0) | bits4(1) | bits4(2) | bits4(3);
}
inline uint32_t block_hits(const uint16_t* u, uint16_t t) {
  const __m128i mask = _mm_set1_epi16(0x7FFF);
  const __m128i below = _mm_set1_epi16(static_cast<int16_t>(static_cast<int16_t>(t) - 1));
  const __m128i* p = reinterpret_cast<const __m128i*>(u);
  const __m128i lo = _mm_cmpgt_epi16(_mm_and_si128(_mm_loadu_si128(p), mask), below);
  const __m128i hi = _mm_cmpgt_epi16(_mm_and_si128(_mm_loadu_si128(p + 1), mask), below);
  // one byte per 16-bit lane after saturating packs: -1 stays -1, 0 stays 0
  return static_cast<uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(lo, hi)));
}
#else
template <typename U>
inline uint32_t block_hits(const U* u, U t) {
  uint32_t bits = 0;
  for (int j = 0; j < kBlock; ++j) bits |= uint32_t(Key<U>::of(u[j]) >= t) << j;
  return bits;
}
#endif

// Appends the block's hits (bit j of `hits`: u[j], at position first + j) to a candidate
// buffer, as many as it has room for; returns the count of hits so far, stored or not.
template <typename U>
inline int64_t append_hits(const U* u, uint32_t hits, int64_t first, U* cv, uint32_t* cp,
                           int64_t m, int64_t cap) {
  if (m + kBlock <= cap) {  // room for any block: no check per hit
    for (; hits; hits &= hits - 1, ++m) {
      const int j = __builtin_ctz(hits);
      cv[m] = u[j];
      cp[m] = static_cast<uint32_t>(first + j);
    }
    return m;
  }
  for (; hits; hits &= hits - 1, ++m) {
    const int j = __builtin_ctz(hits);
    if (m < cap) {
      cv[m] = u[j];
      cp[m] = static_cast<uint32_t>(first + j);
    }
  }
  return m;
}

// Keeps the elements of u[0, n) with key >= t (positions relative to u): the filter loop
// of a chunk. Returns how many were kept (possibly more than cap; only cap are stored).
template <typename U>
inline int64_t filter_values(const U* u, int64_t n, U t, U* cv, uint32_t* cp, int64_t cap) {
  int64_t m = 0, i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const uint32_t hits = block_hits(u + i, t);
    if (hits) m = append_hits(u + i, hits, i, cv, cp, m, cap);
  }
  return append_tail(u + i, n - i, t, i, cv, cp, m, cap);
}

// Whether the filter loops may use AVX-512 (checked once: the CPU has it and SSF_CPU_ISA
// is not "baseline", which the tests set to run the SSE2 loops on the same machine).
bool use_avx512();

#ifdef SSF_X86_DISPATCH
// The filter loop with AVX-512 over the full blocks of [0, n), in two stages per tile of
// kTileBlocks blocks (16 KB of float32, still in L1 for the second stage):
//  1. block(i) gives the 16 raw values of block i (loading them, or forming them: the
//     error-feedback source), one compare gives the hit mask, and the block's number and
//     mask are appended to a list that moves on only when the mask is not empty;
//  2. for each listed block, block.stored(i) reads its values again and two compress
//     stores append the hits' values and positions.
// Neither stage branches on the data: hits fall in well under half of the blocks, at
// random, so a branch per block mispredicts on each hit block (the version that skipped
// empty blocks lost 2x on fresh inputs), while compressing every block costs two
// compresses and two 64-byte stores per block; listing first costs one 4-byte store.
// Returns the count kept; the caller filters the last n % 16 values.
template <typename Block>
__attribute__((target("avx512f"))) inline int64_t filter_blocks_avx512(
    const Block& block, int64_t n, uint32_t t, uint32_t* cv, uint32_t* cp, int64_t cap) {
  constexpr int64_t kTileBlocks = 256;
  const __m512i mask = _mm512_set1_epi32(0x7FFFFFFF), tv = _mm512_set1_epi32(int32_t(t));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  uint32_t listed[kTileBlocks];  // (block in tile) << 16 | its hit mask
  const int64_t blocks = n / 16;
  int64_t m = 0;
  for (int64_t first = 0; first < blocks; first += kTileBlocks) {
    const int64_t count = std::min(kTileBlocks, blocks - first);
    int64_t h = 0;
    for (int64_t b = 0; b < count; ++b) {
      const __m512i v = block((first + b) * 16);
      const __mmask16 hits = _mm512_cmpge_epu32_mask(_mm512_and_si512(v, mask), tv);
      listed[h] = uint32_t(b) << 16 | uint32_t(hits);
      h += hits != 0;
    }
    for (int64_t j = 0; j < h; ++j) {
      const int64_t i = (first + int64_t(listed[j] >> 16)) * 16;
      const __mmask16 hits = static_cast<__mmask16>(listed[j] & 0xFFFF);
      const __m512i v = block.stored(i);
      if (m + 16 <= cap) {
        const __m512i pos = _mm512_add_epi32(lane, _mm512_set1_epi32(int32_t(i)));
        _mm512_storeu_si512(cv + m, _mm512_maskz_compress_epi32(hits, v));
        _mm512_storeu_si512(cp + m, _mm512_maskz_compress_epi32(hits, pos));
        m += __builtin_popcount(hits);
      } else {
        uint32_t raw[16];
        _mm512_storeu_si512(raw, v);
        m = append_hits(raw, hits, i, cv, cp, m, cap);
      }
    }
  }
  return m;
}

// The plain source's blocks: 16 keys loaded as they are.
struct LoadBlock {
  const uint32_t* u;
  __attribute__((target("avx512f"))) __m512i operator()(int64_t i) const {
    return _mm512_loadu_si512(u + i);
  }
  __attribute__((target("avx512f"))) __m512i stored(int64_t i) const {
    return _mm512_loadu_si512(u + i);
  }
};
#endif

// The plain source: selects from x as it is.
template <typename U>
struct Plain {
  const U* x;
  int64_t n;
  U raw(int64_t i) const { return x[i]; }
  const U* values() const { return x; }
  void materialize() const {}
  int64_t filter(int64_t b, int64_t e, U t, U* cv, uint32_t* cp, int64_t cap) const {
#ifdef SSF_X86_DISPATCH
    if constexpr (sizeof(U) == 4) {
      if (use_avx512()) {
        const int64_t n = e - b, full = n & ~int64_t(15);
        const int64_t m = filter_blocks_avx512(LoadBlock{x + b}, n, t, cv, cp, cap);
        return append_tail(x + b + full, n - full, t, full, cv, cp, m, cap);
      }
    }
#endif
    return filter_values(x + b, e - b, t, cv, cp, cap);
  }
};

#ifdef SSF_X86_DISPATCH
// count_at_least over float32 keys with AVX-512: each hit subtracts -1 from its lane.
__attribute__((target("avx512f"))) inline int64_t count_at_least_avx512(const uint32_t* keys,
                                                                        int64_t m, uint32_t x) {
  const __m512i xv = _mm512_set1_epi32(int32_t(x));
  __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
  int64_t j = 0;
  for (; j + 32 <= m; j += 32) {  // two accumulators: the adds do not wait on each other
    a0 = _mm512_mask_sub_epi32(a0, _mm512_cmpge_epu32_mask(_mm512_loadu_si512(keys + j), xv),
                               a0, _mm512_set1_epi32(-1));
    a1 = _mm512_mask_sub_epi32(
        a1, _mm512_cmpge_epu32_mask(_mm512_loadu_si512(keys + j + 16), xv), a1,
        _mm512_set1_epi32(-1));
  }
  for (; j + 16 <= m; j += 16)
    a0 = _mm512_mask_sub_epi32(a0, _mm512_cmpge_epu32_mask(_mm512_loadu_si512(keys + j), xv),
                               a0, _mm512_set1_epi32(-1));
  alignas(64) int32_t lanes[16];  // (GCC 12 warns inside _mm512_reduce_add_epi32)
  _mm512_store_si512(lanes, _mm512_add_epi32(a0, a1));
  int64_t c = 0;
  for (const int32_t l : lanes) c += l;
  for (; j < m; ++j) c += keys[j] >= x;
  return c;
}
#endif

// How many of keys[0, m) are >= x (keys have the sign bit clear).
template <typename U>
int64_t count_at_least(const U* keys, int64_t m, U x) {
  if (x > Key<U>::kMask) return 0;
  int64_t c = 0, j = 0;
#ifdef SSF_X86_DISPATCH
  if constexpr (sizeof(U) == 4) {
    if (use_avx512()) return count_at_least_avx512(keys, m, x);
  }
#endif
#if defined(__SSE2__)
  // Below the sign bit keys compare alike as signed integers (block_hits).
  if constexpr (sizeof(U) == 4) {
    const __m128i below = _mm_set1_epi32(static_cast<int32_t>(x) - 1);
    __m128i acc = _mm_setzero_si128();
    for (; j + 4 <= m; j += 4) {  // a hit is -1 in its lane
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(keys + j));
      acc = _mm_sub_epi32(acc, _mm_cmpgt_epi32(v, below));
    }
    alignas(16) int32_t lanes[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(lanes), acc);
    c = int64_t(lanes[0]) + lanes[1] + lanes[2] + lanes[3];
  }
#endif
  for (; j < m; ++j) c += keys[j] >= x;
  return c;
}

// The k-th largest of keys[0, m) (1 <= k <= m, keys with the sign bit clear), known to
// lie in [lo, hi]: bisection on the key, one vectorized count per step. No step depends
// on the keys' order or on a branch per key, where a heap or a histogram waits on its own
// updates; ~log2(hi - lo) passes over m keys, for the few thousand keys it is given.
// With slack > 0 it stops once the bracket is that narrow and returns its lower end: a key
// at most slack below the k-th largest, which at least k keys reach (an estimate's need).
template <typename U>
U kth_key_by_count(const U* keys, int64_t m, int64_t k, U lo, U hi, U slack = 0) {
  while (U(hi - lo) > slack) {  // count(>= lo) >= k > count(>= hi + 1)
    const U mid = static_cast<U>(lo + (hi - lo + 1) / 2);
    if (count_at_least(keys, m, mid) >= k) lo = mid; else hi = static_cast<U>(mid - 1);
  }
  return lo;
}

// 32-bit mixing (a fixed permutation of uint32, murmur3's finalizer): the jitter of the
// sample positions, so a stride never lines up with a weight layout.
inline uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// Scratch memory of n T's for one call: a grow-only buffer of the calling thread (slot 0,
// 1, 2), reused from call to call, since fresh pages cost page faults every call (2-4 % of
// a 2.5e7 fused op). Up to kKeptBytes per slot stays with the thread; a larger request gets
// its own allocation, freed with the Scratch.
template <typename T>
class Scratch {
 public:
  static constexpr int64_t kKeptBytes = int64_t(32) << 20;
  Scratch(int slot, int64_t n) {
    thread_local std::unique_ptr<T[]> kept[3];
    thread_local int64_t kept_n[3] = {0, 0, 0};
    if (n * int64_t(sizeof(T)) > kKeptBytes) {
      own_.reset(new T[n]);
      p_ = own_.get();
      return;
    }
    if (kept_n[slot] < n) {
      kept[slot].reset(new T[n]);
      kept_n[slot] = n;
    }
    p_ = kept[slot].get();
  }
  T* get() const { return p_; }

 private:
  std::unique_ptr<T[]> own_;
  T* p_ = nullptr;
};

// A key that somewhat more than k of the n values exceed, from a stratified sample
// (runs of 16 consecutive elements, run j at a pseudo-random place in the j-th of equal
// strata):
// the q-th largest sampled key, q = the expected hits above the k-th largest value plus 3
// standard deviations plus 2, found by bisection (kth_key_by_count) to within 2^-10 of
// itself for float32 (exactly for 16-bit keys): the key decides the speed, never the
// result. A heap of the q largest looked cheaper on a benchmark that reused a few inputs,
// but only because the branch predictor had learned their samples: on gradients that are
// new every step it took 2.3x the bisection's cycles (9.7k against 4.2k at 1e5 elements).
// Returns false below 256 values. From there up the sample and filter beat the radix select,
// whose fixed costs (2048-bin histograms) dominated small inputs: 13.0 -> 3.5 us a call at
// 1e4 elements, 4.1 -> 2.2 us at 1e3, 3.2 -> 2.0 us at 300 (2 threads, new inputs).
template <typename U, typename Src>
bool sample_key(const Src& src, int64_t n, int64_t k, U* key, int64_t* expect) {
  if (n < 256) return false;
  // Expected sampled elements above the k-th largest, h: the sample costs ~h n / k reads
  // and a selection among them, the candidates beyond k (~3 k / sqrt(h)) a resolve step and
  // a filter branch each; with the second ~3x the first per element (measured), their sum
  // is least at h = (4.5 k^2 / n)^(2/3). At most 1/64 of the input (one run, 1/16 at
  // most, below 1024 values) and 32768 samples.
  const double want = std::min(256.0, std::max(2.0, std::cbrt(std::pow(4.5 * double(k) * double(k) / double(n), 2.0))));
  // The sample is read in runs of kRun consecutive elements (a cache line of float32): one
  // stratum per run, the run's start jittered inside it. A miss brings kRun samples, not one.
  constexpr int64_t kRun = 16;
  const int64_t runs = (std::min<int64_t>(
      std::min<int64_t>(n / 64, 32768),
      std::max<int64_t>(256, static_cast<int64_t>(std::ceil(want * double(n) / double(k))))) +
      kRun - 1) / kRun;  // runs <= ceil(n / 1024), n >= 256: a stratum holds >= 256 values
  const int64_t s = runs * kRun;
  const double hits = double(s) * double(k) / double(n);
  const int64_t q = std::min<int64_t>(s, static_cast<int64_t>(hits + 3.0 * std::sqrt(hits)) + 2);
  const Scratch<U> scratch(2, s);  // slot 2: free until the resolve
  U* keys = scratch.get();
  U top = 0;
  for (int64_t j = 0; j < runs; ++j) {
    const int64_t lo = (j * n) / runs, width = ((j + 1) * n) / runs - lo - kRun + 1;
    const int64_t at = lo + int64_t(mix32(uint32_t(j) + 1) % uint64_t(width));  // mix32(0) = 0
    for (int64_t r = 0; r < kRun; ++r) {
      keys[j * kRun + r] = Key<U>::of(src.raw(at + r));
      top = std::max(top, keys[j * kRun + r]);
    }
  }
  constexpr U kSlack = sizeof(U) == 4 ? U(1) << 13 : U(0);  // float32: 2^13 of 2^23 ulps
  *key = kth_key_by_count(keys, s, q, U(0), top, kSlack);
  *expect = static_cast<int64_t>(double(q) * double(n) / double(s));
  return true;
}

// The candidates one chunk kept: raw values and positions relative to the chunk start.
template <typename U>
struct ChunkCandidates {
  const U* v = nullptr;
  const uint32_t* p = nullptr;
  int64_t m = 0;
  int64_t begin = 0;  // the chunk's first position
};

#ifdef SSF_X86_DISPATCH
// emit_selected's full blocks with AVX-512 (float32 values, int32 positions): the keys
// above kth, and ties while `tie` lasts, compressed out 16 at a time while a whole block of
// output fits before `end`. Returns (candidates done, output position).
__attribute__((target("avx512f"))) inline std::pair<int64_t, int64_t> emit_blocks_avx512(
    const uint32_t* v, const uint32_t* p, int64_t m, int64_t first, uint32_t kth, int64_t& tie,
    uint32_t* out_v, int32_t* out_i, int64_t o, int64_t end) {
  const __m512i mask = _mm512_set1_epi32(0x7FFFFFFF), kv = _mm512_set1_epi32(int32_t(kth));
  const __m512i fv = _mm512_set1_epi32(int32_t(first));
  int64_t j = 0;
  for (; j + 16 <= m && o + 16 <= end; j += 16) {
    const __m512i raw = _mm512_loadu_si512(v + j);
    const __m512i key = _mm512_and_si512(raw, mask);
    uint32_t take = _mm512_cmpgt_epu32_mask(key, kv);
    uint32_t eq = _mm512_cmpeq_epu32_mask(key, kv);
    for (; eq && tie > 0; eq &= eq - 1, --tie) take |= eq & (0u - eq);  // ties: rare
    const __m512i pos = _mm512_add_epi32(_mm512_loadu_si512(p + j), fv);
    _mm512_storeu_si512(out_v + o, _mm512_maskz_compress_epi32(__mmask16(take), raw));
    _mm512_storeu_si512(out_i + o, _mm512_maskz_compress_epi32(__mmask16(take), pos));
    o += __builtin_popcount(take);
  }
  return {j, o};
}
#endif

// Writes the selected of one chunk's candidates (raw values v, positions first + p, m of
// them) into out[o, end): keys above kth, and keys equal to it while `tie` lasts
// (decremented as taken). Each candidate is written and the position moves on only when it
// is taken (no branch on the data); it stops once end is reached, so nothing is written
// past the chunk's share of the output. Returns the output position reached.
template <typename U, typename I>
int64_t emit_selected(const U* v, const uint32_t* p, int64_t m, int64_t first, U kth,
                      int64_t& tie, U* out_v, I* out_i, int64_t o, int64_t end) {
  int64_t j = 0;
#ifdef SSF_X86_DISPATCH
  if constexpr (sizeof(U) == 4 && std::is_same_v<I, int32_t>) {
    if (use_avx512()) std::tie(j, o) = emit_blocks_avx512(v, p, m, first, kth, tie, out_v, out_i, o, end);
  }
#endif
  for (; j < m && o < end; ++j) {
    const U key = Key<U>::of(v[j]);
    out_v[o] = v[j];
    out_i[o] = static_cast<I>(first + p[j]);
    bool take = key > kth;
    if (key == kth) take = tie-- > 0;  // ties are rare: a predicted branch
    o += take;
  }
  return o;
}

// The exact top k of candidates whose keys are all >= t, the chunks' lists in index order:
// out_v/out_i (positions base + chunk begin + p), index order, ties to the lower index.
//
// Few candidates (what a mid-size tensor has): their keys copied into one array, the k-th
// largest found by bisection on [t, largest key] with a vectorized count per step (a
// compare and an add per key and step, no dependence between keys, where a histogram's
// increments wait on each other when keys share a bin), then one pass emits the keys above
// it and the first ties. Many: a radix select like topk_bits, its 2048 bins spanning only
// the candidates' band, every pass over the chunks in parallel.
template <typename U, typename I>
void resolve_candidates(const std::vector<ChunkCandidates<U>>& cc, int64_t k, U t,
                        U* out_v, I* out_i, int64_t base) {
  const int64_t nc = int64_t(cc.size());
  int64_t total_c = 0;
  for (const auto& ch : cc) total_c += ch.m;
  if (total_c < (int64_t(1) << 16)) {
    const Scratch<U> scratch(2, total_c);
    U* keys = scratch.get();
    U top = t;
    for (int64_t c = 0, q = 0; c < nc; ++c) {
      for (int64_t j = 0; j < cc[c].m; ++j) {
        keys[q] = Key<U>::of(cc[c].v[j]);
        top = std::max(top, keys[q++]);
      }
    }
    const U kth = kth_key_by_count(keys, total_c, k, t, top);
    int64_t tie = k - count_at_least(keys, total_c, static_cast<U>(kth + 1));
    for (int64_t c = 0, o = 0; c < nc; ++c)
      o = emit_selected(cc[c].v, cc[c].p, cc[c].m, base + cc[c].begin, kth, tie, out_v, out_i,
                        o, k);
    return;
  }
  std::vector<U> tops(nc, t);
  at::parallel_for(0, nc, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      U top = t;
      for (int64_t j = 0; j < cc[c].m; ++j) top = std::max(top, Key<U>::of(cc[c].v[j]));
      tops[c] = top;
    }
  });
  const U top = *std::max_element(tops.begin(), tops.end());
  constexpr int64_t bins = 2048;
  int shift = 0;
  while ((static_cast<uint64_t>(top - t) >> shift) >= uint64_t(bins)) ++shift;
  auto bin = [&](U v) { return static_cast<int64_t>((Key<U>::of(v) - t) >> shift); };
  auto each_chunk = [&](const auto& fn) {
    at::parallel_for(0, nc, 1, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) fn(c);
    });
  };
  // Per chunk histograms, the pivot bin and what lies above.
  std::vector<int32_t> hist(nc * bins, 0);
  each_chunk([&](int64_t c) {
    int32_t* h = hist.data() + c * bins;
    for (int64_t j = 0; j < cc[c].m; ++j) ++h[bin(cc[c].v[j])];
  });
  std::vector<int64_t> total(bins, 0);
  for (int64_t c = 0; c < nc; ++c)
    for (int64_t b = 0; b < bins; ++b) total[b] += hist[c * bins + b];
  int64_t pivot = bins - 1, above = 0;
  for (; pivot > 0 && above + total[pivot] < k; --pivot) above += total[pivot];
  const int64_t need = k - above;  // taken from the pivot bin, 1 <= need <= total[pivot]
  // The pivot bin's keys, chunk by chunk in index order, and the exact k-th key among them.
  std::vector<int64_t> piv_off(nc + 1, 0);
  for (int64_t c = 0; c < nc; ++c) piv_off[c] = hist[c * bins + pivot];
  exclusive_scan(piv_off.data(), nc + 1);
  std::vector<U> piv(total[pivot]);
  each_chunk([&](int64_t c) {
    int64_t q = piv_off[c];
    for (int64_t j = 0; j < cc[c].m; ++j)
      if (bin(cc[c].v[j]) == pivot) piv[q++] = Key<U>::of(cc[c].v[j]);
  });
  std::vector<U> sel(piv);
  std::nth_element(sel.begin(), sel.begin() + (need - 1), sel.end(), std::greater<U>());
  const U kth = sel[need - 1];
  int64_t ties_left = need;  // keys equal to kth are taken, lowest indices first
  for (const U key : piv) ties_left -= key > kth;
  // Per chunk: its share of the ties and where its output starts.
  std::vector<int64_t> ties(nc, 0), out_off(nc + 1, 0);
  for (int64_t c = 0; c < nc; ++c) {
    int64_t greater = 0, equal = 0;
    for (int64_t q = piv_off[c]; q < piv_off[c + 1]; ++q) {
      greater += piv[q] > kth;
      equal += piv[q] == kth;
    }
    ties[c] = std::min(equal, ties_left);
    ties_left -= ties[c];
    int64_t a = 0;
    for (int64_t b = pivot + 1; b < bins; ++b) a += hist[c * bins + b];
    out_off[c] = a + greater + ties[c];
  }
  exclusive_scan(out_off.data(), nc + 1);
  each_chunk([&](int64_t c) {
    int64_t tie = ties[c];
    emit_selected(cc[c].v, cc[c].p, cc[c].m, base + cc[c].begin, kth, tie, out_v, out_i,
                  out_off[c], out_off[c + 1]);
  });
}

// Inputs up to this size that are not filtered (below 256 values, k > n / 16, or the sample
// missed) are resolved whole, every element a candidate: bisection over all their keys,
// without the radix select's fixed costs (2048-bin histograms and their scans). Per call,
// 2 threads, new inputs each call: n = 64, k = 1: 2.7 -> 1.4 us; 1000, k = 500: 8.0 -> 2.9
// us; 4000, k = 2000: 19.6 -> 6.2 us; at 16000 (k = 1600) the two are level.
constexpr int64_t kResolveAll = 4096;

// The positions 0, 1, ..., kResolveAll - 1, built once: every element's, as a candidate.
inline const uint32_t* every_position() {
  static const std::array<uint32_t, kResolveAll> table = [] {
    std::array<uint32_t, kResolveAll> a{};
    for (int64_t i = 0; i < kResolveAll; ++i) a[i] = static_cast<uint32_t>(i);
    return a;
  }();
  return table.data();
}

// The exact top k of x[0, n) without a filter: resolved whole when small, else radix select.
template <typename U, typename I>
void select_whole(const U* x, int64_t n, int64_t k, U* out_v, I* out_i, int64_t base) {
  if (k > 0 && k < n && n <= kResolveAll) {
    resolve_candidates<U, I>({ChunkCandidates<U>{x, every_position(), n, 0}}, k, U(0), out_v,
                             out_i, base);
  } else {
    topk_bits<U, I>(x, n, k, out_v, out_i, base);
  }
}

// Exact top-k of src's n values into out_v/out_i (index order, positions base + i). After
// the call src.values() holds every value (the error-feedback source has written them).
template <typename U, typename I, typename Src>
void topk_filtered(const Src& src, int64_t n, int64_t k, U* out_v, I* out_i, int64_t base = 0) {
  U t = 0;
  int64_t expect = 0;
  // Filtering pays when the candidates are a small share of the input.
  if (k == 0 || k == n || k > n / 16 || !sample_key<U>(src, n, k, &t, &expect)) {
    src.materialize();
    select_whole<U, I>(src.values(), n, k, out_v, out_i, base);
    return;
  }
  const Chunks ch(n);
  const int64_t cap = (2 * expect) / ch.count + 4 * kBlock + 64;
  const Scratch<U> cv(0, cap * ch.count);
  const Scratch<uint32_t> cp(1, cap * ch.count);
  std::vector<int64_t> count(ch.count, 0);
  ch.for_each([&](int64_t c) {
    count[c] = src.filter(ch.begin(c), ch.end(c), t, cv.get() + c * cap, cp.get() + c * cap, cap);
  });
  int64_t total = 0;
  for (int64_t m : count) total += m;
  const U* x = src.values();
  if (total < k || total > 4 * expect + 4096) {  // the sample missed: select from everything
    select_whole<U, I>(x, n, k, out_v, out_i, base);
    return;
  }
  std::vector<ChunkCandidates<U>> cc(ch.count);
  bool overflowed = false;
  for (int64_t c = 0; c < ch.count; ++c) {
    cc[c] = {cv.get() + c * cap, cp.get() + c * cap, count[c], ch.begin(c)};
    overflowed |= count[c] > cap;
  }
  std::vector<std::vector<U>> more_v(ch.count);  // chunks that overflowed, recollected
  std::vector<std::vector<uint32_t>> more_p(ch.count);
  if (overflowed) {  // rare: no parallel region otherwise
    ch.for_each([&](int64_t c) {
      const int64_t m = count[c], b = ch.begin(c);
      if (m <= cap) return;
      more_v[c].resize(m);
      more_p[c].resize(m);
      filter_values(x + b, ch.end(c) - b, t, more_v[c].data(), more_p[c].data(), m);
      cc[c].v = more_v[c].data();
      cc[c].p = more_p[c].data();
    });
  }
  resolve_candidates<U, I>(cc, k, t, out_v, out_i, base);
}

// Runs fn(s) for segments s of [off[s], off[s+1]), s < nseg: a large segment uses every
// thread inside its own selection, the small ones run one per thread.
template <typename F>
void for_segments(const int64_t* off, int64_t nseg, const F& fn) {
  constexpr int64_t kLarge = int64_t(1) << 20;
  std::vector<int64_t> small;
  for (int64_t s = 0; s < nseg; ++s) {
    if (off[s + 1] - off[s] >= kLarge) fn(s); else small.push_back(s);
  }
  at::parallel_for(0, int64_t(small.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) fn(small[j]);
  });
}

}  // namespace cpu
}  // namespace ssf
