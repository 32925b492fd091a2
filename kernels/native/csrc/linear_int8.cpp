// int8 x int8 GEMM (W8A8): out[M, N] = sx[m] * sw[n] * sum_k xq[m, k] * wq[n, k].
//
// Activations are quantized per row (token) on entry: sx = max|x| / 127, xq in [-127, 127].
// Weights are quantized per output channel at load and packed as [ceil(N/VI), K4, VI, 4]: one
// vector = VI output channels x 4 consecutive k (VI = 16 with AVX-512, 8 with AVX2), K padded
// with zeros to K4 * 4. The products are summed in int32, exactly (|sum| <= 127 * 127 * K):
// - VNNI (AVX-512 VNNI, 256-bit AVX-VNNI): vpdpbusd takes unsigned activations, so they are
//   stored as xq + 128 and 128 * sum_k wq[n, k] (``wsum``, computed at load) is taken back off;
// - AVX2, AVX-512BW: vpmaddubsw on |xq| and wq carrying xq's sign (pairs of products fit int16:
//   2 * 127 * 127 < 32767), then vpmaddwd with ones.
// Exact integer sums make every output independent of the batch and of the order of k.
#include "kernels.h"

namespace fusedserve {

#if FS_VL > 1
#if defined(__AVX512F__)
using vi = __m512i;
constexpr int VI = 16;
inline vi vi_zero() { return _mm512_setzero_si512(); }
inline vi vi_load(const void* p) { return _mm512_loadu_si512(p); }
inline vi vi_bcast(int32_t q) { return _mm512_set1_epi32(q); }
inline __m512 vi_float(vi a) { return _mm512_cvtepi32_ps(a); }
#if defined(__AVX512VNNI__)
constexpr bool OFFSET = true;  // activations stored as xq + 128 (vpdpbusd wants them unsigned)
constexpr int MI = 6, NI = 4, WIDE_ROWS = 2;
// Inline asm, not the intrinsic: GCC 12 keeps a stack copy of every accumulator of a tile
// that uses _mm512_dpbusd_epi32 (a store per instruction), halving the tile's throughput.
inline vi dot4(vi acc, vi x, vi w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}
#else
constexpr bool OFFSET = false;
constexpr int MI = 4, NI = 4, WIDE_ROWS = 2;
inline vi dot4(vi acc, vi x, vi w) {
  const __mmask64 neg = _mm512_movepi8_mask(x);
  const vi sw = _mm512_mask_sub_epi8(w, neg, _mm512_setzero_si512(), w);
  const vi p = _mm512_maddubs_epi16(_mm512_abs_epi8(x), sw);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
}
#endif
#else
using vi = __m256i;
constexpr int VI = 8;
inline vi vi_zero() { return _mm256_setzero_si256(); }
inline vi vi_load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi vi_bcast(int32_t q) { return _mm256_set1_epi32(q); }
inline __m256 vi_float(vi a) { return _mm256_cvtepi32_ps(a); }
// 4 x 2 tiles, with VNNI too: 6 x 2 (15 of the 16 ymm) ran at 0.55-0.7x of them (16-256 rows, Zen 4).
constexpr int MI = 4, NI = 2, WIDE_ROWS = 1;
#if FS_VNNI256
constexpr bool OFFSET = true;  // as with AVX-512 VNNI: activations + 128, wsum taken back off
inline vi dot4(vi acc, vi x, vi w) {
  asm(FS_DPBUSD256 : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}
#else
constexpr bool OFFSET = false;
inline vi dot4(vi acc, vi x, vi w) {
  const vi p = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif
#endif

// Decode (one or two rows) takes NW weight vectors a tile.
constexpr int NW = 4;
constexpr int RS = NW > NI ? NW : NI;  // stride of a row in a tile's results

// pf: the next tile's weights (or null), fetched pf_step bytes at each k-quad of this tile (see
// int4_gemm in linear_int4.cpp). The FMA GEMM does without: its streams are long enough (16 bytes
// a k), and fetching ahead cost it 7-20%.
template <int M, int NV>
inline void int8_tile(const int8_t* xq, int64_t ldx, int64_t K4, const int8_t* const* w, vi* res,
                      const int8_t* pf, int64_t pf_step) {
  vi acc[M][NV];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vi_zero();
  for (int64_t kq = 0; kq < K4; ++kq) {
    vi wv[NV];
    if (pf)
      for (int64_t o = 0; o < pf_step; o += 64) __builtin_prefetch(pf + kq * pf_step + o, 0, 2);
    if constexpr (M == 1) {  // each weight vector used as loaded
      int32_t quad;
      std::memcpy(&quad, xq + 4 * kq, sizeof(quad));
      const vi xb = vi_bcast(quad);
      for (int v = 0; v < NV; ++v) acc[0][v] = dot4(acc[0][v], xb, vi_load(w[v] + kq * VI * 4));
      continue;
    }
    for (int v = 0; v < NV; ++v) wv[v] = vi_load(w[v] + kq * VI * 4);
    for (int i = 0; i < M; ++i) {
      int32_t quad;
      std::memcpy(&quad, xq + i * ldx + 4 * kq, sizeof(quad));
      const vi xb = vi_bcast(quad);
      for (int v = 0; v < NV; ++v) acc[i][v] = dot4(acc[i][v], xb, wv[v]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) res[i * RS + v] = acc[i][v];
}

template <int NV>
inline void int8_rows(int m, const int8_t* xq, int64_t ldx, int64_t K4, const int8_t* const* w, vi* res,
                      const int8_t* pf, int64_t pf_step) {
  switch (m) {
#if defined(__AVX512VNNI__)
    case 6: int8_tile<6, NV>(xq, ldx, K4, w, res, pf, pf_step); break;
    case 5: int8_tile<5, NV>(xq, ldx, K4, w, res, pf, pf_step); break;
#endif
    case 4: int8_tile<4, NV>(xq, ldx, K4, w, res, pf, pf_step); break;
    case 3: int8_tile<3, NV>(xq, ldx, K4, w, res, pf, pf_step); break;
    case 2: int8_tile<2, NV>(xq, ldx, K4, w, res, pf, pf_step); break;
    default: int8_tile<1, NV>(xq, ldx, K4, w, res, pf, pf_step); break;
  }
}

inline void int8_nv(int nv, int m, const int8_t* xq, int64_t ldx, int64_t K4, const int8_t* const* w, vi* res,
                    const int8_t* pf, int64_t pf_step) {
  switch (nv) {
#if defined(__AVX512F__)
    case 4: int8_rows<4>(m, xq, ldx, K4, w, res, pf, pf_step); break;
    case 3: int8_rows<3>(m, xq, ldx, K4, w, res, pf, pf_step); break;
#else
    case 4: int8_tile<1, 4>(xq, ldx, K4, w, res, pf, pf_step); break;  // decode tiles only: one row
    case 3: int8_tile<1, 3>(xq, ldx, K4, w, res, pf, pf_step); break;
#endif
    case 2: int8_rows<2>(m, xq, ldx, K4, w, res, pf, pf_step); break;
    default: int8_rows<1>(m, xq, ldx, K4, w, res, pf, pf_step); break;
  }
}

template <typename T>
void quantize_rows(const at::Tensor& x, int64_t K4, std::vector<int8_t>& xq, std::vector<float>& sx) {
  const int64_t M = x.size(0), K = x.size(1), ld = x.stride(0);
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int8_t* q = xq.data() + r * K4 * 4;
      sx[r] = quantize_row_i8(xp + r * ld, K, q, OFFSET ? 0x80 : 0);
      std::fill(q + K, q + K4 * 4, static_cast<int8_t>(OFFSET ? 0x80 : 0));  // padding k: zero
    }
  });
}

template <typename O>
void int8_gemm(const int8_t* xq, const float* sx, int64_t M, int64_t K4, const int8_t* packed, int64_t nvec,
               int64_t N, const float* sw, const int32_t* wsum, O* op, int64_t ldo) {
  const bool narrow = M <= WIDE_ROWS;
  const int tile_v = narrow ? NW : NI, tile_m = narrow ? static_cast<int>(M) : MI;
  const int64_t nblocks = (nvec + tile_v - 1) / tile_v;
  const int64_t tile_bytes = tile_v * K4 * VI * 4, pf_step = tile_bytes / K4;  // as int4_gemm's
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    vi res[MI * RS];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t v0 = blk * tile_v;
      const int nv = static_cast<int>(std::min<int64_t>(tile_v, nvec - v0));
      const int8_t* w[RS];
      for (int v = 0; v < nv; ++v) w[v] = packed + (v0 + v) * K4 * VI * 4;
      for (int64_t m0 = 0; m0 < M; m0 += tile_m) {
        const int m = static_cast<int>(std::min<int64_t>(tile_m, M - m0));
        const int8_t* pf = m0 == 0 && blk + 1 < b1 ? packed + (blk + 1) * tile_bytes : nullptr;
        int8_nv(nv, m, xq + m0 * K4 * 4, K4 * 4, K4, w, res, pf, pf_step);
        for (int v = 0; v < nv; ++v) {
          const int64_t n0 = (v0 + v) * VI;
          const int valid = static_cast<int>(std::min<int64_t>(VI, N - n0));
          for (int i = 0; i < m; ++i) {
            int32_t sums[VI];
            std::memcpy(sums, &res[i * RS + v], sizeof(sums));
            const float s = sx[m0 + i];
            for (int j = 0; j < valid; ++j) {
              const int32_t d = OFFSET ? sums[j] - 128 * wsum[n0 + j] : sums[j];
              op[(m0 + i) * ldo + n0 + j] = static_cast<O>(static_cast<float>(d) * s * sw[n0 + j]);
            }
          }
        }
      }
    }
  });
}
#endif

