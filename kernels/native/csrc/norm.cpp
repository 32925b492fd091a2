// RMSNorm (with the residual add) and the per-head q/k norm + rotary of Qwen3.
#include "kernels.h"

namespace fusedserve {
// ------------------------------------------------------------- norms and rotary
// Rounded like transformers' Qwen3 in the model's dtype: the normalised value is rounded to T
// before the weight multiplies it, and rotary rounds x*cos and rot(x)*sin before adding. With a
// float32 weight W over 16-bit rows (a hybrid's zero-centred norms, 1 + w): x / rms * w in float32,
// rounded once, as transformers' Qwen3.5 / Qwen3-Next norms are.

template <typename T>
inline float inv_rms(const T* x, int64_t D, float eps) {
  vf acc = vzero();
  int64_t d = 0;
  for (; d + VL <= D; d += VL) {
    vf v = vload(x + d);
    acc = vfma(v, v, acc);
  }
  float ss = vsum(acc);
  for (; d < D; ++d) ss += to_f(x[d]) * to_f(x[d]);
  return 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
}

template <typename T, typename W = T>
inline void norm_row(const T* x, const W* w, float r, int64_t D, T* out) {
  constexpr bool once = std::is_same_v<W, float> && !std::is_same_v<T, float>;
  int64_t d = 0;
  if constexpr (once) {
    for (; d + VL <= D; d += VL) vstore(out + d, vmul(vload(w + d), vmul(vload(x + d), vset(r))));
    for (; d < D; ++d) out[d] = static_cast<T>(w[d] * (to_f(x[d]) * r));
  } else {
    for (; d + VL <= D; d += VL) vstore(out + d, vmul(vload(w + d), vround<T>(vmul(vload(x + d), vset(r)))));
    for (; d < D; ++d) out[d] = static_cast<T>(to_f(w[d]) * to_f(static_cast<T>(to_f(x[d]) * r)));
  }
}

template <typename T, typename W = T>
void add_rms_norm_impl(at::Tensor& x, const c10::optional<at::Tensor>& add, const at::Tensor& w, double eps,
                       at::Tensor& out) {
  const int64_t N = x.size(0), D = x.size(1), ldx = x.stride(0), ldo = out.stride(0);
  T* xp = x.data_ptr<T>();
  const T* ap = add.has_value() ? add->data_ptr<T>() : nullptr;
  const int64_t lda = add.has_value() ? add->stride(0) : 0;
  const W* wp = w.data_ptr<W>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      T* row = xp + n * ldx;
      if (ap) {
        const T* a = ap + n * lda;
        int64_t d = 0;
        for (; d + VL <= D; d += VL) vstore(row + d, _add(vload(row + d), vload(a + d)));
        for (; d < D; ++d) row[d] = static_cast<T>(to_f(row[d]) + to_f(a[d]));
      }
      norm_row(row, wp, inv_rms(row, D, static_cast<float>(eps)), D, op + n * ldo);
    }
  });
}

// x += add (when given, rounded to x's dtype), then out = RMSNorm(x) * w; rows of [N, D].
void add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& add, const at::Tensor& w, double eps,
                  at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 && w.is_contiguous(),
              "rms_norm: [N, D] tensors with contiguous rows");
  TORCH_CHECK((x.scalar_type() == w.scalar_type() || w.scalar_type() == at::kFloat) &&
              x.scalar_type() == out.scalar_type(), "rms_norm: dtypes");
  TORCH_CHECK(!add.has_value() || (add->sizes() == x.sizes() && add->stride(1) == 1), "rms_norm: add shape");
  if (w.scalar_type() == at::kFloat && x.scalar_type() == at::kBFloat16) {
    add_rms_norm_impl<bf16, float>(x, add, w, eps, out);
    return;
  }
  if (w.scalar_type() == at::kFloat && x.scalar_type() == at::kHalf) {
    add_rms_norm_impl<f16, float>(x, add, w, eps, out);
    return;
  }
  switch (x.scalar_type()) {
    case at::kFloat: add_rms_norm_impl<float>(x, add, w, eps, out); break;
    case at::kBFloat16: add_rms_norm_impl<bf16>(x, add, w, eps, out); break;
    case at::kHalf: add_rms_norm_impl<f16>(x, add, w, eps, out); break;
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type());
  }
}

