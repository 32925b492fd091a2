// A prompt chunk through the Gated DeltaNet (Qwen3.5, Qwen3-Next linear attention): the causal
// conv over one sequence's new inputs continuing from its slot's, and the chunked delta rule from
// the slot's state, in blocks of 64 tokens per head held in cache-sized buffers. The torch form
// (kernels/gated_delta.py: chunked) materialises every block's products for the whole prompt and
// spends most of its time in copies; here each (head, block) is a few small fp32 GEMMs that stay
// in L2, and the state is advanced in place in its slot.
#include "gated_delta.h"

namespace fusedserve {
namespace {

constexpr int64_t BLOCK = 64;  // tokens per block of the chunked rule (transformers' and FLA's)
constexpr int64_t CB = 64;     // conv channels per task
constexpr int64_t MAXW = 8;    // conv inputs kept (kernel - 1)

// C[M, N] += alpha A[M, K] B[K, N] (row-major fp32), NV vectors of columns at a time: a tile of
// 4 rows x NV vectors keeps its accumulators in registers and loads each row of B once for 4 rows.
template <int NV>
void gemm_cols(int64_t M, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
               float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; i += 4) {
    const int64_t rows = std::min<int64_t>(4, M - i);
    vf acc[4][NV];
    for (int64_t r = 0; r < rows; ++r)
      for (int t = 0; t < NV; ++t) acc[r][t] = vload(C + (i + r) * ldc + t * VL);
    for (int64_t p = 0; p < K; ++p) {
      vf bv[NV];
      for (int t = 0; t < NV; ++t) bv[t] = vload(B + p * ldb + t * VL);
      for (int64_t r = 0; r < rows; ++r) {
        const vf av = vset(alpha * A[(i + r) * lda + p]);
        for (int t = 0; t < NV; ++t) acc[r][t] = vfma(av, bv[t], acc[r][t]);
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int t = 0; t < NV; ++t) vstore(C + (i + r) * ldc + t * VL, acc[r][t]);
  }
}

// N a multiple of VL (the callers' N: 64, dk, dv; checked).
void gemm_acc(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
              int64_t ldb, float* C, int64_t ldc) {
  int64_t j = 0;
  for (; j + 4 * VL <= N; j += 4 * VL) gemm_cols<4>(M, K, alpha, A, lda, B + j, ldb, C + j, ldc);
  for (; j < N; j += VL) gemm_cols<1>(M, K, alpha, A, lda, B + j, ldb, C + j, ldc);
}

// Forward substitution for row i of (I + A) X = R in place (rows j < i already solved): X_i = R_i -
// sum_j A[i, j] X_j, a vector of columns at a time held in registers across j.
void substitute_row(const float* a, int64_t i, float* x, int64_t ld) {
  float* xi = x + i * ld;
  int64_t c = 0;
  for (; c + 4 * VL <= ld; c += 4 * VL) {
    vf acc[4];
    for (int t = 0; t < 4; ++t) acc[t] = vload(xi + c + t * VL);
    for (int64_t j = 0; j < i; ++j) {
      const vf aj = vset(-a[j]);
      for (int t = 0; t < 4; ++t) acc[t] = vfma(aj, vload(x + j * ld + c + t * VL), acc[t]);
    }
    for (int t = 0; t < 4; ++t) vstore(xi + c + t * VL, acc[t]);
  }
  for (; c < ld; ++c)
    for (int64_t j = 0; j < i; ++j) xi[c] -= a[j] * x[j * ld + c];
}

// One head's working set for a block (zero rows past the prompt's end change nothing: their k,
// v, beta and g are 0).
struct HeadBlock {
  std::vector<float> q, k, kt, v, r, nw, o, kk, qk;
  float beta[BLOCK], decay[BLOCK];
  HeadBlock(int64_t dk, int64_t dv)
      : q(BLOCK * dk), k(BLOCK * dk), kt(dk * BLOCK), v(BLOCK * dv), r(BLOCK * (dv + dk)), nw(BLOCK * dv),
        o(BLOCK * dv), kk(BLOCK * BLOCK), qk(BLOCK * BLOCK) {}
};

// The block's c tokens from S [dk, dv] (in place): o [BLOCK, dv] their outputs, S the state after.
// As kernels/gated_delta.py's chunked: A = beta_i k_i.k_j e^(d_i - d_j) (j < i); (I + A) X = [beta v,
// beta e^d k] by forward substitution; new = X_v - X_k S; o = (q e^d) S + (q.k e^(d_i - d_j))_(j<=i) new;
// S = e^(d_last) S + (k e^(d_last - d))^T new.
void block_rule(HeadBlock& w, float* S, int64_t dk, int64_t dv) {
  const int64_t ld = dv + dk;
  for (int64_t i = 0; i < BLOCK; ++i)
    for (int64_t p = 0; p < dk; ++p) w.kt[p * BLOCK + i] = w.k[i * dk + p];
  std::fill(w.kk.begin(), w.kk.end(), 0.f);
  std::fill(w.qk.begin(), w.qk.end(), 0.f);
  gemm_acc(BLOCK, BLOCK, dk, 1.f, w.k.data(), dk, w.kt.data(), BLOCK, w.kk.data(), BLOCK);
  gemm_acc(BLOCK, BLOCK, dk, 1.f, w.q.data(), dk, w.kt.data(), BLOCK, w.qk.data(), BLOCK);
  for (int64_t i = 0; i < BLOCK; ++i) {
    for (int64_t j = 0; j < BLOCK; ++j) {
      const float pair = j <= i ? std::exp(w.decay[i] - w.decay[j]) : 0.f;
      w.kk[i * BLOCK + j] = j < i ? w.beta[i] * w.kk[i * BLOCK + j] * pair : 0.f;
      w.qk[i * BLOCK + j] *= pair;
    }
    const float ed = std::exp(w.decay[i]);
    float* ri = w.r.data() + i * ld;
    for (int64_t j = 0; j < dv; ++j) ri[j] = w.beta[i] * w.v[i * dv + j];
    for (int64_t p = 0; p < dk; ++p) ri[dv + p] = w.beta[i] * ed * w.k[i * dk + p];
    substitute_row(w.kk.data() + i * BLOCK, i, w.r.data(), ld);
    for (int64_t p = 0; p < dk; ++p) w.q[i * dk + p] *= ed;
  }
  for (int64_t i = 0; i < BLOCK; ++i) std::memcpy(w.nw.data() + i * dv, w.r.data() + i * ld, dv * sizeof(float));
  gemm_acc(BLOCK, dv, dk, -1.f, w.r.data() + dv, ld, S, dv, w.nw.data(), dv);
  std::fill(w.o.begin(), w.o.end(), 0.f);
  gemm_acc(BLOCK, dv, dk, 1.f, w.q.data(), dk, S, dv, w.o.data(), dv);
  gemm_acc(BLOCK, dv, BLOCK, 1.f, w.qk.data(), BLOCK, w.nw.data(), dv, w.o.data(), dv);
  const float last = w.decay[BLOCK - 1], block_decay = std::exp(last);
  float tail[BLOCK];
  for (int64_t i = 0; i < BLOCK; ++i) tail[i] = std::exp(last - w.decay[i]);
  for (int64_t x = 0; x < dk * dv; ++x) S[x] *= block_decay;
  for (int64_t p = 0; p < dk; ++p)
    for (int64_t i = 0; i < BLOCK; ++i) w.kt[p * BLOCK + i] *= tail[i];
  gemm_acc(dk, dv, BLOCK, 1.f, w.kt.data(), BLOCK, w.nw.data(), dv, S, dv);
}

template <typename T>
void delta_prompt_impl(const at::Tensor& conv, const at::Tensor& b, const at::Tensor& a, const at::Tensor& z,
                       const at::Tensor& neg_a, const at::Tensor& dt_bias, const at::Tensor& norm_w, double eps,
                       int64_t key_heads, at::Tensor state, int64_t slot, at::Tensor out) {
  const int64_t n = conv.size(0), H = state.size(1), dk = state.size(2), dv = state.size(3);
  const int64_t per = H / key_heads, key_dim = key_heads * dk;
  const T *cp = conv.data_ptr<T>(), *bp = b.data_ptr<T>(), *ap = a.data_ptr<T>(), *zp = z.data_ptr<T>();
  const T* wp = norm_w.data_ptr<T>();
  const float *nap = neg_a.data_ptr<float>(), *dtp = dt_bias.data_ptr<float>();
  T* op = out.data_ptr<T>();
  const int64_t ldc = conv.stride(0), ldb = b.stride(0), lda = a.stride(0), ldz = z.stride(0), ldo = out.stride(0);
  const float e = static_cast<float>(eps), scale = 1.f / std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    HeadBlock w(dk, dv);
    for (int64_t h = h0; h < h1; ++h) {
      float* S = state.data_ptr<float>() + (slot * H + h) * dk * dv;
      for (int64_t t0 = 0; t0 < n; t0 += BLOCK) {
        const int64_t c = std::min(BLOCK, n - t0);
        float sum = 0.f;
        for (int64_t i = 0; i < BLOCK; ++i) {
          if (i >= c) {
            std::fill_n(w.q.data() + i * dk, dk, 0.f), std::fill_n(w.k.data() + i * dk, dk, 0.f);
            std::fill_n(w.v.data() + i * dv, dv, 0.f);
            w.beta[i] = 0.f, w.decay[i] = sum;
            continue;
          }
          const int64_t r = t0 + i;
          delta_qkv(cp + r * ldc, h / per, h, dk, dv, key_dim, scale, w.q.data() + i * dk, w.k.data() + i * dk,
                    w.v.data() + i * dv);
          w.beta[i] = delta_beta(bp[r * ldb + h]);
          sum += delta_gate(ap[r * lda + h], nap[h], dtp[h]);
          w.decay[i] = sum;
        }
        block_rule(w, S, dk, dv);
        for (int64_t i = 0; i < c; ++i)
          gated_norm_row(w.o.data() + i * dv, zp + (t0 + i) * ldz + h * dv, wp, e, dv, op + (t0 + i) * ldo + h * dv);
      }
    }
  });
}