int64_t int8_lanes() {
#if FS_VL > 1
  return VI;
#else
  return 0;
#endif
}

bool int8_offset() {
#if FS_VL > 1
  return OFFSET;
#else
  return false;
#endif
}

// out[M, N] = quantize(x) @ W^T with W int8 packed [ceil(N/VI), K4, VI, 4], per-channel scales
// sw [N] (float32) and wsum [N] (int32, the packed rows' sums).
void linear_w8a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sw, const at::Tensor& wsum,
                 at::Tensor out) {
#if FS_VL > 1
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 4 && packed.size(2) == VI && packed.size(3) == 4,
              "linear_w8a8: x [M, K], packed [N/VI, K4, VI, 4] with VI = ", VI, ", out [M, N]");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && sw.scalar_type() == at::kFloat &&
              wsum.scalar_type() == at::kInt && x.stride(1) == 1 && out.stride(1) == 1,
              "linear_w8a8: int8 pack, float32 scales, int32 sums, contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), nvec = packed.size(0), K4 = packed.size(1);
  TORCH_CHECK(K4 * 4 >= K && K4 * 4 < K + 4 && out.size(0) == M && nvec * VI >= N && nvec * VI < N + VI &&
              sw.numel() == N && wsum.numel() == N, "linear_w8a8: shape mismatch x ", x.sizes(), " packed ",
              packed.sizes(), " out ", out.sizes());
  if (M == 0) return;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> sx;
  if (xq.size() < static_cast<size_t>(M * K4 * 4)) xq.resize(M * K4 * 4);
  if (sx.size() < static_cast<size_t>(M)) sx.resize(M);
  switch (x.scalar_type()) {
    case at::kFloat: quantize_rows<float>(x, K4, xq, sx); break;
    case at::kBFloat16: quantize_rows<bf16>(x, K4, xq, sx); break;
    case at::kHalf: quantize_rows<f16>(x, K4, xq, sx); break;
    default: TORCH_CHECK(false, "linear_w8a8: unsupported activation dtype ", x.scalar_type());
  }
  const int8_t* pp = packed.data_ptr<int8_t>();
  const float* swp = sw.data_ptr<float>();
  const int32_t* wsp = wsum.data_ptr<int32_t>();
  const int64_t ldo = out.stride(0);
  switch (out.scalar_type()) {
    case at::kFloat: int8_gemm(xq.data(), sx.data(), M, K4, pp, nvec, N, swp, wsp, out.data_ptr<float>(), ldo); break;
    case at::kBFloat16: int8_gemm(xq.data(), sx.data(), M, K4, pp, nvec, N, swp, wsp, out.data_ptr<bf16>(), ldo); break;
    case at::kHalf: int8_gemm(xq.data(), sx.data(), M, K4, pp, nvec, N, swp, wsp, out.data_ptr<f16>(), ldo); break;
    default: TORCH_CHECK(false, "linear_w8a8: unsupported output dtype ", out.scalar_type());
  }
