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

// One tensor's range [0, n): with KEY, r += g and out = |r| / (sqrt(v) / b + e); without,
// out = sqrt(v) / b + e, the denominator alone (SparDL's and ExDyna's selections divide
// partial sums by it). With ROOT the denominator is square-rooted first (the key by the
// gain, ops.h). Each operation rounds once, in moments.h's order for the
// denominator (the module is built with -ffp-contract=off). The square root is the
// instruction's, correctly rounded; written with intrinsics because std::sqrt keeps
// errno's semantics, which stops the compiler from vectorizing the loop (it ran at a fifth
// of the memory's speed).
template <bool KEY, bool ROOT>
void range_scalar(float* r, const float* g, const float* v, float* out, int64_t n, float b,
                  float e) {
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 bv = _mm_set1_ps(b), ev = _mm_set1_ps(e);
  const __m128 sign = _mm_set1_ps(-0.0f);
  for (; i + 4 <= n; i += 4) {
    __m128 den = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(_mm_loadu_ps(v + i)), bv), ev);
    if constexpr (ROOT) den = _mm_sqrt_ps(den);
    if constexpr (KEY) {
      const __m128 acc = _mm_add_ps(_mm_loadu_ps(r + i), _mm_loadu_ps(g + i));
      _mm_storeu_ps(r + i, acc);
      _mm_storeu_ps(out + i, _mm_div_ps(_mm_andnot_ps(sign, acc), den));
    } else {
      _mm_storeu_ps(out + i, den);
    }
  }
#endif
  for (; i < n; ++i) {
    float den = std::sqrt(v[i]) / b + e;
    if constexpr (ROOT) den = std::sqrt(den);
    if constexpr (KEY) {
      const float acc = r[i] + g[i];
      r[i] = acc;
      out[i] = std::fabs(acc) / den;
    } else {
      out[i] = den;
    }
  }
}

#ifdef SSF_X86_DISPATCH
template <bool KEY, bool ROOT>
__attribute__((target("avx512f"))) void range_avx512(float* r, const float* g, const float* v,
                                                     float* out, int64_t n, float b, float e) {
  const __m512 bv = _mm512_set1_ps(b), ev = _mm512_set1_ps(e);
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 den = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(_mm512_loadu_ps(v + i)), bv), ev);
    if constexpr (ROOT) den = _mm512_sqrt_ps(den);
    if constexpr (KEY) {
      const __m512 acc = _mm512_add_ps(_mm512_loadu_ps(r + i), _mm512_loadu_ps(g + i));
      _mm512_storeu_ps(r + i, acc);
      const __m512 mag = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(acc), magnitude));
      _mm512_storeu_ps(out + i, _mm512_div_ps(mag, den));
    } else {
      _mm512_storeu_ps(out + i, den);
    }
  }
  range_scalar<KEY, ROOT>(KEY ? r + i : r, KEY ? g + i : g, v + i, out + i, n - i, b, e);
}
#endif

template <bool KEY, bool ROOT>
void range(float* r, const float* g, const float* v, float* out, int64_t n, float b, float e) {
#ifdef SSF_X86_DISPATCH
  if (cpu::use_avx512()) return range_avx512<KEY, ROOT>(r, g, v, out, n, b, e);
#endif
  range_scalar<KEY, ROOT>(r, g, v, out, n, b, e);
}

// The checked tiling of exp_avg_sqs (with KEY, grads alike) over `out` (and the residual),
// then range<KEY, root> over it in parallel, each thread's span split at the tensors' bounds.
template <bool KEY>
void over_tensors(const char* op, const std::vector<at::Tensor>* grads, at::Tensor* residual,
                  const std::vector<at::Tensor>& exp_avg_sqs,
                  const std::vector<double>& bias2_sqrt, double eps, at::Tensor& out,
                  bool root) {
  const std::vector<int64_t> off =
      check_step_key(op, grads, residual, exp_avg_sqs, bias2_sqrt, out, at::kCPU);
  const size_t nseg = exp_avg_sqs.size();
  const int64_t n = off[nseg];
  float* r = KEY ? residual->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  std::vector<const float*> g(nseg, nullptr), v(nseg);
  std::vector<float> b(nseg);
  for (size_t s = 0; s < nseg; ++s) {
    if constexpr (KEY) g[s] = (*grads)[s].const_data_ptr<float>();
    v[s] = exp_avg_sqs[s].const_data_ptr<float>();
    b[s] = float(bias2_sqrt[s]);
  }
  const float e = float(eps);
  at::parallel_for(0, n, int64_t(1) << 15, [&](int64_t lo, int64_t hi) {
    // the pieces [off[s], off[s + 1]) this range covers; empty tensors cover none
    for (int64_t s = std::upper_bound(off.begin(), off.end(), lo) - off.begin() - 1;
         s < int64_t(nseg) && off[s] < hi; ++s) {
      const int64_t b0 = std::max(lo, off[s]), b1 = std::min(hi, off[s + 1]);
      float* rs = KEY ? r + b0 : nullptr;
      const float* gs = KEY ? g[s] + (b0 - off[s]) : nullptr;
      if (root)
        range<KEY, true>(rs, gs, v[s] + (b0 - off[s]), o + b0, b1 - b0, b[s], e);
      else
        range<KEY, false>(rs, gs, v[s] + (b0 - off[s]), o + b0, b1 - b0, b[s], e);
    }
  });
}

}  // namespace


void ef_step_key_cpu(const std::vector<at::Tensor>& grads, at::Tensor& residual,
                     const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::vector<double>& bias2_sqrt, double eps, at::Tensor& key,
                     bool root) {
  over_tensors<true>("ef_step_key", &grads, &residual, exp_avg_sqs, bias2_sqrt, eps, key, root);
}

void step_denominator_cpu(const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<double>& bias2_sqrt, double eps, at::Tensor& out,
                          bool root) {
  over_tensors<false>("step_denominator", nullptr, nullptr, exp_avg_sqs, bias2_sqrt, eps, out,
                      root);
}

}  // namespace ssf
