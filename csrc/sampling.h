// DGC's sampled threshold (sampled_threshold in ops.h): how many elements are sampled and
// which rank of the sample estimates the k-th largest of n. Defined here once for the CPU
// (csrc/cpu/select.cpp) and CUDA (csrc/cuda/segmented.cu) kernels, so both estimate alike
// (sample j is element (j * n) / samples on both). No ATen here, so the raw CUDA kernels can
// include it.
#pragma once

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

}  // namespace sampling
}  // namespace ssf
