// DeepSeek-V4 lightning indexer, scored in place in the paged cache (docs/deepseek_v4.md,
// "Lightning indexer"; docs/cpu_kernels.md).
//
// wideserve::v4_indexer_topk(q [T, H, D], weights [T, H] fp32, cache [S, D], table [rows, nb],
//                            token_rows [T], visible [T], entries_per_block, k, portable)
//   -> picks [T, k] int64
//
// Token t belongs to the request whose block-table row is token_rows[t] and sees its entries
// 0..visible[t]-1; entry e lives at cache slot table[row, e / epb] * epb + e % epb. Its score
//   s(t, e) = sum_h weights[t, h] * relu(q[t, h] . cache[slot(e)])
// is accumulated in fp32 (the caller folds every scale into weights), and picks[t] are the k
// entries of largest score, ordered by (score descending, entry ascending): the order of a
// stable descending sort, which the torch path (layers/indexer.py) uses, so that ties (ReLU
// makes many scores exactly 0) go to the lowest entry. Fewer than k visible: the rest is -1.
// Nothing is gathered: each key row is read once from the cache, scored, and dropped.
//
// Products: bf16 q with a bf16 cache use AVX512-BF16 dot products (pairs of bf16 multiplied
// exactly and summed in fp32); fp32 q (an fp32 model, or the indexer forced to fp32) reads a
// bf16 or fp32 cache as fp32 (bf16 -> fp32 is exact) with fp32 FMAs. `portable` forces the
// plain C++ loops (always compiled; the only path without AVX512), so both are testable.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using at::BFloat16;

inline float to_float(float x) { return x; }
inline float to_float(BFloat16 x) { return static_cast<float>(x); }

// Where one token reads: its q rows, its head weights and its request's table row.
struct TokenView {
  const void* q;              // [H, D] of q's dtype
  const float* weights;       // [H]
  const int64_t* table_row;   // [nb]
  int64_t visible;
};

struct CacheView {
  const void* data;           // [S, D]
  int64_t slots;
  int64_t dim;
  int64_t heads;
  int64_t entries_per_block;
};

// Slot of entry e (validated: a table block outside the cache is an error, not a wild read).
inline int64_t slot_of(const CacheView& c, const int64_t* row, int64_t e) {
  const int64_t epb = c.entries_per_block, block = row[e / epb];
  TORCH_CHECK(block >= 0 && (block + 1) * epb <= c.slots, "v4_indexer_topk: block table entry ",
              block, " points outside the cache (", c.slots / epb, " blocks)");
  return block * epb + e % epb;
}

// Per-thread scratch of the scoring functions.
struct Scratch {
  std::vector<const void*> keys;   // key row of every visible entry
  std::vector<uint32_t> qt;        // q in the AVX512 lane layout
  std::vector<float> wv;           // head weights in that layout
};

using ScoreFn = void (*)(const CacheView&, const TokenView&, float*, Scratch&);

// Key row of every visible entry, a table block at a time (each block validated).
template <typename KT>
void key_rows(const CacheView& c, const TokenView& t, std::vector<const void*>& keys) {
  const KT* cache = static_cast<const KT*>(c.data);
  const int64_t epb = c.entries_per_block;
  keys.resize(t.visible);
  for (int64_t e0 = 0; e0 < t.visible; e0 += epb) {
    const KT* base = cache + slot_of(c, t.table_row, e0) * c.dim;
    for (int64_t j = 0; j < epb && e0 + j < t.visible; ++j) keys[e0 + j] = base + j * c.dim;
  }
}

// ------------------------------------------------------------------ portable scoring
template <typename QT, typename KT>
void score_portable(const CacheView& c, const TokenView& t, float* out, Scratch&) {
  const QT* q = static_cast<const QT*>(t.q);
  const KT* cache = static_cast<const KT*>(c.data);
  const int64_t H = c.heads, D = c.dim;
  std::vector<float> qf(H * D);
  for (int64_t i = 0; i < H * D; ++i) qf[i] = to_float(q[i]);
  for (int64_t e = 0; e < t.visible; ++e) {
    const KT* key = cache + slot_of(c, t.table_row, e) * D;
    float score = 0.f;
    for (int64_t h = 0; h < H; ++h) {
      const float* qh = qf.data() + h * D;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * to_float(key[d]);
      score += t.weights[h] * std::max(dot, 0.f);
    }
    out[e] = score;
  }
}

