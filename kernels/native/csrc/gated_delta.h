// What the Gated DeltaNet's decode step (gated_delta.cpp) and prompt chunks
// (gated_delta_prompt.cpp) compute alike, so that a token's arithmetic is the same either way.
#pragma once

#include "kernels.h"

namespace fusedserve {

// SiLU(x) = x / (1 + e^-x), VL lanes at a time with vexp (silu_mul's arithmetic): a vector's body
// and its tail compute it alike, so no token's result depends on where its channel falls.
inline vf vsilu(vf x) { return _div(x, _add(vset(1.f), vexp(_sub(vzero(), x)))); }

// A tail of fewer than VL lanes through the vector op f: padded with zeros, the lanes kept.
template <typename F>
inline void tail_lanes(const float* x, float* y, int64_t m, F f) {
  alignas(64) float t[VL] = {}, r[VL];
  for (int64_t i = 0; i < m; ++i) t[i] = x[i];
  vstore(r, f(vload(t)));
  for (int64_t i = 0; i < m; ++i) y[i] = r[i];
}

// dst[0, m) = SiLU(acc rounded to T), rounded to T: the conv's output rounded, then SiLU's.
template <typename T>
inline void conv_silu(const float* acc, T* dst, int64_t m) {
  const auto f = [](vf a) { return vsilu(vround<T>(a)); };
  int64_t j = 0;
  for (; j + VL <= m; j += VL) vstore(dst + j, f(vload(acc + j)));
  if (j < m) {
    float r[VL];
    tail_lanes(acc + j, r, m - j, f);
    for (int64_t i = 0; i < m - j; ++i) dst[j + i] = static_cast<T>(r[i]);
  }
}

// One row's q and k of key head kh from the conv's output, L2-normalised as transformers' l2norm
// (x / sqrt(sum x^2 + 1e-6)), q scaled by 1 / sqrt(dk); and v of value head h.
template <typename T>
inline void delta_qkv(const T* row, int64_t kh, int64_t h, int64_t dk, int64_t dv, int64_t key_dim, float scale,
                      float* q, float* k, float* v) {
  float qq = 0.f, kk = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    q[i] = to_f(row[kh * dk + i]);
    k[i] = to_f(row[key_dim + kh * dk + i]);
    qq += q[i] * q[i];
    kk += k[i] * k[i];
  }
  const float rq = 1.f / std::sqrt(qq + 1e-6f), rk = 1.f / std::sqrt(kk + 1e-6f);
  for (int64_t i = 0; i < dk; ++i) q[i] = q[i] * rq * scale, k[i] *= rk;
  for (int64_t j = 0; j < dv; ++j) v[j] = to_f(row[2 * key_dim + h * dv + j]);
}

// beta = sigmoid(b) rounded to T (transformers computes it in the model's dtype).
template <typename T>
inline float delta_beta(T b) {
  const float bv = to_f(b);
  return to_f(static_cast<T>(1.f / (1.f + std::exp(-bv))));
}

// g = -exp(A_log) * softplus(a + dt_bias), float32.
template <typename T>
inline float delta_gate(T a, float neg_a, float dt_bias) {
  const float av = to_f(a) + dt_bias;
  return neg_a * (av > 20.f ? av : std::log1p(std::exp(av)));
}

// The rule's output o [dv] (float32) through the head's RMSNorm times its weight, gated by
// SiLU(z), rounded to T where transformers rounds (the output, the normed value, its product with
// the weight, the gated result).
template <typename T>
inline void gated_norm_row(float* o, const T* z, const T* w, float eps, int64_t dv, T* dst) {
  float ss = 0.f;
  for (int64_t j = 0; j < dv; ++j) {
    o[j] = to_f(static_cast<T>(o[j]));
    ss += o[j] * o[j];
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(dv) + eps);
  float zf[MAX_HEAD_DIM], gate[MAX_HEAD_DIM];
  for (int64_t j = 0; j < dv; ++j) zf[j] = to_f(z[j]);
  int64_t j = 0;
  for (; j + VL <= dv; j += VL) vstore(gate + j, vsilu(vload(zf + j)));
  if (j < dv) tail_lanes(zf + j, gate + j, dv - j, vsilu);
  for (j = 0; j < dv; ++j) {
    const float normed = to_f(static_cast<T>(o[j] * inv));
    const float weighted = to_f(static_cast<T>(to_f(w[j]) * normed));
    dst[j] = static_cast<T>(weighted * gate[j]);
  }
}

// The argument checks both entry points share: conv [n, C] (q, k, v), b and a [n, H], z and out
// [n, H dv], rows strided, one dtype; neg_a, dt_bias [H] and state [S, H, dk, dv] float32.
void check_delta_args(const char* fn, const at::Tensor& conv, const at::Tensor& b, const at::Tensor& a,
                      const at::Tensor& z, const at::Tensor& neg_a, const at::Tensor& dt_bias,
                      const at::Tensor& norm_w, int64_t key_heads, const at::Tensor& state,
                      const at::Tensor& slots, const at::Tensor& out);

}  // namespace fusedserve
