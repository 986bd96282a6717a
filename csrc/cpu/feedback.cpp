// Fused error-feedback selection on the CPU (ef_topk, segmented_ef_topk, group_ef_topk;
// ops.h).
//
// Error feedback around a top-k is, written as separate passes: acc = residual + grad
// (read 2, write 1), select from acc (read 1-2), zero the selected entries (k writes).
// Here the sum is computed inside the selection's filter pass (topk.h's source concept):
// each block of residual + grad is formed in registers, written back as the new residual
// and tested in the same loop, so the input is read once and the residual written once;
// the candidates' exact top k and the k residual updates are small. When the filter does
// not apply (k a large share of n, tiny inputs) the sum is written first and the radix
// select reads it: one pass more, same result.
//
// With a DGC velocity (momentum correction) the same pass first forms velocity * m + grad,
// writes it back as the velocity and adds it into the residual: gradient, velocity and
// residual read once, velocity and residual written once, where torch's mul_, add_ and the
// error feedback make three passes; the sent entries of the velocity are cleared with the
// residual's. The product and the sum round separately, as torch's two ops do: the module
// is compiled with -ffp-contract=off, so no multiply-add is ever fused.
#include "../checks.h"
#include "../ops.h"
#include "common.h"
#include "topk.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

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

// velocity * m + grad for velocity and gradient of the residual's dtype A: the product
// rounded to A, then the sum rounded to A (velocity.mul_(m).add_(grad); 16-bit values
// computed in float32, as torch's CPU kernels do).
template <typename A>
inline A momentum_step(A u, A g, float m) {
  if constexpr (std::is_same_v<A, float>) {
    const float p = u * m;
    return p + g;
  } else {
    const A p = static_cast<A>(static_cast<float>(u) * m);
    return static_cast<A>(static_cast<float>(p) + static_cast<float>(g));
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

// The same with a DGC velocity: u = v * m + g (two roundings) stored back into v, then
// residual + u.
struct MomentumAddStoreBlock {
  const float* g;
  float* v;
  float* r;
  float m;
  __attribute__((target("avx512f"))) __m512i operator()(int64_t i) const {
    const __m512 u = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(v + i), _mm512_set1_ps(m)),
                                   _mm512_loadu_ps(g + i));
    _mm512_storeu_ps(v + i, u);
    const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(r + i), u);
    _mm512_storeu_ps(r + i, sum);
    return _mm512_castps_si512(sum);
  }
  __attribute__((target("avx512f"))) __m512i stored(int64_t i) const {
    return _mm512_loadu_si512(r + i);
  }
};
#endif

// The error-feedback source of topk.h: values residual[i] + grad[i] (MOM: residual[i] +
// the new velocity v[i] * m + grad[i]), written back into the residual (and the velocity)
// as the filter passes over them.
template <typename A, typename G, bool MOM>
struct Feedback {
  static_assert(!MOM || std::is_same_v<A, G>, "a velocity has the residual's dtype");
  using U = BitsOf<A>;
  const G* g;
  A* r;
  int64_t n;
  A* v = nullptr;  // MOM: the velocity
  float m = 0.f;   // MOM: the momentum

  static U bits(A a) {
    U u;
    std::memcpy(&u, &a, sizeof(U));
    return u;
  }
  // MOM: the new velocity at i, what is added into the residual (instantiated only then).
  A velocity(int64_t i) const { return momentum_step(v[i], g[i], m); }
  A sum(int64_t i) const {
    if constexpr (MOM) return accumulate(r[i], velocity(i));
    else return accumulate(r[i], g[i]);
  }
  // Writes position i's new velocity (MOM) and residual; returns the residual.
  A write(int64_t i) const {
    if constexpr (MOM) {
      const A u = velocity(i);
      v[i] = u;
      return r[i] = accumulate(r[i], u);
    } else {
      return r[i] = accumulate(r[i], g[i]);
    }
  }
  U raw(int64_t i) const { return bits(sum(i)); }
  const U* values() const { return static_cast<const U*>(static_cast<const void*>(r)); }
  void materialize() const {
    at::parallel_for(0, n, int64_t(1) << 15, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) write(i);
    });
  }
  int64_t filter(int64_t b, int64_t e, U t, U* cv, uint32_t* cp, int64_t cap) const {
    int64_t hit = 0, i = b;
#ifdef SSF_X86_DISPATCH
    if constexpr (std::is_same_v<A, float> && std::is_same_v<G, float>) {
      if (cpu::use_avx512()) {
        if constexpr (MOM)
          hit = cpu::filter_blocks_avx512(MomentumAddStoreBlock{g + b, v + b, r + b, m}, e - b,
                                          t, cv, cp, cap);
        else
          hit = cpu::filter_blocks_avx512(AddStoreBlock{g + b, r + b}, e - b, t, cv, cp, cap);
        i = b + ((e - b) & ~int64_t(15));
      }
    }
#endif
    constexpr int B = cpu::kBlock;
    A sums[B];
    U ub[B];
    for (; i + B <= e; i += B) {
      for (int j = 0; j < B; ++j) sums[j] = write(i + j);
      std::memcpy(ub, sums, sizeof(ub));
      const uint32_t hits = cpu::block_hits(ub, t);
      if (hits) hit = cpu::append_hits(ub, hits, i - b, cv, cp, hit, cap);
    }
    for (; i < e; ++i) {
      const U u = bits(write(i));
      hit = cpu::append_tail(&u, 1, t, i - b, cv, cp, hit, cap);
    }
    return hit;
  }
};