#if defined(__AVX512F__)
// ------------------------------------------------------------------ AVX512 scoring
// q is laid out so that one vector holds Hc = 16 / G heads, G lanes each: lane (h, o) holds
// the values of q_h at key offsets s*G*u + o*u (u values per lane: 2 bf16 for dpbf16, 1 float
// for an FMA) for step s. A step multiplies it by G consecutive key pieces broadcast to every
// head, so each lane accumulates a partial dot product of its head with no horizontal sum per
// product; after the last step the G lanes of a head are folded (butterfly adds), ReLU'd and
// weighted, and one horizontal sum per entry adds the heads up. Eight entries are scored at
// once (independent accumulators; each q vector is loaded once for all eight).
template <int G>
inline __m512i broadcast_dwords(const void* p) {
  if constexpr (G == 1) {
    int32_t x;
    std::memcpy(&x, p, 4);
    return _mm512_set1_epi32(x);
  } else if constexpr (G == 2) {
    long long x;
    std::memcpy(&x, p, 8);
    return _mm512_set1_epi64(x);
  } else if constexpr (G == 4) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  } else if constexpr (G == 8) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  } else {
    return _mm512_loadu_si512(p);
  }
}

// G bf16 values widened to fp32 (exact: bf16 is the top half of an fp32) and broadcast.
template <int G>
inline __m512 broadcast_bf16_as_fp32(const BFloat16* p) {
  __m256i raw;
  if constexpr (G <= 4) {
    long long x = 0;
    std::memcpy(&x, p, 2 * G);
    raw = _mm256_zextsi128_si256(_mm_cvtsi64_si128(x));
  } else if constexpr (G == 8) {
    raw = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  if constexpr (G == 1) return _mm512_permutexvar_ps(_mm512_setzero_si512(), x);
  if constexpr (G == 2) return _mm512_castpd_ps(_mm512_broadcastsd_pd(_mm512_castpd512_pd128(_mm512_castps_pd(x))));
  if constexpr (G == 4) return _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(0, 0, 0, 0));
  if constexpr (G == 8) return _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 1, 0));
  return x;
}

// How one step multiplies a q vector by broadcast key pieces (u key values per lane; a lane
// of q is always one dword: 2 bf16 or 1 float).
struct FloatDot {
  using Q = float;
  using K = float;
  static constexpr int u = 1;
  template <int G>
  static __m512 step(__m512 acc, __m512i a, const K* key) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(broadcast_dwords<G>(key)), acc);
  }
};

struct FloatBf16Dot {
  using Q = float;
  using K = BFloat16;
  static constexpr int u = 1;
  template <int G>
  static __m512 step(__m512 acc, __m512i a, const K* key) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), broadcast_bf16_as_fp32<G>(key), acc);
  }
};

#if defined(__AVX512BF16__)
struct Bf16Dot {  // pairs of bf16 multiplied exactly, summed in fp32
  using Q = BFloat16;
  using K = BFloat16;
  static constexpr int u = 2;
  template <int G>
  static __m512 step(__m512 acc, __m512i a, const K* key) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)broadcast_dwords<G>(key));
  }
};
#endif

// Every lane of a head's group of G lanes <- the group's sum.
template <int G>
inline __m512 fold(__m512 x) {
  if constexpr (G >= 2) x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  if constexpr (G >= 4) x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
  if constexpr (G >= 8) x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  if constexpr (G >= 16) x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  return x;
}

template <typename Op, int G>
void score_avx512(const CacheView& c, const TokenView& t, float* out, Scratch& scratch) {
  using KT = typename Op::K;
  constexpr int Hc = 16 / G, E = 8;
  constexpr int64_t kAhead = 32;   // entries (4-8 KiB of keys at D = 64 / 128 in bf16)
  const int64_t H = c.heads, D = c.dim, S = D / (G * Op::u), groups = (H + Hc - 1) / Hc;
  // q in lane layout [groups, S, 16] and the head weights [groups, 16] (lane (h, 0) only).
  std::vector<uint32_t>& qt = scratch.qt;
  std::vector<float>& wv = scratch.wv;
  qt.assign(groups * S * 16, 0u);
  wv.assign(groups * 16, 0.f);
  const auto* q = static_cast<const typename Op::Q*>(t.q);
  for (int64_t h = 0; h < H; ++h) {
    const int64_t g = h / Hc, lane0 = (h % Hc) * G;
    wv[g * 16 + lane0] = t.weights[h];
    for (int64_t s = 0; s < S; ++s)
      for (int o = 0; o < G; ++o)
        std::memcpy(&qt[(g * S + s) * 16 + lane0 + o], q + h * D + (s * G + o) * Op::u, 4);
  }
  key_rows<KT>(c, t, scratch.keys);
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(KT));
  for (int64_t e0 = 0; e0 < t.visible; e0 += E) {
    const int n = static_cast<int>(std::min<int64_t>(E, t.visible - e0));
    // Prefetch the rows kAhead entries on: table blocks are scattered, and the hardware
    // prefetcher loses the stream at every block edge (and never sees the next block).
    for (int64_t j = e0 + kAhead; j < std::min(e0 + kAhead + E, t.visible); ++j)
      for (int64_t b = 0; b < row_bytes; b += 64)
        _mm_prefetch(static_cast<const char*>(scratch.keys[j]) + b, _MM_HINT_T0);
    const KT* key[E];
    for (int j = 0; j < E; ++j) key[j] = static_cast<const KT*>(scratch.keys[e0 + (j < n ? j : 0)]);
    __m512 score[E];
    for (int j = 0; j < E; ++j) score[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512 acc[E];
      for (int j = 0; j < E; ++j) acc[j] = _mm512_setzero_ps();
      const uint32_t* a = qt.data() + g * S * 16;
      for (int64_t s = 0; s < S; ++s) {
        const __m512i qa = _mm512_loadu_si512(a + s * 16);
        const int64_t off = s * G * Op::u;
        for (int j = 0; j < E; ++j) acc[j] = Op::template step<G>(acc[j], qa, key[j] + off);
      }
      const __m512 w = _mm512_loadu_ps(wv.data() + g * 16);
      for (int j = 0; j < E; ++j)
        score[j] = _mm512_fmadd_ps(_mm512_max_ps(fold<G>(acc[j]), _mm512_setzero_ps()), w, score[j]);
    }
    for (int j = 0; j < n; ++j) out[e0 + j] = _mm512_reduce_add_ps(score[j]);
  }
}

