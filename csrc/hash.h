// The hash functions of ZEN's hierarchical hashing (csrc/cpu/hash.cpp, csrc/cuda/hash.cu and
// the pure-torch fallback in ssfusion_hvd/ops.py compute exactly these; no ATen here, so the
// raw CUDA kernels can include it).
//
//   round seed  s_i = fmix64(seed + (i + 1) * 0x9E3779B97F4A7C15)        (all mod 2^64)
//   hash        h_i(idx) = fmix64(uint64(int64(idx)) ^ s_i)
//   range       [m] by the high 32 bits: ((h >> 32) * m) >> 32           (m < 2^31)
//
// h_0 picks the partition (the first level, identical on every rank for the same seed);
// h_1..h_k pick slots inside the partition's parallel memory (the second level).
// fmix64 is MurmurHash3's 64-bit finalizer (the paper uses MurmurHash with per-function
// seeds); it is a bijection, so distinct keys never collide before the range reduction.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SSF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SSF_HOST_DEVICE inline
#endif

namespace ssf {
namespace hashing {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kMix1 = 0xFF51AFD7ED558CCDULL;
constexpr uint64_t kMix2 = 0xC4CEB9FE1A85EC53ULL;
// Largest partition count / table size: the range reduction multiplies 32-bit numbers.
constexpr int64_t kMaxRange = 0x7FFFFFFF;
// Most second-level hash functions (rounds) accepted.
constexpr int64_t kMaxRounds = 64;

SSF_HOST_DEVICE uint64_t fmix64(uint64_t h) {
  h ^= h >> 33;
  h *= kMix1;
  h ^= h >> 33;
  h *= kMix2;
  h ^= h >> 33;
  return h;
}

// Seed of hash function i (0 = the partition hash h_0).
SSF_HOST_DEVICE uint64_t round_seed(uint64_t seed, int64_t i) {
  return fmix64(seed + uint64_t(i + 1) * kGolden);
}

// h(idx) reduced to [0, m).
SSF_HOST_DEVICE int64_t hash_to(int64_t idx, uint64_t s, int64_t m) {
  const uint64_t h = fmix64(static_cast<uint64_t>(idx) ^ s);
  return static_cast<int64_t>(((h >> 32) * static_cast<uint64_t>(m)) >> 32);
}

}  // namespace hashing
}  // namespace ssf
