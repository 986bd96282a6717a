// Shared moments on CUDA (see kernels.cuh): the element's arithmetic is csrc/moments.h's,
// the same code as the CPU's; and the key of the selection by Adam's pending step. A batch
// of tensors is one launch: blockIdx.y picks the tensor, a grid-stride loop over x covers
// its elements, so a model's many small tensors cost a launch per batch of them rather
// than one each.
#include "../moments.h"
#include "kernels.cuh"

#include <algorithm>

namespace ssf {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocksX = 1024;

__global__ void momentum_kernel(const MomentBatch batch, const moments::MomentumArgs args) {
  const int t = blockIdx.y;
  const int64_t n = batch.n[t];
  float* p = batch.p[t];
  const float* g = batch.g[t];
  float* u = batch.s1[t];
  float* age = batch.age[t];
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += int64_t(gridDim.x) * blockDim.x) {
    float pj = p[j], uj = u[j], aj = age[j];
    moments::momentum_element(pj, g[j], uj, aj, args);
    p[j] = pj;
    u[j] = uj;
    age[j] = aj;
  }
}

__global__ void adam_kernel(const MomentBatch batch, const float lr, const float beta1,
                            const float beta2, const float eps) {
  const int t = blockIdx.y;
  const int64_t n = batch.n[t];
  const moments::AdamArgs args{lr, beta1, beta2, eps, batch.bias1[t], batch.bias2_sqrt[t]};
  float* p = batch.p[t];
  const float* g = batch.g[t];
  float* m = batch.s1[t];
  float* v = batch.s2[t];
  float* age = batch.age[t];
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += int64_t(gridDim.x) * blockDim.x) {
    float pj = p[j], mj = m[j], vj = v[j], aj = age[j];
    moments::adam_element(pj, g[j], mj, vj, aj, args);
    p[j] = pj;
    m[j] = mj;
    v[j] = vj;
    age[j] = aj;
  }
}

// The key of the selection by the pending step (ops.h): the denominator is adam_element's,
// sqrt(v) / bias2_sqrt + eps, and the key divides the error feedback's sum by it. Plain
// float operations, each rounded once: nvcc's defaults keep division and square root IEEE
// (-prec-div, -prec-sqrt) and there is no product to contract, so the bits are the CPU
// kernel's (csrc/cpu/step_key.cpp) and the torch composition's. ROOT: the denominator's
// square root (the key by the gain).
template <bool KEY, bool ROOT>
__global__ void step_key_kernel(const KeyBatch batch, float* residual, float* out,
                                const float eps) {
  const int t = blockIdx.y;
  const int64_t n = batch.n[t];
  const float b = batch.bias2_sqrt[t];
  const float* v = batch.v[t];
  const float* g = batch.g[t];
  float* r = KEY ? residual + batch.off[t] : nullptr;
  float* o = out + batch.off[t];
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += int64_t(gridDim.x) * blockDim.x) {
    float den = sqrtf(v[j]) / b + eps;
    if (ROOT) den = sqrtf(den);
    if (KEY) {
      const float acc = r[j] + g[j];
      r[j] = acc;
      o[j] = fabsf(acc) / den;
    } else {
      o[j] = den;
    }
  }
}

template <class Batch>
dim3 grid_of(const Batch& batch) {
  int64_t most = 1;
  for (int i = 0; i < batch.count; ++i) most = std::max(most, batch.n[i]);
  const int64_t blocks = std::min<int64_t>(kMaxBlocksX, (most + kThreads - 1) / kThreads);
  return dim3(unsigned(blocks), unsigned(batch.count));
}

}  // namespace

void shared_momentum(const MomentBatch& batch, float lr, float momentum, float dampening,
                     bool nesterov, cudaStream_t stream) {
  if (batch.count == 0) return;
  momentum_kernel<<<grid_of(batch), kThreads, 0, stream>>>(
      batch, moments::MomentumArgs{lr, momentum, dampening, nesterov});
  SSF_CUDA_CHECK_LAUNCH();
}

void shared_adam(const MomentBatch& batch, float lr, float beta1, float beta2, float eps,
                 cudaStream_t stream) {
  if (batch.count == 0) return;
  adam_kernel<<<grid_of(batch), kThreads, 0, stream>>>(batch, lr, beta1, beta2, eps);
  SSF_CUDA_CHECK_LAUNCH();
}

void step_key(const KeyBatch& batch, float* residual, float* out, float eps, bool root,
              cudaStream_t stream) {
  if (batch.count == 0) return;
  const dim3 grid = grid_of(batch);
  if (residual != nullptr && root)
    step_key_kernel<true, true><<<grid, kThreads, 0, stream>>>(batch, residual, out, eps);
  else if (residual != nullptr)
    step_key_kernel<true, false><<<grid, kThreads, 0, stream>>>(batch, residual, out, eps);
  else if (root)
    step_key_kernel<false, true><<<grid, kThreads, 0, stream>>>(batch, nullptr, out, eps);
  else
    step_key_kernel<false, false><<<grid, kThreads, 0, stream>>>(batch, nullptr, out, eps);
  SSF_CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace ssf
