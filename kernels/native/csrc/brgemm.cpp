// The matrix-engine GEMM through oneDNN's batch-reduce micro-kernel as torch ships it
// (at::native::cpublas::brgemm, what torch's CPU flash attention runs): AMX-BF16 / AMX-INT8 tiles
// on Xeons since Sapphire Rapids, AVX-512 BF16 / VNNI code elsewhere. oneDNN's matmul (torch.mm)
// reorders the weight on every call, which costs most of a small launch; here the weight is
// repacked once at load (kernels/linear.py) into the micro-kernel's VNNI blocks of NB columns,
//   bf16: [N/NB][K/2][NB][2] (pairs of inputs), int8: [N/NB][K/4][NB][4] (quads of inputs),
// and a launch is one call per (block of up to MB rows, block of NB columns) into an fp32
// (int32) tile, rounded (or kept exact) into out: no allocation per call after the first.
// int8 runs as u8 x s8 (VNNI's and AMX's native form): the rows + 128, the sums less 128 x each
// column's weight sum, so the int32 result is the exact signed product.
#include "kernels.h"

#include <ATen/native/CPUBlas.h>

namespace fusedserve {

// Older torch headers lack these overloads (the macros name them): there both calls refuse, and
// the chooser leaves the path out (kernels/linear.py: LinearOp._agrees).
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_U8I8I32)
#define FS_BRGEMM 1
#endif

constexpr int64_t NB = 64;  // columns per block: four AMX tiles wide

int64_t brgemm_block() { return NB; }

#if FS_BRGEMM
namespace {

constexpr int64_t MB = 64;  // rows per call

// A launch's operands: rows [M, K] contiguous of `in`, a pack [N/NB, K/per, NB, per] of `w`
// covering out's N columns.
void check_operands(const char* name, const at::Tensor& x, at::ScalarType in, const at::Tensor& packed,
                    at::ScalarType w, int64_t per, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == in, name, ": rows [M, K] contiguous ", in);
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == w && packed.is_contiguous() &&
                  packed.size(1) * per == x.size(1) && packed.size(2) == NB && packed.size(3) == per &&
                  packed.size(0) * NB >= N,
              name, ": packed [N/", NB, ", K/", per, ", ", NB, ", ", per, "] ", w);
}

template <typename In, typename Acc, typename Store>
void run_blocks(int64_t M, int64_t K, int64_t nblocks, const In* x, const void* w, int64_t wblock, Store store) {
  const int64_t mblocks = (M + MB - 1) / MB;
  at::parallel_for(0, nblocks * mblocks, 1, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<Acc> tile;
    if (tile.size() < static_cast<size_t>(MB * NB)) tile.resize(MB * NB);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t nb = b / mblocks, m0 = (b % mblocks) * MB, m = std::min(MB, M - m0);
      if constexpr (std::is_same_v<Acc, float>) {
        at::native::cpublas::brgemm(m, NB, K, K, NB, NB, false, reinterpret_cast<const at::BFloat16*>(x) + m0 * K,
                                    static_cast<const at::BFloat16*>(w) + nb * wblock, tile.data(), true);
      } else {
        at::native::cpublas::brgemm(m, NB, K, K, NB, NB, false, reinterpret_cast<const unsigned char*>(x) + m0 * K,
                                    static_cast<const signed char*>(w) + nb * wblock, tile.data(), true);
      }
      store(m0, m, nb * NB, tile.data());
    }
    at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace
#endif

#if !FS_BRGEMM
void linear_brgemm(const at::Tensor&, const at::Tensor&, at::Tensor) {
  TORCH_CHECK(false, "linear_brgemm: this torch's CPUBlas has no bf16 brgemm");
}
void linear_brgemm_w8a8(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor) {
  TORCH_CHECK(false, "linear_brgemm_w8a8: this torch's CPUBlas has no u8 x s8 brgemm");
}
#else

void linear_brgemm(const at::Tensor& x, const at::Tensor& packed, at::Tensor out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  check_operands("linear_brgemm", x, at::kBFloat16, packed, at::kBFloat16, 2, N);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.stride(1) == 1 &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "linear_brgemm: out [M, N] bf16 or fp32, rows contiguous");
  const int64_t ld = out.stride(0);
  const bool f32 = out.scalar_type() == at::kFloat;
  char* op = static_cast<char*>(out.data_ptr());
  run_blocks<bf16, float>(M, K, packed.size(0), x.data_ptr<bf16>(), packed.data_ptr(), K * NB,
                          [&](int64_t m0, int64_t m, int64_t n0, const float* t) {
                            const int64_t nn = std::min(NB, N - n0);
                            for (int64_t i = 0; i < m; ++i) {
                              if (f32) {
                                std::memcpy(reinterpret_cast<float*>(op) + (m0 + i) * ld + n0, t + i * NB, nn * 4);
                              } else {
                                bf16* d = reinterpret_cast<bf16*>(op) + (m0 + i) * ld + n0;
                                for (int64_t j = 0; j < nn; ++j) d[j] = static_cast<bf16>(t[i * NB + j]);
                              }
                            }
                          });
}

void linear_brgemm_w8a8(const at::Tensor& q, const at::Tensor& packed, const at::Tensor& wsum, at::Tensor acc) {
  const int64_t M = q.size(0), K = q.size(1), N = acc.size(1);
  check_operands("linear_brgemm_w8a8", q, at::kChar, packed, at::kChar, 4, N);
  TORCH_CHECK(acc.dim() == 2 && acc.size(0) == M && acc.is_contiguous() && acc.scalar_type() == at::kInt &&
                  wsum.scalar_type() == at::kInt && wsum.numel() >= N,
              "linear_brgemm_w8a8: acc [M, N] int32, wsum [N] int32");
  thread_local std::vector<uint8_t> shifted;  // the rows + 128 as u8: q ^ 0x80
  if (shifted.size() < static_cast<size_t>(M * K)) shifted.resize(M * K);
  const int8_t* qp = q.data_ptr<int8_t>();
  uint8_t* sp = shifted.data();
  at::parallel_for(0, M * K, 4096, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) sp[i] = static_cast<uint8_t>(qp[i]) ^ 0x80u;
  });
  const int32_t* ws = wsum.data_ptr<int32_t>();
  int32_t* ap = acc.data_ptr<int32_t>();
  run_blocks<uint8_t, int32_t>(M, K, packed.size(0), sp, packed.data_ptr(), K * NB,
                               [&](int64_t m0, int64_t m, int64_t n0, const int32_t* t) {
                                 const int64_t nn = std::min(NB, N - n0);
                                 for (int64_t i = 0; i < m; ++i)
                                   for (int64_t j = 0; j < nn; ++j)
                                     ap[(m0 + i) * N + n0 + j] = t[i * NB + j] - 128 * ws[n0 + j];
                               });
}
#endif

}  // namespace fusedserve
