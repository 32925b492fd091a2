// fusedserve CPU kernels: weight-streaming linear (bf16/fp16/int8 weights) and paged
// decode attention read in place from the KV pages.
//
// One source, compiled once per instruction set (kernels/native.py picks the flags
// from the running CPU): AVX-512 (+BF16), AVX2+FMA, or plain C++. Every output
// element's reduction runs in a fixed order that depends only on K (vector lanes
// over k, a fixed horizontal sum, then the scalar tail), never on how many rows the
// call has, so a request's outputs do not depend on the batch it lands in.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
using f16 = c10::Half;

// ----------------------------------------------------------------- vector layer

#if defined(__AVX512F__)
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
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
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
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
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
#endif

inline float to_f(float v) { return v; }
inline float to_f(bf16 v) { return static_cast<float>(v); }
inline float to_f(f16 v) { return static_cast<float>(v); }
inline float to_f(int8_t v) { return static_cast<float>(v); }

const char* isa_name() {
#if defined(__AVX512BF16__)
  return "avx512bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

// ----------------------------------------------------------------------- linear

constexpr int MR = 4;  // activation rows per register tile
constexpr int NR = 4;  // weight rows per register tile

// acc[i][j] = x[i] . w[j] over K, in the fixed order described at the top.
template <typename W, int M, int N>
inline void dot_tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float* res) {
  vf acc[M][N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) acc[i][j] = vzero();
  int64_t k = 0;
  for (; k + VL <= K; k += VL) {
    vf wv[N];
    for (int j = 0; j < N; ++j) wv[j] = vload(w + j * ldw + k);
    for (int i = 0; i < M; ++i) {
      vf xv = vload(x + i * ldx + k);
      for (int j = 0; j < N; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float s = vsum(acc[i][j]);
      for (int64_t t = k; t < K; ++t) s += x[i * ldx + t] * to_f(w[j * ldw + t]);
      res[i * NR + j] = s;
    }
}

template <typename W, int N>
inline void dot_rows(int m, const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float* res) {
  switch (m) {
    case 4: dot_tile<W, 4, N>(x, ldx, w, ldw, K, res); break;
    case 3: dot_tile<W, 3, N>(x, ldx, w, ldw, K, res); break;
    case 2: dot_tile<W, 2, N>(x, ldx, w, ldw, K, res); break;
    default: dot_tile<W, 1, N>(x, ldx, w, ldw, K, res); break;
  }
}

#if defined(__AVX512BF16__)
// bf16 x bf16 pairs into fp32 lanes (vdpbf16ps), 32 k per instruction.
template <int M, int N>
inline void dot_tile_bf16(const bf16* x, int64_t ldx, const bf16* w, int64_t ldw, int64_t K, float* res) {
  __m512 acc[M][N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[N];
    for (int j = 0; j < N; ++j) wv[j] = _mm512_loadu_si512(w + j * ldw + k);
    for (int i = 0; i < M; ++i) {
      __m512i xv = _mm512_loadu_si512(x + i * ldx + k);
      for (int j = 0; j < N; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float s = _mm512_reduce_add_ps(acc[i][j]);
      for (int64_t t = k; t < K; ++t) s += to_f(x[i * ldx + t]) * to_f(w[j * ldw + t]);
      res[i * NR + j] = s;
    }
}

template <int N>
inline void dot_rows_bf16(int m, const bf16* x, int64_t ldx, const bf16* w, int64_t ldw, int64_t K, float* res) {
  switch (m) {
    case 4: dot_tile_bf16<4, N>(x, ldx, w, ldw, K, res); break;
    case 3: dot_tile_bf16<3, N>(x, ldx, w, ldw, K, res); break;
    case 2: dot_tile_bf16<2, N>(x, ldx, w, ldw, K, res); break;
    default: dot_tile_bf16<1, N>(x, ldx, w, ldw, K, res); break;
  }
}
#endif

template <typename O>
inline void store_out(O* out, int64_t ldo, int m, int n, const float* res, const float* scale) {
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      float v = res[i * NR + j];
      if (scale) v *= scale[j];
      out[i * ldo + j] = static_cast<O>(v);
    }
}

// Activations as float32 rows: a scratch that grows once and is reused (no per-call allocation).
const float* as_f32(const at::Tensor& x, std::vector<float>& buf) {
  const int64_t M = x.size(0), K = x.size(1), ld = x.stride(0);
  if (x.scalar_type() == at::kFloat && ld == K) return x.data_ptr<float>();
  if (buf.size() < static_cast<size_t>(M * K)) buf.resize(M * K);
  for (int64_t i = 0; i < M; ++i) {
    float* dst = buf.data() + i * K;
    switch (x.scalar_type()) {
      case at::kFloat: std::memcpy(dst, x.data_ptr<float>() + i * ld, K * sizeof(float)); break;
      case at::kBFloat16: { const bf16* s = x.data_ptr<bf16>() + i * ld; for (int64_t k = 0; k < K; ++k) dst[k] = s[k]; break; }
      case at::kHalf: { const f16* s = x.data_ptr<f16>() + i * ld; for (int64_t k = 0; k < K; ++k) dst[k] = s[k]; break; }
      default: TORCH_CHECK(false, "linear: unsupported activation dtype ", x.scalar_type());
    }
  }
  return buf.data();
}

template <typename W, typename O>
void linear_f32(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* scale,
                O* out, int64_t ldo) {
  const int64_t nblocks = (N + NR - 1) / NR;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    float res[MR * NR];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NR;
      const int n = static_cast<int>(std::min<int64_t>(NR, N - n0));
      const W* wb = w + n0 * K;
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int m = static_cast<int>(std::min<int64_t>(MR, M - m0));
        switch (n) {
          case 4: dot_rows<W, 4>(m, x + m0 * K, K, wb, K, K, res); break;
          case 3: dot_rows<W, 3>(m, x + m0 * K, K, wb, K, K, res); break;
          case 2: dot_rows<W, 2>(m, x + m0 * K, K, wb, K, K, res); break;
          default: dot_rows<W, 1>(m, x + m0 * K, K, wb, K, K, res); break;
        }
        store_out(out + m0 * ldo + n0, ldo, m, n, res, scale ? scale + n0 : nullptr);
      }
    }
  });
}

