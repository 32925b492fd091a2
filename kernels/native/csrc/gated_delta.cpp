// The Gated DeltaNet's decode step (Qwen3.5, Qwen3-Next linear attention): the causal conv of one
// new input per row and the recurrent delta rule, each in one pass over the row's state, read and
// written in place in its slot of the layer's pool (no gather, no scatter, no temporaries).
#include "gated_delta.h"

namespace fusedserve {

// One (row, head): S [dk, dv] decays by exp(g), takes beta * (v - S^T k) along k, and is read by q.
// Two passes over S: S^T k, then the update with q's read of the new S.
static void delta_row(float* S, const float* q, const float* k, const float* v, float g, float beta,
                      float* out, int64_t dk, int64_t dv) {
  float kv[MAX_HEAD_DIM], delta[MAX_HEAD_DIM], o[MAX_HEAD_DIM];
  const float decay = std::exp(g);
  for (int64_t j = 0; j < dv; ++j) kv[j] = 0.f, o[j] = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    const float* s = S + i * dv;
    const float ki = k[i];
    int64_t j = 0;
    for (; j + VL <= dv; j += VL) vstore(kv + j, vfma(vload(s + j), vset(ki), vload(kv + j)));
    for (; j < dv; ++j) kv[j] += s[j] * ki;
  }
  for (int64_t j = 0; j < dv; ++j) delta[j] = (v[j] - kv[j] * decay) * beta;
  for (int64_t i = 0; i < dk; ++i) {
    float* s = S + i * dv;
    const vf vd = vset(decay), vk = vset(k[i]), vq = vset(q[i]);
    int64_t j = 0;
    for (; j + VL <= dv; j += VL) {
      const vf n = vfma(vload(s + j), vd, vmul(vk, vload(delta + j)));
      vstore(s + j, n);
      vstore(o + j, vfma(n, vq, vload(o + j)));
    }
    for (; j < dv; ++j) {
      s[j] = s[j] * decay + k[i] * delta[j];
      o[j] += s[j] * q[i];
    }
  }
  std::memcpy(out, o, dv * sizeof(float));
}

// The whole decode step after the conv, per (row, head): q and k of the head's key head
// L2-normalised (q scaled by 1 / sqrt(dk)), beta = sigmoid(b) and g = -exp(A) softplus(a + dt_bias),
// the delta rule in place in the row's slot, then the output's RMSNorm per head times its weight,
// gated by SiLU(z), rounded to T where transformers rounds (sigmoid, the rule's output, the normed
// value, its product with the weight, the gated result).
template <typename T>
void delta_step_impl(const at::Tensor& conv, const at::Tensor& b, const at::Tensor& a, const at::Tensor& z,
                     const at::Tensor& neg_a, const at::Tensor& dt_bias, const at::Tensor& norm_w, double eps,
                     int64_t key_heads, at::Tensor state, const at::Tensor& slots, at::Tensor out) {
  const int64_t n = conv.size(0), H = state.size(1), dk = state.size(2), dv = state.size(3);
  const int64_t per = H / key_heads, key_dim = key_heads * dk;
  const T *cp = conv.data_ptr<T>(), *bp = b.data_ptr<T>(), *ap = a.data_ptr<T>(), *zp = z.data_ptr<T>();
  const T* wp = norm_w.data_ptr<T>();
  const float *nap = neg_a.data_ptr<float>(), *dtp = dt_bias.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* st = state.data_ptr<float>();
  T* op = out.data_ptr<T>();
  const int64_t ldc = conv.stride(0), ldb = b.stride(0), lda = a.stride(0), ldz = z.stride(0), ldo = out.stride(0);
  const float e = static_cast<float>(eps), scale = 1.f / std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, n * H, 1, [&](int64_t x0, int64_t x1) {
    float q[MAX_HEAD_DIM], k[MAX_HEAD_DIM], v[MAX_HEAD_DIM], o[MAX_HEAD_DIM];
    for (int64_t x = x0; x < x1; ++x) {
      const int64_t r = x / H, h = x % H;
      delta_qkv(cp + r * ldc, h / per, h, dk, dv, key_dim, scale, q, k, v);
      const float beta = delta_beta(bp[r * ldb + h]), g = delta_gate(ap[r * lda + h], nap[h], dtp[h]);
      delta_row(st + (sp[r] * H + h) * dk * dv, q, k, v, g, beta, o, dk, dv);
      gated_norm_row(o, zp + r * ldz + h * dv, wp, e, dv, op + r * ldo + h * dv);
    }
  });
}

void check_delta_args(const char* fn, const at::Tensor& conv, const at::Tensor& b, const at::Tensor& a,
                      const at::Tensor& z, const at::Tensor& neg_a, const at::Tensor& dt_bias,
                      const at::Tensor& norm_w, int64_t key_heads, const at::Tensor& state,
                      const at::Tensor& slots, const at::Tensor& out) {
  const auto T = conv.scalar_type();
  TORCH_CHECK(b.scalar_type() == T && a.scalar_type() == T && z.scalar_type() == T && norm_w.scalar_type() == T &&
              out.scalar_type() == T && neg_a.scalar_type() == at::kFloat && dt_bias.scalar_type() == at::kFloat &&
              state.scalar_type() == at::kFloat, fn, ": dtypes");
  TORCH_CHECK(conv.stride(1) == 1 && b.stride(1) == 1 && a.stride(1) == 1 && z.stride(1) == 1 && out.stride(1) == 1 &&
              state.is_contiguous() && norm_w.is_contiguous() && slots.is_contiguous() && neg_a.is_contiguous() &&
              dt_bias.is_contiguous(), fn, ": rows with contiguous columns");
  const int64_t H = state.size(1), dk = state.size(2), dv = state.size(3), n = conv.size(0);
  TORCH_CHECK(state.dim() == 4 && key_heads > 0 && H % key_heads == 0 && dk <= MAX_HEAD_DIM && dv <= MAX_HEAD_DIM &&
              conv.size(1) == 2 * key_heads * dk + H * dv && b.size(1) == H && a.size(1) == H &&
              z.size(1) == H * dv && out.size(1) == H * dv && norm_w.numel() == dv && neg_a.numel() == H &&
              dt_bias.numel() == H && b.size(0) == n && a.size(0) == n && z.size(0) == n && out.size(0) == n &&
              slots.scalar_type() == at::kLong, fn, ": shapes");
}