template <typename T, typename W>
inline void norm_rope_head(const T* src, const W* w, const T* cos, const T* sin, float eps, int64_t D,
                           T* tmp, T* dst) {
  norm_row(src, w, inv_rms(src, D, eps), D, tmp);
  const int64_t half = D / 2;
  if (half % VL == 0) {  // both halves a vector at a time: x cos + rot(x) sin, rot(x) = (-x2, x1)
    for (int64_t d = 0; d < half; d += VL) {
      const vf a = vload(tmp + d), b = vload(tmp + d + half);
      vstore(dst + d, _add(vround<T>(vmul(a, vload(cos + d))), vround<T>(vmul(vneg(b), vload(sin + d)))));
      vstore(dst + d + half,
             _add(vround<T>(vmul(b, vload(cos + d + half))), vround<T>(vmul(a, vload(sin + d + half)))));
    }
    return;
  }
  for (int64_t d = 0; d < D; ++d) {
    const float rot = d < half ? -to_f(tmp[d + half]) : to_f(tmp[d - half]);
    dst[d] = static_cast<T>(to_f(static_cast<T>(to_f(tmp[d]) * to_f(cos[d]))) +
                            to_f(static_cast<T>(rot * to_f(sin[d]))));
  }
}

// C: the caches' element, T or int8_t (rows of D values and their scale, kv8_store).
template <typename T, typename C, typename W = T>
void qk_norm_rope_impl(at::Tensor& qkv, const at::Tensor& qw, const at::Tensor& kw, const at::Tensor& cos,
                       const at::Tensor& sin, double eps, at::Tensor& q_out, int64_t H, int64_t KVH,
                       C* kc, C* vc, const int64_t* slots) {
  constexpr bool Q8 = std::is_same_v<C, int8_t> && !std::is_same_v<T, int8_t>;
  const int64_t N = qkv.size(0), D = qw.numel(), ld = qkv.stride(0);
  const int64_t hrow = Q8 ? D + KV8_SCALE_BYTES : D;  // a head's row in the cache, in C elements
  T* base = qkv.data_ptr<T>();
  T* qo = q_out.data_ptr<T>();
  const W *qwp = qw.data_ptr<W>(), *kwp = kw.data_ptr<W>();
  const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  const int64_t ldc = cos.stride(0), lds = sin.stride(0), kv_row = KVH * D, slot_row = KVH * hrow;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N * (H + KVH), 8, [&](int64_t w0, int64_t w1) {
    T tmp[MAX_HEAD_DIM];
    for (int64_t work = w0; work < w1; ++work) {
      const int64_t n = work / (H + KVH), h = work % (H + KVH);
      const T* c = cp + n * ldc;
      const T* s = sp + n * lds;
      if (h < H) {
        norm_rope_head(base + n * ld + h * D, qwp, c, s, e, D, tmp, qo + (n * H + h) * D);
      } else {
        T* k = base + n * ld + H * D + (h - H) * D;
        norm_rope_head(k, kwp, c, s, e, D, tmp, k);
        if (kc) {  // this token's K and V into its cache slot
          C* kd = kc + slots[n] * slot_row + (h - H) * hrow;
          C* vd = vc + slots[n] * slot_row + (h - H) * hrow;
          if constexpr (Q8) {
            kv8_store(k, D, kd);
            kv8_store(k + kv_row, D, vd);
          } else {
            std::memcpy(kd, k, D * sizeof(T));
            std::memcpy(vd, k + kv_row, D * sizeof(T));
          }
        }
      }
    }
  });
}

