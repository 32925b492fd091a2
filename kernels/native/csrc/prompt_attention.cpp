// Prompt chunks' attention, flash style, over the paged bf16 cache (AVX-512 BF16 builds).
//
// A chunk of n new tokens whose sequence holds ctx tokens after this launch (p = ctx - n before
// them: a cached prefix or earlier chunks) attends causally: query j (position p + j) sees keys
// 0 .. p + j. Every chunk of the launch is served by one call.
//
// Per chunk and KV head, K and V are first copied out of the pages into the layouts vdpbf16ps
// takes (each 32-bit word a pair of bf16; an int8 cache's rows dequantized to bf16 on the way):
//   K: [ctx/16][D/2][16] words: word (b, d2, i) = (k[16b + i][2 d2], k[16b + i][2 d2 + 1]), so one
//      vector holds 16 keys' pair d2 and a query's pair d2, broadcast, scores 16 keys per op;
//   V: [ctx/2][D] words: word (t2, d) = (v[2 t2][d], v[2 t2 + 1][d]), so one vector holds 16 dims
//      of two keys and a row's probabilities of those two keys, broadcast, add 16 dims per op.
// A work item is up to 64 query rows (tokens x the KV head's query heads) of one chunk and head,
// its queries copied once into tiles of 8 rows with their pairs interleaved ([D/2][8] words); it
// walks the keys in blocks of 64 up to its last token's position, each block scored for 8 rows
// at a time in registers, then an online softmax in fp32 and base 2 (scores times scale x log2 e;
// the 8 rows' maxima, sums and rescale factors a vector at a time; the probabilities rounded to
// bf16 for the value product, as flash attention does on GPUs), then P V into fp32 rows. Keys
// past a row's position are masked (only in blocks on the diagonal: others take a tile step
// without masks), and blocks past all of a tile's rows are skipped.
#include "kernels.h"

namespace fusedserve {

#if defined(__AVX512BF16__)
namespace {

constexpr int KB = 64;  // keys per block: four vectors of scores
constexpr int NV = KB / 16;
constexpr int RT = 8;  // rows scored and accumulated together in registers
constexpr int ITEM_ROWS = 64;  // query rows per work item
// The tile's helpers run inside tile_step with its scores in registers: inlined whatever GCC's
// size budget says (two masking variants x 8 row counts exceed it). Inlined so, the products are
// _mm512_dpbf16_ps itself: GCC 12 keeps its accumulators in registers, where inline asm's "+v"
// operands cost a register move or two per iteration of the inner loops.
#define FS_ALWAYS_INLINE inline __attribute__((always_inline))

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// An int8 cache row (kv8_store) as bf16 bits: q * scale rounded to nearest even, 16 at a time.
inline void dequant_row(const int8_t* row, int64_t D, uint16_t* dst) {
  const __m512 s = _mm512_set1_ps(kv8_scale(row, D));
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)))), s);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(x));
  }
}

struct Chunk {
  int64_t row, q0, n, ctx, kv_off;  // its block-table row, first query, queries, context, repack offset
};

// A work item's rows: row r is token j0 + r / G of the chunk, query head kvh * G + r % G.
struct Item {
  const Chunk* c;
  int64_t kvh, j0, rows;
};

// Scores of R rows against 2 x 16 keys. q: the tile's query pairs interleaved, [D2][RT] words
// (row r's pair d2 at d2 * RT + r), so every broadcast is one pointer plus a constant.
template <int R>
FS_ALWAYS_INLINE void score_tile(const uint32_t* q, const uint32_t* k0, int64_t D2, __m512* s) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  const uint32_t* k1 = k0 + D2 * 16;
  for (int64_t d2 = 0; d2 < D2; ++d2) {
    const __m512bh kv0 = as_bh(_mm512_loadu_si512(k0 + d2 * 16));
    const __m512bh kv1 = as_bh(_mm512_loadu_si512(k1 + d2 * 16));
    for (int r = 0; r < R; ++r) {
      const __m512bh qb = as_bh(_mm512_set1_epi32(static_cast<int>(q[d2 * RT + r])));
      a0[r] = _mm512_dpbf16_ps(a0[r], qb, kv0);
      a1[r] = _mm512_dpbf16_ps(a1[r], qb, kv1);
    }
  }
  for (int r = 0; r < R; ++r) {
    s[2 * r] = a0[r];
    s[2 * r + 1] = a1[r];
  }
}

