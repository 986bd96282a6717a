// Selection kernels on the CPU: exact magnitude top-k and threshold select.
//
// Top-k is a radix select on the magnitude key, not a sort:
//   pass 1: per-chunk histograms of the key's top 11 bits; the bin holding the k-th
//           largest key (the pivot bin) and the count strictly above it follow exactly;
//   pass 2: gather the elements above the pivot bin and the pivot bin's candidates, both
//           in index order (their per-chunk counts are known from pass 1, so no atomics);
//   resolve: the exact k-th key among the candidates (nth_element on a small array) and
//           how many of the keys equal to it to take (the lowest indices win);
//   merge:  per chunk, merge the above-list and the chosen candidates into the output.
// Two reads of the input and work proportional to k + candidates otherwise.
#include "../ops.h"
#include "../checks.h"
#include "../sampling.h"
#include "common.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

namespace ssf {
namespace {

using cpu::Chunks;
using cpu::Key;

// Top-k of x[0, n) into out_v/out_i (k entries, index order); indices are written as
// base + position, so a segment of a larger buffer reports positions in that buffer.
template <typename U, typename I>
void topk_bits(const U* x, int64_t n, int64_t k, U* out_v, I* out_i, int64_t base = 0) {
  constexpr int kHiBits = Key<U>::kBits < 11 ? Key<U>::kBits : 11;
  constexpr int kShift = Key<U>::kBits - kHiBits;
  constexpr int64_t kBins = int64_t(1) << kHiBits;
  constexpr U kLowMask = static_cast<U>((U(1) << kShift) - 1);
  if (k == 0) return;
  if (k == n) {
    for (int64_t i = 0; i < n; ++i) {
      out_v[i] = x[i];
      out_i[i] = static_cast<I>(base + i);
    }
    return;
  }
  const Chunks ch(n);
  // Pass 1: histograms of the top bits.
  std::vector<int32_t> hist(ch.count * kBins, 0);
  ch.for_each([&](int64_t c) {
    int32_t* h = hist.data() + c * kBins;
    for (int64_t i = ch.begin(c), e = ch.end(c); i < e; ++i) ++h[Key<U>::of(x[i]) >> kShift];
  });
  std::vector<int64_t> total(kBins, 0);
  for (int64_t c = 0; c < ch.count; ++c)
    for (int64_t b = 0; b < kBins; ++b) total[b] += hist[c * kBins + b];
  int64_t pivot = kBins - 1, above = 0;
  for (; pivot > 0 && above + total[pivot] < k; --pivot) above += total[pivot];
  const int64_t need = k - above;  // taken from the pivot bin, 1 <= need <= total[pivot]
  // Per-chunk counts above the pivot bin and inside it, and their offsets.
  std::vector<int64_t> above_off(ch.count + 1, 0), cand_off(ch.count + 1, 0);
  for (int64_t c = 0; c < ch.count; ++c) {
    const int32_t* h = hist.data() + c * kBins;
    int64_t a = 0;
    for (int64_t b = pivot + 1; b < kBins; ++b) a += h[b];
    above_off[c] = a;
    cand_off[c] = h[pivot];
  }
  cpu::exclusive_scan(above_off.data(), ch.count + 1);
  const int64_t n_cand = cpu::exclusive_scan(cand_off.data(), ch.count + 1);
  // Pass 2: gather.
  std::vector<I> above_idx(above), cand_idx(n_cand);
  std::vector<U> cand_low(n_cand);
  ch.for_each([&](int64_t c) {
    int64_t a = above_off[c], q = cand_off[c];
    for (int64_t i = ch.begin(c), e = ch.end(c); i < e; ++i) {
      const U key = Key<U>::of(x[i]);
      const int64_t d = key >> kShift;
      if (d > pivot) {
        above_idx[a++] = static_cast<I>(i);
      } else if (d == pivot) {
        cand_idx[q] = static_cast<I>(i);
        cand_low[q++] = static_cast<U>(key & kLowMask);
      }
    }
  });
  // Resolve the exact k-th key inside the pivot bin.
  std::vector<U> tmp(cand_low);
  std::nth_element(tmp.begin(), tmp.begin() + (need - 1), tmp.end(), std::greater<U>());
  const U kth = tmp[need - 1];
  int64_t greater = 0;
  for (int64_t j = 0; j < n_cand; ++j) greater += cand_low[j] > kth;
  int64_t ties_left = need - greater;  // equal keys taken, lowest indices first
  std::vector<uint8_t> take(n_cand, 0);
  std::vector<int64_t> out_off(ch.count + 1, 0);
  for (int64_t c = 0; c < ch.count; ++c) {
    int64_t taken = 0;
    for (int64_t j = cand_off[c]; j < cand_off[c + 1]; ++j) {
      bool t = cand_low[j] > kth;
      if (!t && cand_low[j] == kth && ties_left > 0) {
        t = true;
        --ties_left;
      }
      take[j] = t;
      taken += t;
    }
    out_off[c] = (above_off[c + 1] - above_off[c]) + taken;
  }
  cpu::exclusive_scan(out_off.data(), ch.count + 1);
  // Merge both index-ordered lists of each chunk into the output.
  ch.for_each([&](int64_t c) {
    int64_t a = above_off[c], ae = above_off[c + 1], q = cand_off[c], qe = cand_off[c + 1];
    int64_t o = out_off[c];
    while (q < qe && !take[q]) ++q;
    while (a < ae || q < qe) {
      I idx;
      if (q >= qe || (a < ae && above_idx[a] < cand_idx[q])) {
        idx = above_idx[a++];
      } else {
        idx = cand_idx[q++];
        while (q < qe && !take[q]) ++q;
      }
      out_v[o] = x[idx];
      out_i[o++] = static_cast<I>(base + idx);
    }
  });
}

template <typename T>
inline bool over_threshold(T v, double thr) {
  const float f = static_cast<float>(v);
  return std::isnan(f) || static_cast<double>(std::fabs(f)) >= thr;
}

// Per-chunk counts of selected elements (pass 1 of threshold select).
template <typename T>
std::vector<int64_t> threshold_counts(const T* x, const Chunks& ch, double thr) {
  std::vector<int64_t> cnt(ch.count + 1, 0);
  ch.for_each([&](int64_t c) {
    int64_t s = 0;
    for (int64_t i = ch.begin(c), e = ch.end(c); i < e; ++i) s += over_threshold(x[i], thr);
    cnt[c] = s;
  });
  return cnt;
}

template <typename T, typename I>
void threshold_write(const T* x, const Chunks& ch, double thr, const std::vector<int64_t>& off,
                     T* out_v, I* out_i) {
  ch.for_each([&](int64_t c) {
    int64_t o = off[c];
    for (int64_t i = ch.begin(c), e = ch.end(c); i < e; ++i) {
      if (over_threshold(x[i], thr)) {
        out_v[o] = x[i];
        out_i[o++] = static_cast<I>(i);
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> topk_cpu(const at::Tensor& x_in, int64_t k) {
  const at::Tensor x = flat_values(x_in, "topk", at::kCPU);
  const int64_t n = x.numel();
  check_k(k, 0, n, "topk");
  const auto idt = index_dtype_for(n);
  at::Tensor values = at::empty({k}, x.options());
  at::Tensor indices = at::empty({k}, x.options().dtype(idt));
  dispatch_index(idt, [&](auto i_tag) {
    using I = decltype(i_tag);
    if (x.element_size() == 4) {
      topk_bits<uint32_t, I>(static_cast<const uint32_t*>(x.const_data_ptr()), n, k,
                             static_cast<uint32_t*>(values.data_ptr()), indices.data_ptr<I>());
    } else {
      topk_bits<uint16_t, I>(static_cast<const uint16_t*>(x.const_data_ptr()), n, k,
                             static_cast<uint16_t*>(values.data_ptr()), indices.data_ptr<I>());
    }
  });
  return {values, indices};
}

std::tuple<at::Tensor, at::Tensor> segmented_topk_cpu(const at::Tensor& flat_in,
                                                      const at::Tensor& offsets_in,
                                                      const at::Tensor& ks_in) {
  const at::Tensor flat = flat_values(flat_in, "segmented_topk", at::kCPU);
  const at::Tensor offsets = offsets_in.to(at::kLong).contiguous();
  const at::Tensor ks = ks_in.to(at::kLong).contiguous();
  const int64_t nseg = ks.numel(), n = flat.numel();
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  const int64_t* kp = ks.const_data_ptr<int64_t>();
  const std::vector<int64_t> out_off = check_segments(offsets, ks, n);
  const auto idt = index_dtype_for(n);
  at::Tensor values = at::empty({out_off[nseg]}, flat.options());
  at::Tensor indices = at::empty({out_off[nseg]}, flat.options().dtype(idt));
  // Large segments use every thread inside one selection; small ones run one per thread.
  constexpr int64_t kLarge = int64_t(1) << 20;
  std::vector<int64_t> small, large;
  for (int64_t s = 0; s < nseg; ++s) (off[s + 1] - off[s] >= kLarge ? large : small).push_back(s);
  dispatch_index(idt, [&](auto i_tag) {
    using I = decltype(i_tag);
    auto run = [&](auto tag, int64_t s) {
      using U = decltype(tag);
      const U* x = static_cast<const U*>(flat.const_data_ptr());
      topk_bits<U, I>(x + off[s], off[s + 1] - off[s], kp[s],
                      static_cast<U*>(values.data_ptr()) + out_off[s],
                      indices.data_ptr<I>() + out_off[s], off[s]);
    };
    auto run_any = [&](int64_t s) {
      if (flat.element_size() == 4) run(uint32_t{}, s); else run(uint16_t{}, s);
    };
    for (int64_t s : large) run_any(s);
    at::parallel_for(0, int64_t(small.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) run_any(small[j]);
    });
  });
  return {values, indices};
}

double sampled_threshold_cpu(const at::Tensor& x_in, int64_t k, int64_t samples, int64_t seed) {
  const at::Tensor x = flat_values(x_in, "sampled_threshold", at::kCPU);
  const int64_t n = x.numel();
  check_k(k, 1, n, "sampled_threshold");
  samples = sampling::clamp_samples(n, samples);
  // The k-th largest of n is estimated by the kk-th largest of a stratified sample whose
  // positions depend on the seed only (sampling.h): every rank passing the same seed samples
  // the same positions.
  const int64_t kk = sampling::sample_rank(n, k, samples);
  const uint64_t stream = sampling::sample_stream(static_cast<uint64_t>(seed));
  double thr = 0.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sampled_threshold", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    std::vector<float> mag(samples);
    for (int64_t j = 0; j < samples; ++j) {
      const float f = static_cast<float>(px[sampling::sample_position(n, samples, j, stream)]);
      mag[j] = std::isnan(f) ? std::numeric_limits<float>::infinity() : std::fabs(f);
    }
    std::nth_element(mag.begin(), mag.begin() + (kk - 1), mag.end(), std::greater<float>());
    thr = mag[kk - 1];
  });
  return thr;
}

int64_t threshold_count_cpu(const at::Tensor& x_in, double thr) {
  const at::Tensor x = threshold_values(x_in, thr, "threshold_count", at::kCPU);
  const Chunks ch(x.numel());
  int64_t total = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "threshold_count", [&] {
    auto cnt = threshold_counts(x.const_data_ptr<scalar_t>(), ch, thr);
    total = cpu::exclusive_scan(cnt.data(), ch.count + 1);
  });
  return total;
}

std::tuple<at::Tensor, at::Tensor> threshold_select_cpu(const at::Tensor& x_in, double thr) {
  const at::Tensor x = threshold_values(x_in, thr, "threshold_select", at::kCPU);
  const int64_t n = x.numel();
  const auto idt = index_dtype_for(n);
  const Chunks ch(n);
  at::Tensor values, indices;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "threshold_select", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    auto off = threshold_counts(px, ch, thr);
    const int64_t total = cpu::exclusive_scan(off.data(), ch.count + 1);
    values = at::empty({total}, x.options());
    indices = at::empty({total}, x.options().dtype(idt));
    dispatch_index(idt, [&](auto i_tag) {
      using I = decltype(i_tag);
      threshold_write(px, ch, thr, off, values.data_ptr<scalar_t>(), indices.data_ptr<I>());
    });
  });
  return {values, indices};
}

}  // namespace ssf