template <typename T>
void conv_prompt_impl(const at::Tensor& x, at::Tensor state, int64_t slot, const at::Tensor& w, at::Tensor out) {
  const int64_t n = x.size(0), C = x.size(1), K = w.size(1), W = K - 1;
  const T *xp = x.data_ptr<T>(), *wp = w.data_ptr<T>();
  T *st = state.data_ptr<T>() + slot * C * W, *op = out.data_ptr<T>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  at::parallel_for(0, (C + CB - 1) / CB, 1, [&](int64_t b0, int64_t b1) {
    float hist[MAXW][CB], wt[MAXW + 1][CB], acc[CB];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t c0 = blk * CB, cn = std::min(CB, C - c0);
      for (int64_t c = 0; c < cn; ++c) {
        for (int64_t i = 0; i < W; ++i) hist[i][c] = to_f(st[(c0 + c) * W + i]);
        for (int64_t i = 0; i < K; ++i) wt[i][c] = to_f(wp[(c0 + c) * K + i]);
      }
      for (int64_t t = 0; t < n; ++t) {
        const T* xr = xp + t * ldx + c0;
        T* orow = op + t * ldo + c0;
        for (int64_t c = 0; c < cn; ++c) {
          const float xin = to_f(xr[c]);
          float a = 0.f;
          for (int64_t i = 0; i < W; ++i) a += wt[i][c] * hist[i][c];
          a += wt[W][c] * xin;
          for (int64_t i = 0; i + 1 < W; ++i) hist[i][c] = hist[i + 1][c];
          hist[W - 1][c] = xin;
          acc[c] = a;
        }
        conv_silu(acc, orow, cn);  // as conv_decode: rounded, then SiLU
      }
      for (int64_t c = 0; c < cn; ++c)
        for (int64_t i = 0; i < W; ++i) st[(c0 + c) * W + i] = static_cast<T>(hist[i][c]);
    }
  });
}

