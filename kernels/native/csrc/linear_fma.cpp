// Packed GEMM for builds without bf16 dot products (AVX2 + FMA, AVX-512 without BF16):
// out[M, N] = x[M, K] @ W^T, W packed at load as [ceil(N/VL), K, VL] (bf16, fp16 or fp32):
// one vector = VL output channels of one k. A tile of MF activation rows x NF weight vectors
// keeps MF x NF fp32 accumulators in registers; each weight vector is loaded and converted to
// fp32 once per row tile and used for MF rows (FMA with the activation broadcast). Calls of more
// than one row tile convert each panel once into a scratch and reuse it for every tile.
// Each output lane sums its k in order, one FMA per k, the same for 1 row or 64: outputs do
// not depend on the batch, and the scratch holds the exact fp32 values of the weights.
#include "kernels.h"

namespace fusedserve {

#if FS_VL > 1
#if defined(__AVX512F__)
constexpr int MF = 6;  // 6 x 4 accumulators + 4 weight vectors of 32 registers
constexpr int NF = 4;
constexpr int WIDE_ROWS = 2;  // 2 x 8 accumulators
#else
constexpr int MF = 4;  // 4 x 3 accumulators + 3 weight vectors of 16 registers
constexpr int NF = 3;
constexpr int WIDE_ROWS = 1;  // 1 x 8 accumulators
#endif
// One or two rows (decode) take 8 weight vectors a tile: with NF, a row has too few independent
// FMA chains to hide the FMA's latency, and 8 streams keep more of the memory system busy.
constexpr int NW = 8;
constexpr int RS = NW > NF ? NW : NF;  // stride of a row in a tile's results

template <int M, int NV, typename W>
inline void fma_tile(const float* x, int64_t ldx, int64_t K, const W* const* w, vf* res) {
  vf acc[M][NV];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (M == 1) {  // each weight vector used as loaded: no register holds it for long
      const vf xb = vset(x[k]);
      for (int v = 0; v < NV; ++v) acc[0][v] = vfma(xb, vload(w[v] + k * VL), acc[0][v]);
      continue;
    }
    vf wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = vload(w[v] + k * VL);
    for (int i = 0; i < M; ++i) {
      const vf xb = vset(x[i * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = vfma(xb, wv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) res[i * RS + v] = acc[i][v];
}

template <int NV, typename W>
inline void fma_rows(int m, const float* x, int64_t ldx, int64_t K, const W* const* w, vf* res) {
  switch (m) {
#if defined(__AVX512F__)
    case 6: fma_tile<6, NV>(x, ldx, K, w, res); break;
    case 5: fma_tile<5, NV>(x, ldx, K, w, res); break;
#endif
    case 4: fma_tile<4, NV>(x, ldx, K, w, res); break;
    case 3: fma_tile<3, NV>(x, ldx, K, w, res); break;
    case 2: fma_tile<2, NV>(x, ldx, K, w, res); break;
    default: fma_tile<1, NV>(x, ldx, K, w, res); break;
  }
}

template <int NV, typename W>
inline void fma_wide_rows(int m, const float* x, int64_t ldx, int64_t K, const W* const* w, vf* res) {
  if (WIDE_ROWS > 1 && m > 1)
    fma_tile<WIDE_ROWS, NV>(x, ldx, K, w, res);
  else
    fma_tile<1, NV>(x, ldx, K, w, res);
}

template <typename W>
inline void fma_nv(int nv, int m, const float* x, int64_t ldx, int64_t K, const W* const* w, vf* res) {
  switch (nv) {
    case 8: fma_wide_rows<8>(m, x, ldx, K, w, res); break;
    case 7: fma_wide_rows<7>(m, x, ldx, K, w, res); break;
    case 6: fma_wide_rows<6>(m, x, ldx, K, w, res); break;
    case 5: fma_wide_rows<5>(m, x, ldx, K, w, res); break;
    case 4: fma_rows<4>(m, x, ldx, K, w, res); break;
    case 3: fma_rows<3>(m, x, ldx, K, w, res); break;
    case 2: fma_rows<2>(m, x, ldx, K, w, res); break;
    default: fma_rows<1>(m, x, ldx, K, w, res); break;
  }
}

template <typename O>
inline void store_lanes(O* out, int valid, vf r) {
  float tmp[VL];
  vstore(tmp, r);
  for (int j = 0; j < valid; ++j) out[j] = static_cast<O>(tmp[j]);
}

template <typename W, typename O>
void fma_gemm(const float* xp, int64_t M, int64_t K, const W* packed, int64_t nvec, int64_t N, O* op,
              int64_t ldo) {
  const bool narrow = M <= WIDE_ROWS;
  const int tile_v = narrow ? NW : NF, tile_m = narrow ? static_cast<int>(M) : MF;
  const int64_t nblocks = (nvec + tile_v - 1) / tile_v;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<float> wide;  // a panel converted to fp32, for calls of several tiles
    vf res[MF * RS];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t v0 = blk * tile_v;
      const int nv = static_cast<int>(std::min<int64_t>(tile_v, nvec - v0));
      const bool ahead = !std::is_same<W, float>::value && M > MF;
      const W* w[RS];
      const float* wf[NF];
      if (ahead) {
        if (wide.size() < static_cast<size_t>(NF * K * VL)) wide.resize(NF * K * VL);
        const W* src = packed + v0 * K * VL;
        for (int64_t e = 0; e < nv * K * VL; e += VL) vstore(wide.data() + e, vload(src + e));
        for (int v = 0; v < nv; ++v) wf[v] = wide.data() + v * K * VL;
      } else {
        for (int v = 0; v < nv; ++v) w[v] = packed + (v0 + v) * K * VL;
      }
      for (int64_t m0 = 0; m0 < M; m0 += tile_m) {
        const int m = static_cast<int>(std::min<int64_t>(tile_m, M - m0));
        if (ahead)
          fma_nv(nv, m, xp + m0 * K, K, K, wf, res);
        else
          fma_nv(nv, m, xp + m0 * K, K, K, w, res);
        for (int v = 0; v < nv; ++v) {
          const int64_t n0 = (v0 + v) * VL;
          const int valid = static_cast<int>(std::min<int64_t>(VL, N - n0));
          for (int i = 0; i < m; ++i) store_lanes(op + (m0 + i) * ldo + n0, valid, res[i * RS + v]);
        }
      }
    }
  });
}

template <typename W>
void fma_out(const float* xp, int64_t M, int64_t K, const W* packed, int64_t nvec, int64_t N, at::Tensor& out) {
  const int64_t ldo = out.stride(0);
  switch (out.scalar_type()) {
    case at::kFloat: fma_gemm(xp, M, K, packed, nvec, N, out.data_ptr<float>(), ldo); break;
    case at::kBFloat16: fma_gemm(xp, M, K, packed, nvec, N, out.data_ptr<bf16>(), ldo); break;
    case at::kHalf: fma_gemm(xp, M, K, packed, nvec, N, out.data_ptr<f16>(), ldo); break;
    default: TORCH_CHECK(false, "linear_fma: unsupported output dtype ", out.scalar_type());
  }
}
#endif

int64_t vector_lanes() { return VL; }

// out[M, N] = x[M, K] @ W^T for W packed [ceil(N/VL), K, VL] (bf16, fp16 or fp32).
void linear_fma(const at::Tensor& x, const at::Tensor& packed, at::Tensor out) {
#if FS_VL > 1
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 3 && packed.size(2) == VL,
              "linear_fma: x [M, K], packed [N/VL, K, VL] with VL = ", VL, ", out [M, N]");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && packed.is_contiguous(), "linear_fma: contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), nvec = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && out.size(0) == M && nvec * VL >= N && nvec * VL < N + VL,
              "linear_fma: shape mismatch x ", x.sizes(), " packed ", packed.sizes(), " out ", out.sizes());
  if (M == 0) return;
  thread_local std::vector<float> xbuf;
  const float* xp = as_f32(x, xbuf);
  switch (packed.scalar_type()) {
    case at::kBFloat16: fma_out(xp, M, K, packed.data_ptr<bf16>(), nvec, N, out); break;
    case at::kHalf: fma_out(xp, M, K, packed.data_ptr<f16>(), nvec, N, out); break;
    case at::kFloat: fma_out(xp, M, K, packed.data_ptr<float>(), nvec, N, out); break;
    default: TORCH_CHECK(false, "linear_fma: unsupported weight dtype ", packed.scalar_type());
  }
#else
  TORCH_CHECK(false, "linear_fma: this build has no vector unit");
#endif
}

}  // namespace fusedserve
