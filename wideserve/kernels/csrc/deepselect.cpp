// DeepSelect top-k: the k best entries of each score row without sorting the row
// (docs/cpu_kernels.md, "DeepSelect top-k"; kernels/deepselect.py is the Python side and
// holds the torch path it must equal).
//
// wideserve::deepselect_topk(scores [R, n] fp32, k, lengths [R] int64 or None, portable)
//   -> picks [R, k] int64
//
// Row r considers entries 0..lengths[r]-1 (all n without lengths); picks[r] are its k best
// entries ordered by (score descending, entry ascending): the order of a stable descending
// sort, so ties (ReLU makes many index scores exactly 0; masked ones are -inf) go to the
// lowest entry, as in layers/attention/indexer.py. Fewer than k entries: the rest is -1.
// NaN is not expected (indexer scores are finite or -inf).
//
// How: each float is mapped to 32 order bits (monotone in the score; -0.0 first becomes +0.0,
// which the stable sort ties with it). A histogram of the top 11 bits finds the bucket that
// holds the k-th best; one pass over the row then keeps every entry of a higher bucket (fewer
// than k) and compacts the k-th bucket's entries, in entry order, into a candidate list; two
// more histogram passes over the candidates (11 and 10 bits) refine it, and entries whose 32
// bits all tie with the k-th are taken lowest entry first. The k chosen, gathered in entry
// order, are put in (score, entry) order by a stable radix sort on their bits. The row is read
// twice and never written; the work after that is proportional to the k-th bucket's
// population (a few percent of the row on index scores) and to k.
//
// Two implementations of the row passes: portable C++ and AVX512 (order bits 16 lanes at a
// time, the compaction by masked compress-stores). They give identical picks (exact
// selection); `portable=true` forces the first so both are tested.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kTopBits = 11;                 // pass 1: bits 31..21
constexpr int kTopShift = 32 - kTopBits;
constexpr int kBuckets = 1 << kTopBits;
constexpr int kCopies = 4;                   // histogram copies: equal buckets in a row do not
                                             // serialise on one counter (4 x 8 KiB, in L1)

