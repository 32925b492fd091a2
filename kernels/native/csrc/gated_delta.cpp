// The Gated DeltaNet's decode step (Qwen3.5, Qwen3-Next linear attention): the causal conv of one
// new input per row and the recurrent delta rule, each in one pass over the row's state, read and
// written in place in its slot of the layer's pool (no gather, no scatter, no temporaries).
#include "kernels.h"

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

// q, k [n, H, dk], v [n, H, dv], g and beta [n, H], float32; state [S, H, dk, dv] float32, row r's
// in slot slots[r]; out [n, H, dv] float32.
void gated_delta_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                        const at::Tensor& beta, at::Tensor state, const at::Tensor& slots, at::Tensor out) {
  const int64_t n = q.size(0), H = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat &&
              state.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "gated_delta_decode: float32 tensors");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && g.is_contiguous() &&
              beta.is_contiguous() && state.is_contiguous() && out.is_contiguous() && slots.is_contiguous(),
              "gated_delta_decode: contiguous tensors");
  TORCH_CHECK(state.dim() == 4 && state.size(1) == H && state.size(2) == dk && state.size(3) == dv &&
              slots.scalar_type() == at::kLong && slots.size(0) == n && dv <= MAX_HEAD_DIM,
              "gated_delta_decode: state [S, H, dk, dv], slots [n] int64, dv <= ", MAX_HEAD_DIM);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  float *st = state.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t slots_n = state.size(0);
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(sp[r] >= 0 && sp[r] < slots_n, "gated_delta_decode: slot out of range");
  at::parallel_for(0, n * H, 1, [&](int64_t a, int64_t b) {
    for (int64_t x = a; x < b; ++x) {
      const int64_t r = x / H, h = x % H;
      delta_row(st + (sp[r] * H + h) * dk * dv, qp + x * dk, kp + x * dk, vp + x * dv, gp[x], bp[x],
                op + x * dv, dk, dv);
    }
  });
}

template <typename T>
void conv_decode_impl(const at::Tensor& x, at::Tensor state, const at::Tensor& slots, const at::Tensor& w,
                      at::Tensor out) {
  const int64_t n = x.size(0), C = x.size(1), K = w.size(1), W = K - 1;
  const T *xp = x.data_ptr<T>(), *wp = w.data_ptr<T>();
  T *st = state.data_ptr<T>(), *op = out.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  at::parallel_for(0, n * C, 256, [&](int64_t a, int64_t b) {
    for (int64_t e = a; e < b; ++e) {
      const int64_t r = e / C, c = e % C;
      T* s = st + (sp[r] * C + c) * W;
      const T* wc = wp + c * K;
      const T xin = xp[r * ldx + c];
      float acc = 0.f;
      for (int64_t i = 0; i < W; ++i) acc += to_f(wc[i]) * to_f(s[i]);
      acc += to_f(wc[W]) * to_f(xin);
      // Rounded as the conv's output and then SiLU's are (each to T).
      const float y = to_f(static_cast<T>(acc));
      op[r * ldo + c] = static_cast<T>(y / (1.f + std::exp(-y)));
      for (int64_t i = 0; i + 1 < W; ++i) s[i] = s[i + 1];
      s[W - 1] = xin;
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