#if defined(__AVX512BF16__)
void linear_bf16_dp(const bf16* x, int64_t ldx, int64_t M, int64_t K, const bf16* w, int64_t N,
                    bf16* out, int64_t ldo) {
  const int64_t nblocks = (N + NR - 1) / NR;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    float res[MR * NR];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NR;
      const int n = static_cast<int>(std::min<int64_t>(NR, N - n0));
      const bf16* wb = w + n0 * K;
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int m = static_cast<int>(std::min<int64_t>(MR, M - m0));
        switch (n) {
          case 4: dot_rows_bf16<4>(m, x + m0 * ldx, ldx, wb, K, K, res); break;
          case 3: dot_rows_bf16<3>(m, x + m0 * ldx, ldx, wb, K, K, res); break;
          case 2: dot_rows_bf16<2>(m, x + m0 * ldx, ldx, wb, K, K, res); break;
          default: dot_rows_bf16<1>(m, x + m0 * ldx, ldx, wb, K, K, res); break;
        }
        store_out(out + m0 * ldo + n0, ldo, m, n, res, nullptr);
      }
    }
  });
}
#endif

#if defined(__AVX512BF16__)
// int8 weights with bf16 activations: each block of NR weight rows is widened to bf16 once
// (exact: |q| <= 127 fits bf16's mantissa) into an L1-resident scratch, then every row tile
// runs vdpbf16ps over it; the per-channel scale is applied to the fp32 sum.
void linear_int8_dp(const bf16* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, const float* scale,
                    int64_t N, bf16* out, int64_t ldo) {
  const int64_t nblocks = (N + NR - 1) / NR;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<bf16> wbuf;
    if (wbuf.size() < static_cast<size_t>(NR * K)) wbuf.resize(NR * K);
    float res[MR * NR];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NR;
      const int n = static_cast<int>(std::min<int64_t>(NR, N - n0));
      const int8_t* src = w + n0 * K;
      bf16* dst = wbuf.data();
      const int64_t total = n * K;
      int64_t k = 0;
      for (; k + 32 <= total; k += 32) {
        __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k));
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
        _mm512_storeu_si512(dst + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
      for (; k < total; ++k) dst[k] = static_cast<bf16>(static_cast<float>(src[k]));
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int m = static_cast<int>(std::min<int64_t>(MR, M - m0));
        switch (n) {
          case 4: dot_rows_bf16<4>(m, x + m0 * ldx, ldx, dst, K, K, res); break;
          case 3: dot_rows_bf16<3>(m, x + m0 * ldx, ldx, dst, K, K, res); break;
          case 2: dot_rows_bf16<2>(m, x + m0 * ldx, ldx, dst, K, K, res); break;
          default: dot_rows_bf16<1>(m, x + m0 * ldx, ldx, dst, K, K, res); break;
        }
        store_out(out + m0 * ldo + n0, ldo, m, n, res, scale + n0);
      }
    }
  });
}
#endif

