// Linear: out[M, N] = x[M, K] @ w[N, K]^T with fp32 accumulation, for bf16/fp16/int8 (+ per-
// channel scales) weights. Every output element's reduction runs in an order that depends only
// on K (vector lanes over k, a fixed horizontal sum, then the tail), never on how many rows the
// call has, so a request's outputs do not depend on the batch it lands in.
#include "kernels.h"

namespace fusedserve {
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
// ------------------------------------------------- packed GEMM (AVX-512 BF16 builds)
// Weights packed at load as [N/16, K/2, 16, 2]: one 64-byte vector holds 16 output channels
// x one pair of k, so a tile of MP activation rows x NP vectors (16 NP channels) keeps MP x NP
// accumulators in registers and each weight vector is loaded once per row tile
// (vdpbf16ps with the activation pair broadcast). Each output lane sums its k pairs in order:
// the same for any number of rows. int8 weights are widened to bf16 (exact) block by block.
constexpr int MP = 6;  // activation rows per tile
constexpr int NP = 4;  // 16-channel vectors per tile
// 7 or 8 rows: one tile of them x 3 vectors (24 accumulators), each weight vector loaded once
// for all the rows, where 6 + 1 or 4 + 4 row tiles load it twice.
constexpr int MP8 = 8, NP8 = 3;

// 32 int8 -> 32 bf16, exact (|q| <= 127).
inline __m512i widen_int8(const int8_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

inline __m512i load_w(const bf16* p) { return _mm512_loadu_si512(p); }
inline __m512i load_w(const int8_t* p) { return widen_int8(p); }

// Lines of memory to ask for into L2 while a tile computes, spread evenly over its k pairs: the
// next block of weights, a share per row tile, so a launch of several tiles streams the next
// block from memory while its later tiles compute on the current one from cache (hints only).
struct Prefetch {
  const char* p = nullptr;
  int64_t lines = 0;
};

// W: bf16 (a packed weight, or an int8 block widened ahead) or int8 widened in registers.
template <int M, int NV, typename W>
inline void packed_tile(const bf16* x, int64_t ldx, int64_t K2, const W* const* w, __m512* res, Prefetch pf) {
  __m512 a[M][NV];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) a[i][v] = _mm512_setzero_ps();
  const char* next = pf.p;
  int64_t owed = 0;  // lines x k pairs done, less K2 per line asked for: pf.lines over K2 pairs
  for (int64_t kp = 0; kp < K2; ++kp) {
    for (owed += pf.lines; owed >= K2; owed -= K2, next += 64) __builtin_prefetch(next, 0, 2);
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
inline void packed_rows(int m, const bf16* x, int64_t ldx, int64_t K2, const W* const* w, __m512* res,
                        Prefetch pf) {
  switch (m) {
    case 6: packed_tile<6, NV>(x, ldx, K2, w, res, pf); break;
    case 5: packed_tile<5, NV>(x, ldx, K2, w, res, pf); break;
    case 4: packed_tile<4, NV>(x, ldx, K2, w, res, pf); break;
    case 3: packed_tile<3, NV>(x, ldx, K2, w, res, pf); break;
    case 2: packed_tile<2, NV>(x, ldx, K2, w, res, pf); break;
    default: packed_tile<1, NV>(x, ldx, K2, w, res, pf); break;
  }
}

template <typename W>
inline void packed_nv(int nv, int m, const bf16* x, int64_t ldx, int64_t K2, const W* const* w, __m512* res,
                      Prefetch pf) {
  switch (nv) {
    case 4: packed_rows<4>(m, x, ldx, K2, w, res, pf); break;
    case 3: packed_rows<3>(m, x, ldx, K2, w, res, pf); break;
    case 2: packed_rows<2>(m, x, ldx, K2, w, res, pf); break;
    default: packed_rows<1>(m, x, ldx, K2, w, res, pf); break;
  }
}

// 7 or 8 rows in one tile of up to NP8 vectors (its own dispatch: instantiating 8-row tiles of
// NP vectors beside the others made GCC lay the 6 x 4 tile out 3-6% slower).
template <typename W>
inline void packed_nv8(int nv, int m, const bf16* x, int64_t ldx, int64_t K2, const W* const* w, __m512* res,
                       Prefetch pf) {
  if (m == 8) {
    switch (nv) {
      case 3: packed_tile<8, 3>(x, ldx, K2, w, res, pf); break;
      case 2: packed_tile<8, 2>(x, ldx, K2, w, res, pf); break;
      default: packed_tile<8, 1>(x, ldx, K2, w, res, pf); break;
    }
  } else {
    switch (nv) {
      case 3: packed_tile<7, 3>(x, ldx, K2, w, res, pf); break;
      case 2: packed_tile<7, 2>(x, ldx, K2, w, res, pf); break;
      default: packed_tile<7, 1>(x, ldx, K2, w, res, pf); break;
    }
  }
}

// Rows of tile t when M rows are split over `tiles` tiles of at most MP: as even as can be from
// 8 rows (measured on Zen 5: 9-31 rows 1.05-1.09x faster than full tiles and a remainder, 10 rows
// 0.97x); below, full tiles first. (7 and 8 rows take one 8-row tile instead: packed_nv8.)
inline int tile_rows(int64_t M, int64_t tiles, int64_t t) {
  if (M < 8) return static_cast<int>(std::min<int64_t>(MP, M - t * MP));
  return static_cast<int>(M / tiles + (t < M % tiles ? 1 : 0));
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
  const char* base = static_cast<const char*>(packed.data_ptr());
  // The loop compiled twice, the 7-8-row form apart (a runtime switch in one loop cost the others'
  // launches 1-3%).
  auto run = [&](auto eight_rows) {
    constexpr bool eight = decltype(eight_rows)::value;
    const int64_t np = eight ? NP8 : NP;  // vectors per block
    const int64_t nblocks = (nvec + np - 1) / np;
    const int64_t tiles = eight ? 1 : (M + MP - 1) / MP, elem = int8 ? 1 : 2, block_bytes = np * K2 * 32 * elem;
    at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
      thread_local std::vector<bf16> wide;  // an int8 block widened to bf16
      __m512 res[(eight ? MP8 : MP) * NP];  // a tile's sums: res[i * NP + v]
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t v0 = blk * np;
        const int nv = static_cast<int>(std::min<int64_t>(np, nvec - v0));
        const bf16* w[NP];
        const int8_t* w8[NP];
        // int8 for up to three row tiles: widened in registers per tile; beyond (prefill): once, into a scratch.
        const bool widen_ahead = int8 && M > 3 * MP;
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
        // The next block of this thread's range, a share per row tile, where there are two tiles or
        // more (a launch of one tile streams its block once: the hardware's prefetch keeps up).
        const int64_t next_lines = blk + 1 < b1 && tiles > 1
                                       ? std::min<int64_t>(np, nvec - v0 - np) * K2 * 32 * elem / 64 : 0;
        const char* next = next_lines ? base + (blk + 1) * block_bytes : nullptr;
        // Rows split evenly over the tiles (8 rows: 4 + 4, not 6 + 2: a 2-row tile loads a weight
        // vector per 2 products; see tile_rows); a row's sums do not depend on its tile's height.
        for (int64_t t = 0, m0 = 0; t < tiles; m0 += eight ? M : tile_rows(M, tiles, t), ++t) {
          const int m = eight ? static_cast<int>(M) : tile_rows(M, tiles, t);
          const int64_t l0 = t * next_lines / tiles, l1 = (t + 1) * next_lines / tiles;
          const Prefetch pf{next + l0 * 64, l1 - l0};
          if constexpr (eight) {
            if (int8)
              packed_nv8(nv, m, xp + m0 * ldx, ldx, K2, w8, res, pf);
            else
              packed_nv8(nv, m, xp + m0 * ldx, ldx, K2, w, res, pf);
          } else if (int8 && !widen_ahead) {
            packed_nv(nv, m, xp + m0 * ldx, ldx, K2, w8, res, pf);
          } else {
            packed_nv(nv, m, xp + m0 * ldx, ldx, K2, w, res, pf);
          }
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
  };
  if (M == 7 || M == 8)
    run(std::true_type{});
  else
    run(std::false_type{});
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
}  // namespace fusedserve
