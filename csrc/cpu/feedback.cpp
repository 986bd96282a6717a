// Fused error-feedback selection on the CPU (ef_topk, segmented_ef_topk; ops.h).
//
// Error feedback around a top-k is, written as separate passes: acc = residual + grad
// (read 2, write 1), select from acc (read 1-2), zero the selected entries (k writes).
// Here the sum is computed inside the selection's filter pass (topk.h's source concept):
// each block of residual + grad is formed in registers, written back as the new residual
// and tested in the same loop, so the input is read once and the residual written once;
// the candidates' exact top k and the k residual updates are small. When the filter does
// not apply (k a large share of n, tiny inputs) the sum is written first and the radix
// select reads it: one pass more, same result.
#include "../checks.h"
#include "../ops.h"
#include "common.h"
#include "topk.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <type_traits>

namespace ssf {
namespace {

// Raw storage of an accumulation value (its magnitude key is these bits, sign cleared).
template <typename A>
using BitsOf = std::conditional_t<sizeof(A) == 4, uint32_t, uint16_t>;

// residual + grad in the residual's dtype: float32 adds exactly as torch does; a 16-bit
// residual adds in float32 and rounds once, as torch's CPU kernels do.
template <typename A, typename G>
inline A accumulate(A r, G g) {
  if constexpr (std::is_same_v<A, float> && std::is_same_v<G, float>) {
    return r + g;
  } else {
    return static_cast<A>(static_cast<float>(r) + static_cast<float>(g));
  }
}

// What the wire loses of a sent value a: zero when the wire carries A exactly, else
// a - (a rounded to W), the rounding error that stays in the residual (memory.py).
template <typename A, typename W>
inline A wire_error(A a) {
  if constexpr (std::is_same_v<A, W>) {
    return A(0);
  } else {
    const float f = static_cast<float>(a);
    return static_cast<A>(f - static_cast<float>(static_cast<W>(f)));
  }
}

#ifdef SSF_X86_DISPATCH
// The float32 error-feedback source's blocks for topk.h's AVX-512 filter: residual + grad
// formed in a register, stored back as the residual, and handed on as raw bits.
struct AddStoreBlock {
  const float* g;
  float* r;
  __attribute__((target("avx512f"))) __m512i operator()(int64_t i) const {
    const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(r + i), _mm512_loadu_ps(g + i));
    _mm512_storeu_ps(r + i, sum);
    return _mm512_castps_si512(sum);
  }
  // The block's values once formed: the residual holds them.
  __attribute__((target("avx512f"))) __m512i stored(int64_t i) const {
    return _mm512_loadu_si512(r + i);
  }
};
#endif

// The error-feedback source of topk.h: values residual[i] + grad[i], written back into
// the residual as the filter passes over them.
template <typename A, typename G>
struct Feedback {
  using U = BitsOf<A>;
  const G* g;
  A* r;
  int64_t n;

  static U bits(A a) {
    U u;
    std::memcpy(&u, &a, sizeof(U));
    return u;
  }
  U raw(int64_t i) const { return bits(accumulate(r[i], g[i])); }
  const U* values() const { return static_cast<const U*>(static_cast<const void*>(r)); }
  void materialize() const {
    at::parallel_for(0, n, int64_t(1) << 15, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) r[i] = accumulate(r[i], g[i]);
    });
  }
  int64_t filter(int64_t b, int64_t e, U t, U* cv, uint32_t* cp, int64_t cap) const {
    int64_t m = 0, i = b;
#ifdef SSF_X86_DISPATCH
    if constexpr (std::is_same_v<A, float> && std::is_same_v<G, float>) {
      if (cpu::use_avx512()) {
        m = cpu::filter_blocks_avx512(AddStoreBlock{g + b, r + b}, e - b, t, cv, cp, cap);
        i = b + ((e - b) & ~int64_t(15));
      }
    }
#endif
    constexpr int B = cpu::kBlock;
    A sum[B];
    U ub[B];
    for (; i + B <= e; i += B) {
      for (int j = 0; j < B; ++j) sum[j] = accumulate(r[i + j], g[i + j]);
      for (int j = 0; j < B; ++j) r[i + j] = sum[j];
      std::memcpy(ub, sum, sizeof(ub));
      const uint32_t hits = cpu::block_hits(ub, t);
      if (hits) m = cpu::append_hits(ub, hits, i - b, cv, cp, m, cap);
    }
    for (; i < e; ++i) {
      const A a = accumulate(r[i], g[i]);
      r[i] = a;
      const U u = bits(a);
      m = cpu::append_tail(&u, 1, t, i - b, cv, cp, m, cap);
    }
    return m;
  }
};

// One segment: residual[0, len) += grad, its top k into out (positions base + i), and the
// selected entries of the residual replaced by their wire error.
template <typename A, typename G, typename W, typename I>
void ef_segment(const G* g, A* r, int64_t len, int64_t k, BitsOf<A>* out_v, I* out_i,
                int64_t base) {
  using U = BitsOf<A>;
  cpu::topk_filtered<U, I>(Feedback<A, G>{g, r, len}, len, k, out_v, out_i, base);
  at::parallel_for(0, k, int64_t(1) << 14, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      A a;
      std::memcpy(&a, out_v + j, sizeof(U));
      r[int64_t(out_i[j]) - base] = wire_error<A, W>(a);
    }
  });
}

