// The AVX512 loop of the GQA paged attention op (paged_attention.h; docs/cpu_kernels.md,
// "Paged attention"): fp32 FMAs on K/V converted on load, a vector exp, register-blocked V
// accumulation; avx512_bf16 dot products when q and the cache are bf16. Compiled to nothing
// but a null avx512_attend() where the build machine has no AVX512.
#include "paged_attention.h"

#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace wideserve_paged {
#if defined(__AVX512F__)
namespace {

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {   // bf16 -> fp32 is a 16-bit left shift
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// e^x for x <= 0 (scores minus their max): 2^n * e^r, |r| <= ln2/2, degree-6 Taylor
// polynomial (relative error ~2e-7); inputs below -104 (and -inf) give 0 through scalef.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 y = _mm512_set1_ps(1.0f / 720);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 120));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 24));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 6));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

float exp_span_avx512(float* x, int64_t n, float* mx_io) {
  __m512 vmax = _mm512_set1_ps(*mx_io);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(x + j));
  float mx = _mm512_reduce_max_ps(vmax);
  for (; j < n; ++j) mx = std::max(mx, x[j]);
  *mx_io = mx;
  __m512 vm = _mm512_set1_ps(mx), vsum = _mm512_setzero_ps();
  j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + j), vm));
    _mm512_storeu_ps(x + j, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (j < n) {
    __mmask16 k = static_cast<__mmask16>((1u << (n - j)) - 1);
    __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), vm));
    e = _mm512_maskz_mov_ps(k, e);
    _mm512_mask_storeu_ps(x + j, k, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  return _mm512_reduce_add_ps(vsum);
}

// Blocks are scattered over the pool, so the hardware prefetcher loses the stream at every
// block edge and a new block's first lines arrive at DRAM latency. The entries of the next
// tile (this item's, and the next item's first when this item ends within a tile) are
// requested into L2 while this tile is computed: a share of them after each batch of keys, so
// that the requests do not stall the loop in one burst when the miss queues fill. The shares
// are spread over every pass of the tile, its score passes and its V passes (one of each per
// group of rows: a KV head's), in proportion to the keys each pass has done: requests packed
// into fewer passes stalled those passes on full miss queues while the others left the memory
// idle (all in the first score pass: 36% of the op's samples on the prefetch instruction,
// Zen 4; all in the score passes, the V passes about two thirds of the arithmetic without a
// request: the 653M decode shape on cold KV 1.2-1.35x slower than spread over both,
// docs/cpu_kernels.md).
// (Per-key prefetches of whole entries a few keys ahead, an earlier scheme, came too late and
// cost more than they saved.)
struct Prefetch {
  const char* const* entries = nullptr;
  int64_t n = 0, done = 0, entry_bytes = 0;
  int64_t pass = 0, passes = 1;   // the score pass under way, of how many
  void upto(int64_t k) {
    for (k = std::min(k, n); done < k; ++done)
      for (int64_t b = 0; b < entry_bytes; b += 64)
        _mm_prefetch(entries[done] + b, _MM_HINT_T1);
  }
  // The share due once `keys` of this pass's `total` keys are done (the passes count alike:
  // the requests due are (pass + keys / total) / passes of the n entries).
  void share(int64_t keys, int64_t total) {
    const int64_t t = std::max<int64_t>(total, 1), all = passes * t;
    upto(((pass * t + std::min(keys, t)) * n + all - 1) / all);
  }
  // This pass is over: all of its share, and the next pass begins.
  void end_pass() {
    upto((pass + 1) * n / passes);
    ++pass;
  }
};