#if defined(__AVX512BF16__)
// ------------------------------------------------- packed GEMM (AVX-512 BF16 builds)
// Weights packed at load as [N/16, K/2, 16, 2]: one 64-byte vector holds 16 output channels
// x one pair of k, so a tile of MP activation rows x NP vectors (16 NP channels) keeps MP x NP
// accumulators in registers and each weight vector is loaded once per row tile
// (vdpbf16ps with the activation pair broadcast). Each output lane sums its k pairs in order:
// the same for any number of rows. int8 weights are widened to bf16 (exact) block by block.
constexpr int MP = 6;  // activation rows per tile
constexpr int NP = 4;  // 16-channel vectors per tile

// 32 int8 -> 32 bf16, exact (|q| <= 127).
inline __m512i widen_int8(const int8_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

inline __m512i load_w(const bf16* p) { return _mm512_loadu_si512(p); }
inline __m512i load_w(const int8_t* p) { return widen_int8(p); }

// W: bf16 (a packed weight, or an int8 block widened ahead) or int8 widened in registers.
template <int M, int NV, typename W>
inline void packed_tile(const bf16* x, int64_t ldx, int64_t K2, const W* const* w, __m512* res) {
  __m512 a[M][NV];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) a[i][v] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512i wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load_w(w[v] + kp * 32);
    for (int i = 0; i < M; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * kp, sizeof(pair));
      const __m512i xb = _mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) a[i][v] = _mm512_dpbf16_ps(a[i][v], (__m512bh)xb, (__m512bh)wv[v]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) res[i * NP + v] = a[i][v];
}

template <int NV, typename W>
inline void packed_rows(int m, const bf16* x, int64_t ldx, int64_t K2, const W* const* w, __m512* res) {
  switch (m) {
    case 6: packed_tile<6, NV>(x, ldx, K2, w, res); break;
    case 5: packed_tile<5, NV>(x, ldx, K2, w, res); break;
    case 4: packed_tile<4, NV>(x, ldx, K2, w, res); break;
    case 3: packed_tile<3, NV>(x, ldx, K2, w, res); break;
    case 2: packed_tile<2, NV>(x, ldx, K2, w, res); break;
    default: packed_tile<1, NV>(x, ldx, K2, w, res); break;
  }
}

template <typename W>
inline void packed_nv(int nv, int m, const bf16* x, int64_t ldx, int64_t K2, const W* const* w, __m512* res) {
  switch (nv) {
    case 4: packed_rows<4>(m, x, ldx, K2, w, res); break;
    case 3: packed_rows<3>(m, x, ldx, K2, w, res); break;
    case 2: packed_rows<2>(m, x, ldx, K2, w, res); break;
    default: packed_rows<1>(m, x, ldx, K2, w, res); break;
  }
}