inline uint32_t order_bits(float f) {
  f += 0.f;                                  // -0.0 -> +0.0
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

inline uint64_t key_of(uint32_t bits, uint32_t entry) {
  return (uint64_t(bits) << 32) | uint32_t(~entry);
}

struct Scratch {
  std::vector<uint32_t> cand_entry, cand_bits;   // the k-th bucket's entries, entry order
  std::vector<uint32_t> high_entry, high_bits;   // entries of higher buckets (< k of them)
  std::vector<uint32_t> ref_entry, ref_bits;     // candidates left by the refining passes
  std::vector<uint32_t> sub_entry, sub_bits;     // the k-th bucket among the survivors
  std::vector<uint32_t> sample;                  // order bits of the sampled entries
  std::vector<uint32_t> sort_entry[2], sort_bits[2];   // the k chosen, and the sort's spare
  uint32_t hist[kCopies][kBuckets];
};

// From the highest bucket down: the bucket b holding the need-th best, and how many entries
// lie in higher buckets (< need).
inline void find_bucket(const uint32_t* hist, int64_t buckets, int64_t need, int64_t& b,
                        int64_t& above) {
  above = 0;
  for (b = buckets - 1; b > 0 && above + hist[b] < need; --b) above += hist[b];
}

// ---------------------------------------------------------------- row passes, portable
void histogram_portable(const float* s, int64_t m, Scratch& sc) {
  std::memset(sc.hist, 0, sizeof(sc.hist));
  int64_t i = 0;
  for (; i + kCopies <= m; i += kCopies)
    for (int c = 0; c < kCopies; ++c) ++sc.hist[c][order_bits(s[i + c]) >> kTopShift];
  for (; i < m; ++i) ++sc.hist[0][order_bits(s[i]) >> kTopShift];
}

void compact_portable(const float* s, int64_t m, uint32_t b, Scratch& sc, int64_t& n_high,
                      int64_t& n_cand) {
  n_high = n_cand = 0;
  for (int64_t i = 0; i < m; ++i) {
    const uint32_t bits = order_bits(s[i]), bucket = bits >> kTopShift;
    if (bucket > b) {
      sc.high_entry[n_high] = uint32_t(i);
      sc.high_bits[n_high++] = bits;
    } else if (bucket == b) {
      sc.cand_entry[n_cand] = uint32_t(i);
      sc.cand_bits[n_cand++] = bits;
    }
  }
}

// Entries whose order bits are at least t -> (entry, bits) lists in entry order.
int64_t survivors_portable(const float* s, int64_t m, uint32_t t, uint32_t* entry,
                           uint32_t* bits_out) {
  int64_t n = 0;
  for (int64_t i = 0; i < m; ++i) {
    const uint32_t bits = order_bits(s[i]);
    if (bits >= t) {
      entry[n] = uint32_t(i);
      bits_out[n++] = bits;
    }
  }
  return n;
}

#if defined(__AVX512F__)
// ---------------------------------------------------------------- row passes, AVX512
inline __m512i order_bits16(__m512 x) {
  const __m512i u = _mm512_castps_si512(_mm512_add_ps(x, _mm512_setzero_ps()));
  const __m512i flip = _mm512_or_si512(_mm512_srai_epi32(u, 31), _mm512_set1_epi32(INT32_MIN));
  return _mm512_xor_si512(u, flip);
}

inline __m512 load_tail(const float* s, int64_t i, int64_t m, __mmask16& live) {
  const int64_t left = m - i;
  live = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  return _mm512_maskz_loadu_ps(live, s + i);
}

void histogram_avx512(const float* s, int64_t m, Scratch& sc) {
  std::memset(sc.hist, 0, sizeof(sc.hist));
  alignas(64) uint32_t b[16];
  for (int64_t i = 0; i < m; i += 16) {
    __mmask16 live;
    const __m512 x = load_tail(s, i, m, live);
    _mm512_store_si512(b, _mm512_srli_epi32(order_bits16(x), kTopShift));
    if (live == 0xFFFF) {
      for (int j = 0; j < 16; j += kCopies)
        for (int c = 0; c < kCopies; ++c) ++sc.hist[c][b[j + c]];
    } else {
      for (int j = 0; j < m - i; ++j) ++sc.hist[0][b[j]];
    }
  }
}

void compact_avx512(const float* s, int64_t m, uint32_t b, Scratch& sc, int64_t& n_high,
                    int64_t& n_cand) {
  n_high = n_cand = 0;
  const __m512i bucket_b = _mm512_set1_epi32(int(b));
  const __m512i step = _mm512_set1_epi32(16);
  __m512i entry = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t i = 0; i < m; i += 16, entry = _mm512_add_epi32(entry, step)) {
    __mmask16 live;
    const __m512i bits = order_bits16(load_tail(s, i, m, live));
    const __m512i bucket = _mm512_srli_epi32(bits, kTopShift);
    const __mmask16 eq = _mm512_mask_cmpeq_epu32_mask(live, bucket, bucket_b);
    const __mmask16 gt = _mm512_mask_cmpgt_epu32_mask(live, bucket, bucket_b);
    if (eq) {
      _mm512_mask_compressstoreu_epi32(sc.cand_entry.data() + n_cand, eq, entry);
      _mm512_mask_compressstoreu_epi32(sc.cand_bits.data() + n_cand, eq, bits);
      n_cand += __builtin_popcount(eq);
    }
    if (gt) {
      _mm512_mask_compressstoreu_epi32(sc.high_entry.data() + n_high, gt, entry);
      _mm512_mask_compressstoreu_epi32(sc.high_bits.data() + n_high, gt, bits);
      n_high += __builtin_popcount(gt);
    }
  }
}

