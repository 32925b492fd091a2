// 4-bit weights x int8 activations (W4A8), weights in groups of 32 inputs per output channel:
// w[n, k] ~= (u[n, k] - z) * d[n, k / 32] with u in [0, 15], an fp16 scale d per group, and z = 8
// (symmetric, Q4_0's scheme) or a zero point per group (asymmetric: AWQ, GPTQ; their groups of
// 128 are four groups of 32 sharing d and z). Zero points: uint8 [ceil(N/VI), K/32, VI].
//
// Packed at load as [ceil(N/VI), K/32, 4, VI, 4] bytes: for one group and one block b of the
// four, the VI x 4 bytes hold inputs 8b..8b+3 of each channel in their low nibbles and inputs
// 8b+4..8b+7 in their high nibbles (two k-quads per vector load). Scales: [ceil(N/VI), K/32, VI].
// Activations are quantized per row as for W8A8 (signed, [-127, 127]), with each group's sum.
// A group's products sum exactly in int32 (vpdpbusd with the weights as the unsigned operand,
// or vpmaddubsw + vpmaddwd: 2 * 15 * 127 fits int16); u - 8 is applied as - 8 * the group's
// activation sum; the group total then scales by d in fp32, groups in order, the row's scale
// last. The order depends on K alone: outputs do not depend on the batch.
#include "kernels.h"