// out[M, N] (bf16) = x[M, K] (bf16) @ W^T for W packed [ceil(N/16), K/2, 16, 2] (bf16 or int8,
// with float32 scales [N] for int8).
void linear_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scale,
                   at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2,
              "linear_packed: x [M, K], packed [N/16, K/2, 16, 2], out [M, N]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&
              out.stride(1) == 1 && packed.is_contiguous(), "linear_packed: bf16 rows, contiguous pack");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), K2 = packed.size(1);
  TORCH_CHECK(K == 2 * K2 && out.size(0) == M && packed.size(0) * 16 >= N && packed.size(0) * 16 < N + 16,
              "linear_packed: shape mismatch x ", x.sizes(), " packed ", packed.sizes(), " out ", out.sizes());
  const bool int8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || packed.scalar_type() == at::kBFloat16, "linear_packed: bf16 or int8 pack");
  const float* sc = nullptr;
  if (int8) {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->numel() == N, "int8 scales");
    sc = scale->data_ptr<float>();
  }
  if (M == 0) return;
  const bf16* xp = x.data_ptr<bf16>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  bf16* op = out.data_ptr<bf16>();
  const int64_t nvec = packed.size(0);
  const int64_t nblocks = (nvec + NP - 1) / NP;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<bf16> wide;  // an int8 block widened to bf16
    __m512 res[MP * NP];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t v0 = blk * NP;
      const int nv = static_cast<int>(std::min<int64_t>(NP, nvec - v0));
      const bf16* w[NP];
      const int8_t* w8[NP];
      // int8 within one row tile: widened in registers; over several: once, into a scratch.
      const bool widen_ahead = int8 && M > MP;
      if (widen_ahead) {
        if (wide.size() < static_cast<size_t>(NP * K2 * 32)) wide.resize(NP * K2 * 32);
        const int8_t* src = packed.data_ptr<int8_t>() + v0 * K2 * 32;
        for (int64_t e = 0; e < nv * K2 * 32; e += 32) _mm512_storeu_si512(wide.data() + e, widen_int8(src + e));
        for (int v = 0; v < nv; ++v) w[v] = wide.data() + v * K2 * 32;
      } else if (int8) {
        for (int v = 0; v < nv; ++v) w8[v] = packed.data_ptr<int8_t>() + (v0 + v) * K2 * 32;
      } else {
        for (int v = 0; v < nv; ++v) w[v] = packed.data_ptr<bf16>() + (v0 + v) * K2 * 32;
      }
      for (int64_t m0 = 0; m0 < M; m0 += MP) {
        const int m = static_cast<int>(std::min<int64_t>(MP, M - m0));
        if (int8 && !widen_ahead)
          packed_nv(nv, m, xp + m0 * ldx, ldx, K2, w8, res);
        else
          packed_nv(nv, m, xp + m0 * ldx, ldx, K2, w, res);
        for (int v = 0; v < nv; ++v) {
          const int64_t n0 = (v0 + v) * 16;
          const int valid = static_cast<int>(std::min<int64_t>(16, N - n0));
          const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
          const __m512 s = sc ? _mm512_maskz_loadu_ps(mask, sc + n0) : _mm512_setzero_ps();
          for (int i = 0; i < m; ++i) {
            __m512 r = res[i * NP + v];
            if (sc) r = _mm512_mul_ps(r, s);
            _mm256_mask_storeu_epi16(op + (m0 + i) * ldo + n0, mask, (__m256i)_mm512_cvtneps_pbh(r));
          }
        }
      }
    }
  });
}
#endif

bool has_packed() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

template <typename W>
void dispatch_out(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* scale,
                  at::Tensor& out) {
  const int64_t ldo = out.stride(0);
  switch (out.scalar_type()) {
    case at::kFloat: linear_f32(x, M, K, w, N, scale, out.data_ptr<float>(), ldo); break;
    case at::kBFloat16: linear_f32(x, M, K, w, N, scale, out.data_ptr<bf16>(), ldo); break;
    case at::kHalf: linear_f32(x, M, K, w, N, scale, out.data_ptr<f16>(), ldo); break;
    default: TORCH_CHECK(false, "linear: unsupported output dtype ", out.scalar_type());
  }
}

// out[M, N] = x[M, K] @ w[N, K]^T (x scale[n] for int8 weights), fp32 accumulation.
void linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "linear: 2-d tensors expected");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu(), "linear: CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && out.size(0) == M && out.size(1) == N, "linear: shape mismatch x ", x.sizes(),
              " w ", w.sizes(), " out ", out.sizes());
  TORCH_CHECK(w.is_contiguous(), "linear: weight must be contiguous");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "linear: rows of x and out must be contiguous");
  if (M == 0) return;
  const float* sc = nullptr;
  if (w.scalar_type() == at::kChar) {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->numel() == N &&
                scale->is_contiguous(), "linear: int8 weights need float32 scales [N]");
    sc = scale->data_ptr<float>();
  }