// o[r] = o[r] x corr[r] + P V for CV vectors of 16 dims from c: R x CV accumulator chains (16 at
// R = 8, CV = 2: enough independent vdpbf16ps to cover its latency), each row's probability pair
// broadcast once for its CV vectors. Every lane sums its t2 terms in order, whatever CV is.
template <int R, int CV>
FS_ALWAYS_INLINE void value_cols(const uint32_t* p, const float* corr, const uint32_t* vp, int64_t D, int64_t c, float* o) {
  __m512 a[R][CV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < CV; ++j)
      a[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c + 16 * j), _mm512_set1_ps(corr[r]));
  for (int t2 = 0; t2 < KB / 2; ++t2) {
    __m512bh vv[CV];
    for (int j = 0; j < CV; ++j) vv[j] = as_bh(_mm512_loadu_si512(vp + t2 * D + c + 16 * j));
    for (int r = 0; r < R; ++r) {
      const __m512bh pb = as_bh(_mm512_set1_epi32(static_cast<int>(p[r * (KB / 2) + t2])));
      for (int j = 0; j < CV; ++j) a[r][j] = _mm512_dpbf16_ps(a[r][j], pb, vv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < CV; ++j) _mm512_storeu_ps(o + r * D + c + 16 * j, a[r][j]);
}

template <int R>
FS_ALWAYS_INLINE void value_tile(const uint32_t* p, const float* corr, const uint32_t* vp, int64_t D, float* o) {
  int64_t c = 0;
  for (; c + 32 <= D; c += 32) value_cols<R, 2>(p, corr, vp, D, c, o);
  if (c < D) value_cols<R, 1>(p, corr, vp, D, c, o);
}

// 2^x for x <= 0 or -inf (0 for x below -149): 2^n * p(x - n), n = round(x), p a degree-5 Taylor
// polynomial of 2^f on [-1/2, 1/2] (relative error < 3e-6, far below the bf16 rounding of the
// probabilities). -inf gives NaN: callers mask those lanes.
FS_ALWAYS_INLINE __m512 exp2_neg(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  for (float c : {9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// Horizontal max (or sum) of R <= 8 rows' vectors at once: lane r of the result is row r's. A
// transposing tree (unpack, 64-bit shuffle, 128-bit permute), about 4 ops a row where one row's
// own reduction takes 8; lanes past R hold junk.
template <int R, bool MAX>
FS_ALWAYS_INLINE __m256 rows_reduce(const __m512* v) {
  auto op = [](__m256 a, __m256 b) { return MAX ? _mm256_max_ps(a, b) : _mm256_add_ps(a, b); };
  __m256 h[8];
  for (int r = 0; r < 8; ++r) {
    const __m512 x = v[r < R ? r : 0];
    h[r] = op(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  }
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = op(_mm256_unpacklo_ps(h[2 * i], h[2 * i + 1]), _mm256_unpackhi_ps(h[2 * i], h[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    b[i] = op(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  return op(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

// One block of KB keys for R query rows: scores, the online softmax's update, then P V. The rows'
// maxima, sums and rescale factors are computed 8 rows to a vector. MASK: some row of the tile
// sees only part of the block (the causal diagonal); else every key is visible and no lane is
// masked (the same values: a mask of all ones changes nothing).
template <int R, bool MASK>
void tile_step(const uint32_t* q, const uint32_t* kblk, const uint32_t* vblk, int64_t D, int64_t kb0,
               const int64_t* qpos, float scale, float* m, float* l, float* o) {
  __m512 s[NV / 2][2 * R];
  for (int h = 0; h < NV / 2; ++h) score_tile<R>(q, kblk + h * 2 * (D / 2) * 16, D / 2, s[h]);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const float scale2 = scale * 1.44269504f;  // scores in base 2: softmax(s) = 2^(s log2 e - max) / sum
  __mmask16 vis[R][NV];
  __m512 mx[R];
  for (int r = 0; r < R; ++r) {
    const int64_t limit = qpos[r] - kb0;  // keys kb0 + i with i <= limit are visible
    const __m512i lim = _mm512_set1_epi32(static_cast<int>(std::clamp<int64_t>(limit, -1, KB)));
    for (int v = 0; v < NV; ++v) {
      __m512& x = s[v / 2][2 * r + v % 2];
      x = _mm512_mul_ps(x, _mm512_set1_ps(scale2));
      if constexpr (MASK) {
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * v));
        vis[r][v] = limit < KB - 1 ? _mm512_cmple_epi32_mask(key, lim) : static_cast<__mmask16>(0xffff);
        x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), vis[r][v], x);
      }
      mx[r] = v == 0 ? x : _mm512_max_ps(mx[r], x);
    }
  }
  const __mmask8 rows = static_cast<__mmask8>((1u << R) - 1);
  const __m256 m_old = _mm256_mask_loadu_ps(_mm256_setzero_ps(), rows, m);
  const __m256 m_new = _mm256_max_ps(m_old, rows_reduce<R, true>(mx));
  // A row's first block: m_old = -inf, clamped (its l and o are still 0).
  const __m256 d = _mm256_max_ps(_mm256_sub_ps(m_old, m_new), _mm256_set1_ps(-200.f));
  const __m256 corr = _mm512_castps512_ps256(exp2_neg(_mm512_castps256_ps512(d)));
  alignas(32) float mn[8], cr[8];
  _mm256_store_ps(mn, m_new);
  _mm256_store_ps(cr, corr);
  _mm256_mask_storeu_ps(m, rows, m_new);
  alignas(64) uint32_t p[R * KB / 2];
  __m512 sum[R];
  for (int r = 0; r < R; ++r) {
    const __m512 mr = _mm512_set1_ps(mn[r]);
    sum[r] = _mm512_setzero_ps();
    for (int v = 0; v < NV; v += 2) {  // masked keys weigh exactly 0
      __m512 e0 = exp2_neg(_mm512_sub_ps(s[v / 2][2 * r], mr));
      __m512 e1 = exp2_neg(_mm512_sub_ps(s[v / 2][2 * r + 1], mr));
      if constexpr (MASK) {
        e0 = _mm512_maskz_mov_ps(vis[r][v], e0);
        e1 = _mm512_maskz_mov_ps(vis[r][v + 1], e1);
      }
      sum[r] = _mm512_add_ps(sum[r], _mm512_add_ps(e0, e1));
      _mm512_store_si512(p + r * KB / 2 + v * 8, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
    }
  }
  const __m256 l_new = _mm256_fmadd_ps(_mm256_mask_loadu_ps(_mm256_setzero_ps(), rows, l), corr,
                                       rows_reduce<R, false>(sum));
  _mm256_mask_storeu_ps(l, rows, l_new);
  value_tile<R>(p, cr, vblk, D, o);
}

template <bool MASK>
void dispatch_rows(int rows, const uint32_t* q, const uint32_t* kblk, const uint32_t* vblk, int64_t D,
                   int64_t kb0, const int64_t* qpos, float scale, float* m, float* l, float* o) {
  switch (rows) {
    case 8: tile_step<8, MASK>(q, kblk, vblk, D, kb0, qpos, scale, m, l, o); break;
    case 7: tile_step<7, MASK>(q, kblk, vblk, D, kb0, qpos, scale, m, l, o); break;
    case 6: tile_step<6, MASK>(q, kblk, vblk, D, kb0, qpos, scale, m, l, o); break;
    case 5: tile_step<5, MASK>(q, kblk, vblk, D, kb0, qpos, scale, m, l, o); break;
    case 4: tile_step<4, MASK>(q, kblk, vblk, D, kb0, qpos, scale, m, l, o); break;
    case 3: tile_step<3, MASK>(q, kblk, vblk, D, kb0, qpos, scale, m, l, o); break;
    case 2: tile_step<2, MASK>(q, kblk, vblk, D, kb0, qpos, scale, m, l, o); break;
    default: tile_step<1, MASK>(q, kblk, vblk, D, kb0, qpos, scale, m, l, o); break;
  }
}

// qpos rises with the row, so the tile's first row decides whether a row sees only part of the block.
void dispatch_tile(int rows, const uint32_t* q, const uint32_t* kblk, const uint32_t* vblk, int64_t D,
                   int64_t kb0, const int64_t* qpos, float scale, float* m, float* l, float* o) {
  if (qpos[0] - kb0 < KB - 1)
    dispatch_rows<true>(rows, q, kblk, vblk, D, kb0, qpos, scale, m, l, o);
  else
    dispatch_rows<false>(rows, q, kblk, vblk, D, kb0, qpos, scale, m, l, o);
}

}  // namespace

bool has_prompt_attention() { return true; }

void prompt_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& chunks, int64_t block_size, double scale,
                      at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "prompt_attention: q/out [T, H, D], caches [slots, KVH, D]");
  const bool q8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && (q8 || k_cache.scalar_type() == at::kBFloat16) &&
                  v_cache.scalar_type() == k_cache.scalar_type() && out.scalar_type() == at::kBFloat16,
              "prompt_attention: bf16 q and out, bf16 or int8 caches");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "prompt_attention: head rows and caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1 &&
                  chunks.scalar_type() == at::kLong && chunks.dim() == 2 && chunks.size(1) == 4 &&
                  chunks.is_contiguous(),
              "prompt_attention: int32 block tables, chunks [C, 4] int64 (row, first query, queries, ctx)");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1), G = H / KVH, D2 = D / 2;
  const int64_t hrow = q8 ? D + KV8_SCALE_BYTES : D;  // a head's row in the cache, in elements
  TORCH_CHECK(H % KVH == 0 && D % 16 == 0 && D <= MAX_HEAD_DIM && k_cache.size(2) == hrow &&
                  v_cache.sizes() == k_cache.sizes(),
              "prompt_attention: unsupported head layout");
  const int64_t C = chunks.size(0), bts = block_tables.stride(0), slot_stride = KVH * hrow;
  const int64_t* ch = chunks.data_ptr<int64_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  std::vector<Chunk> cs(C);
  int64_t words = 0;  // 32-bit words of K (and of V) repacked, every chunk and head
  for (int64_t c = 0; c < C; ++c) {
    const int64_t ctx = ch[c * 4 + 3], n = ch[c * 4 + 2];
    TORCH_CHECK(n > 0 && n <= ctx && ch[c * 4 + 1] + n <= q.size(0), "prompt_attention: bad chunk ", c);
    cs[c] = {ch[c * 4], ch[c * 4 + 1], n, ctx, words};
    words += KVH * ((ctx + KB - 1) / KB * KB) * D2;
  }
  thread_local std::vector<uint32_t> kbuf, vbuf;
  if (kbuf.size() < static_cast<size_t>(words)) {
    kbuf.resize(words);
    vbuf.resize(words);
  }
  const uint16_t* kp = q8 ? nullptr : reinterpret_cast<const uint16_t*>(k_cache.data_ptr<bf16>());
  const uint16_t* vp = q8 ? nullptr : reinterpret_cast<const uint16_t*>(v_cache.data_ptr<bf16>());
  const int8_t* kp8 = q8 ? k_cache.data_ptr<int8_t>() : nullptr;
  const int8_t* vp8 = q8 ? v_cache.data_ptr<int8_t>() : nullptr;
  uint32_t* kr = kbuf.data();
  uint32_t* vr = vbuf.data();
  // Repack: one (chunk, KV head, block of 32 keys) per unit of work.
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (chunk, kvh * blocks + block)
  for (int64_t c = 0; c < C; ++c) {
    const int64_t nb = (cs[c].ctx + KB - 1) / KB;
    for (int64_t i = 0; i < KVH * nb; ++i) blocks.emplace_back(c, i);
  }
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 8, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<uint16_t> deq;  // an int8 block's K and V rows as bf16
    if (q8 && deq.size() < static_cast<size_t>(2 * KB * D)) deq.resize(2 * KB * D);
    for (int64_t w = b0; w < b1; ++w) {
      const Chunk& c = cs[blocks[w].first];
      const int64_t nb = (c.ctx + KB - 1) / KB, h = blocks[w].second / nb, blk = blocks[w].second % nb;
      const int64_t base = c.kv_off + h * nb * KB * D2;
      uint32_t* kd = kr + base + blk * KB * D2;  // KB/16 groups of 16 keys: [KB/16][D2][16]
      uint32_t* vd = vr + base + blk * KB * D2;  // [KB/2][D]
      const uint16_t* krow[KB];
      const uint16_t* vrow[KB];
      for (int t = 0; t < KB; ++t) {
        const int64_t pos = blk * KB + t;
        if (pos < c.ctx) {
          const int64_t slot = static_cast<int64_t>(bt[c.row * bts + pos / block_size]) * block_size + pos % block_size;
          if (q8) {
            uint16_t* kd16 = deq.data() + t * D;
            uint16_t* vd16 = deq.data() + (KB + t) * D;
            dequant_row(kp8 + slot * slot_stride + h * hrow, D, kd16);
            dequant_row(vp8 + slot * slot_stride + h * hrow, D, vd16);
            krow[t] = kd16;
            vrow[t] = vd16;
          } else {
            krow[t] = kp + slot * slot_stride + h * D;
            vrow[t] = vp + slot * slot_stride + h * D;
          }
        } else {
          krow[t] = vrow[t] = nullptr;
        }
      }
      for (int t = 0; t < KB; ++t) {
        uint32_t* dst = kd + (t / 16) * D2 * 16 + t % 16;
        if (krow[t] == nullptr) {
          for (int64_t d2 = 0; d2 < D2; ++d2) dst[d2 * 16] = 0;
        } else {
          const uint32_t* src = reinterpret_cast<const uint32_t*>(krow[t]);
          for (int64_t d2 = 0; d2 < D2; ++d2) dst[d2 * 16] = src[d2];
        }
      }
      for (int t2 = 0; t2 < KB / 2; ++t2) {
        const uint16_t* a = vrow[2 * t2];
        const uint16_t* b = vrow[2 * t2 + 1];
        uint32_t* dst = vd + t2 * D;
        for (int64_t d = 0; d < D; ++d)
          dst[d] = (a ? a[d] : 0u) | (static_cast<uint32_t>(b ? b[d] : 0u) << 16);
      }
    }
  });
  // Work items: up to ITEM_ROWS query rows of one chunk and KV head.
  const int64_t item_tokens = std::max<int64_t>(1, ITEM_ROWS / G);
  std::vector<Item> items;
  for (const Chunk& c : cs)
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t j0 = 0; j0 < c.n; j0 += item_tokens)
        items.push_back({&c, h, j0, std::min<int64_t>(item_tokens, c.n - j0) * G});
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<bf16>());
  bf16* op = out.data_ptr<bf16>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> obuf;
    if (obuf.size() < static_cast<size_t>(ITEM_ROWS * D)) obuf.resize(ITEM_ROWS * D);
    float* o = obuf.data();
    float m[ITEM_ROWS], l[ITEM_ROWS];
    int64_t qpos[ITEM_ROWS];
    thread_local std::vector<uint32_t> qbuf;  // the item's queries, a tile at a time: [tile][D2][RT]
    if (qbuf.size() < static_cast<size_t>(ITEM_ROWS * D2)) qbuf.resize(ITEM_ROWS * D2);
    uint32_t* qt = qbuf.data();
    for (int64_t it = i0; it < i1; ++it) {
      const Item& w = items[it];
      const Chunk& c = *w.c;
      const int64_t p = c.ctx - c.n, nb = (c.ctx + KB - 1) / KB;
      const uint32_t* kh = kr + c.kv_off + w.kvh * nb * KB * D2;
      const uint32_t* vh = vr + c.kv_off + w.kvh * nb * KB * D2;
      for (int64_t r = 0; r < w.rows; ++r) {
        const int64_t j = w.j0 + r / G, head = w.kvh * G + r % G;
        const uint32_t* qrow = reinterpret_cast<const uint32_t*>(qp + (c.q0 + j) * qs0 + head * qs1);
        uint32_t* dst = qt + (r / RT) * RT * D2 + r % RT;
        for (int64_t d2 = 0; d2 < D2; ++d2) dst[d2 * RT] = qrow[d2];
        qpos[r] = p + j;
        m[r] = -INFINITY;
        l[r] = 0.f;
      }
      std::fill(o, o + w.rows * D, 0.f);
      const int64_t last = qpos[w.rows - 1];  // the item's furthest visible key
      for (int64_t kb0 = 0; kb0 <= last; kb0 += KB) {
        const uint32_t* kblk = kh + kb0 * D2;
        const uint32_t* vblk = vh + kb0 * D2;
        for (int64_t r0 = 0; r0 < w.rows; r0 += RT) {
          const int rows = static_cast<int>(std::min<int64_t>(RT, w.rows - r0));
          if (kb0 > qpos[r0 + rows - 1]) continue;  // the tile's rows see none of it (later rows see more)
          dispatch_tile(rows, qt + r0 * D2, kblk, vblk, D, kb0, qpos + r0, sc, m + r0, l + r0, o + r0 * D);
        }
      }
      for (int64_t r = 0; r < w.rows; ++r) {
        const int64_t j = w.j0 + r / G, head = w.kvh * G + r % G;
        bf16* dst = op + (c.q0 + j) * os0 + head * os1;
        const __m512 inv = _mm512_set1_ps(l[r] > 0.f ? 1.f / l[r] : 0.f);
        for (int64_t d = 0; d < D; d += 16) vstore(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), inv));
      }
    }
  });
}

#else

bool has_prompt_attention() { return false; }

void prompt_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      int64_t, double, at::Tensor) {
  TORCH_CHECK(false, "prompt_attention: this build has no AVX-512 BF16");
}

#endif

}  // namespace fusedserve
