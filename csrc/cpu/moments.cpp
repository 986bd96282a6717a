// Shared moments on the CPU: one parallel pass per tensor (csrc/moments.h has the element's
// arithmetic, csrc/ops.h the op's contract).
#include "../checks.h"
#include "../moments.h"
#include "../ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <vector>

namespace ssf {
namespace {

constexpr int64_t kGrain = int64_t(1) << 15;

}  // namespace

void shared_momentum_step_cpu(std::vector<at::Tensor> params, const std::vector<at::Tensor>& grads,
                              std::vector<at::Tensor> bufs, std::vector<at::Tensor> ages,
                              double lr, double momentum, double dampening, bool nesterov) {
  check_moment_lists({params, grads, bufs, ages}, "shared_momentum_step", at::kCPU);
  const moments::MomentumArgs args{float(lr), float(momentum), float(dampening), nesterov};
  for (size_t i = 0; i < params.size(); ++i) {
    float* p = params[i].data_ptr<float>();
    const float* g = grads[i].const_data_ptr<float>();
    float* u = bufs[i].data_ptr<float>();
    float* a = ages[i].data_ptr<float>();
    at::parallel_for(0, params[i].numel(), kGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t j = lo; j < hi; ++j) moments::momentum_element(p[j], g[j], u[j], a[j], args);
    });
  }
}

void shared_adam_step_cpu(std::vector<at::Tensor> params, const std::vector<at::Tensor>& grads,
                          std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
                          std::vector<at::Tensor> ages, double lr, double beta1, double beta2,
                          double eps, const std::vector<double>& bias1,
                          const std::vector<double>& bias2_sqrt) {
  check_adam_step(params, grads, exp_avgs, exp_avg_sqs, ages, bias1.size(), bias2_sqrt.size(), at::kCPU);
  for (size_t i = 0; i < params.size(); ++i) {
    const moments::AdamArgs args{float(lr), float(beta1), float(beta2), float(eps),
                                 float(bias1[i]), float(bias2_sqrt[i])};
    float* p = params[i].data_ptr<float>();
    const float* g = grads[i].const_data_ptr<float>();
    float* m = exp_avgs[i].data_ptr<float>();
    float* v = exp_avg_sqs[i].data_ptr<float>();
    float* a = ages[i].data_ptr<float>();
    at::parallel_for(0, params[i].numel(), kGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t j = lo; j < hi; ++j) moments::adam_element(p[j], g[j], m[j], v[j], a[j], args);
    });
  }
}

}  // namespace ssf
