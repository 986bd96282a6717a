// Selection kernels on the CPU: exact magnitude top-k (topk.h: a sampled filter pass, or
// a radix select) and threshold select.
#include "../ops.h"
#include "../checks.h"
#include "../sampling.h"
#include "common.h"
#include "topk.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

namespace ssf {

bool cpu::use_avx512() {
#ifdef SSF_X86_DISPATCH
  static const bool on = [] {
    const char* isa = std::getenv("SSF_CPU_ISA");
    return __builtin_cpu_supports("avx512f") && !(isa && std::string(isa) == "baseline");
  }();
  return on;
#else
  return false;
#endif
}

int64_t cpu_parallel_threads(int64_t n) {
  std::vector<uint8_t> seen(std::max<int64_t>(1, at::get_num_threads()), 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    const int tid = at::get_thread_num();
    if (tid >= 0 && tid < int64_t(seen.size())) seen[tid] = 1;  // distinct slots: no race
  });
  int64_t count = 0;
  for (const uint8_t s : seen) count += s;
  return count;
}

namespace {

using cpu::Chunks;

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
    auto run = [&](auto tag) {
      using U = decltype(tag);
      cpu::topk_filtered<U, I>(cpu::Plain<U>{static_cast<const U*>(x.const_data_ptr()), n}, n, k,
                               static_cast<U*>(values.data_ptr()), indices.data_ptr<I>());
    };
    if (x.element_size() == 4) run(uint32_t{}); else run(uint16_t{});
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
  dispatch_index(idt, [&](auto i_tag) {
    using I = decltype(i_tag);
    auto run = [&](auto tag, int64_t s) {
      using U = decltype(tag);
      const U* x = static_cast<const U*>(flat.const_data_ptr());
      const int64_t len = off[s + 1] - off[s];
      cpu::topk_filtered<U, I>(cpu::Plain<U>{x + off[s], len}, len, kp[s],
                               static_cast<U*>(values.data_ptr()) + out_off[s],
                               indices.data_ptr<I>() + out_off[s], off[s]);
    };
    auto run_any = [&](int64_t s) {
      if (flat.element_size() == 4) run(uint32_t{}, s); else run(uint16_t{}, s);
    };
    cpu::for_segments(off, nseg, run_any);
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
