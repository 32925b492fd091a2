// LoRA updates of a launch's rows, each with its own adapter slot (punica's SGMV): one call per
// projection and layer applies every slot's adapter to its own rows, in two parallel passes over
// all the slots at once (shrink: u = A x per slot's rows; expand: y += B u per block of outputs).
#include "kernels.h"

namespace fusedserve {

namespace {

struct Group {
  int64_t slot, first, count;  // its tokens are rows[first .. first + count)
};

// Grown once to the largest launch: no allocation per step after the first.
thread_local std::vector<int64_t> t_rows;
thread_local std::vector<Group> t_groups;
thread_local std::vector<float> t_u, t_x;
thread_local std::vector<uint32_t> t_pairs;

// Shrink one A row for one group: u[first + i, r] = A[r] . x(i), four tokens per load of A's row.
// ``xf``: the group's tokens in float32, [count, K].
template <typename T>
inline void shrink_row(const T* ar, const float* xf, int64_t count, int64_t K, float* u, int64_t PR) {
  for (int64_t i0 = 0; i0 < count; i0 += 4) {
    const int64_t m = std::min<int64_t>(4, count - i0);
    vf acc[4] = {vzero(), vzero(), vzero(), vzero()};
    int64_t d = 0;
    for (; d + VL <= K; d += VL) {
      vf av = vload(ar + d);
      for (int64_t i = 0; i < m; ++i) acc[i] = vfma(av, vload(xf + (i0 + i) * K + d), acc[i]);
    }
    for (int64_t i = 0; i < m; ++i) {
      float s = vsum(acc[i]);
      for (int64_t dd = d; dd < K; ++dd) s += to_f(ar[dd]) * xf[(i0 + i) * K + dd];
      u[(i0 + i) * PR] = s;
    }
  }
}

// Expand one block of VL columns at ``o`` for one group: B's block converted once for its tokens.
template <typename T>
inline void expand_block(const T* bs, int64_t N, int64_t R, int64_t o, const float* u, int64_t PR,
                         const int64_t* rp, int64_t count, T* yp, int64_t ldy) {
  float bf[64 * VL];  // rank <= 64
  for (int64_t c = 0; c < R; ++c) vstore(bf + c * VL, vload(bs + c * N + o));
  for (int64_t i = 0; i < count; ++i) {
    const float* ui = u + i * PR;
    T* yr = yp + rp[i] * ldy + o;
    vf acc = vload(yr);
    for (int64_t c = 0; c < R; ++c) acc = vfma(vset(ui[c]), vload(bf + c * VL), acc);
    vstore(yr, acc);
  }
}

#if defined(__AVX512BF16__)
inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// bf16: vdpbf16ps, two products a lane per instruction, the tokens read as they are.
inline void shrink_row_bf16(const bf16* ar, const bf16* x, int64_t ldx, const int64_t* rp, int64_t count,
                            int64_t K, float* u, int64_t PR) {
  for (int64_t i0 = 0; i0 < count; i0 += 4) {
    const int64_t m = std::min<int64_t>(4, count - i0);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t d = 0;
    for (; d + 32 <= K; d += 32) {
      const __m512i av = _mm512_loadu_si512(ar + d);
      for (int64_t i = 0; i < m; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], as_bh(av), as_bh(_mm512_loadu_si512(x + rp[i0 + i] * ldx + d)));
    }
    for (int64_t i = 0; i < m; ++i) {
      float s = _mm512_reduce_add_ps(acc[i]);
      const bf16* xr = x + rp[i0 + i] * ldx;
      for (int64_t dd = d; dd < K; ++dd) s += to_f(ar[dd]) * to_f(xr[dd]);
      u[(i0 + i) * PR] = s;
    }
  }
}

// One block of 16 columns: B's rank rows paired (c and c + 1 interleaved per column, as vdpbf16ps
// takes them) once, then each token's u pairs (``up``: [count][R / 2]) broadcast against them.
inline void expand_block_bf16(const bf16* bs, int64_t N, int64_t R, int64_t o, const uint32_t* up,
                              const int64_t* rp, int64_t count, bf16* yp, int64_t ldy) {
  __m512i bp[32];  // rank / 2 <= 32 pairs
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                       6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int64_t R2 = R / 2;
  for (int64_t c = 0; c < R2; ++c) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + 2 * c * N + o));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + (2 * c + 1) * N + o));
    bp[c] = _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
  }
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t* ui = up + i * R2;
    bf16* yr = yp + rp[i] * ldy + o;
    __m512 acc = vload(yr);
    for (int64_t c = 0; c < R2; ++c)
      acc = _mm512_dpbf16_ps(acc, as_bh(_mm512_set1_epi32(static_cast<int>(ui[c]))), as_bh(bp[c]));
    vstore(yr, acc);
  }
}
#endif