namespace fusedserve {

#if FS_VL > 1
#if defined(__AVX512F__)
using v4 = __m512i;
using f4 = __m512;
constexpr int V4 = 16;
constexpr int M4 = 4, N4 = 4;  // tiles: 1-2 rows x 4 vectors (decode), else 4 rows x 2 vectors
inline v4 z4() { return _mm512_setzero_si512(); }
inline v4 load4(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline v4 lo4(v4 b) { return _mm512_and_si512(b, _mm512_set1_epi8(0x0F)); }
inline v4 hi4(v4 b) { return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(0x0F)); }
inline v4 bc4(int32_t q) { return _mm512_set1_epi32(q); }
inline v4 sub4(v4 a, int32_t s) { return _mm512_sub_epi32(a, _mm512_set1_epi32(s)); }
inline v4 add4(v4 a, v4 b) { return _mm512_add_epi32(a, b); }
inline f4 cvt4(v4 a) { return _mm512_cvtepi32_ps(a); }
inline f4 scales4(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline f4 fz4() { return _mm512_setzero_ps(); }
inline f4 fma4(f4 a, f4 b, f4 c) { return _mm512_fmadd_ps(a, b, c); }
#if defined(__AVX512VNNI__)
inline v4 dot_u4(v4 acc, v4 w, v4 x) {  // inline asm: see dot4 in linear_int8.cpp
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  return acc;
}
#endif
inline v4 pairs4(v4 w, v4 x) { return _mm512_maddubs_epi16(w, x); }
inline v4 add16(v4 a, v4 b) { return _mm512_add_epi16(a, b); }
inline v4 widen4(v4 a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
inline v4 zeros4(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline v4 mul4(v4 a, v4 b) { return _mm512_mullo_epi32(a, b); }
inline v4 subv4(v4 a, v4 b) { return _mm512_sub_epi32(a, b); }
#else
using v4 = __m256i;
using f4 = __m256;
constexpr int V4 = 8;
constexpr int M4 = 2, N4 = 4;  // tiles: 1 row x 4 vectors (decode), else 2 rows x 2 vectors
inline v4 z4() { return _mm256_setzero_si256(); }
inline v4 load4(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline v4 lo4(v4 b) { return _mm256_and_si256(b, _mm256_set1_epi8(0x0F)); }
inline v4 hi4(v4 b) { return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F)); }
inline v4 bc4(int32_t q) { return _mm256_set1_epi32(q); }
inline v4 sub4(v4 a, int32_t s) { return _mm256_sub_epi32(a, _mm256_set1_epi32(s)); }
inline v4 add4(v4 a, v4 b) { return _mm256_add_epi32(a, b); }
inline f4 cvt4(v4 a) { return _mm256_cvtepi32_ps(a); }
inline f4 scales4(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline f4 fz4() { return _mm256_setzero_ps(); }
inline f4 fma4(f4 a, f4 b, f4 c) { return _mm256_fmadd_ps(a, b, c); }
inline v4 pairs4(v4 w, v4 x) { return _mm256_maddubs_epi16(w, x); }
inline v4 add16(v4 a, v4 b) { return _mm256_add_epi16(a, b); }
inline v4 widen4(v4 a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
inline v4 zeros4(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline v4 mul4(v4 a, v4 b) { return _mm256_mullo_epi32(a, b); }
inline v4 subv4(v4 a, v4 b) { return _mm256_sub_epi32(a, b); }
#if FS_VNNI256
inline v4 dot_u4(v4 acc, v4 w, v4 x) {
  asm(FS_DPBUSD256 : "+v"(acc) : "v"(w), "v"(x));
  return acc;
}
#endif
#endif
#if defined(__AVX512VNNI__) || FS_VNNI256
constexpr bool VNNI4 = true;
#else
// Without VNNI a group's pair sums stay in int16 until the group ends, one vpmaddwd a group
// rather than one a k-quad: |u * x| <= 15 * 127, so 16 products (8 pairs) sum to at most 30480.
constexpr bool VNNI4 = false;
inline v4 dot_u4(v4 acc, v4, v4) { return acc; }  // not called: the int16 path is taken
#endif

constexpr int G4 = 32;  // inputs per group

struct QuantRows {  // activations quantized per row, for one call
  const int8_t* q;   // [M, K32] signed
  const float* sx;   // [M]
  const int32_t* gs;  // [M, G]: each group's sum of q
  int64_t ld;        // K32
};

// pf: the next tile's weights (or null), fetched a group's share (pf_step bytes) at each group
// of this tile, so they are in the caches when it starts (see int4_gemm); pfs: its scales, a
// group's share (NV x V4 halves) at each group likewise.
template <int M, int NV, bool ZP>
inline void int4_tile(const QuantRows& xr, int64_t m0, int64_t G, const uint8_t* const* w, const f16* const* d,
                      const uint8_t* const* z, f4* res, const uint8_t* pf, int64_t pf_step, const uint8_t* pfs) {
  f4 facc[M][NV];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) facc[i][v] = fz4();
  for (int64_t g = 0; g < G; ++g) {
    if (pf) {
      for (int64_t o = 0; o < pf_step; o += 64) __builtin_prefetch(pf + g * pf_step + o, 0, 2);
      for (int64_t o = 0; o < NV * V4 * 2; o += 64) __builtin_prefetch(pfs + g * NV * V4 * 2 + o, 0, 2);
    }
    v4 acc[M][NV], acc2[M][NV];  // low and high nibbles apart: two dependency chains
    for (int i = 0; i < M; ++i)
      for (int v = 0; v < NV; ++v) acc[i][v] = acc2[i][v] = z4();
    for (int b = 0; b < 4; ++b) {
      v4 wl[NV], wh[NV];
      for (int v = 0; v < NV; ++v) {
        const v4 raw = load4(w[v] + (g * 4 + b) * V4 * 4);
        wl[v] = lo4(raw);
        wh[v] = hi4(raw);
      }
      for (int i = 0; i < M; ++i) {
        const int8_t* xq = xr.q + (m0 + i) * xr.ld + g * G4 + 8 * b;
        int32_t q0, q1;
        std::memcpy(&q0, xq, 4);
        std::memcpy(&q1, xq + 4, 4);
        const v4 x0 = bc4(q0), x1 = bc4(q1);
        for (int v = 0; v < NV; ++v) {
          if constexpr (VNNI4) {
            acc[i][v] = dot_u4(acc[i][v], wl[v], x0);
            acc2[i][v] = dot_u4(acc2[i][v], wh[v], x1);
          } else {  // int16 pair sums: acc low nibbles, acc2 high
            acc[i][v] = add16(acc[i][v], pairs4(wl[v], x0));
            acc2[i][v] = add16(acc2[i][v], pairs4(wh[v], x1));
          }
        }
      }
    }
    if constexpr (!VNNI4)
      for (int i = 0; i < M; ++i)
        for (int v = 0; v < NV; ++v) {
          acc[i][v] = widen4(add16(acc[i][v], acc2[i][v]));
          acc2[i][v] = z4();
        }
    f4 ds[NV];
    for (int v = 0; v < NV; ++v) ds[v] = scales4(d[v] + g * V4);
    if constexpr (ZP) {  // sum (u - z) x = sum u x - z * (the group's activation sum), exactly
      v4 zs[NV];
      for (int v = 0; v < NV; ++v) zs[v] = zeros4(z[v] + g * V4);
      for (int i = 0; i < M; ++i) {
        const v4 gsum = bc4(xr.gs[(m0 + i) * G + g]);
        for (int v = 0; v < NV; ++v)
          facc[i][v] = fma4(cvt4(subv4(add4(acc[i][v], acc2[i][v]), mul4(zs[v], gsum))), ds[v], facc[i][v]);
      }
    } else {
      for (int i = 0; i < M; ++i) {
        const int32_t corr = 8 * xr.gs[(m0 + i) * G + g];
        for (int v = 0; v < NV; ++v)
          facc[i][v] = fma4(cvt4(sub4(add4(acc[i][v], acc2[i][v]), corr)), ds[v], facc[i][v]);
      }
    }
  }
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) res[i * N4 + v] = facc[i][v];
}

template <int NV, bool ZP>
inline void int4_rows(int m, const QuantRows& xr, int64_t m0, int64_t G, const uint8_t* const* w,
                      const f16* const* d, const uint8_t* const* z, f4* res, const uint8_t* pf, int64_t pf_step, const uint8_t* pfs) {
  switch (m) {
#if defined(__AVX512F__)
    case 4: int4_tile<4, NV, ZP>(xr, m0, G, w, d, z, res, pf, pf_step, pfs); break;
    case 3: int4_tile<3, NV, ZP>(xr, m0, G, w, d, z, res, pf, pf_step, pfs); break;
#endif
    case 2: int4_tile<2, NV, ZP>(xr, m0, G, w, d, z, res, pf, pf_step, pfs); break;
    default: int4_tile<1, NV, ZP>(xr, m0, G, w, d, z, res, pf, pf_step, pfs); break;
  }
}

// Rows per tile: few vectors with many rows, more vectors for one or two rows (decode), where
// the registers the rows would take go to more weight streams instead.
#if defined(__AVX512F__)
constexpr int WIDE_ROWS = 2;
#else
constexpr int WIDE_ROWS = 1;
#endif

template <bool ZP>
inline void int4_nv(int nv, int m, const QuantRows& xr, int64_t m0, int64_t G, const uint8_t* const* w,
                    const f16* const* d, const uint8_t* const* z, f4* res, const uint8_t* pf, int64_t pf_step, const uint8_t* pfs) {
  switch (nv) {
    case 4: int4_rows<4, ZP>(m, xr, m0, G, w, d, z, res, pf, pf_step, pfs); break;
    case 3: int4_rows<3, ZP>(m, xr, m0, G, w, d, z, res, pf, pf_step, pfs); break;
    case 2: int4_rows<2, ZP>(m, xr, m0, G, w, d, z, res, pf, pf_step, pfs); break;
    default: int4_rows<1, ZP>(m, xr, m0, G, w, d, z, res, pf, pf_step, pfs); break;
  }
}

template <typename T>
void quantize_groups(const at::Tensor& x, int64_t K32, std::vector<int8_t>& q, std::vector<float>& sx,
                     std::vector<int32_t>& gs) {
  const int64_t M = x.size(0), K = x.size(1), ld = x.stride(0), G = K32 / G4;
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = xp + r * ld;
      int8_t* qr = q.data() + r * K32;
      const float s = quantize_row_i8(row, K, qr, 0);
      std::fill(qr + K, qr + K32, static_cast<int8_t>(0));
      for (int64_t g = 0; g < G; ++g) {
        int32_t sum = 0;
        for (int t = 0; t < G4; ++t) sum += qr[g * G4 + t];
        gs[r * G + g] = sum;
      }
      sx[r] = s;
    }
  });
}

template <typename O>
void int4_gemm(const QuantRows& xr, int64_t M, int64_t G, const uint8_t* packed, const f16* scales,
               const uint8_t* zeros, int64_t nvec, int64_t N, O* op, int64_t ldo) {
  const bool wide = M <= WIDE_ROWS;
  const int tile_v = wide ? N4 : 2, tile_m = wide ? static_cast<int>(M) : M4;
  const int64_t nblocks = (nvec + tile_v - 1) / tile_v;
  // A tile's weights are tile_v streams of one vector's packing each (a few KB at decode sizes),
  // too short for the hardware prefetchers to ramp up before they end: the tile fetches the next
  // tile's bytes as it goes. Tiles of a thread are adjacent in memory.
  const int64_t tile_bytes = tile_v * G * 4 * V4 * 4, pf_step = tile_bytes / G;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    f4 res[M4 * N4];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t v0 = blk * tile_v;
      const int nv = static_cast<int>(std::min<int64_t>(tile_v, nvec - v0));
      const uint8_t* w[N4];
      const f16* d[N4];
      const uint8_t* z[N4] = {};
      for (int v = 0; v < nv; ++v) {
        w[v] = packed + (v0 + v) * G * 4 * V4 * 4;
        d[v] = scales + (v0 + v) * G * V4;
        if (zeros) z[v] = zeros + (v0 + v) * G * V4;
      }
      for (int64_t m0 = 0; m0 < M; m0 += tile_m) {
        const int m = static_cast<int>(std::min<int64_t>(tile_m, M - m0));
        const uint8_t* pf = m0 == 0 && blk + 1 < b1 ? packed + (blk + 1) * tile_bytes : nullptr;
        const uint8_t* pfs = reinterpret_cast<const uint8_t*>(scales + (blk + 1) * tile_v * G * V4);
        if (zeros)
          int4_nv<true>(nv, m, xr, m0, G, w, d, z, res, pf, pf_step, pfs);
        else
          int4_nv<false>(nv, m, xr, m0, G, w, d, z, res, pf, pf_step, pfs);
        for (int v = 0; v < nv; ++v) {
          const int64_t n0 = (v0 + v) * V4;
          const int valid = static_cast<int>(std::min<int64_t>(V4, N - n0));
          for (int i = 0; i < m; ++i) {
            float tmp[V4];
            std::memcpy(tmp, &res[i * N4 + v], sizeof(tmp));
            const float s = xr.sx[m0 + i];
            for (int j = 0; j < valid; ++j) op[(m0 + i) * ldo + n0 + j] = static_cast<O>(tmp[j] * s);
          }
        }
      }
    }
  });
}
#endif