int64_t survivors_avx512(const float* s, int64_t m, uint32_t t, uint32_t* entry,
                         uint32_t* bits_out) {
  int64_t n = 0;
  const __m512i cut = _mm512_set1_epi32(int(t)), step = _mm512_set1_epi32(16);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t i = 0; i < m; i += 16, idx = _mm512_add_epi32(idx, step)) {
    __mmask16 live;
    const __m512i bits = order_bits16(load_tail(s, i, m, live));
    const __mmask16 keep = _mm512_mask_cmpge_epu32_mask(live, bits, cut);
    if (keep) {
      _mm512_mask_compressstoreu_epi32(entry + n, keep, idx);
      _mm512_mask_compressstoreu_epi32(bits_out + n, keep, bits);
      n += __builtin_popcount(keep);
    }
  }
  return n;
}
#endif

// ---------------------------------------------------------------- ordering the k chosen
// (entry[i], bits[i]) for i < k, in entry order -> picks ordered by (bits descending, entry
// ascending): a stable LSD radix sort on ~bits (11/11/10-bit digits; a digit all entries
// share is skipped). Cheaper than a comparison sort of k 64-bit keys (2-5x at k = 512-2048).
void order_chosen(Scratch& sc, int64_t k, int64_t* picks) {
  uint32_t *e = sc.sort_entry[0].data(), *b = sc.sort_bits[0].data();
  uint32_t *e2 = sc.sort_entry[1].data(), *b2 = sc.sort_bits[1].data();
  const int shifts[3] = {0, 10, 21}, widths[3] = {10, 11, 11};
  for (int pass = 0; pass < 3; ++pass) {
    const uint32_t mask = (1u << widths[pass]) - 1;
    uint32_t* count = sc.hist[0];
    std::memset(count, 0, sizeof(uint32_t) * (mask + 1));
    for (int64_t i = 0; i < k; ++i) ++count[(~b[i] >> shifts[pass]) & mask];
    if (count[(~b[0] >> shifts[pass]) & mask] == uint32_t(k)) continue;   // one digit: as is
    uint32_t at = 0;
    for (uint32_t d = 0; d <= mask; ++d) { const uint32_t c = count[d]; count[d] = at; at += c; }
    for (int64_t i = 0; i < k; ++i) {
      const uint32_t to = count[(~b[i] >> shifts[pass]) & mask]++;
      e2[to] = e[i];
      b2[to] = b[i];
    }
    std::swap(e, e2);
    std::swap(b, b2);
  }
  for (int64_t i = 0; i < k; ++i) picks[i] = e[i];
}

// ---------------------------------------------------------------- the k-th and the chosen
// Given the entries above the k-th's bucket (sc.high_*, n_high of them, entry order) and that
// bucket's entries (ce/cb, n_cand, entry order), of which `need` >= 1 belong to the top k:
// find the k-th best key by refining on the lower bits (into sc.ref_*, so ce/cb stay whole),
// then write the k chosen in entry order to out_*: the high entries merged with the
// candidates whose key is at least the k-th's.
void finish(Scratch& sc, int64_t n_high, const uint32_t* ce, const uint32_t* cb,
            int64_t n_cand, int64_t need, int64_t k, int first_shift, uint32_t* out_e,
            uint32_t* out_b) {
  int64_t live = n_cand, b, above;
  const uint32_t *le = ce, *lb = cb;
  sc.ref_entry.resize(n_cand);
  sc.ref_bits.resize(n_cand);
  for (int shift = first_shift; shift > 0 && live > need;) {   // 11 bits, then the last 10
    const int width = std::min(11, shift);
    shift -= width;
    const uint32_t mask = (1u << width) - 1;
    uint32_t* hist = sc.hist[0];
    std::memset(hist, 0, sizeof(uint32_t) * (mask + 1));
    for (int64_t i = 0; i < live; ++i) ++hist[(lb[i] >> shift) & mask];
    find_bucket(hist, mask + 1, need, b, above);
    int64_t kept = 0;
    for (int64_t i = 0; i < live; ++i) {     // may run in place: kept <= i
      if (((lb[i] >> shift) & mask) == uint32_t(b)) {
        sc.ref_entry[kept] = le[i];
        sc.ref_bits[kept++] = lb[i];
      }
    }
    le = sc.ref_entry.data();
    lb = sc.ref_bits.data();
    live = kept;
    need -= above;
  }
  // live == need: all of them, the k-th is the smallest key among them; otherwise all 32
  // bits tie and the lowest entries win: the k-th is the need-th in entry order.
  uint64_t kth = key_of(lb[need - 1], le[need - 1]);
  if (live == need)
    for (int64_t i = 0; i < live; ++i) kth = std::min(kth, key_of(lb[i], le[i]));
  int64_t h = 0, c = 0, got = 0;
  auto next_cand = [&]() {
    while (c < n_cand && key_of(cb[c], ce[c]) < kth) ++c;
  };
  next_cand();
  while (got < k) {
    if (c < n_cand && (h >= n_high || ce[c] < sc.high_entry[h])) {
      out_e[got] = ce[c];
      out_b[got++] = cb[c++];
      next_cand();
    } else {
      out_e[got] = sc.high_entry[h];
      out_b[got++] = sc.high_bits[h++];
    }
  }
}