template <typename T>
void lora_impl(const at::Tensor& x, at::Tensor& y, const at::Tensor& slots, const at::Tensor& a,
               const at::Tensor& bt, const std::vector<int64_t>& parts, const at::Tensor& active) {
  const int64_t n_tok = x.size(0), K = x.size(1), N = y.size(1), S = a.size(0), PR = a.size(1);
  const int64_t R = bt.size(1), P = static_cast<int64_t>(parts.size()) - 1, R2 = R / 2;
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  const int32_t* sp = slots.data_ptr<int32_t>();
  const uint8_t* act = active.data_ptr<uint8_t>();
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = bt.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  // The active slots' tokens, grouped by slot.
  std::vector<int64_t>& rows = t_rows;
  std::vector<Group>& groups = t_groups;
  rows.clear();
  groups.clear();
  for (int64_t s = 0; s < S; ++s) {
    if (!act[s]) continue;  // this adapter leaves the projection alone in this layer
    const int64_t first = static_cast<int64_t>(rows.size());
    for (int64_t t = 0; t < n_tok; ++t)
      if (sp[t] == s) rows.push_back(t);
    if (static_cast<int64_t>(rows.size()) > first) groups.push_back({s, first, static_cast<int64_t>(rows.size()) - first});
  }
  const int64_t G = static_cast<int64_t>(groups.size()), total = static_cast<int64_t>(rows.size());
  if (!G) return;
  if (static_cast<int64_t>(t_u.size()) < total * PR) t_u.resize(total * PR);
  float* u = t_u.data();  // [total, PR]: each group's tokens consecutive
  const int64_t* rp = rows.data();
  bool paired = false;
#if defined(__AVX512BF16__)
  paired = std::is_same_v<T, bf16> && R % 2 == 0;
#endif
  float* xf = nullptr;
  if (!paired) {  // the grouped tokens once in float32
    if (static_cast<int64_t>(t_x.size()) < total * K) t_x.resize(total * K);
    xf = t_x.data();
    for (int64_t i = 0; i < total; ++i)
      for (int64_t d = 0; d < K; ++d) xf[i * K + d] = to_f(xp[rp[i] * ldx + d]);
  }
  // Shrink, every group's every A row as one work item.
  const int64_t per = std::max<int64_t>(1, total / G);
  at::parallel_for(0, G * PR, std::max<int64_t>(1, 16 / per), [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const Group& g = groups[k / PR];
      const int64_t r = k % PR;
      const T* ar = ap + (g.slot * PR + r) * K;
      float* ur = u + g.first * PR + r;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, bf16>) {
        if (paired) {
          shrink_row_bf16(ar, xp, ldx, rp + g.first, g.count, K, ur, PR);
          continue;
        }
      }
#endif
      shrink_row(ar, xf + g.first * K, g.count, K, ur, PR);
    }
  });
  // Expand, every group's every full block of every part as one work item; tails after.
  std::vector<int64_t> full(P), start(P + 1, 0);
  for (int64_t j = 0; j < P; ++j) {
    full[j] = (parts[j + 1] - parts[j]) / VL;
    start[j + 1] = start[j] + full[j];
  }
  const int64_t blocks = start[P];
  uint32_t* pairs = nullptr;
  if (paired) {  // u rounded to bf16 (as a bf16 matmul's output is) and paired: [part][token][R / 2]
    if (static_cast<int64_t>(t_pairs.size()) < P * total * R2) t_pairs.resize(P * total * R2);
    pairs = t_pairs.data();
    for (int64_t j = 0; j < P; ++j)
      for (int64_t i = 0; i < total; ++i)
        for (int64_t c = 0; c < R2; ++c) {
          const bf16 lo(u[i * PR + j * R + 2 * c]), hi(u[i * PR + j * R + 2 * c + 1]);
          pairs[(j * total + i) * R2 + c] = static_cast<uint32_t>(lo.x) | (static_cast<uint32_t>(hi.x) << 16);
        }
  }
  at::parallel_for(0, G * blocks, std::max<int64_t>(4, 64 / per), [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const Group& g = groups[k / blocks];
      const int64_t b = k % blocks;
      int64_t j = 0;
      while (b >= start[j + 1]) ++j;
      const int64_t o = parts[j] + (b - start[j]) * VL;
      const T* bs = bp + g.slot * R * N;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, bf16>) {
        if (paired) {
          expand_block_bf16(bs, N, R, o, pairs + (j * total + g.first) * R2, rp + g.first, g.count, yp, ldy);
          continue;
        }
      }
#endif
      expand_block(bs, N, R, o, u + g.first * PR + j * R, PR, rp + g.first, g.count, yp, ldy);
    }
  });
  for (const Group& g : groups)  // a part's columns past its last full block
    for (int64_t j = 0; j < P; ++j)
      for (int64_t o = parts[j] + full[j] * VL; o < parts[j + 1]; ++o)
        for (int64_t i = g.first; i < g.first + g.count; ++i) {
          float acc = to_f(yp[rp[i] * ldy + o]);
          for (int64_t c = 0; c < R; ++c) acc += u[i * PR + j * R + c] * to_f(bp[(g.slot * R + c) * N + o]);
          yp[rp[i] * ldy + o] = static_cast<T>(acc);
        }
}

}  // namespace