// One step of a q.k dot product: fp32 FMAs over 16 converted elements (D % 16 == 0), or, with
// bf16 q and keys and avx512_bf16, vdpbf16ps over 32 (exact bf16 products summed in fp32).
template <typename CT, bool kBf16>
struct Dot {
  static constexpr int kStep = 16;
  using QT = float;
  using Vec = __m512;
  static Vec load_q(const float* q) { return _mm512_loadu_ps(q); }
  static Vec load_k(const CT* k) { return load16(k); }
  static __m512 fma(__m512 acc, Vec q, Vec k) { return _mm512_fmadd_ps(q, k, acc); }
};
#if defined(__AVX512BF16__)
template <>
struct Dot<at::BFloat16, true> {
  static constexpr int kStep = 32;
  using QT = at::BFloat16;
  using Vec = __m512bh;
  static Vec load_q(const at::BFloat16* q) { return (__m512bh)_mm512_loadu_si512(q); }
  static Vec load_k(const at::BFloat16* k) { return (__m512bh)_mm512_loadu_si512(k); }
  static __m512 fma(__m512 acc, Vec q, Vec k) { return _mm512_dpbf16_ps(acc, q, k); }
};
#endif

// Lane i of the result is the sum of v[i]'s 16 lanes (a transpose-and-add tree: ~3 ops per
// sum, against ~8 for a horizontal reduction of each vector alone).
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int k = 0; k < 8; ++k)   // per 128-bit lane: v[2k] at positions 0, 2; v[2k+1] at 1, 3
    a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: v[4k + m] at position m
    __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
    b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  __m512 t0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 t1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores s[r][j] = scale * q_r . k_j of NR rows against keys [ja, jb) of the tile. Where 16 % NR
// == 0, blocks of 16 / NR keys fill 16 accumulators that one hsum16 reduces; the rest one key
// at a time.
template <int NR, typename CT, bool kBf16>
void scores(const typename Dot<CT, kBf16>::QT* q, int64_t D, const CT* const* kp, int64_t koff,
            int64_t ja, int64_t jb, float scale, float* s, Prefetch* pf) {
  using Dt = Dot<CT, kBf16>;
  int64_t j = ja;
  if constexpr (16 % NR == 0) {
    constexpr int KB = 16 / NR;
    for (; j + KB <= jb; j += KB) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += Dt::kStep) {
        typename Dt::Vec qv[NR];
        for (int r = 0; r < NR; ++r) qv[r] = Dt::load_q(q + r * D + d);
        for (int kk = 0; kk < KB; ++kk) {
          typename Dt::Vec kv = Dt::load_k(kp[j + kk] + koff + d);
          for (int r = 0; r < NR; ++r) acc[r * KB + kk] = Dt::fma(acc[r * KB + kk], qv[r], kv);
        }
      }
      alignas(64) float sums[16];
      _mm512_store_ps(sums, _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale)));
      for (int r = 0; r < NR; ++r) std::memcpy(s + r * kTile + j, sums + r * KB, KB * 4);
      if (pf != nullptr) pf->share(j + KB - ja, jb - ja);
    }
  }
  for (; j < jb; ++j) {
    __m512 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += Dt::kStep) {
      typename Dt::Vec kv = Dt::load_k(kp[j] + koff + d);
      for (int r = 0; r < NR; ++r) acc[r] = Dt::fma(acc[r], Dt::load_q(q + r * D + d), kv);
    }
    for (int r = 0; r < NR; ++r) s[r * kTile + j] = _mm512_reduce_add_ps(acc[r]) * scale;
  }
}

// 32 bf16 values as two fp32 vectors without a widening shuffle: the even-indexed ones (low
// halves of each 32-bit pair, shifted up) and the odd ones (high halves, masked). Accumulators
// fed this way hold each 32 columns as [16 even | 16 odd]; unsplit_columns restores the order.
inline void load32_split(const at::BFloat16* x, __m512* even, __m512* odd) {
  __m512i v = _mm512_loadu_si512(x);
  *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(~0xFFFF)));
}
inline void load32_split(const float* x, __m512* lo, __m512* hi) {   // fp32: plain order
  *lo = _mm512_loadu_ps(x);
  *hi = _mm512_loadu_ps(x + 16);
}

// The columns accumulate_v wrote split (whole 64-column chunks of a bf16 cache), back in order.
inline void unsplit_columns(float* acc, int64_t D) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                      24, 8);
  for (int64_t c = 0; c < D / 64 * 64; c += 32) {
    __m512 even = _mm512_loadu_ps(acc + c), odd = _mm512_loadu_ps(acc + c + 16);
    _mm512_storeu_ps(acc + c, _mm512_permutex2var_ps(even, lo, odd));
    _mm512_storeu_ps(acc + c + 16, _mm512_permutex2var_ps(even, hi, odd));
  }
}