// The whole row: a histogram of the top bits, then one compaction pass.
void choose_by_histogram(const float* s, int64_t m, int64_t k, Scratch& sc, bool fast,
                         uint32_t* out_e, uint32_t* out_b) {
#if defined(__AVX512F__)
  if (fast) histogram_avx512(s, m, sc); else histogram_portable(s, m, sc);
#else
  histogram_portable(s, m, sc);
#endif
  for (int c = 1; c < kCopies; ++c)
    for (int b = 0; b < kBuckets; ++b) sc.hist[0][b] += sc.hist[c][b];
  int64_t b, above, n_high, n_cand;
  find_bucket(sc.hist[0], kBuckets, k, b, above);
  sc.cand_entry.resize(m);
  sc.cand_bits.resize(m);
  sc.high_entry.resize(k);
  sc.high_bits.resize(k);
#if defined(__AVX512F__)
  if (fast) compact_avx512(s, m, uint32_t(b), sc, n_high, n_cand);
  else compact_portable(s, m, uint32_t(b), sc, n_high, n_cand);
#else
  compact_portable(s, m, uint32_t(b), sc, n_high, n_cand);
#endif
  finish(sc, n_high, sc.cand_entry.data(), sc.cand_bits.data(), n_cand, k - above, k,
         kTopShift, out_e, out_b);
}

// A cut-off from a sample: kSample entries at a fixed stride; the r-th best of them, with r
// a few standard deviations above the k-th's expected rank in the sample, is below the row's
// k-th almost always. One pass keeps the entries at or above it (survivors, entry order);
// the exact selection then runs on those. Returns false, having done nothing the caller
// needs, when fewer than k survive (the cut-off was too high) or the sample cannot help.
constexpr int64_t kSample = 1024;

bool choose_by_sample(const float* s, int64_t m, int64_t k, Scratch& sc, bool fast,
                      uint32_t* out_e, uint32_t* out_b) {
  const double expect = double(k) * kSample / double(m);
  const int64_t r = int64_t(expect + 4.0 * std::sqrt(expect) + 8.0);
  if (m < 4 * kSample || r >= kSample / 4) return false;
  sc.sample.resize(kSample);
  for (int64_t i = 0; i < kSample; ++i) sc.sample[i] = order_bits(s[i * m / kSample]);
  std::nth_element(sc.sample.begin(), sc.sample.begin() + (r - 1), sc.sample.end(),
                   std::greater<uint32_t>());
  const uint32_t cut = sc.sample[r - 1];
  sc.cand_entry.resize(m);
  sc.cand_bits.resize(m);
  uint32_t *se = sc.cand_entry.data(), *sb = sc.cand_bits.data();
#if defined(__AVX512F__)
  const int64_t n = fast ? survivors_avx512(s, m, cut, se, sb)
                         : survivors_portable(s, m, cut, se, sb);
#else
  (void)fast;
  const int64_t n = survivors_portable(s, m, cut, se, sb);
#endif
  if (n < k) return false;
  // The survivors' own top-bit histogram and compaction (scalar: a few k entries).
  uint32_t* hist = sc.hist[0];
  std::memset(hist, 0, sizeof(uint32_t) * kBuckets);
  for (int64_t i = 0; i < n; ++i) ++hist[sb[i] >> kTopShift];
  int64_t b, above, n_high = 0, n_sub = 0;
  find_bucket(hist, kBuckets, k, b, above);
  sc.high_entry.resize(k);
  sc.high_bits.resize(k);
  sc.sub_entry.resize(n);
  sc.sub_bits.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bucket = sb[i] >> kTopShift;
    if (bucket > uint32_t(b)) {
      sc.high_entry[n_high] = se[i];
      sc.high_bits[n_high++] = sb[i];
    } else if (bucket == uint32_t(b)) {
      sc.sub_entry[n_sub] = se[i];
      sc.sub_bits[n_sub++] = sb[i];
    }
  }
  finish(sc, n_high, sc.sub_entry.data(), sc.sub_bits.data(), n_sub, k - above, k, kTopShift,
         out_e, out_b);
  return true;
}

