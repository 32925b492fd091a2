// fusedserve CPU kernels: what every translation unit shares.
//
// The sources are compiled once per instruction set (kernels/native.py picks the flags from
// the running CPU): AVX-512 (+BF16, +VNNI), AVX2+FMA (+AVX-VNNI), or plain C++. This header is
// the vector layer they are written in, and the kernels' declarations.
#pragma once

// Tensor and the scalar types, not <ATen/ATen.h>: its every-op declarations cost each of these
// files ~4 s of a ~7 s compile (benchmarks/native_build.py measures the whole build).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace fusedserve {

using bf16 = c10::BFloat16;
using f16 = c10::Half;

constexpr int MAX_GROUP = 16;  // query heads per KV head
constexpr int MAX_HEAD_DIM = 512;

// ----------------------------------------------------------------- vector layer

#if defined(__AVX512F__)
#define FS_VL 16
constexpr int VL = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline vf vload(const bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vload(const f16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vf vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline vf _max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf _sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf _add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf _div(vf a, vf b) { return _mm512_div_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FS_VL 8
constexpr int VL = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline vf vload(const bf16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf vload(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf _max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf _sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf _add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf _div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
#define FS_VL 1
constexpr int VL = 1;
using vf = float;
inline vf vzero() { return 0.f; }
inline vf vset(float a) { return a; }
inline vf vload(const float* p) { return *p; }
inline void vstore(float* p, vf a) { *p = a; }
inline vf vload(const bf16* p) { return static_cast<float>(*p); }
inline vf vload(const f16* p) { return static_cast<float>(*p); }
inline vf vload(const int8_t* p) { return static_cast<float>(*p); }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf vmul(vf a, vf b) { return a * b; }
inline float vsum(vf a) { return a; }
inline vf _max(vf a, vf b) { return std::max(a, b); }
inline vf _sub(vf a, vf b) { return a - b; }
inline vf _add(vf a, vf b) { return a + b; }
inline vf _div(vf a, vf b) { return a / b; }
#endif

// 256-bit VNNI for the int8 and int4 GEMMs without AVX-512: vpdpbusd on ymm registers, in
// AVX-VNNI's VEX encoding, or in EVEX encoding (AVX-512 VNNI + VL) for the avxvnni_evex build,
// which runs this same code on hosts that have AVX-512 VNNI but not AVX-VNNI. Inline asm, not the
// intrinsic (see dot4 in linear_int8.cpp); the assembler takes either encoding whatever the flags.
#if FS_VL == 8 && (defined(__AVXVNNI__) || defined(FS_VNNI256_EVEX))
#define FS_VNNI256 1
#if defined(FS_VNNI256_EVEX)
#define FS_DPBUSD256 "%{evex%} vpdpbusd %2, %1, %0"  // %{ %}: literal braces in an asm template
#else
#define FS_DPBUSD256 "%{vex%} vpdpbusd %2, %1, %0"
#endif
#else
#define FS_VNNI256 0
#endif

// e^x for x in [-87, 88] (clamped there): 2^n * p(r), r = x - n ln2, degree-6 polynomial
// (relative error ~1e-7). The ISA blocks below only round n and apply 2^n.
inline vf exp_poly(vf x, vf n) {
  vf r = vfma(n, vset(-0.693145752f), x);  // ln 2 in two parts: r = x - n ln2, exactly enough
  r = vfma(n, vset(-1.42860677e-6f), r);
  vf p = vset(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = vfma(p, r, vset(c));
  return p;
}

#if defined(__AVX512F__)
inline vf vexp(vf x) {
  x = _mm512_min_ps(_mm512_max_ps(x, vset(-87.f)), vset(88.f));
  vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, vset(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf p = exp_poly(x, n);
  return _mm512_scalef_ps(p, n);
}
inline float vmax_all(vf a) { return _mm512_reduce_max_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline vf vexp(vf x) {
  x = _mm256_min_ps(_mm256_max_ps(x, vset(-87.f)), vset(88.f));
  vf n = _mm256_round_ps(_mm256_mul_ps(x, vset(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf p = exp_poly(x, n);
  __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}
inline float vmax_all(vf a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
#else
inline vf vexp(vf x) { return std::exp(x); }
inline float vmax_all(vf a) { return a; }
#endif

inline float to_f(float v) { return v; }
inline float to_f(bf16 v) { return static_cast<float>(v); }
inline float to_f(f16 v) { return static_cast<float>(v); }
inline float to_f(int8_t v) { return static_cast<float>(v); }

// Rounding to the model's dtype a vector at a time, bit for bit as static_cast<T> rounds one value
// (nearest even; a NaN becomes c10's 0x7FC0 in bf16), so the norms, rotary and SiLU x up run
// vectorized and still round like transformers: vround<T>(x) is x rounded to T and widened back,
// vstore(T*, x) stores x rounded to T.
template <typename T>
inline vf vround(vf x);
template <>
inline vf vround<float>(vf x) { return x; }
#if defined(__AVX512F__)
inline __m512i bf16_bits(vf x) {  // c10::BFloat16(x)'s bits in the low half of each 32-bit lane
  const __m512i u = _mm512_castps_si512(x);
  const __m512i bias =
      _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
template <>
inline vf vround<bf16>(vf x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16)); }
template <>
inline vf vround<f16>(vf x) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void vstore(bf16* p, vf x) {
#if defined(__AVX512BF16__)
  // vcvtneps2bf16 rounds as c10 does but for denormals (to zero) and NaN payloads: a vector with
  // either (fpclass: NaN or denormal) takes the exact path below.
  if (_mm512_fpclass_ps_mask(x, 0xA1) == 0) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
    return;
  }
#endif
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
}
inline void vstore(f16* p, vf x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif FS_VL > 1
inline __m256i bf16_bits(vf x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i bias =
      _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
template <>
inline vf vround<bf16>(vf x) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16)); }
template <>
inline vf vround<f16>(vf x) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void vstore(bf16* p, vf x) {
  const __m256i b = bf16_bits(x);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
inline void vstore(f16* p, vf x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
template <>
inline vf vround<bf16>(vf x) { return static_cast<float>(static_cast<bf16>(x)); }
template <>
inline vf vround<f16>(vf x) { return static_cast<float>(static_cast<f16>(x)); }
inline void vstore(bf16* p, vf x) { *p = static_cast<bf16>(x); }
inline void vstore(f16* p, vf x) { *p = static_cast<f16>(x); }
#endif

// Activation rows -> int8 for the integer GEMMs: q[k] = clamp(round(x[k] / s), -127, 127) with
// s = max|x| / 127 (1 for a zero row), each byte xor'ed with ``flip`` (0x80 stores q + 128, the
// unsigned form vpdpbusd reads). The vector and scalar parts round alike (the current mode,
// round-half-even, as std::nearbyint), so a row quantizes the same on every ISA.
#if defined(__AVX512F__)
inline vf vabs(vf a) { return _mm512_abs_ps(a); }
inline vf vneg(vf a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN))); }
inline void store_i8(int8_t* q, vf v, uint8_t flip) {
  __m512i i = _mm512_cvtps_epi32(v);
  i = _mm512_max_epi32(_mm512_min_epi32(i, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
  const __m128i b = _mm_xor_si128(_mm512_cvtepi32_epi8(i), _mm_set1_epi8(static_cast<char>(flip)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), b);
}
#elif FS_VL > 1
inline vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
inline vf vneg(vf a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.f)); }
inline void store_i8(int8_t* q, vf v, uint8_t flip) {
  __m256i i = _mm256_cvtps_epi32(v);
  i = _mm256_max_epi32(_mm256_min_epi32(i, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  const __m128i b = _mm_xor_si128(_mm_packs_epi16(w, w), _mm_set1_epi8(static_cast<char>(flip)));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), b);
}
#else
inline vf vabs(vf a) { return std::fabs(a); }
inline vf vneg(vf a) { return -a; }
#endif

template <typename T>
inline float quantize_row_i8(const T* x, int64_t K, int8_t* q, uint8_t flip) {
  vf am = vzero();
  int64_t k = 0;
  for (; k + FS_VL <= K; k += FS_VL) am = _max(am, vabs(vload(x + k)));
  float amax = vmax_all(am);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(to_f(x[k])));
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  const float inv = 1.f / s;
  k = 0;
#if FS_VL > 1
  for (; k + FS_VL <= K; k += FS_VL) store_i8(q + k, vmul(vload(x + k), vset(inv)), flip);
#endif
  for (; k < K; ++k) {
    const int v = std::max(-127, std::min(127, static_cast<int>(std::nearbyint(to_f(x[k]) * inv))));
    q[k] = static_cast<int8_t>(static_cast<uint8_t>(static_cast<uint8_t>(v) ^ flip));
  }
  return s;
}

// An int8 K/V cache row (``--kv-cache-dtype int8``): a head's D values quantized as above
// (symmetric, round-half-even), then their float32 scale in the row's last 4 bytes: x = q * scale.
constexpr int64_t KV8_SCALE_BYTES = 4;
inline float kv8_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof(s));
  return s;
}
template <typename T>
inline void kv8_store(const T* x, int64_t D, int8_t* row) {
  const float s = quantize_row_i8(x, D, row, 0);
  std::memcpy(row + D, &s, sizeof(s));
}

// prompt_attention.cpp
bool has_prompt_attention();
void prompt_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& chunks, int64_t block_size, double scale,
                      at::Tensor out);

// linear.cpp
const float* as_f32(const at::Tensor& x, std::vector<float>& buf);  // rows as fp32 (a reused scratch)
void linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale, at::Tensor out);
bool has_packed();
#if defined(__AVX512BF16__)
void linear_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scale,
                   at::Tensor out);
#endif

// brgemm.cpp
int64_t brgemm_block();
void linear_brgemm(const at::Tensor& x, const at::Tensor& packed, at::Tensor out);
void linear_brgemm_w8a8(const at::Tensor& q, const at::Tensor& packed, const at::Tensor& wsum, at::Tensor acc);

// linear_fma.cpp
int64_t vector_lanes();
void linear_fma(const at::Tensor& x, const at::Tensor& packed, at::Tensor out);

// linear_int8.cpp
int64_t int8_lanes();
bool int8_offset();
void quantize_rows_i8(const at::Tensor& x, at::Tensor q, at::Tensor sx);
void scale_int32(const at::Tensor& acc, const at::Tensor& sx, const at::Tensor& sw, at::Tensor out);
void linear_w8a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sw, const at::Tensor& wsum,
                 at::Tensor out);

// linear_int4.cpp
int64_t int4_lanes();
void linear_w4a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, at::Tensor out,
                 const c10::optional<at::Tensor>& zeros);