#else
  TORCH_CHECK(false, "linear_w8a8: this build has no vector unit");
#endif
}


// The two ends of a W8A8 product whose integer middle runs elsewhere (a matrix engine's int8 GEMM,
// e.g. AMX through oneDNN): rows quantized exactly as linear_w8a8 quantizes them (signed, no +128),
// and the int32 sums scaled exactly as int8_gemm scales them. With exact int32 sums in between, the
// output equals linear_w8a8's bit for bit, whichever GEMM summed.
void quantize_rows_i8(const at::Tensor& x, at::Tensor q, at::Tensor sx) {
#if FS_VL > 1
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && q.scalar_type() == at::kChar && sx.scalar_type() == at::kFloat &&
              x.size(0) == q.size(0) && x.size(1) == q.size(1) && sx.numel() >= x.size(0) &&
              x.stride(1) == 1 && q.stride(1) == 1 && sx.is_contiguous(),
              "quantize_rows_i8: x [M, K], q [M, K] int8, sx [>= M] float32");
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0), ldq = q.stride(0);
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = sx.data_ptr<float>();
  auto run = [&](auto* xp) {
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) sp[r] = quantize_row_i8(xp + r * ldx, K, qp + r * ldq, 0);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(x.data_ptr<float>()); break;
    case at::kBFloat16: run(x.data_ptr<bf16>()); break;
    case at::kHalf: run(x.data_ptr<f16>()); break;
    default: TORCH_CHECK(false, "quantize_rows_i8: unsupported activation dtype ", x.scalar_type());
  }