#if defined(__AVX512BF16__)
  if (w.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16) {
    linear_bf16_dp(x.data_ptr<bf16>(), x.stride(0), M, K, w.data_ptr<bf16>(), N, out.data_ptr<bf16>(),
                   out.stride(0));
    return;
  }
  if (w.scalar_type() == at::kChar && x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16) {
    linear_int8_dp(x.data_ptr<bf16>(), x.stride(0), M, K, w.data_ptr<int8_t>(), sc, N, out.data_ptr<bf16>(),
                   out.stride(0));
    return;
  }
#endif
  thread_local std::vector<float> xbuf;
  const float* xf = as_f32(x, xbuf);
  switch (w.scalar_type()) {
    case at::kBFloat16: dispatch_out(xf, M, K, w.data_ptr<bf16>(), N, sc, out); break;
    case at::kHalf: dispatch_out(xf, M, K, w.data_ptr<f16>(), N, sc, out); break;
    case at::kChar: dispatch_out(xf, M, K, w.data_ptr<int8_t>(), N, sc, out); break;
    case at::kFloat: dispatch_out(xf, M, K, w.data_ptr<float>(), N, sc, out); break;
    default: TORCH_CHECK(false, "linear: unsupported weight dtype ", w.scalar_type());
  }
}

// -------------------------------------------------------------- decode attention

constexpr int CHUNK = 32;  // context tokens scored before one online-softmax rescale
constexpr int MAX_GROUP = 16;
constexpr int MAX_HEAD_DIM = 512;

template <typename T>
inline float dot_f32(const float* q, const T* k, int64_t D) {
  vf acc = vzero();
  int64_t d = 0;
  for (; d + VL <= D; d += VL) acc = vfma(vload(q + d), vload(k + d), acc);
  float s = vsum(acc);
  for (; d < D; ++d) s += q[d] * to_f(k[d]);
  return s;
}

template <typename T>
inline void axpy_f32(float a, const T* v, float* acc, int64_t D) {
  vf av = vset(a);
  int64_t d = 0;
  for (; d + VL <= D; d += VL) vstore(acc + d, vfma(av, vload(v + d), vload(acc + d)));
  for (; d < D; ++d) acc[d] += a * to_f(v[d]);
}

inline void scale_f32(float a, float* acc, int64_t D) {
  vf av = vset(a);
  int64_t d = 0;
  for (; d + VL <= D; d += VL) vstore(acc + d, vmul(av, vload(acc + d)));
  for (; d < D; ++d) acc[d] *= a;
}

