// The shared-moments step of one element (ssfusion_hvd/moments.py, moments="shared", no
// senders' waits), written once for the CPU (csrc/cpu/moments.cpp) and CUDA
// (csrc/cuda/moments.cu) kernels. Plain float32 arithmetic in the order the torch fallback
// (SharedMoments' foreach path) uses; powf(b, 1) is b exactly, so an element sent every
// step (age 1) has a fresh share of exactly 1 and the step is torch's SGD / Adam.
//
// An element's age counts the steps since it last arrived; it is read, advanced by this
// step, and reset to 0 where the synchronized gradient g is non-zero (it arrived).
#pragma once

#include "hash.h"  // SSF_HOST_DEVICE

#include <cmath>

namespace ssf {
namespace moments {

// psi(a) = (1 - b^a) / (a (1 - b)): of a steps of one gradient, the share still in a
// moment that decays by b per step (moments.py: fresh_share).
SSF_HOST_DEVICE float fresh_share(float b, float a) {
  return (1.0f - powf(b, a)) / a / (1.0f - b);
}

struct MomentumArgs {
  float lr, mu, dampening;
  bool nesterov;
};

// SGD with momentum: u <- mu u + c psi, moved = u + c (1 - psi) / (1 - mu) (c = (1 - d) g),
// Nesterov: mu moved + g; p <- p - lr moved.
SSF_HOST_DEVICE void momentum_element(float& p, float g, float& u, float& age,
                                      const MomentumArgs& s) {
  const float a = age + 1.0f;
  // an element that did not arrive (g = 0, most of them at a low density) adds nothing
  // through its share: skip the pow, which dominates the CPU's pass
  const float psi = g != 0.0f ? fresh_share(s.mu, a) : 1.0f;
  const float c = g * (1.0f - s.dampening);
  u = u * s.mu + c * psi;
  const float rest = psi * (-1.0f / (1.0f - s.mu)) + 1.0f / (1.0f - s.mu);
  float moved = u + c * rest;
  if (s.nesterov) moved = moved * s.mu + g;
  p = p + moved * -s.lr;
  age = g != 0.0f ? 0.0f : a;
}

struct AdamArgs {
  float lr, beta1, beta2, eps;
  float bias1;       // 1 - beta1^t (t: this tensor's step count)
  float bias2_sqrt;  // (1 - beta2^t)^(1/2)
};

// Adam: what arrived, g, is a steps of g / a: m <- b1 m + (1 - b1) g psi_b1(a),
// v <- b2 v + (1 - b2^a) (g / a)^2, update = (m + g (1 - psi)) / (sqrt(v) / bias2_sqrt + eps)
// / bias1; p <- p - lr update. Decoupled weight decay is the caller's.
SSF_HOST_DEVICE void adam_element(float& p, float g, float& m, float& v, float& age,
                                  const AdamArgs& s) {
  const float a = age + 1.0f;
  const bool arrived = g != 0.0f;  // (else every term below that reads a share adds 0)
  const float s1 = arrived ? fresh_share(s.beta1, a) : 1.0f;
  const float rate = g * (1.0f / a);
  m = m * s.beta1 + (1.0f - s.beta1) * (g * s1);
  v = v * s.beta2 + (rate * rate) * (arrived ? 1.0f - powf(s.beta2, a) : 0.0f);
  const float num = m + g * (1.0f - s1);
  const float denom = sqrtf(v) / s.bias2_sqrt + s.eps;
  p = p + (num / denom / s.bias1) * -s.lr;
  age = g != 0.0f ? 0.0f : a;
}

}  // namespace moments
}  // namespace ssf