int64_t checked_slot(const char* fn, const at::Tensor& slots, int64_t row, int64_t pool) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && row >= 0 && row < slots.numel(),
              fn, ": row out of range");
  const int64_t slot = slots.data_ptr<int64_t>()[row];
  TORCH_CHECK(slot >= 0 && slot < pool, fn, ": slot out of range");
  return slot;
}

}  // namespace

// One sequence's prompt chunk of n tokens after the conv (arguments as gated_delta_step's, the
// state in slot slots[row]): the chunked delta rule from the slot's state, left advanced past them.
void gated_delta_prompt(const at::Tensor& conv, const at::Tensor& b, const at::Tensor& a, const at::Tensor& z,
                        const at::Tensor& neg_a, const at::Tensor& dt_bias, const at::Tensor& norm_w, double eps,
                        int64_t key_heads, at::Tensor state, const at::Tensor& slots, int64_t row, at::Tensor out) {
  check_delta_args("gated_delta_prompt", conv, b, a, z, neg_a, dt_bias, norm_w, key_heads, state, slots, out);
  TORCH_CHECK(state.size(2) % VL == 0 && state.size(3) % VL == 0, "gated_delta_prompt: head dims by ", VL);
  const int64_t slot = checked_slot("gated_delta_prompt", slots, row, state.size(0));
  switch (conv.scalar_type()) {
    case at::kFloat: delta_prompt_impl<float>(conv, b, a, z, neg_a, dt_bias, norm_w, eps, key_heads, state, slot, out); break;
    case at::kBFloat16: delta_prompt_impl<bf16>(conv, b, a, z, neg_a, dt_bias, norm_w, eps, key_heads, state, slot, out); break;
    case at::kHalf: delta_prompt_impl<f16>(conv, b, a, z, neg_a, dt_bias, norm_w, eps, key_heads, state, slot, out); break;
    default: TORCH_CHECK(false, "gated_delta_prompt: unsupported dtype ", conv.scalar_type());
  }
}