void lora_apply(const at::Tensor& x, at::Tensor y, const at::Tensor& slots, const at::Tensor& a,
                const at::Tensor& bt, const std::vector<int64_t>& parts, const at::Tensor& active) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
              "lora_apply: x [T, in] and y [T, out] with contiguous rows");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.is_contiguous() && bt.is_contiguous() && a.size(0) == bt.size(0),
              "lora_apply: a [slots, parts * rank, in], bt [slots, rank, out], contiguous");
  TORCH_CHECK(a.size(2) == x.size(1) && bt.size(2) == y.size(1), "lora_apply: dims");
  TORCH_CHECK(parts.size() >= 2 && parts.front() == 0 && parts.back() == y.size(1) &&
              a.size(1) == bt.size(1) * static_cast<int64_t>(parts.size() - 1), "lora_apply: parts");
  TORCH_CHECK(bt.size(1) <= 64, "lora_apply: rank at most 64");
  TORCH_CHECK(slots.scalar_type() == at::kInt && slots.is_contiguous() && slots.size(0) == x.size(0),
              "lora_apply: slots int32 [T]");
  TORCH_CHECK(active.scalar_type() == at::kByte && active.size(0) == a.size(0), "lora_apply: active uint8 [slots]");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && x.scalar_type() == a.scalar_type() &&
              a.scalar_type() == bt.scalar_type(), "lora_apply: one dtype");
  switch (x.scalar_type()) {
    case at::kFloat: lora_impl<float>(x, y, slots, a, bt, parts, active); break;
    case at::kBFloat16: lora_impl<bf16>(x, y, slots, a, bt, parts, active); break;
    case at::kHalf: lora_impl<f16>(x, y, slots, a, bt, parts, active); break;
    default: TORCH_CHECK(false, "lora_apply: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace fusedserve