// One segment (src: its Feedback source, positions from 0): residual += grad (or the new
// velocity), its top k into out (positions base + i), the selected entries of the residual
// replaced by their wire error and, with mask, those of the velocity cleared.
template <typename W, typename I, typename Src, typename A = std::remove_pointer_t<decltype(Src::r)>>
void ef_segment(const Src& src, int64_t k, bool mask, BitsOf<A>* out_v, I* out_i, int64_t base) {
  using U = BitsOf<A>;
  cpu::topk_filtered<U, I>(src, src.n, k, out_v, out_i, base);
  at::parallel_for(0, k, int64_t(1) << 14, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      A a;
      std::memcpy(&a, out_v + j, sizeof(U));
      const int64_t i = int64_t(out_i[j]) - base;
      src.r[i] = wire_error<A, W>(a);
      if (mask) src.v[i] = A(0);
    }
  });
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
void dispatch_feedback(at::ScalarType grad, const at::Tensor& residual, at::ScalarType wire,
                       at::ScalarType idt, const F& fn) {
  dispatch_value(residual.scalar_type(), [&](auto a_tag) {
    using A = decltype(a_tag);
    dispatch_value(grad, [&](auto g_tag) {
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

// Calls fn(src) with the Feedback source of [lo, hi) of the flat gradient and residual:
// with the velocity when there is one (then A == G, checked).
template <typename A, typename G, typename F>
void with_source(const G* g, A* r, A* v, float m, int64_t lo, int64_t hi, const F& fn) {
  if (v == nullptr) {
    fn(Feedback<A, G, false>{g + lo, r + lo, hi - lo});
  } else {
    if constexpr (std::is_same_v<A, G>) {
      fn(Feedback<A, G, true>{g + lo, r + lo, hi - lo, v + lo, m});
    } else {
      TORCH_CHECK(false, "ef_topk: a velocity needs the gradient in the residual's dtype");
    }
  }
}

// A source over pieces that tile [0, n): piece p holds positions [off[p], off[p + 1]) and
// is a Feedback source of its own (positions from 0; its gradient where it lies, its
// residual and velocity views of the whole ones, which are single buffers). topk.h's
// selection sees one input: the sample finds a position's piece by binary search, and the
// filter and the materialization run each piece's own loops over the part of a thread's
// chunk it covers, so a fusion group's gradients are read where they lie and no staged
// concatenation is written.
template <typename Src>
struct Pieces {
  using A = std::remove_pointer_t<decltype(Src::r)>;
  using U = BitsOf<A>;
  const std::vector<Src>& piece;
  const int64_t* off;  // piece.size() + 1 bounds, from 0 to n
  A* r;                // the whole residual (the values once formed)
  A* v;                // the whole velocity, or nullptr
  int64_t n;

  int64_t find(int64_t i) const {  // the piece holding position i (empty pieces hold none)
    return std::upper_bound(off, off + piece.size() + 1, i) - off - 1;
  }
  U raw(int64_t i) const {
    const int64_t p = find(i);
    return piece[p].raw(i - off[p]);
  }
  const U* values() const { return static_cast<const U*>(static_cast<const void*>(r)); }
  // fn(p, lo, hi) for every non-empty part [lo, hi) (piece p's positions) of [b, e).
  template <typename F>
  void each(int64_t b, int64_t e, const F& fn) const {
    for (int64_t p = find(b); p < int64_t(piece.size()) && off[p] < e; ++p) {
      const int64_t lo = std::max(b, off[p]) - off[p], hi = std::min(e, off[p + 1]) - off[p];
      if (hi > lo) fn(p, lo, hi);
    }
  }
  void materialize() const {
    at::parallel_for(0, n, int64_t(1) << 15, [&](int64_t b, int64_t e) {
      each(b, e, [&](int64_t p, int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) piece[p].write(i);
      });
    });
  }
  // topk.h's filter over [b, e): each part's hits appended after the last part's, their
  // positions moved from the part's start to b's.
  int64_t filter(int64_t b, int64_t e, U t, U* cv, uint32_t* cp, int64_t cap) const {
    int64_t m = 0;
    each(b, e, [&](int64_t p, int64_t lo, int64_t hi) {
      const int64_t at = std::min(m, cap);
      const int64_t got = piece[p].filter(lo, hi, t, cv + at, cp + at, cap - at);
      const auto shift = static_cast<uint32_t>(off[p] + lo - b);
      for (int64_t j = at, end = std::min(m + got, cap); j < end; ++j) cp[j] += shift;
      m += got;
    });
    return m;
  }
};

// Calls fn(src) with the Pieces source of gradients seg[p] (piece p at [off[p], off[p+1])
// of the residual and velocity), as with_source.
template <typename A, typename G, typename F>
void with_pieces(const std::vector<const void*>& seg, const int64_t* off, A* r, A* v, float m,
                 const F& fn) {
  const int64_t np = int64_t(seg.size());
  auto run = [&](auto tag) {
    using Src = decltype(tag);
    std::vector<Src> piece;
    piece.reserve(np);
    for (int64_t p = 0; p < np; ++p) {
      Src s{static_cast<const G*>(seg[p]) , r + off[p], off[p + 1] - off[p]};
      if (v != nullptr) {
        s.v = v + off[p];
        s.m = m;
      }
      piece.push_back(s);
    }
    fn(Pieces<Src>{piece, off, r, v, off[np]});
  };
  if (v == nullptr) {
    run(Feedback<A, G, false>{});
  } else {
    if constexpr (std::is_same_v<A, G>) {
      run(Feedback<A, G, true>{});
    } else {
      TORCH_CHECK(false, "ef_topk: a velocity needs the gradient in the residual's dtype");
    }
  }
}

// The offsets of tensors laid back to back: 0, n_0, n_0 + n_1, ...
inline std::vector<int64_t> tiling_offsets(const std::vector<at::Tensor>& tensors) {
  std::vector<int64_t> off(tensors.size() + 1, 0);
  for (size_t s = 0; s < tensors.size(); ++s) off[s + 1] = off[s] + tensors[s].numel();
  return off;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> ef_topk_tensors_cpu(const std::vector<at::Tensor>& grads,
                                                       at::Tensor& residual, int64_t k,
                                                       at::ScalarType wire_dtype,
                                                       const std::optional<at::Tensor>& velocity,
                                                       double momentum, bool mask_velocity) {
  const std::vector<int64_t> off = tiling_offsets(grads);
  check_feedback_segments(grads, residual, wire_dtype, velocity, off, "ef_topk", at::kCPU);
  const int64_t n = residual.numel();
  check_k(k, 0, n, "ef_topk");
  std::vector<const void*> seg(grads.size());
  for (size_t s = 0; s < seg.size(); ++s) seg[s] = grads[s].const_data_ptr();
  const auto idt = index_dtype_for(n);
  at::Tensor values = at::empty({k}, residual.options());
  at::Tensor indices = at::empty({k}, residual.options().dtype(idt));
  dispatch_feedback(grads[0].scalar_type(), residual, wire_dtype, idt, [&](auto a, auto g, auto w, auto i) {
    using A = decltype(a);
    using I = decltype(i);
    A* v = velocity ? static_cast<A*>(velocity->data_ptr()) : nullptr;
    with_pieces<A, decltype(g)>(seg, off.data(), static_cast<A*>(residual.data_ptr()), v,
                                float(momentum), [&](const auto& src) {
      ef_segment<decltype(w), I>(src, k, mask_velocity && v,
                                 static_cast<BitsOf<A>*>(values.data_ptr()),
                                 indices.data_ptr<I>(), 0);
    });
  });
  return {values, indices};
}

std::tuple<at::Tensor, at::Tensor> ef_topk_cpu(const at::Tensor& grad_in, at::Tensor& residual,
                                               int64_t k, at::ScalarType wire_dtype,
                                               const std::optional<at::Tensor>& velocity,
                                               double momentum, bool mask_velocity) {
  const at::Tensor grad = check_feedback(grad_in, residual, wire_dtype, velocity, "ef_topk", at::kCPU);
  const int64_t n = grad.numel();
  check_k(k, 0, n, "ef_topk");
  const auto idt = index_dtype_for(n);
  at::Tensor values = at::empty({k}, residual.options());
  at::Tensor indices = at::empty({k}, residual.options().dtype(idt));
  dispatch_feedback(grad.scalar_type(), residual, wire_dtype, idt, [&](auto a, auto g, auto w, auto i) {
    using A = decltype(a);
    using G = decltype(g);
    using I = decltype(i);
    A* v = velocity ? static_cast<A*>(velocity->data_ptr()) : nullptr;
    with_source(static_cast<const G*>(grad.const_data_ptr()), static_cast<A*>(residual.data_ptr()),
                v, float(momentum), 0, n, [&](const auto& src) {
                  ef_segment<decltype(w), I>(src, k, mask_velocity && v,
                                             static_cast<BitsOf<A>*>(values.data_ptr()),
                                             indices.data_ptr<I>(), 0);
                });
  });
  return {values, indices};
}

namespace {

// The segmented error-feedback selection (checked inputs, offsets and ks int64 on the host):
// segment s's gradient starts at seg[s]; with `flat` (the whole gradient, residual-sized)
// the elements outside every segment are accumulated and kept.
std::tuple<at::Tensor, at::Tensor> segmented_feedback(
    at::ScalarType grad_dtype, at::Tensor& residual, const at::Tensor& offsets,
    const at::Tensor& ks, const std::vector<int64_t>& out_off, at::ScalarType wire_dtype,
    const std::optional<at::Tensor>& velocity, double momentum, bool mask_velocity,
    const void* flat, const std::vector<const void*>& seg) {
  const int64_t nseg = ks.numel(), n = residual.numel();
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  const int64_t* kp = ks.const_data_ptr<int64_t>();
  const auto idt = index_dtype_for(n);
  at::Tensor values = at::empty({out_off[nseg]}, residual.options());
  at::Tensor indices = at::empty({out_off[nseg]}, residual.options().dtype(idt));
  dispatch_feedback(grad_dtype, residual, wire_dtype, idt, [&](auto a, auto g, auto w, auto i) {
    using A = decltype(a);
    using G = decltype(g);
    using I = decltype(i);
    A* pr = static_cast<A*>(residual.data_ptr());
    A* pv = velocity ? static_cast<A*>(velocity->data_ptr()) : nullptr;
    const float m = float(momentum);
    auto* out_v = static_cast<BitsOf<A>*>(values.data_ptr());
    I* out_i = indices.data_ptr<I>();
    if (flat != nullptr) {
      const G* pg = static_cast<const G*>(flat);
      auto keep = [&](const auto& src) { src.materialize(); };
      with_source(pg, pr, pv, m, 0, nseg ? off[0] : n, keep);
      if (nseg) with_source(pg, pr, pv, m, off[nseg], n, keep);
    }
    cpu::for_segments(off, nseg, [&](int64_t s) {
      with_source(static_cast<const G*>(seg[s]), pr + off[s], pv ? pv + off[s] : nullptr, m, 0,
                  off[s + 1] - off[s], [&](const auto& src) {
        ef_segment<decltype(w), I>(src, kp[s], mask_velocity && pv, out_v + out_off[s],
                                   out_i + out_off[s], off[s]);
      });
    });
  });
  return {values, indices};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> segmented_ef_topk_cpu(const at::Tensor& grad_in,
                                                         at::Tensor& residual,
                                                         const at::Tensor& offsets_in,
                                                         const at::Tensor& ks_in,
                                                         at::ScalarType wire_dtype,
                                                         const std::optional<at::Tensor>& velocity,
                                                         double momentum, bool mask_velocity) {
  const at::Tensor grad =
      check_feedback(grad_in, residual, wire_dtype, velocity, "segmented_ef_topk", at::kCPU);
  const at::Tensor offsets = offsets_in.to(at::kLong).contiguous();
  const at::Tensor ks = ks_in.to(at::kLong).contiguous();
  const std::vector<int64_t> out_off = check_segments(offsets, ks, grad.numel());
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  const auto* base = static_cast<const char*>(grad.const_data_ptr());
  std::vector<const void*> seg(ks.numel());
  for (size_t s = 0; s < seg.size(); ++s) seg[s] = base + off[s] * grad.element_size();
  return segmented_feedback(grad.scalar_type(), residual, offsets, ks, out_off, wire_dtype,
                            velocity, momentum, mask_velocity, base, seg);
}

std::tuple<at::Tensor, at::Tensor> segmented_ef_topk_tensors_cpu(
    const std::vector<at::Tensor>& grads, at::Tensor& residual, const at::Tensor& offsets_in,
    const at::Tensor& ks_in, at::ScalarType wire_dtype, const std::optional<at::Tensor>& velocity,
    double momentum, bool mask_velocity) {
  const at::Tensor offsets = offsets_in.to(at::kLong).contiguous();
  const at::Tensor ks = ks_in.to(at::kLong).contiguous();
  const std::vector<int64_t> out_off = check_segments(offsets, ks, residual.numel());
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  check_feedback_segments(grads, residual, wire_dtype, velocity,
                          std::vector<int64_t>(off, off + ks.numel() + 1), "segmented_ef_topk",
                          at::kCPU);
  std::vector<const void*> seg(grads.size());
  for (size_t s = 0; s < seg.size(); ++s) seg[s] = grads[s].const_data_ptr();
  return segmented_feedback(grads[0].scalar_type(), residual, offsets, ks, out_off, wire_dtype,
                            velocity, momentum, mask_velocity, nullptr, seg);
}

namespace {

// The rest of a group budget (ops.h: group_ef_topk) once the floors are taken (their nf
// values fv and indices fi, index order, already replaced in the residual): the k - nf
// largest of residual[lo, hi) outside the floors, their residual entries replaced by their
// wire error (with mask, their velocity entries cleared), merged with the floors into
// out (k entries, index order). The residual's k largest over the span contain at least
// k - nf non-floor elements, and the largest of those are the rest's top: one filtered
// top-k pass, then O(k log nf) work on its candidates.
template <typename A, typename W, typename I>
void group_rest(A* r, A* v, bool mask, int64_t lo, int64_t hi, int64_t k, int64_t nf,
                const BitsOf<A>* fv, const I* fi, BitsOf<A>* out_v, I* out_i) {
  using U = BitsOf<A>;
  const int64_t rest = k - nf;
  std::vector<U> cv(k);
  std::vector<I> ci(k);
  cpu::topk_filtered<U, I>(cpu::Plain<U>{reinterpret_cast<const U*>(r) + lo, hi - lo}, hi - lo,
                           k, cv.data(), ci.data(), lo);
  // Candidates the floors already took are skipped; of the others, the k - nf largest are
  // kept: all but the nf - c least (c: candidates that are floors), found by a bounded heap
  // of the nf least so far, "least" by key, then by the higher index (ties go to the lower).
  std::vector<uint8_t> skip(k, 0);
  auto less = [&](int64_t a, int64_t b) {  // candidate a ranks below b
    const U ka = cpu::Key<U>::of(cv[a]), kb = cpu::Key<U>::of(cv[b]);
    return ka < kb || (ka == kb && a > b);
  };
  std::vector<int64_t> least;  // max-heap under `less`: its top is the best of the least
  least.reserve(nf + 1);
  int64_t c = 0;
  for (int64_t j = 0, f = 0; j < k; ++j) {
    while (f < nf && fi[f] < ci[j]) ++f;
    if (f < nf && fi[f] == ci[j]) {
      skip[j] = 1;
      ++c;
    } else if (nf > 0 && (int64_t(least.size()) < nf || less(j, least.front()))) {
      least.push_back(j);
      std::push_heap(least.begin(), least.end(), less);
      if (int64_t(least.size()) > nf) {
        std::pop_heap(least.begin(), least.end(), less);
        least.pop_back();
      }
    }
  }
  std::sort(least.begin(), least.end(), less);  // the least first
  for (int64_t d = 0; d < nf - c; ++d) skip[least[d]] = 1;
  std::vector<int64_t> taken;  // output slots of the rest
  taken.reserve(rest);
  int64_t o = 0, f = 0;
  for (int64_t j = 0; j < k; ++j) {
    if (skip[j]) continue;
    for (; f < nf && fi[f] < ci[j]; ++f, ++o) {
      out_v[o] = fv[f];
      out_i[o] = fi[f];
    }
    out_v[o] = cv[j];
    out_i[o] = ci[j];
    taken.push_back(o++);
  }
  for (; f < nf; ++f, ++o) {
    out_v[o] = fv[f];
    out_i[o] = fi[f];
  }
  // the residual (and velocity) updates: random writes, each a likely cache miss, spread
  // over the threads as ef_segment's are
  at::parallel_for(0, rest, int64_t(1) << 12, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t at = taken[t], i = int64_t(out_i[at]);
      A a;
      std::memcpy(&a, out_v + at, sizeof(U));
      r[i] = wire_error<A, W>(a);
      if (mask) v[i] = A(0);
    }
  });
}

// group_ef_topk given the floors' selection (fv, fi): checked k, the rest and the merge.
std::tuple<at::Tensor, at::Tensor> group_finish(at::ScalarType grad_dtype, at::Tensor& residual,
                                                const at::Tensor& offsets, int64_t k,
                                                at::ScalarType wire_dtype,
                                                const std::optional<at::Tensor>& velocity,
                                                bool mask_velocity, const at::Tensor& fv,
                                                const at::Tensor& fi) {
  const int64_t nf = fv.numel();
  if (k == nf) return {fv, fi};
  const int64_t nseg = offsets.numel() - 1;
  const int64_t lo = offsets.const_data_ptr<int64_t>()[0];
  const int64_t hi = offsets.const_data_ptr<int64_t>()[nseg];
  at::Tensor values = at::empty({k}, residual.options());
  at::Tensor indices = at::empty({k}, fi.options());
  dispatch_feedback(grad_dtype, residual, wire_dtype, fi.scalar_type(),
                    [&](auto a, auto, auto w, auto i) {
    using A = decltype(a);
    using I = decltype(i);
    group_rest<A, decltype(w), I>(
        static_cast<A*>(residual.data_ptr()), velocity ? static_cast<A*>(velocity->data_ptr()) : nullptr,
        mask_velocity && velocity.has_value(), lo, hi, k, nf,
        static_cast<const BitsOf<A>*>(fv.const_data_ptr()), fi.const_data_ptr<I>(),
        static_cast<BitsOf<A>*>(values.data_ptr()), indices.data_ptr<I>());
  });
  return {values, indices};
}

// The budget k against the floors and the segments (before anything changes).
void check_group(const at::Tensor& offsets_in, const at::Tensor& floors_in, int64_t k) {
  const at::Tensor offsets = offsets_in.to(at::kLong).contiguous();
  const at::Tensor floors = floors_in.to(at::kLong).contiguous();
  const int64_t nseg = floors.numel();
  TORCH_CHECK(offsets.numel() == nseg + 1, "group_ef_topk: ", offsets.numel(),
                    " offsets for ", nseg, " segments (need len(floors) + 1)");
  const int64_t base = floors.sum().item<int64_t>();
  const int64_t span = nseg ? offsets[nseg].item<int64_t>() - offsets[0].item<int64_t>() : 0;
  TORCH_CHECK(base <= k && k <= span, "group_ef_topk: k=", k, " outside [", base, ", ",
                    span, "] (the floors' sum, the segments' elements)");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> group_ef_topk_cpu(const at::Tensor& grad, at::Tensor& residual,
                                                     const at::Tensor& offsets,
                                                     const at::Tensor& floors, int64_t k,
                                                     at::ScalarType wire_dtype,
                                                     const std::optional<at::Tensor>& velocity,
                                                     double momentum, bool mask_velocity) {
  check_group(offsets, floors, k);
  auto [fv, fi] = segmented_ef_topk_cpu(grad, residual, offsets, floors, wire_dtype, velocity,
                                        momentum, mask_velocity);
  return group_finish(grad.scalar_type(), residual, offsets.to(at::kLong).contiguous(), k,
                      wire_dtype, velocity, mask_velocity, fv, fi);
}

std::tuple<at::Tensor, at::Tensor> group_ef_topk_tensors_cpu(
    const std::vector<at::Tensor>& grads, at::Tensor& residual, const at::Tensor& offsets,
    const at::Tensor& floors, int64_t k, at::ScalarType wire_dtype,
    const std::optional<at::Tensor>& velocity, double momentum, bool mask_velocity) {
  check_group(offsets, floors, k);
  auto [fv, fi] = segmented_ef_topk_tensors_cpu(grads, residual, offsets, floors, wire_dtype,
                                                velocity, momentum, mask_velocity);
  return group_finish(grads[0].scalar_type(), residual, offsets.to(at::kLong).contiguous(), k,
                      wire_dtype, velocity, mask_velocity, fv, fi);
}

}  // namespace ssf