// q_out[n, h] = rotary(RMSNorm(q[n, h]) * qw); k heads of qkv normalised and rotated in place; with
// caches given, each token's k and v heads also land in row slots[n] of k_cache / v_cache: as they
// are ([slots, KVH, D] in qkv's dtype), or quantized (int8 [slots, KVH, D + 4], kv8_store).
void qk_norm_rope(at::Tensor qkv, const at::Tensor& qw, const at::Tensor& kw, const at::Tensor& cos,
                  const at::Tensor& sin, double eps, at::Tensor q_out, int64_t H, int64_t KVH,
                  const c10::optional<at::Tensor>& k_cache, const c10::optional<at::Tensor>& v_cache,
                  const c10::optional<at::Tensor>& slot_mapping) {
  const int64_t D = qw.numel();
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && q_out.is_contiguous() && D <= MAX_HEAD_DIM && D % 2 == 0,
              "qk_norm_rope: qkv [N, (H + 2 KVH) D] rows contiguous, q_out contiguous");
  TORCH_CHECK(cos.stride(-1) == 1 && sin.stride(-1) == 1 && cos.size(-1) == D && qkv.size(1) >= (H + 2 * KVH) * D,
              "qk_norm_rope: cos/sin [N, D]");
  const bool f32w = qw.scalar_type() == at::kFloat && qkv.scalar_type() != at::kFloat;
  TORCH_CHECK(qkv.scalar_type() == q_out.scalar_type() && qkv.scalar_type() == cos.scalar_type() &&
              (qkv.scalar_type() == qw.scalar_type() || f32w) && kw.scalar_type() == qw.scalar_type(),
              "qk_norm_rope: dtypes");
  const bool cache = k_cache.has_value();
  const bool q8 = cache && k_cache->scalar_type() == at::kChar;
  if (cache) {
    const bool layout = q8 ? k_cache->size(-2) == KVH && k_cache->size(-1) == D + KV8_SCALE_BYTES
                           : k_cache->scalar_type() == qkv.scalar_type() &&
                                 k_cache->size(-1) * k_cache->size(-2) == KVH * D;
    TORCH_CHECK(v_cache.has_value() && slot_mapping.has_value() && k_cache->is_contiguous() &&
                v_cache->is_contiguous() && v_cache->scalar_type() == k_cache->scalar_type() &&
                k_cache->numel() == v_cache->numel() && layout && slot_mapping->scalar_type() == at::kLong &&
                slot_mapping->numel() == qkv.size(0) && slot_mapping->is_contiguous(),
                "qk_norm_rope: caches [slots, KVH, D] in qkv's dtype or int8 [slots, KVH, D + 4], "
                "slot_mapping [N] int64");
  }
  const int64_t* slots = cache ? slot_mapping->data_ptr<int64_t>() : nullptr;
  switch (qkv.scalar_type()) {
#define FS_QK(T, S)                                                                                        \
  case S:                                                                                                  \
    if (f32w && !q8)                                                                                       \
      qk_norm_rope_impl<T, T, float>(qkv, qw, kw, cos, sin, eps, q_out, H, KVH,                            \
                                     cache ? k_cache->data_ptr<T>() : nullptr,                           \
                                     cache ? v_cache->data_ptr<T>() : nullptr, slots);                   \
    else if (q8 && f32w)                                                                                   \
      qk_norm_rope_impl<T, int8_t, float>(qkv, qw, kw, cos, sin, eps, q_out, H, KVH,                       \
                                          k_cache->data_ptr<int8_t>(), v_cache->data_ptr<int8_t>(), slots); \
    else if (q8)                                                                                           \
      qk_norm_rope_impl<T, int8_t>(qkv, qw, kw, cos, sin, eps, q_out, H, KVH, k_cache->data_ptr<int8_t>(), \
                                   v_cache->data_ptr<int8_t>(), slots);                                  \
    else                                                                                                   \
      qk_norm_rope_impl<T, T>(qkv, qw, kw, cos, sin, eps, q_out, H, KVH,                                   \
                              cache ? k_cache->data_ptr<T>() : nullptr,                                  \
                              cache ? v_cache->data_ptr<T>() : nullptr, slots);                          \
    break;
    FS_QK(float, at::kFloat)
    FS_QK(bf16, at::kBFloat16)
    FS_QK(f16, at::kHalf)
#undef FS_QK
    default: TORCH_CHECK(false, "qk_norm_rope: unsupported dtype ", qkv.scalar_type());
  }
}

template <typename T>
void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t N = gate_up.size(0), I = out.size(1), ldg = gate_up.stride(0), ldo = out.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const T* g = gp + n * ldg;
      const T* u = g + I;
      T* o = op + n * ldo;
      // Rounded like silu_ then mul in T: the activation to T, then the product to T.
      int64_t i = 0;
      for (; i + VL <= I; i += VL) {
        const vf gv = vload(g + i);
        const vf s = _div(gv, _add(vset(1.f), vexp(_sub(vzero(), gv))));
        vstore(o + i, vmul(vround<T>(s), vload(u + i)));
      }
      for (; i < I; ++i) {
        const float gv = to_f(g[i]);
        o[i] = static_cast<T>(to_f(static_cast<T>(gv / (1.f + std::exp(-gv)))) * to_f(u[i]));
      }
    }
  });
}

// out[n, i] = silu(gate_up[n, i]) * gate_up[n, I + i]: the MLP's activation in one pass.
void silu_mul(const at::Tensor& gate_up, at::Tensor out) {
  TORCH_CHECK(gate_up.dim() == 2 && out.dim() == 2 && gate_up.size(1) == 2 * out.size(1) &&
              gate_up.size(0) == out.size(0) && gate_up.stride(1) == 1 && out.stride(1) == 1 &&
              gate_up.scalar_type() == out.scalar_type(), "silu_mul: gate_up [N, 2I], out [N, I], one dtype");
  switch (out.scalar_type()) {
    case at::kFloat: silu_mul_impl<float>(gate_up, out); break;
    case at::kBFloat16: silu_mul_impl<bf16>(gate_up, out); break;
    case at::kHalf: silu_mul_impl<f16>(gate_up, out); break;
    default: TORCH_CHECK(false, "silu_mul: unsupported dtype ", out.scalar_type());
  }
}
}  // namespace fusedserve