// acc[r] += sum_j s[r][j] * v_j for NR rows, NV*16 output columns at column c0 (NV even: split
// pairs, see load32_split; NV = 1: in order). With `pf`, its share after every kShareKeys keys,
// this call being keys [done, done + n) of a pass of `total` (a share after every key, with
// its division, measured slower at short contexts in session 24).
constexpr int64_t kShareKeys = 4;
template <int NR, int NV, typename CT>
void accumulate_v(const float* s, const CT* const* kp, int64_t voff, int64_t n, float* acc,
                  int64_t D, int64_t c0, Prefetch* pf = nullptr, int64_t done = 0,
                  int64_t total = 0) {
  __m512 a[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = _mm512_loadu_ps(acc + r * D + c0 + v * 16);
  for (int64_t j = 0; j < n; ++j) {
    const CT* vr = kp[j] + voff + c0;
    __m512 vv[NV];
    if constexpr (NV % 2 == 0) {
      for (int v = 0; v < NV; v += 2) load32_split(vr + v * 16, &vv[v], &vv[v + 1]);
    } else {
      for (int v = 0; v < NV; ++v) vv[v] = load16(vr + v * 16);
    }
    for (int r = 0; r < NR; ++r) {
      __m512 pj = _mm512_set1_ps(s[r * kTile + j]);
      for (int v = 0; v < NV; ++v) a[r][v] = _mm512_fmadd_ps(pj, vv[v], a[r][v]);
    }
    if (pf != nullptr && j % kShareKeys == kShareKeys - 1) pf->share(done + j + 1, total);
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + r * D + c0 + v * 16, a[r][v]);
}

// One V pass: the rows' outputs over the tile's n keys, 64 columns at a time (the prefetch
// shares over the 64-column chunks' keys; the few columns past them have none).
template <int NR, typename CT>
void accumulate_rows(const float* s, const CT* const* kp, int64_t voff, int64_t n, float* acc,
                     int64_t D, Prefetch* pf) {
  int64_t c = 0;
  for (; c + 64 <= D; c += 64)
    accumulate_v<NR, 4, CT>(s, kp, voff, n, acc, D, c, pf, c / 64 * n, D / 64 * n);
  for (; c < D; c += 16) accumulate_v<NR, 1, CT>(s, kp, voff, n, acc, D, c);
}

// Dispatch a row count 1..4 to a template (rows are handled four at a time).
template <typename F>
void by_rows(int64_t nr, F f) {
  switch (nr) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// Calls f(r0, nr, koff) for each group of at most four rows of one KV head (koff: the head's
// offset in an entry); groups never straddle heads.
template <typename F>
void row_groups(const Problem& p, const Span& s, F f) {
  for (int64_t h = 0; h < p.kv_heads; ++h)
    for (int64_t r = 0; r < s.head_rows; r += 4)
      f(h * s.head_rows + r, std::min<int64_t>(4, s.head_rows - r), h * p.dim);
}

// The entries to prefetch while keys [.., k1) of `it` are scored: its next tile, and the next
// item's first tile once `it` ends within the next tile (so an item's last tile is not left
// without a prefetch running ahead).
template <typename CT>
Prefetch next_entries(const Problem& p, const Item& it, const Item* next, const Span& s,
                      int64_t k1, Scratch& w, int64_t entry_bytes) {
  const CT** kp = reinterpret_cast<const CT**>(w.next_kp.data());
  int64_t n = 0;
  if (k1 < s.hi) {
    int64_t n1 = std::min(k1 + kTile, s.hi);
    entry_ptrs<CT>(p, it, k1, n1, kp);
    n = n1 - k1;
  }
  if (k1 + kTile >= s.hi && next != nullptr) {
    Span ns = span_of(p, *next);
    int64_t n1 = std::min(ns.lo + kTile, ns.hi);
    entry_ptrs<CT>(p, *next, ns.lo, n1, kp + n);
    n += n1 - ns.lo;
  }
  return Prefetch{reinterpret_cast<const char* const*>(kp), n, 0, entry_bytes};
}

template <typename QT, typename CT>
void attend_avx512(const Problem& p, const Item& it, const Item* next, Scratch& w) {
  Span s = span_of(p, it);
  const int64_t D = p.dim, voff = p.kv_heads * D;
  const int64_t entry_bytes = p.width * static_cast<int64_t>(sizeof(CT));
  const CT** kp = start_item<QT, CT>(p, it, s, w);
#if defined(__AVX512BF16__)
  // bf16 x bf16 dot products take the queries as bf16: the caller's own values, unchanged.
  constexpr bool kBf16 = std::is_same_v<QT, at::BFloat16> && std::is_same_v<CT, QT>;
  const bool bf16_dots = kBf16 && D % 32 == 0;
  if (bf16_dots)
    for (int64_t i = 0; i < s.rows * D; ++i) w.qb[i] = at::BFloat16(w.q[i]);
#endif
  for (int64_t k0 = s.lo; k0 < s.hi; k0 += kTile) {
    int64_t k1 = std::min(k0 + kTile, s.hi), n = k1 - k0;
    entry_ptrs<CT>(p, it, k0, k1, kp);
    Prefetch ahead = next_entries<CT>(p, it, next, s, k1, w, entry_bytes);
    // a score pass and a V pass per group of rows (row_groups)
    ahead.passes = std::max<int64_t>(1, 2 * p.kv_heads * ((s.head_rows + 3) / 4));
    row_groups(p, s, [&](int64_t r0, int64_t nr, int64_t koff) {
      // Keys any of these rows sees: the first row's window start to the last row's query.
      int64_t a0, b0, a1, b1;
      row_range(p, it, s, r0, k0, k1, &a0, &b0);
      row_range(p, it, s, r0 + nr - 1, k0, k1, &a1, &b1);
      int64_t ja = a0 - k0, jb = std::max(b1 - k0, ja);
      float* srow = w.s.data() + r0 * kTile;
      by_rows(nr, [&](auto c) {
        constexpr int NR = decltype(c)::value;
#if defined(__AVX512BF16__)
        if constexpr (kBf16) {
          if (bf16_dots) {
            scores<NR, at::BFloat16, true>(w.qb.data() + r0 * D, D,
                                           reinterpret_cast<const at::BFloat16* const*>(kp),
                                           koff, ja, jb, p.scale, srow, &ahead);
            return;
          }
        }
#endif
        scores<NR, CT, false>(w.q.data() + r0 * D, D, kp, koff, ja, jb, p.scale, srow, &ahead);
      });
      ahead.end_pass();
    });
    bool any = false;
    for (int64_t r = 0; r < s.rows; ++r) {
      int64_t a, b;
      row_range(p, it, s, r, k0, k1, &a, &b);
      any |= softmax_update(w.s.data() + r * kTile, n, a - k0, b - k0, &w.m[r], &w.l[r],
                            w.acc.data() + r * D, D, exp_span_avx512);
    }
    if (any)
      row_groups(p, s, [&](int64_t r0, int64_t nr, int64_t koff) {
        by_rows(nr, [&](auto c) {
          accumulate_rows<decltype(c)::value, CT>(w.s.data() + r0 * kTile, kp, voff + koff, n,
                                                  w.acc.data() + r0 * D, D, &ahead);
        });
        ahead.end_pass();
      });
    ahead.upto(ahead.n);              // what the passes left (rows that see nothing)
  }
  if constexpr (std::is_same_v<CT, at::BFloat16>)
    for (int64_t r = 0; r < s.rows; ++r) unsplit_columns(w.acc.data() + r * D, D);
  store_outputs<QT>(p, it, s, w.acc.data(), w.l.data());
}

}  // namespace

AttendFn avx512_attend(bool q_bf16, bool cache_bf16) {
  if (q_bf16) return cache_bf16 ? attend_avx512<at::BFloat16, at::BFloat16>
                                : attend_avx512<at::BFloat16, float>;
  return cache_bf16 ? attend_avx512<float, at::BFloat16> : attend_avx512<float, float>;
}
#else
AttendFn avx512_attend(bool, bool) { return nullptr; }
#endif  // __AVX512F__
}  // namespace wideserve_paged