// attention.cpp
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                      double scale, at::Tensor out);

// norm.cpp
void add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& add, const at::Tensor& w, double eps,
                  at::Tensor out);
void qk_norm_rope(at::Tensor qkv, const at::Tensor& qw, const at::Tensor& kw, const at::Tensor& cos,
                  const at::Tensor& sin, double eps, at::Tensor q_out, int64_t H, int64_t KVH,
                  const c10::optional<at::Tensor>& k_cache, const c10::optional<at::Tensor>& v_cache,
                  const c10::optional<at::Tensor>& slot_mapping);
void silu_mul(const at::Tensor& gate_up, at::Tensor out);
void gated_delta_step(const at::Tensor& conv, const at::Tensor& b, const at::Tensor& a, const at::Tensor& z,
                      const at::Tensor& neg_a, const at::Tensor& dt_bias, const at::Tensor& norm_w, double eps,
                      int64_t key_heads, at::Tensor state, const at::Tensor& slots, at::Tensor out);
void conv_decode(const at::Tensor& x, at::Tensor state, const at::Tensor& slots, const at::Tensor& weight,
                 at::Tensor out);
// gated_delta_prompt.cpp
void gated_delta_prompt(const at::Tensor& conv, const at::Tensor& b, const at::Tensor& a, const at::Tensor& z,
                        const at::Tensor& neg_a, const at::Tensor& dt_bias, const at::Tensor& norm_w, double eps,
                        int64_t key_heads, at::Tensor state, const at::Tensor& slots, int64_t row, at::Tensor out);
void conv_prompt(const at::Tensor& x, at::Tensor state, const at::Tensor& slots, int64_t row, const at::Tensor& weight,
                 at::Tensor out);
void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask);
// lora.cpp
void lora_apply(const at::Tensor& x, at::Tensor y, const at::Tensor& slots, const at::Tensor& a,
                const at::Tensor& bt, const std::vector<int64_t>& parts, const at::Tensor& active);
bool group_arrive_wait(at::Tensor flags, int64_t rank, int64_t seq, int64_t wait_us);

}  // namespace fusedserve
