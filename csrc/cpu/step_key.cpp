// Adam's pending step as a selection key, fused with the error feedback's sum, on the CPU
// (ef_step_key_cpu; ops.h has the contract).
//
// Written as torch ops the key costs a pass per operation: the group's exp_avg_sq copied
// into one buffer, a division, a square root, an addition, the residual's sum, a
// division and an absolute value, each reading and writing the group's size (GPT-2 as one
// group on 2 cores: 270 ms against the magnitude kernel's 51). Here one pass reads the
// gradient, the residual and v where they lie and writes the residual and the key; the
// top-k then reads the key with the magnitude kernels (keys are >= 0, so their magnitude
// order is the key's order).
#include "../checks.h"
#include "../ops.h"
#include "topk.h"  // SSF_X86_DISPATCH, cpu::use_avx512

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace ssf {
namespace {

// One tensor's range [0, n): r += g, key = |r| / (sqrt(v) / b + e). Each operation rounds
// once, in moments.h's order for the denominator (the module is built with
// -ffp-contract=off). The square root is the instruction's, correctly rounded; written
// with intrinsics because std::sqrt keeps errno's semantics, which stops the compiler
// from vectorizing the loop (it ran at a fifth of the memory's speed).
void key_range_scalar(float* r, const float* g, const float* v, float* out, int64_t n, float b,
                      float e) {
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 bv = _mm_set1_ps(b), ev = _mm_set1_ps(e);
  const __m128 sign = _mm_set1_ps(-0.0f);
  for (; i + 4 <= n; i += 4) {
    const __m128 acc = _mm_add_ps(_mm_loadu_ps(r + i), _mm_loadu_ps(g + i));
    _mm_storeu_ps(r + i, acc);
    const __m128 den = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(_mm_loadu_ps(v + i)), bv), ev);
    _mm_storeu_ps(out + i, _mm_div_ps(_mm_andnot_ps(sign, acc), den));
  }
#endif
  for (; i < n; ++i) {
    const float acc = r[i] + g[i];
    r[i] = acc;
    out[i] = std::fabs(acc) / (std::sqrt(v[i]) / b + e);
  }
}

#ifdef SSF_X86_DISPATCH
__attribute__((target("avx512f"))) void key_range_avx512(float* r, const float* g,
                                                         const float* v, float* out, int64_t n,
                                                         float b, float e) {
  const __m512 bv = _mm512_set1_ps(b), ev = _mm512_set1_ps(e);
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 acc = _mm512_add_ps(_mm512_loadu_ps(r + i), _mm512_loadu_ps(g + i));
    _mm512_storeu_ps(r + i, acc);
    const __m512 den = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(_mm512_loadu_ps(v + i)), bv), ev);
    const __m512 mag = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(acc), magnitude));
    _mm512_storeu_ps(out + i, _mm512_div_ps(mag, den));
  }
  key_range_scalar(r + i, g + i, v + i, out + i, n - i, b, e);
}
#endif

void key_range(float* r, const float* g, const float* v, float* out, int64_t n, float b, float e) {
#ifdef SSF_X86_DISPATCH
  if (cpu::use_avx512()) return key_range_avx512(r, g, v, out, n, b, e);
#endif
  key_range_scalar(r, g, v, out, n, b, e);
}

}  // namespace


void ef_step_key_cpu(const std::vector<at::Tensor>& grads, at::Tensor& residual,
                     const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::vector<double>& bias2_sqrt, double eps, at::Tensor& key) {
  const char* op = "ef_step_key";
  const size_t nseg = grads.size();
  TORCH_CHECK(nseg >= 1, op, ": no tensors");
  TORCH_CHECK(exp_avg_sqs.size() == nseg && bias2_sqrt.size() == nseg, op, ": ", nseg,
              " gradients, ", exp_avg_sqs.size(), " exp_avg_sq tensors and ", bias2_sqrt.size(),
              " bias corrections (one of each per tensor)");
  check_moment_lists({grads, exp_avg_sqs}, op, at::kCPU);
  for (const at::Tensor* t : {&residual, &key}) {
    TORCH_CHECK(t->device().type() == at::kCPU && t->scalar_type() == at::kFloat &&
                    t->is_contiguous(),
                op, ": residual and key must be contiguous float32 CPU tensors");
  }
  std::vector<int64_t> off(nseg + 1, 0);
  for (size_t s = 0; s < nseg; ++s) off[s + 1] = off[s] + grads[s].numel();
  const int64_t n = off[nseg];
  TORCH_CHECK(residual.numel() == n && key.numel() == n, op, ": the tensors hold ", n,
              " elements, the residual ", residual.numel(), " and the key ", key.numel(),
              " (the tensors must tile both)");
  float* r = residual.data_ptr<float>();
  float* out = key.data_ptr<float>();
  std::vector<const float*> g(nseg), v(nseg);
  std::vector<float> b(nseg);
  for (size_t s = 0; s < nseg; ++s) {
    g[s] = grads[s].const_data_ptr<float>();
    v[s] = exp_avg_sqs[s].const_data_ptr<float>();
    b[s] = float(bias2_sqrt[s]);
  }
  const float e = float(eps);
  at::parallel_for(0, n, int64_t(1) << 15, [&](int64_t lo, int64_t hi) {
    // the pieces [off[s], off[s + 1]) this range covers; empty tensors cover none
    for (int64_t s = std::upper_bound(off.begin(), off.end(), lo) - off.begin() - 1;
         s < int64_t(nseg) && off[s] < hi; ++s) {
      const int64_t b0 = std::max(lo, off[s]), b1 = std::min(hi, off[s + 1]);
      key_range(r + b0, g[s] + (b0 - off[s]), v[s] + (b0 - off[s]), out + b0, b1 - b0, b[s], e);
    }
  });
}

}  // namespace ssf
