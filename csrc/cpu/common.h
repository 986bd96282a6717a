// Helpers shared by the CPU kernels: magnitude keys and chunked parallel loops.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace ssf {
namespace cpu {

// Raw storage of a value: the magnitude key is its bits without the sign bit, which orders
// |x| like IEEE for numbers and puts NaN above +Inf (ops.h).
template <typename U>
struct Key {
  static_assert(std::is_unsigned<U>::value, "raw bits must be unsigned");
  static constexpr int kBits = int(sizeof(U)) * 8 - 1;
  static constexpr U kMask = static_cast<U>(static_cast<U>(~U(0)) >> 1);
  static inline U of(U raw) { return static_cast<U>(raw & kMask); }
};

// A fixed split of [0, n) into chunks, a few per thread, so that per-chunk partial results
// (histograms, counts) can be combined in chunk order: the output never depends on the
// number of threads that ran.
struct Chunks {
  int64_t n = 0, size = 1, count = 0;
  Chunks(int64_t n_, int64_t min_chunk = int64_t(1) << 15) : n(n_) {
    if (n <= 0) return;
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    count = std::max<int64_t>(1, std::min<int64_t>(threads * 4, (n + min_chunk - 1) / min_chunk));
    size = (n + count - 1) / count;
    size = std::min<int64_t>(size, int64_t(1) << 30);  // per-chunk counts fit in int32
    count = (n + size - 1) / size;
  }
  int64_t begin(int64_t c) const { return c * size; }
  int64_t end(int64_t c) const { return std::min(n, (c + 1) * size); }
  // Runs fn(chunk) for every chunk, in parallel over chunks.
  template <typename F>
  void for_each(const F& fn) const {
    at::parallel_for(0, count, 1, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) fn(c);
    });
  }
};

// Exclusive prefix sum in place; returns the total.
template <typename T>
inline T exclusive_scan(T* a, int64_t n) {
  T run = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T v = a[i];
    a[i] = run;
    run += v;
  }
  return run;
}

}  // namespace cpu
}  // namespace ssf
