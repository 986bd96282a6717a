// DGC's sampled threshold (sampled_threshold in ops.h): how many elements are sampled, which
// positions, and which rank of the sample estimates the k-th largest of n. Defined here once
// for the CPU (csrc/cpu/select.cpp) and CUDA (csrc/cuda/segmented.cu) kernels, so both sample
// the same positions; ssfusion_hvd/ops.py mirrors sample_position() on int64 tensors for the
// torch fallback. No ATen here, so the raw CUDA kernels can include it.
//
// Positions: stratified jittered sampling. The n elements are cut into `samples` strata
//   stratum j = [lo_j, lo_{j+1}),  lo_j = floor(j * n / samples)
// (each at least one element wide since samples <= n), and sample j is drawn uniformly from
// stratum j by a counter-based hash of (seed, j):
//   s     = fmix64(seed + 0x9E3779B97F4A7C15)          (hash.h's round_seed(seed, 0))
//   h_j   = fmix64(uint64(j) ^ s)
//   pos_j = lo_j + (h_j >> 1) % (lo_{j+1} - lo_j)
// No RNG state: every backend and every rank computes the same positions from the same seed,
// and a different seed gives different positions. A fixed stride (the former x[(j*n)/samples])
// aliases with weight layouts: with the stride equal to a row length it reads one column
// only, and a gradient whose large entries sit in other columns is then estimated far too
// low. The jitter breaks every such periodicity while the strata keep the sample spread over
// the whole tensor. lo_j is computed as j*q + (j*r)/samples (n = q*samples + r, r < samples),
// which overflows no int64 for any n and samples < 2^31; the modulo takes the 63 high bits
// of h_j so the torch mirror works on non-negative int64 (its bias, width / 2^63, is nil).
#pragma once

#include "hash.h"  // fmix64, round_seed, SSF_HOST_DEVICE

#include <algorithm>
#include <cstdint>

namespace ssf {
namespace sampling {

// The number of samples taken from n elements: `samples` clamped to [1, n].
inline int64_t clamp_samples(int64_t n, int64_t samples) {
  return std::max<int64_t>(1, std::min(samples, n));
}

// The ceil(k * samples / n)-th largest sample (at least the first) estimates the k-th
// largest of n.
inline int64_t sample_rank(int64_t n, int64_t k, int64_t samples) {
  return std::max<int64_t>(1, (k * samples + n - 1) / n);
}

// The hash stream s of a call with `seed` (computed once per call, passed to the kernels).
SSF_HOST_DEVICE uint64_t sample_stream(uint64_t seed) { return hashing::round_seed(seed, 0); }

// floor(j * n / samples) without forming j * n (0 <= j <= samples, 1 <= samples <= n).
SSF_HOST_DEVICE int64_t stratum_begin(int64_t n, int64_t samples, int64_t j) {
  const int64_t q = n / samples, r = n % samples;
  return j * q + (j * r) / samples;
}

// Position of sample j (0 <= j < samples, samples already clamped to [1, n]) in [0, n): a
// uniform draw from stratum j by the hash stream s = sample_stream(seed).
SSF_HOST_DEVICE int64_t sample_position(int64_t n, int64_t samples, int64_t j, uint64_t s) {
  const int64_t lo = stratum_begin(n, samples, j);
  const uint64_t width = static_cast<uint64_t>(stratum_begin(n, samples, j + 1) - lo);
  const uint64_t h = hashing::fmix64(static_cast<uint64_t>(j) ^ s);
  return lo + static_cast<int64_t>((h >> 1) % width);
}

}  // namespace sampling
}  // namespace ssf