// x [n, C] one sequence's new inputs (rows may be strided), state [S, C, K - 1] (its slot
// slots[row]), weight [C, K], out [n, C], one dtype: out = SiLU(causal conv continuing from the
// slot's inputs), which are left holding the last K - 1.
void conv_prompt(const at::Tensor& x, at::Tensor state, const at::Tensor& slots, int64_t row, const at::Tensor& weight,
                 at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 && out.size(0) == x.size(0) &&
              out.size(1) == x.size(1) && state.is_contiguous() && weight.is_contiguous() && state.dim() == 3 &&
              state.size(1) == x.size(1) && state.size(2) == weight.size(1) - 1 && weight.size(0) == x.size(1) &&
              weight.size(1) >= 2 && weight.size(1) <= 9 && x.scalar_type() == state.scalar_type() &&
              x.scalar_type() == weight.scalar_type() && x.scalar_type() == out.scalar_type(),
              "conv_prompt: x [n, C], state [S, C, K - 1], weight [C, K] (2 <= K <= 9), out [n, C], one dtype");
  const int64_t slot = checked_slot("conv_prompt", slots, row, state.size(0));
  switch (x.scalar_type()) {
    case at::kFloat: conv_prompt_impl<float>(x, state, slot, weight, out); break;
    case at::kBFloat16: conv_prompt_impl<bf16>(x, state, slot, weight, out); break;
    case at::kHalf: conv_prompt_impl<f16>(x, state, slot, weight, out); break;
    default: TORCH_CHECK(false, "conv_prompt: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace fusedserve
