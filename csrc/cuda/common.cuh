// Helpers shared by the raw kernels of csrc/cuda/*.cu (the CUDA counterpart of
// csrc/cpu/common.h): workspace carving, launch grids, an iota kernel, explicit
// instantiation lists. No torch here.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace ssf {
namespace cuda {

// Carves 256-byte aligned regions out of a caller-provided workspace, in order; with
// base == nullptr it only counts, so *_workspace_bytes() and the op carve the same layout.
// `off` is the number of bytes carved so far.
struct Carver {
  char* base;
  size_t off = 0;
  explicit Carver(void* b) : base(static_cast<char*>(b)) {}
  template <typename T>
  T* take(size_t count) {
    off = (off + 255) / 256 * 256;
    T* p = base ? reinterpret_cast<T*>(base + off) : nullptr;
    off += count * sizeof(T);
    return p;
  }
  // Throws unless a workspace was given and its `bytes` hold everything carved so far.
  void require(size_t bytes, const char* op) const {
    if (base == nullptr || bytes < off)
      throw std::runtime_error(std::string("ssfusion_hvd CUDA ") + op + ": workspace too small");
  }
};

// Blocks of `threads` threads covering n elements, at least 1 and at most max_blocks (the
// kernels loop with a grid stride beyond that).
inline unsigned int grid_for(int64_t n, int threads, int64_t max_blocks) {
  const int64_t b = (n + threads - 1) / threads;
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(b, max_blocks)));
}

// out[i] = i for i < n (grid-stride loop). Internal linkage: every .cu compiles its own
// copy, as when each defined it.
namespace {
template <typename T>
__global__ void iota_kernel(T* __restrict__ out, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = static_cast<T>(i);
}
}  // namespace

// The types every raw op is instantiated for: value bits U (16-bit: float16/bfloat16,
// 32-bit: float32) and index type I. M is a macro taking (U), (I) or (U, I).
#define SSF_FOR_EACH_U(M) M(uint16_t) M(uint32_t)
#define SSF_FOR_EACH_I(M) M(int32_t) M(int64_t)
#define SSF_FOR_EACH_UI(M) \
  M(uint16_t, int32_t) M(uint16_t, int64_t) M(uint32_t, int32_t) M(uint32_t, int64_t)

}  // namespace cuda
}  // namespace ssf