// e^x for the softmax (x <= 0 here): 2^n * p(r), r = x - n ln2, degree-6 polynomial
// (relative error ~1e-7).
#if defined(__AVX512F__)
inline vf vexp(vf x) {
  x = _mm512_max_ps(x, vset(-87.f));
  vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, vset(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm512_fnmadd_ps(n, vset(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, vset(1.42860677e-6f), r);
  vf p = vset(1.f / 720);
  p = vfma(p, r, vset(1.f / 120));
  p = vfma(p, r, vset(1.f / 24));
  p = vfma(p, r, vset(1.f / 6));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.f));
  p = vfma(p, r, vset(1.f));
  return _mm512_scalef_ps(p, n);
}
inline float vmax_all(vf a) { return _mm512_reduce_max_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline vf vexp(vf x) {
  x = _mm256_max_ps(x, vset(-87.f));
  vf n = _mm256_round_ps(_mm256_mul_ps(x, vset(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm256_fnmadd_ps(n, vset(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, vset(1.42860677e-6f), r);
  vf p = vset(1.f / 720);
  p = vfma(p, r, vset(1.f / 120));
  p = vfma(p, r, vset(1.f / 24));
  p = vfma(p, r, vset(1.f / 6));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.f));
  p = vfma(p, r, vset(1.f));
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

// One query token per sequence against its paged context, K/V read in place from the
// pages; online softmax in float32; query head h reads KV head h / (H / KVH).
// A work item is one sequence and a run of its KV heads (all of them when the batch alone
// keeps the threads busy): a token's K/V rows for those heads are contiguous in the page,
// so the pages stream in order. GT: query heads per KV head known at compile time (0: not).
template <typename T, int GT>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                           double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), G = GT > 0 ? GT : H / KVH;
  const int64_t max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t slot_stride = KVH * D;
  const int64_t DV = D - D % VL;  // vector part of a head row
  const float sc = static_cast<float>(scale);
  // Split the KV heads into groups only as far as the threads need work.
  int64_t groups = 1;
  const int64_t threads = at::get_num_threads();
  while (B * groups < threads && groups < KVH) {
    int64_t next = groups + 1;
    while (KVH % next) ++next;
    groups = next;
  }
  const int64_t hpg = KVH / groups;  // KV heads per work item
  const int64_t nq = hpg * G;  // query heads per work item
  at::parallel_for(0, B * groups, 1, [&](int64_t w0, int64_t w1) {
    thread_local std::vector<float> qbuf, abuf, sbuf;
    if (qbuf.size() < static_cast<size_t>(nq * D)) { qbuf.resize(nq * D); abuf.resize(nq * D); }
    if (sbuf.size() < static_cast<size_t>(nq * CHUNK)) sbuf.resize(nq * CHUNK);
    float* qf = qbuf.data();
    float* acc = abuf.data();
    float* s = sbuf.data();
    float mx[MAX_GROUP * 64], l[MAX_GROUP * 64];
    for (int64_t work = w0; work < w1; ++work) {
      const int64_t b = work / groups, kh0 = (work % groups) * hpg;
      const int64_t len = sl[b];
      for (int64_t j = 0; j < nq; ++j) {
        const T* src = qp + b * qs0 + (kh0 * G + j) * qs1;
        for (int64_t d = 0; d < D; ++d) qf[j * D + d] = to_f(src[d]) * sc;
        std::fill(acc + j * D, acc + (j + 1) * D, 0.f);
        mx[j] = -INFINITY;
        l[j] = 0.f;
      }
      for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {
        const int64_t n = std::min<int64_t>(CHUNK, len - t0);
        const T* krows[CHUNK];
        const T* vrows[CHUNK];
        for (int64_t t = 0; t < n; ++t) {
          const int64_t pos = t0 + t;
          const int64_t slot = static_cast<int64_t>(bt[b * max_blocks + pos / block_size]) * block_size +
                               pos % block_size;
          krows[t] = kp + slot * slot_stride + kh0 * D;
          vrows[t] = vp + slot * slot_stride + kh0 * D;
        }
        for (int64_t t = 0; t < n; ++t) {  // scores: each K row once for its G query heads
          for (int64_t h = 0; h < hpg; ++h) {
            const T* krow = krows[t] + h * D;
            const float* qh = qf + h * G * D;
            vf a[GT > 0 ? GT : MAX_GROUP];
            for (int64_t g = 0; g < G; ++g) a[g] = vzero();
            for (int64_t d = 0; d < DV; d += VL) {
              const vf kv = vload(krow + d);
              for (int64_t g = 0; g < G; ++g) a[g] = vfma(vload(qh + g * D + d), kv, a[g]);
            }
            for (int64_t g = 0; g < G; ++g) {
              float v = vsum(a[g]);
              for (int64_t d = DV; d < D; ++d) v += qh[g * D + d] * to_f(krow[d]);
              s[(h * G + g) * CHUNK + t] = v;
            }
          }
        }
        for (int64_t j = 0; j < nq; ++j) {  // online softmax, one rescale per chunk
          float* sj = s + j * CHUNK;
          for (int64_t t = n; t < CHUNK; ++t) sj[t] = -INFINITY;
          vf mv = vset(-INFINITY);
          for (int t = 0; t < CHUNK; t += VL) mv = _max(mv, vload(sj + t));
          const float m = std::max(mx[j], vmax_all(mv));
          const float corr = std::exp(mx[j] - m);  // exp(-inf) = 0 on the first chunk
          l[j] *= corr;
          scale_f32(corr, acc + j * D, D);
          vf sum = vzero();
          for (int t = 0; t < CHUNK; t += VL) {
            vf e = vexp(_sub(vload(sj + t), vset(m)));
            vstore(sj + t, e);
            for (int u = 0; u < VL; ++u) if (t + u >= n) sj[t + u] = 0.f;  // padding lanes weigh 0
            sum = _add(sum, vload(sj + t));
          }
          l[j] += vsum(sum);
          mx[j] = m;
        }
        for (int64_t t = 0; t < n; ++t) {  // values, in page order
          for (int64_t h = 0; h < hpg; ++h) {
            const T* vrow = vrows[t] + h * D;
            float* ah = acc + h * G * D;
            const float* sh = s + h * G * CHUNK + t;
            for (int64_t d = 0; d < DV; d += VL) {
              const vf vv = vload(vrow + d);
              for (int64_t g = 0; g < G; ++g)
                vstore(ah + g * D + d, vfma(vset(sh[g * CHUNK]), vv, vload(ah + g * D + d)));
            }
            for (int64_t d = DV; d < D; ++d)
              for (int64_t g = 0; g < G; ++g) ah[g * D + d] += sh[g * CHUNK] * to_f(vrow[d]);
          }
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        T* dst = op + b * os0 + (kh0 * G + j) * os1;
        const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[j * D + d] * inv);
      }
    }
  });
}

template <typename T>
void decode_attention_g(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                        double scale, at::Tensor& out) {
  switch (q.size(1) / k_cache.size(1)) {
    case 1: decode_attention_impl<T, 1>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out); break;
    case 2: decode_attention_impl<T, 2>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out); break;
    case 4: decode_attention_impl<T, 4>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out); break;
    case 8: decode_attention_impl<T, 8>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out); break;
    default: decode_attention_impl<T, 0>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out); break;
  }
}