// Lanes per head: Hc = the power of two >= H (at most 16) heads share a vector, unless the
// head width does not split into G * u pieces; then fewer lanes per head (padding heads).
template <typename Op>
ScoreFn avx512_scorer(int64_t H, int64_t D) {
  int G = 16;
  while (G > 1 && 16 / G < H) G /= 2;
  while (G >= 1 && D % (G * Op::u) != 0) G /= 2;
  switch (G) {
    case 16: return score_avx512<Op, 16>;
    case 8: return score_avx512<Op, 8>;
    case 4: return score_avx512<Op, 4>;
    case 2: return score_avx512<Op, 2>;
    case 1: return score_avx512<Op, 1>;
    default: return nullptr;  // an odd bf16 width: the portable path
  }
}
#endif

// ------------------------------------------------------------------ top-k
// A float's bits made order-preserving as an unsigned int (after -0.0 -> +0.0: the stable
// sort ties them), so (bits << 32 | ~entry) orders pairs by score, then by lowest entry.
inline uint32_t order_bits(float f) {
  f += 0.f;
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// picks[0..k) <- the k best entries of scores[0..n) (score descending, entry ascending), -1
// after the n-th. Selection by radix on the order bits (11/11/10 bits: each pass keeps the
// entries above the k-th's bucket and refines inside it), then a sort of only the k chosen.
void top_k(const float* scores, int64_t n, int64_t k, int64_t* picks,
           std::vector<uint32_t>& bits, std::vector<uint32_t>& cand,
           std::vector<uint64_t>& chosen) {
  chosen.clear();
  bits.resize(n);
  for (int64_t e = 0; e < n; ++e) bits[e] = order_bits(scores[e]);
  auto key = [&](uint32_t e) { return (uint64_t(bits[e]) << 32) | uint32_t(~e); };
  if (n <= k) {
    for (int64_t e = 0; e < n; ++e) chosen.push_back(key(uint32_t(e)));
  } else {
    cand.resize(n);
    for (int64_t e = 0; e < n; ++e) cand[e] = uint32_t(e);
    int64_t live = n, need = k;
    const int shifts[3] = {21, 10, 0};
    const int widths[3] = {11, 11, 10};
    for (int pass = 0; pass < 3 && need > 0; ++pass) {
      const int shift = shifts[pass];
      const uint32_t mask = (1u << widths[pass]) - 1;
      int64_t hist[2048] = {0};
      for (int64_t i = 0; i < live; ++i) ++hist[(bits[cand[i]] >> shift) & mask];
      int64_t above = 0, b = mask;
      for (; b > 0 && above + hist[b] < need; --b) above += hist[b];
      int64_t kept = 0;
      for (int64_t i = 0; i < live; ++i) {  // cand stays in entry order
        const uint32_t e = cand[i];
        const int64_t bucket = (bits[e] >> shift) & mask;
        if (bucket > b) chosen.push_back(key(e));
        else if (bucket == b) cand[kept++] = e;
      }
      live = kept;
      need -= above;
    }
    // Equal order bits remain: the lowest entries win (cand is in entry order).
    for (int64_t i = 0; i < need; ++i) chosen.push_back(key(cand[i]));
  }
  std::sort(chosen.begin(), chosen.end(), std::greater<uint64_t>());
  const int64_t m = static_cast<int64_t>(chosen.size());
  for (int64_t i = 0; i < k; ++i) picks[i] = i < m ? int64_t(~uint32_t(chosen[i])) : -1;
}

ScoreFn pick_scorer(at::ScalarType qt, at::ScalarType kt, int64_t H, int64_t D, bool portable) {
  const bool bf16_q = qt == at::kBFloat16, bf16_k = kt == at::kBFloat16;
  TORCH_CHECK(!bf16_q || bf16_k, "v4_indexer_topk: a bf16 q needs a bf16 cache");
  ScoreFn fast = nullptr;
#if defined(__AVX512F__)
  if (!portable) {
#if defined(__AVX512BF16__)
    if (bf16_q) fast = avx512_scorer<Bf16Dot>(H, D);
#endif
    if (!bf16_q) fast = bf16_k ? avx512_scorer<FloatBf16Dot>(H, D) : avx512_scorer<FloatDot>(H, D);
  }
#endif
  (void)H;
  (void)D;
  (void)portable;
  if (fast) return fast;
  if (bf16_q) return score_portable<BFloat16, BFloat16>;
  return bf16_k ? score_portable<float, BFloat16> : score_portable<float, float>;
}

at::Tensor v4_indexer_topk(const at::Tensor& q, const at::Tensor& weights,
                           const at::Tensor& cache, const at::Tensor& table,
                           const at::Tensor& token_rows, const at::Tensor& visible,
                           int64_t entries_per_block, int64_t k, bool portable) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "v4_indexer_topk: q must be [T, H, D] contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "v4_indexer_topk: q must be float32 or bfloat16");
  TORCH_CHECK(cache.dim() == 2 && cache.size(1) == D && cache.is_contiguous() &&
                  (cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kBFloat16),
              "v4_indexer_topk: cache must be [slots, D] contiguous float32/bfloat16");
  TORCH_CHECK(weights.sizes() == at::IntArrayRef({T, H}) && weights.is_contiguous() &&
                  weights.scalar_type() == at::kFloat,
              "v4_indexer_topk: weights must be [T, H] contiguous float32");
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && table.scalar_type() == at::kLong,
              "v4_indexer_topk: table must be [rows, blocks] contiguous int64");
  TORCH_CHECK(token_rows.sizes() == at::IntArrayRef({T}) && visible.sizes() == at::IntArrayRef({T}) &&
                  token_rows.scalar_type() == at::kLong && visible.scalar_type() == at::kLong &&
                  token_rows.is_contiguous() && visible.is_contiguous(),
              "v4_indexer_topk: token_rows and visible must be [T] contiguous int64");
  TORCH_CHECK(entries_per_block > 0 && k > 0, "v4_indexer_topk: entries_per_block and k must be > 0");
  const CacheView c{cache.data_ptr(), cache.size(0), D, H, entries_per_block};
  const int64_t* rows = token_rows.data_ptr<int64_t>();
  const int64_t* vis = visible.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(rows[t] >= 0 && rows[t] < table.size(0), "v4_indexer_topk: token ", t,
                " has table row ", rows[t], " of ", table.size(0));
    TORCH_CHECK(vis[t] >= 0 && vis[t] <= table.size(1) * entries_per_block &&
                    vis[t] < (int64_t(1) << 32),
                "v4_indexer_topk: token ", t, " sees ", vis[t], " entries; its table row holds ",
                table.size(1) * entries_per_block);
  }
  const ScoreFn score = pick_scorer(q.scalar_type(), cache.scalar_type(), H, D, portable);
  at::Tensor picks = at::empty({T, k}, table.options());
  const char* qbase = static_cast<const char*>(q.data_ptr());
  const int64_t qrow = H * D * q.element_size();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    Scratch scratch;
    std::vector<uint32_t> bits, cand;
    std::vector<uint64_t> chosen;
    for (int64_t t = begin; t < end; ++t) {
      const TokenView view{qbase + t * qrow, weights.data_ptr<float>() + t * H,
                           table.data_ptr<int64_t>() + rows[t] * table.size(1), vis[t]};
      scores.resize(vis[t]);
      score(c, view, scores.data(), scratch);
      top_k(scores.data(), vis[t], k, picks.data_ptr<int64_t>() + t * k, bits, cand, chosen);
    }
  });
  return picks;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("v4_indexer_topk(Tensor q, Tensor weights, Tensor cache, Tensor table, "
        "Tensor token_rows, Tensor visible, int entries_per_block, int k, bool portable) -> Tensor");
}

TORCH_LIBRARY_IMPL(wideserve, CPU, m) { m.impl("v4_indexer_topk", &v4_indexer_topk); }