#else
  TORCH_CHECK(false, "quantize_rows_i8: this build has no vector unit");
#endif
}

void scale_int32(const at::Tensor& acc, const at::Tensor& sx, const at::Tensor& sw, at::Tensor out) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.stride(1) == 1 && out.dim() == 2 &&
              out.stride(1) == 1 && out.size(0) == acc.size(0) && out.size(1) == acc.size(1) &&
              sx.scalar_type() == at::kFloat && sw.scalar_type() == at::kFloat && sx.is_contiguous() &&
              sw.is_contiguous() && sx.numel() >= acc.size(0) && sw.numel() == acc.size(1),
              "scale_int32: acc [M, N] int32, sx [>= M], sw [N] float32, out [M, N]");
  const int64_t M = acc.size(0), N = acc.size(1), lda = acc.stride(0), ldo = out.stride(0);
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* sxp = sx.data_ptr<float>();
  const float* swp = sw.data_ptr<float>();
  auto run = [&](auto* op) {
    using O = std::remove_pointer_t<decltype(op)>;
    at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) {
        const float s = sxp[i];
        for (int64_t j = 0; j < N; ++j) op[i * ldo + j] = static_cast<O>(static_cast<float>(ap[i * lda + j]) * s * swp[j]);
      }
    });
  };
  switch (out.scalar_type()) {
    case at::kFloat: run(out.data_ptr<float>()); break;
    case at::kBFloat16: run(out.data_ptr<bf16>()); break;
    case at::kHalf: run(out.data_ptr<f16>()); break;
    default: TORCH_CHECK(false, "scale_int32: unsupported output dtype ", out.scalar_type());
  }
}

}  // namespace fusedserve