void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                      double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "decode_attention: q/out [B, H, D], caches [slots, KVH, D]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_attention: head rows and caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              block_tables.is_contiguous() && seq_lens.is_contiguous(), "decode_attention: int32 tables");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && H / KVH <= MAX_GROUP && H <= MAX_GROUP * 64 && D <= MAX_HEAD_DIM &&
              k_cache.size(2) == D,
              "decode_attention: unsupported head layout");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "decode_attention: q, cache and out dtypes differ");
  switch (q.scalar_type()) {
    case at::kFloat: decode_attention_g<float>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out); break;
    case at::kBFloat16: decode_attention_g<bf16>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out); break;
    case at::kHalf: decode_attention_g<f16>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out); break;
    default: TORCH_CHECK(false, "decode_attention: unsupported dtype ", q.scalar_type());
  }
}

// ------------------------------------------------------------- norms and rotary
// Rounded like transformers' Qwen3 in the model's dtype: the normalised value is rounded to T
// before the weight multiplies it, and rotary rounds x*cos and rot(x)*sin before adding.

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

template <typename T>
inline void norm_row(const T* x, const T* w, float r, int64_t D, T* out) {
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(to_f(w[d]) * to_f(static_cast<T>(to_f(x[d]) * r)));
}

template <typename T>
void add_rms_norm_impl(at::Tensor& x, const c10::optional<at::Tensor>& add, const at::Tensor& w, double eps,
                       at::Tensor& out) {
  const int64_t N = x.size(0), D = x.size(1), ldx = x.stride(0), ldo = out.stride(0);
  T* xp = x.data_ptr<T>();
  const T* ap = add.has_value() ? add->data_ptr<T>() : nullptr;
  const int64_t lda = add.has_value() ? add->stride(0) : 0;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      T* row = xp + n * ldx;
      if (ap)
        for (int64_t d = 0; d < D; ++d) row[d] = static_cast<T>(to_f(row[d]) + to_f(ap[n * lda + d]));
      norm_row(row, wp, inv_rms(row, D, static_cast<float>(eps)), D, op + n * ldo);
    }
  });
}

// x += add (when given, rounded to x's dtype), then out = RMSNorm(x) * w; rows of [N, D].
void add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& add, const at::Tensor& w, double eps,
                  at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 && w.is_contiguous(),
              "rms_norm: [N, D] tensors with contiguous rows");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.scalar_type() == out.scalar_type(), "rms_norm: dtypes");
  TORCH_CHECK(!add.has_value() || (add->sizes() == x.sizes() && add->stride(1) == 1), "rms_norm: add shape");
  switch (x.scalar_type()) {
    case at::kFloat: add_rms_norm_impl<float>(x, add, w, eps, out); break;
    case at::kBFloat16: add_rms_norm_impl<bf16>(x, add, w, eps, out); break;
    case at::kHalf: add_rms_norm_impl<f16>(x, add, w, eps, out); break;
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type());
  }
}