int64_t int4_lanes() {
#if FS_VL > 1
  return V4;
#else
  return 0;
#endif
}

// out[M, N] = quantize(x) @ W^T, W 4-bit packed [ceil(N/V4), K/32, 4, V4, 4] (uint8) with fp16
// group scales [ceil(N/V4), K/32, V4] and, where asymmetric, uint8 zero points of the same shape
// (else 8); K of x may be shorter than K/32 * 32 (zero padding).
void linear_w4a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, at::Tensor out,
                 const c10::optional<at::Tensor>& zeros) {
#if FS_VL > 1
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 5 && packed.size(2) == 4 && packed.size(3) == V4 &&
              packed.size(4) == 4, "linear_w4a8: x [M, K], packed [N/V4, K/32, 4, V4, 4] with V4 = ", V4);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && scales.scalar_type() == at::kHalf &&
              scales.is_contiguous() && x.stride(1) == 1 && out.stride(1) == 1, "linear_w4a8: layouts");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), nvec = packed.size(0), G = packed.size(1);
  TORCH_CHECK(G * G4 >= K && G * G4 < K + G4 && out.size(0) == M && nvec * V4 >= N && nvec * V4 < N + V4 &&
              scales.size(0) == nvec && scales.size(1) == G, "linear_w4a8: shape mismatch x ", x.sizes(),
              " packed ", packed.sizes(), " out ", out.sizes());
  TORCH_CHECK(!zeros.has_value() || (zeros->scalar_type() == at::kByte && zeros->is_contiguous() &&
                                      zeros->sizes() == scales.sizes()),
              "linear_w4a8: zero points uint8, shaped as the scales");
  if (M == 0) return;
  const uint8_t* zp = zeros.has_value() ? zeros->data_ptr<uint8_t>() : nullptr;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> sx;
  thread_local std::vector<int32_t> gs;
  const int64_t K32 = G * G4;
  if (q.size() < static_cast<size_t>(M * K32)) q.resize(M * K32);
  if (sx.size() < static_cast<size_t>(M)) sx.resize(M);
  if (gs.size() < static_cast<size_t>(M * G)) gs.resize(M * G);
  switch (x.scalar_type()) {
    case at::kFloat: quantize_groups<float>(x, K32, q, sx, gs); break;
    case at::kBFloat16: quantize_groups<bf16>(x, K32, q, sx, gs); break;
    case at::kHalf: quantize_groups<f16>(x, K32, q, sx, gs); break;
    default: TORCH_CHECK(false, "linear_w4a8: unsupported activation dtype ", x.scalar_type());
  }
  const QuantRows xr{q.data(), sx.data(), gs.data(), K32};
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const f16* sp = scales.data_ptr<f16>();
  const int64_t ldo = out.stride(0);
  switch (out.scalar_type()) {
    case at::kFloat: int4_gemm(xr, M, G, pp, sp, zp, nvec, N, out.data_ptr<float>(), ldo); break;
    case at::kBFloat16: int4_gemm(xr, M, G, pp, sp, zp, nvec, N, out.data_ptr<bf16>(), ldo); break;
    case at::kHalf: int4_gemm(xr, M, G, pp, sp, zp, nvec, N, out.data_ptr<f16>(), ldo); break;
    default: TORCH_CHECK(false, "linear_w4a8: unsupported output dtype ", out.scalar_type());
  }
#else
  TORCH_CHECK(false, "linear_w4a8: this build has no vector unit");
#endif
}

}  // namespace fusedserve
