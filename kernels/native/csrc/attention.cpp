// Paged decode attention: K/V read in place from the pages, online softmax in fp32, GQA.
#include "kernels.h"

namespace fusedserve {
// -------------------------------------------------------------- decode attention

constexpr int CHUNK = 32;  // context tokens scored before one online-softmax rescale

// Ask for a row's cache lines ahead of its use (a hint: no effect on any result).
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

inline void scale_f32(float a, float* acc, int64_t D) {
  vf av = vset(a);
  int64_t d = 0;
  for (; d + VL <= D; d += VL) vstore(acc + d, vmul(av, vload(acc + d)));
  for (; d < D; ++d) acc[d] *= a;
}

// acc[g][0, VB * VL) += p[g, t] * v[t][off, off + VB * VL) over a chunk's n tokens, in token
// order (the same sums as one token at a time), the block of acc held in registers.
template <typename T, int G, int VB>
inline void values_block(const T* const* vrows, int64_t n, int64_t off, const float* sh, float* ah, int64_t D) {
  vf a[G][VB];
  for (int g = 0; g < G; ++g)
    for (int b = 0; b < VB; ++b) a[g][b] = vload(ah + g * D + b * VL);
  for (int64_t t = 0; t < n; ++t) {
    vf vv[VB];
    for (int b = 0; b < VB; ++b) vv[b] = vload(vrows[t] + off + b * VL);
    for (int g = 0; g < G; ++g) {
      const vf p = vset(sh[g * CHUNK + t]);
      for (int b = 0; b < VB; ++b) a[g][b] = vfma(p, vv[b], a[g][b]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int b = 0; b < VB; ++b) vstore(ah + g * D + b * VL, a[g][b]);
}

// One query token per sequence against its paged context, K/V read in place from the
// pages; online softmax in float32; query head h reads KV head h / (H / KVH).
// A work item is one sequence's run of up to PART context tokens, every head where there are
// enough items: a token's K/V rows for all heads are contiguous in its page, so an item reads
// whole blocks of pages in order (splitting the heads among the threads instead, as before, gave
// each thread a strided half of every row: 1.25x slower at 4,096 tokens, batch 1). Each item
// leaves its (max, sum, weighted values) per head; a second pass merges a sequence's items in
// order. The split depends on the sequence's own length, never on the batch or the threads: a
// row's output is the same in any batch.
// GT: query heads per KV head known at compile time (0: not). C: the cache's element, T, or int8_t
// for quantized rows (kv8_store: D values, then their scale), whose K scale multiplies the score
// and whose V scale the probability (after the softmax's sum took it).
constexpr int64_t PART = 512;

template <typename T, typename C, int GT>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                           double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), G = GT > 0 ? GT : H / KVH;
  const int64_t bt_stride = block_tables.stride(0);  // rows may be a corner of a wider table
  const T* qp = q.data_ptr<T>();
  constexpr bool Q8 = std::is_same_v<C, int8_t>;
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  T* op = out.data_ptr<T>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t hrow = Q8 ? D + KV8_SCALE_BYTES : D;  // a head's row in the cache, in C elements
  const int64_t slot_stride = KVH * hrow;
  const int64_t DV = D - D % VL;  // vector part of a head row
  const float sc = static_cast<float>(scale);
  // Items (sequence, first token), a sequence's in order from first[b]; the scratch only grows.
  thread_local std::vector<int64_t> item_row, item_t0, first;
  thread_local std::vector<float> part_m, part_l, part_acc;
  item_row.clear();
  item_t0.clear();
  first.resize(B + 1);
  for (int64_t b = 0; b < B; ++b) {
    first[b] = static_cast<int64_t>(item_row.size());
    for (int64_t t0 = 0; t0 == 0 || t0 < sl[b]; t0 += PART) {
      item_row.push_back(b);
      item_t0.push_back(t0);
    }
  }
  const int64_t items = static_cast<int64_t>(item_row.size());
  first[B] = items;
  if (part_m.size() < static_cast<size_t>(items * H)) {
    part_m.resize(items * H);
    part_l.resize(items * H);
  }
  if (part_acc.size() < static_cast<size_t>(items * H * D)) part_acc.resize(items * H * D);
  // thread_local names inside the lambdas would be each worker thread's own: pass pointers.
  const int64_t* irow = item_row.data();
  const int64_t* it0 = item_t0.data();
  const int64_t* ifirst = first.data();
  float* pm = part_m.data();
  float* pl = part_l.data();
  float* pacc = part_acc.data();
  // Few items (one short sequence): the KV heads are split too, as far as the threads need work
  // (each head's sums are its own, so this changes no output).
  int64_t groups = 1;
  const int64_t threads = at::get_num_threads();
  while (items * groups < threads && groups < KVH) {
    int64_t next = groups + 1;
    while (KVH % next) ++next;
    groups = next;
  }
  const int64_t hpg = KVH / groups;  // KV heads per work item
  const int64_t nq = hpg * G;  // query heads per work item
  const bool single = items == B;  // no sequence past PART tokens: nothing to merge
  // A run's K/V rows (from token t0, at most CHUNK, up to te) of sequence b, from KV head kh.
  auto rows_at = [&](int64_t b, int64_t t0, int64_t te, int64_t kh, const C** kr, const C** vr) -> int64_t {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(CHUNK, te - t0));
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = t0 + t;
      const int64_t slot = static_cast<int64_t>(bt[b * bt_stride + pos / block_size]) * block_size +
                           pos % block_size;
      kr[t] = kp + slot * slot_stride + kh * hrow;
      vr[t] = vp + slot * slot_stride + kh * hrow;
    }
    return n;
  };
  const int64_t row_bytes = hpg * hrow * static_cast<int64_t>(sizeof(C));  // an item's heads of a token
  at::parallel_for(0, items * groups, 1, [&](int64_t w0, int64_t w1) {
    thread_local std::vector<float> qbuf, sbuf;
    if (qbuf.size() < static_cast<size_t>(H * D)) qbuf.resize(H * D);
    if (sbuf.size() < static_cast<size_t>(H * CHUNK)) sbuf.resize(H * CHUNK);
    float* qf = qbuf.data();
    float* s = sbuf.data();
    for (int64_t work = w0; work < w1; ++work) {
      const int64_t part = work / groups, kh0 = (work % groups) * hpg;
      const int64_t b = irow[part], tb = it0[part];
      const int64_t te = std::min<int64_t>(sl[b], tb + PART);
      float* acc = pacc + (part * H + kh0 * G) * D;
      float* mx = pm + part * H + kh0 * G;
      float* l = pl + part * H + kh0 * G;
      for (int64_t j = 0; j < nq; ++j) {
        const T* src = qp + b * qs0 + (kh0 * G + j) * qs1;
        for (int64_t d = 0; d < D; ++d) qf[j * D + d] = to_f(src[d]) * sc;
        std::fill(acc + j * D, acc + (j + 1) * D, 0.f);
        mx[j] = -INFINITY;
        l[j] = 0.f;
      }
      // The chunk's K/V rows (this item's heads of each token: contiguous), and the next chunk's
      // (this item's, else the next item's first), which the loops below prefetch a token at a
      // time while this one is scored and summed: pages are scattered, so the hardware's stream
      // prefetch restarts at every block, and a step over many sequences waits on memory.
      const C* krows[CHUNK];
      const C* vrows[CHUNK];
      const C* knext[CHUNK];
      const C* vnext[CHUNK];
      int64_t n_next = rows_at(b, tb, te, kh0, krows, vrows);
      for (int64_t t0 = tb; t0 < te; t0 += CHUNK) {
        const int64_t n = n_next;
        if (t0 + CHUNK < te) {
          n_next = rows_at(b, t0 + CHUNK, te, kh0, knext, vnext);
        } else if (work + 1 < w1) {
          const int64_t np = (work + 1) / groups, nb = irow[np];
          n_next = rows_at(nb, it0[np], std::min<int64_t>(sl[nb], it0[np] + PART), ((work + 1) % groups) * hpg,
                           knext, vnext);
        } else {
          n_next = 0;
        }
        for (int64_t t = n; t < n_next; ++t) {
          prefetch_row(knext[t], row_bytes);
          prefetch_row(vnext[t], row_bytes);
        }
        for (int64_t t = 0; t < n; ++t) {  // scores: each K row once for its G query heads
          if (t < n_next) {
            prefetch_row(knext[t], row_bytes);
            prefetch_row(vnext[t], row_bytes);
          }
          for (int64_t h = 0; h < hpg; ++h) {
            const C* krow = krows[t] + h * hrow;
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
              if constexpr (Q8) v *= kv8_scale(krow, D);
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
        if constexpr (Q8)  // each token's V scale into its probabilities, for the value sums
          for (int64_t h = 0; h < hpg; ++h)
            for (int64_t t = 0; t < n; ++t) {
              const float vs = kv8_scale(vrows[t] + h * hrow, D);
              for (int64_t g = 0; g < G; ++g) s[(h * G + g) * CHUNK + t] *= vs;
            }
        if constexpr (GT > 0) {  // values: acc[g] += p[g, t] * v[t], a block of acc in registers
          constexpr int VB = GT <= 2 ? 4 : GT <= 4 ? 2 : 1;
          for (int64_t h = 0; h < hpg; ++h) {
            float* ah = acc + h * G * D;
            const float* sh = s + h * G * CHUNK;
            int64_t d = 0;
            for (; d + VB * VL <= DV; d += VB * VL) values_block<C, GT, VB>(vrows, n, h * hrow + d, sh, ah + d, D);
            for (; d < DV; d += VL) values_block<C, GT, 1>(vrows, n, h * hrow + d, sh, ah + d, D);
            for (int64_t t = 0; t < n; ++t)
              for (d = DV; d < D; ++d)
                for (int64_t g = 0; g < G; ++g) ah[g * D + d] += sh[g * CHUNK + t] * to_f(vrows[t][h * hrow + d]);
          }
        } else {
          for (int64_t t = 0; t < n; ++t) {  // values, in page order
            for (int64_t h = 0; h < hpg; ++h) {
              const C* vrow = vrows[t] + h * hrow;
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
        std::copy(knext, knext + n_next, krows);  // the next chunk's rows (unused past the item)
        std::copy(vnext, vnext + n_next, vrows);
      }
      if (single)  // every sequence one item: its output now, as the merge would write it
        for (int64_t j = 0; j < nq; ++j) {
          T* dst = op + b * os0 + (kh0 * G + j) * os1;
          const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[j * D + d] * inv);
        }
    }
  });
  if (single) return;
  // Merge each sequence's items in order: weights exp(m_i - max), 1 for a single item (exact).
  at::parallel_for(0, B * H, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / H, j = r % H;
      T* dst = op + b * os0 + j * os1;
      float m = -INFINITY;
      for (int64_t w = ifirst[b]; w < ifirst[b + 1]; ++w) m = std::max(m, pm[w * H + j]);
      if (m == -INFINITY) {  // an empty context
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(0.f);
        continue;
      }
      float l = 0.f;
      float o[MAX_HEAD_DIM] = {};
      for (int64_t w = ifirst[b]; w < ifirst[b + 1]; ++w) {
        const float wt = std::exp(pm[w * H + j] - m);
        l += pl[w * H + j] * wt;
        const float* a = pacc + (w * H + j) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += a[d] * wt;
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
    }
  });
}

template <typename T, typename C>
void decode_attention_g(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                        double scale, at::Tensor& out) {
  switch (q.size(1) / k_cache.size(1)) {
#define FS_G(GT) decode_attention_impl<T, C, GT>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out)
    case 1: FS_G(1); break;
    case 2: FS_G(2); break;
    case 4: FS_G(4); break;
    case 8: FS_G(8); break;
    default: FS_G(0); break;
#undef FS_G
  }
}

template <typename T>
void decode_attention_c(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                        double scale, at::Tensor& out) {
  if (k_cache.scalar_type() == at::kChar)
    decode_attention_g<T, int8_t>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out);
  else
    decode_attention_g<T, T>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out);
}

void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                      double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "decode_attention: q/out [B, H, D], caches [slots, KVH, D] (int8: D + 4)");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_attention: head rows and caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              block_tables.stride(1) == 1 && seq_lens.is_contiguous(), "decode_attention: int32 tables");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  const bool q8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(H % KVH == 0 && H / KVH <= MAX_GROUP && H <= MAX_GROUP * 64 && D <= MAX_HEAD_DIM &&
              k_cache.size(2) == D + (q8 ? KV8_SCALE_BYTES : 0) && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: unsupported head layout");
  TORCH_CHECK((q8 || q.scalar_type() == k_cache.scalar_type()) && v_cache.scalar_type() == k_cache.scalar_type() &&
              q.scalar_type() == out.scalar_type(),
              "decode_attention: the caches are q's dtype or int8, out is q's");
  switch (q.scalar_type()) {
#define FS_T(T) decode_attention_c<T>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out)
    case at::kFloat: FS_T(float); break;
    case at::kBFloat16: FS_T(bf16); break;
    case at::kHalf: FS_T(f16); break;
#undef FS_T
    default: TORCH_CHECK(false, "decode_attention: unsupported dtype ", q.scalar_type());
  }
}
}  // namespace fusedserve