template <typename T>
inline void norm_rope_head(const T* src, const T* w, const T* cos, const T* sin, float eps, int64_t D,
                           T* tmp, T* dst) {
  norm_row(src, w, inv_rms(src, D, eps), D, tmp);
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rot = d < half ? -to_f(tmp[d + half]) : to_f(tmp[d - half]);
    dst[d] = static_cast<T>(to_f(static_cast<T>(to_f(tmp[d]) * to_f(cos[d]))) +
                            to_f(static_cast<T>(rot * to_f(sin[d]))));
  }
}

template <typename T>
void qk_norm_rope_impl(at::Tensor& qkv, const at::Tensor& qw, const at::Tensor& kw, const at::Tensor& cos,
                       const at::Tensor& sin, double eps, at::Tensor& q_out, int64_t H, int64_t KVH) {
  const int64_t N = qkv.size(0), D = qw.numel(), ld = qkv.stride(0);
  T* base = qkv.data_ptr<T>();
  T* qo = q_out.data_ptr<T>();
  const T *qwp = qw.data_ptr<T>(), *kwp = kw.data_ptr<T>(), *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  const int64_t ldc = cos.stride(0), lds = sin.stride(0);
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
      }
    }
  });
}

// q_out[n, h] = rotary(RMSNorm(q[n, h]) * qw); k heads of qkv normalised and rotated in place.
void qk_norm_rope(at::Tensor qkv, const at::Tensor& qw, const at::Tensor& kw, const at::Tensor& cos,
                  const at::Tensor& sin, double eps, at::Tensor q_out, int64_t H, int64_t KVH) {
  const int64_t D = qw.numel();
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && q_out.is_contiguous() && D <= MAX_HEAD_DIM && D % 2 == 0,
              "qk_norm_rope: qkv [N, (H + 2 KVH) D] rows contiguous, q_out contiguous");
  TORCH_CHECK(cos.stride(-1) == 1 && sin.stride(-1) == 1 && cos.size(-1) == D && qkv.size(1) >= (H + KVH) * D,
              "qk_norm_rope: cos/sin [N, D]");
  TORCH_CHECK(qkv.scalar_type() == q_out.scalar_type() && qkv.scalar_type() == cos.scalar_type() &&
              qkv.scalar_type() == qw.scalar_type(), "qk_norm_rope: dtypes");
  switch (qkv.scalar_type()) {
    case at::kFloat: qk_norm_rope_impl<float>(qkv, qw, kw, cos, sin, eps, q_out, H, KVH); break;
    case at::kBFloat16: qk_norm_rope_impl<bf16>(qkv, qw, kw, cos, sin, eps, q_out, H, KVH); break;
    case at::kHalf: qk_norm_rope_impl<f16>(qkv, qw, kw, cos, sin, eps, q_out, H, KVH); break;
    default: TORCH_CHECK(false, "qk_norm_rope: unsupported dtype ", qkv.scalar_type());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa_name, "the instruction set this build targets");
  m.def("has_packed", &has_packed, "whether linear_packed exists in this build");
#if defined(__AVX512BF16__)
  m.def("linear_packed", &linear_packed, "out = x @ W.T, W packed [N/16, K/2, 16, 2] (bf16 or int8 + scales)",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("out"));
#endif
  m.def("linear", &linear, "out = x @ w.T (x scale for int8 w), fp32 accumulation",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("out"));
  m.def("decode_attention", &decode_attention, "paged decode attention, K/V read in place",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("out"));
  m.def("add_rms_norm", &add_rms_norm, "x += add; out = rms_norm(x) * w (rows)",
        py::arg("x"), py::arg("add"), py::arg("w"), py::arg("eps"), py::arg("out"));
  m.def("qk_norm_rope", &qk_norm_rope, "per-head q/k RMSNorm and rotary, q into q_out, k in place",
        py::arg("qkv"), py::arg("q_w"), py::arg("k_w"), py::arg("cos"), py::arg("sin"), py::arg("eps"),
        py::arg("q_out"), py::arg("heads"), py::arg("kv_heads"));
}