// conv [n, C] (the conv's output: q, k, v), b and a [n, H], z [n, H dv], rows strided, one dtype T;
// neg_a, dt_bias [H] float32; norm_w [dv] T; state [S, H, dk, dv] float32, row r's in slot
// slots[r]; out [n, H dv] T: the gated, normed output of the delta rule, its states advanced.
void gated_delta_step(const at::Tensor& conv, const at::Tensor& b, const at::Tensor& a, const at::Tensor& z,
                      const at::Tensor& neg_a, const at::Tensor& dt_bias, const at::Tensor& norm_w, double eps,
                      int64_t key_heads, at::Tensor state, const at::Tensor& slots, at::Tensor out) {
  check_delta_args("gated_delta_step", conv, b, a, z, neg_a, dt_bias, norm_w, key_heads, state, slots, out);
  TORCH_CHECK(slots.size(0) == conv.size(0), "gated_delta_step: a slot per row");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < conv.size(0); ++r)
    TORCH_CHECK(sp[r] >= 0 && sp[r] < state.size(0), "gated_delta_step: slot out of range");
  const auto T = conv.scalar_type();
  switch (T) {
    case at::kFloat: delta_step_impl<float>(conv, b, a, z, neg_a, dt_bias, norm_w, eps, key_heads, state, slots, out); break;
    case at::kBFloat16: delta_step_impl<bf16>(conv, b, a, z, neg_a, dt_bias, norm_w, eps, key_heads, state, slots, out); break;
    case at::kHalf: delta_step_impl<f16>(conv, b, a, z, neg_a, dt_bias, norm_w, eps, key_heads, state, slots, out); break;
    default: TORCH_CHECK(false, "gated_delta_step: unsupported dtype ", T);
  }
}

// One channel's conv over its K - 1 saved inputs and the new one (fp32 sum, in tap order), the
// state shifted to take the new input.
template <typename T>
inline float conv_channel(T* s, const T* wc, T xin, int64_t W) {
  float acc = 0.f;
  for (int64_t i = 0; i < W; ++i) acc += to_f(wc[i]) * to_f(s[i]);
  acc += to_f(wc[W]) * to_f(xin);
  for (int64_t i = 0; i + 1 < W; ++i) s[i] = s[i + 1];
  s[W - 1] = xin;
  return acc;
}

// A work item is one row's block of VL channels: the taps per channel, then SiLU over the block
// (conv_silu: rounded as the conv's output and then SiLU's are, each to T).
template <typename T>
void conv_decode_impl(const at::Tensor& x, at::Tensor state, const at::Tensor& slots, const at::Tensor& w,
                      at::Tensor out) {
  const int64_t n = x.size(0), C = x.size(1), K = w.size(1), W = K - 1;
  const T *xp = x.data_ptr<T>(), *wp = w.data_ptr<T>();
  T *st = state.data_ptr<T>(), *op = out.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0), blocks = (C + VL - 1) / VL;
  at::parallel_for(0, n * blocks, 16, [&](int64_t a, int64_t b) {
    alignas(64) float acc[VL];
    for (int64_t e = a; e < b; ++e) {
      const int64_t r = e / blocks, c0 = (e % blocks) * VL, m = std::min<int64_t>(VL, C - c0);
      T* s = st + (sp[r] * C + c0) * W;
      const T* xr = xp + r * ldx + c0;
      T* o = op + r * ldo + c0;
      for (int64_t j = 0; j < m; ++j) acc[j] = conv_channel(s + j * W, wp + (c0 + j) * K, xr[j], W);
      conv_silu(acc, o, m);
    }
  });
}

// x [n, C] (a row's new input; rows may be strided), state [S, C, K - 1], weight [C, K], out [n, C],
// one dtype; out = SiLU(conv over the state's K - 1 inputs and x), and the state shifts in x.
void conv_decode(const at::Tensor& x, at::Tensor state, const at::Tensor& slots, const at::Tensor& weight,
                 at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 && state.is_contiguous() &&
              weight.is_contiguous() && state.dim() == 3 && state.size(1) == x.size(1) &&
              state.size(2) == weight.size(1) - 1 && weight.size(0) == x.size(1) && slots.size(0) == x.size(0) &&
              slots.scalar_type() == at::kLong && slots.is_contiguous() && x.scalar_type() == state.scalar_type() &&
              x.scalar_type() == weight.scalar_type() && x.scalar_type() == out.scalar_type(),
              "conv_decode: x [n, C], state [S, C, K - 1], weight [C, K], out [n, C], one dtype");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < x.size(0); ++r) TORCH_CHECK(sp[r] >= 0 && sp[r] < state.size(0), "conv_decode: slot out of range");
  switch (x.scalar_type()) {
    case at::kFloat: conv_decode_impl<float>(x, state, slots, weight, out); break;
    case at::kBFloat16: conv_decode_impl<bf16>(x, state, slots, weight, out); break;
    case at::kHalf: conv_decode_impl<f16>(x, state, slots, weight, out); break;
    default: TORCH_CHECK(false, "conv_decode: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace fusedserve