// residual[lo, hi) += grad[lo, hi): the part of a segmented call no segment covers.
template <typename A, typename G>
void accumulate_range(const G* g, A* r, int64_t lo, int64_t hi) {
  if (hi > lo) Feedback<A, G>{g + lo, r + lo, hi - lo}.materialize();
}

// Calls fn(A{}) with the C++ type of a value dtype.
template <typename F>
void dispatch_value(at::ScalarType t, const F& fn) {
  if (t == at::kFloat) fn(float{});
  else if (t == at::kHalf) fn(c10::Half{});
  else fn(c10::BFloat16{});
}

// Calls fn(A{}, G{}, W{}, I{}) for the checked (check_feedback) dtypes of an error-feedback
// op: a 16-bit residual has gradient and wire of its own dtype, so only the float32
// residual mixes.
template <typename F>
void dispatch_feedback(const at::Tensor& grad, const at::Tensor& residual, at::ScalarType wire,
                       at::ScalarType idt, const F& fn) {
  dispatch_value(residual.scalar_type(), [&](auto a_tag) {
    using A = decltype(a_tag);
    dispatch_value(grad.scalar_type(), [&](auto g_tag) {
      using G = decltype(g_tag);
      dispatch_value(wire, [&](auto w_tag) {
        using W = decltype(w_tag);
        if constexpr (std::is_same_v<A, float> ||
                      (std::is_same_v<A, G> && std::is_same_v<A, W>)) {
          dispatch_index(idt, [&](auto i_tag) { fn(a_tag, g_tag, w_tag, i_tag); });
        }
      });
    });
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> ef_topk_cpu(const at::Tensor& grad_in, at::Tensor& residual,
                                               int64_t k, at::ScalarType wire_dtype) {
  const at::Tensor grad = check_feedback(grad_in, residual, wire_dtype, "ef_topk", at::kCPU);
  const int64_t n = grad.numel();
  check_k(k, 0, n, "ef_topk");
  const auto idt = index_dtype_for(n);
  at::Tensor values = at::empty({k}, residual.options());
  at::Tensor indices = at::empty({k}, residual.options().dtype(idt));
  dispatch_feedback(grad, residual, wire_dtype, idt, [&](auto a, auto g, auto w, auto i) {
    using A = decltype(a);
    using I = decltype(i);
    ef_segment<A, decltype(g), decltype(w), I>(
        static_cast<const decltype(g)*>(grad.const_data_ptr()),
        static_cast<A*>(residual.data_ptr()), n, k,
        static_cast<BitsOf<A>*>(values.data_ptr()), indices.data_ptr<I>(), 0);
  });
  return {values, indices};
}

std::tuple<at::Tensor, at::Tensor> segmented_ef_topk_cpu(const at::Tensor& grad_in,
                                                         at::Tensor& residual,
                                                         const at::Tensor& offsets_in,
                                                         const at::Tensor& ks_in,
                                                         at::ScalarType wire_dtype) {
  const at::Tensor grad =
      check_feedback(grad_in, residual, wire_dtype, "segmented_ef_topk", at::kCPU);
  const at::Tensor offsets = offsets_in.to(at::kLong).contiguous();
  const at::Tensor ks = ks_in.to(at::kLong).contiguous();
  const int64_t nseg = ks.numel(), n = grad.numel();
  const std::vector<int64_t> out_off = check_segments(offsets, ks, n);
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  const int64_t* kp = ks.const_data_ptr<int64_t>();
  const auto idt = index_dtype_for(n);
  at::Tensor values = at::empty({out_off[nseg]}, residual.options());
  at::Tensor indices = at::empty({out_off[nseg]}, residual.options().dtype(idt));
  dispatch_feedback(grad, residual, wire_dtype, idt, [&](auto a, auto g, auto w, auto i) {
    using A = decltype(a);
    using G = decltype(g);
    using I = decltype(i);
    const G* pg = static_cast<const G*>(grad.const_data_ptr());
    A* pr = static_cast<A*>(residual.data_ptr());
    auto* pv = static_cast<BitsOf<A>*>(values.data_ptr());
    I* pi = indices.data_ptr<I>();
    // Elements outside every segment are accumulated and kept.
    accumulate_range(pg, pr, 0, nseg ? off[0] : n);
    if (nseg) accumulate_range(pg, pr, off[nseg], n);
    cpu::for_segments(off, nseg, [&](int64_t s) {
      ef_segment<A, G, decltype(w), I>(pg + off[s], pr + off[s], off[s + 1] - off[s], kp[s],
                                       pv + out_off[s], pi + out_off[s], off[s]);
    });
  });
  return {values, indices};
}

}  // namespace ssf
