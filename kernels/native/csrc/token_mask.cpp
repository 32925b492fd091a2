// Structured outputs: a grammar's token bitmask applied to the logits in place, one pass.
#include <cmath>
#include <limits>

#include "kernels.h"

namespace fusedserve {

// logits [B, V] fp32 (rows may be strided); bitmask [B, ceil(V/32)] int32, bit v % 32 of word
// v / 32 allows token v. A refused token's logit becomes -inf; an all-ones word is skipped.
void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask: logits [B, V] float32, rows contiguous");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
                  bitmask.size(0) == logits.size(0) && bitmask.size(1) * 32 >= logits.size(1),
              "apply_token_bitmask: bitmask [B, ceil(V/32)] int32");
  const int64_t B = logits.size(0), V = logits.size(1), W = bitmask.size(1), ld = logits.stride(0);
  float* lp = logits.data_ptr<float>();
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float neg = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * W, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint32_t m = mp[i];
      if (m == 0xFFFFFFFFu) continue;
      const int64_t b = i / W, v0 = (i % W) * 32, n = std::min<int64_t>(32, V - v0);
      float* row = lp + b * ld + v0;
      if (m == 0) {
        for (int64_t k = 0; k < n; ++k) row[k] = neg;
      } else {
        for (int64_t k = 0; k < n; ++k)
          if (!((m >> k) & 1u)) row[k] = neg;
      }
    }
  });
}

}  // namespace fusedserve