// ---------------------------------------------------------------- one row
void select_row(const float* s, int64_t m, int64_t k, int64_t* picks, Scratch& sc,
                bool fast) {
  const int64_t take = std::min(k, m);
  for (int64_t i = take; i < k; ++i) picks[i] = -1;
  if (take == 0) return;
  for (auto* v : {&sc.sort_entry[0], &sc.sort_entry[1], &sc.sort_bits[0], &sc.sort_bits[1]})
    v->resize(take);
  uint32_t* out_e = sc.sort_entry[0].data();
  uint32_t* out_b = sc.sort_bits[0].data();
  if (m <= k) {                               // every entry, already in entry order
    for (int64_t e = 0; e < m; ++e) {
      out_e[e] = uint32_t(e);
      out_b[e] = order_bits(s[e]);
    }
  } else if (!choose_by_sample(s, m, k, sc, fast, out_e, out_b)) {
    choose_by_histogram(s, m, k, sc, fast, out_e, out_b);
  }
  order_chosen(sc, take, picks);
}

at::Tensor deepselect_topk(const at::Tensor& scores, int64_t k,
                           const c10::optional<at::Tensor>& lengths, bool portable) {
  TORCH_CHECK(scores.dim() == 2 && scores.is_contiguous() &&
                  scores.scalar_type() == at::kFloat && scores.device().is_cpu(),
              "deepselect_topk: scores must be [rows, n] contiguous float32 on the CPU");
  TORCH_CHECK(k >= 0, "deepselect_topk: k must be >= 0, got ", k);
  const int64_t rows = scores.size(0), n = scores.size(1);
  TORCH_CHECK(n < (int64_t(1) << 32) - 1, "deepselect_topk: rows of 2^32 entries or more");
  const int64_t* len = nullptr;
  if (lengths.has_value()) {
    const at::Tensor& l = *lengths;
    TORCH_CHECK(l.dim() == 1 && l.size(0) == rows && l.is_contiguous() &&
                    l.scalar_type() == at::kLong,
                "deepselect_topk: lengths must be [rows] contiguous int64");
    len = l.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(len[r] >= 0 && len[r] <= n, "deepselect_topk: row ", r, " has length ",
                  len[r], " outside 0..", n);
  }
  at::Tensor picks = at::empty({rows, k}, scores.options().dtype(at::kLong));
  if (rows == 0 || k == 0) return picks;
  const float* s = scores.data_ptr<float>();
  int64_t* p = picks.data_ptr<int64_t>();
  bool fast = false;
#if defined(__AVX512F__)
  fast = !portable;
#endif
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t r = begin; r < end; ++r)
      select_row(s + r * n, len ? len[r] : n, k, p + r * k, scratch, fast);
  });
  return picks;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("deepselect_topk(Tensor scores, int k, Tensor? lengths=None, bool portable=False)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(wideserve, CPU, m) { m.impl("deepselect_topk", &deepselect_topk); }
