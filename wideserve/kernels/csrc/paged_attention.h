// Shared pieces of the GQA paged attention op (docs/cpu_kernels.md, "Paged attention"):
// the problem an op call resolves, its work items and their geometry, per-thread scratch, and
// the online-softmax bookkeeping both implementations use. paged_attention.cpp holds the op
// (argument checks, the KV write, the work split, the portable loop); paged_attention_avx512.cpp
// the AVX512 loop, reached through avx512_attend().
//
// Work item: one (request, block of queries), every KV head: a tile of kTile keys is whole
// cache entries (contiguous within a block, so DRAM streams them), read through the block table
// once and then used by every head. A KV head's G query heads per query are folded into rows
// (row = (head * queries + query) * G + g) that share each K/V load. An online softmax in fp32
// (running max, sum, output per row) means one pass over the keys an item can see. Only entries
// a query may attend to are read: a NaN in a never-written or out-of-window slot cannot reach
// an output.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace wideserve_paged {


constexpr int64_t kTile = 128;      // keys per online-softmax step
constexpr int64_t kMaxRows = 16;    // folded rows per KV head of an item (multi-query segments)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Item {
  int64_t req, q0, q1;              // queries q0..q1-1 of request req (local indices)
};

// Everything an item needs, resolved once per call.
struct Problem {
  const char* q;                    // token t's head h at q + (t * q_tok + h * q_head) elements
  int64_t q_tok, q_head;
  char* out;                        // [T, H, D] contiguous
  const char* cache;
  const int64_t* table;
  int64_t table_stride;
  const int64_t* req_rows;          // nullptr: identity
  const int64_t* qsl;
  const int64_t* seq_lens;
  int64_t heads, kv_heads, groups, dim, width, block_size, num_blocks, window;
  float scale;
};

inline float to_f32(float x) { return x; }
inline float to_f32(at::BFloat16 x) { return static_cast<float>(x); }

// Per-item geometry: query positions and the key span each row may read.
struct Span {
  int64_t qstart;                   // token row of local query 0
  int64_t pos0;                     // position of local query 0
  int64_t lo, hi;                   // keys [lo, hi) the item reads
  int64_t head_rows;                // rows per KV head: queries * G
  int64_t rows;                     // all heads
};

inline int64_t key_lo(const Problem& p, int64_t pos) {
  return p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
}

inline Span span_of(const Problem& p, const Item& it) {
  int64_t qs = p.qsl[it.req], qlen = p.qsl[it.req + 1] - qs;
  int64_t pos0 = p.seq_lens[it.req] - qlen;
  int64_t head_rows = (it.q1 - it.q0) * p.groups;
  return Span{qs, pos0, key_lo(p, pos0 + it.q0), pos0 + it.q1, head_rows,
              head_rows * p.kv_heads};
}

// Row r's visible keys, clipped to [k0, k1).
inline void row_range(const Problem& p, const Item& it, const Span& s, int64_t r, int64_t k0,
                      int64_t k1, int64_t* a, int64_t* b) {
  int64_t pos = s.pos0 + it.q0 + (r % s.head_rows) / p.groups;
  *a = std::max(k0, key_lo(p, pos));
  *b = std::min(k1, pos + 1);
}

// Entry pointers (bytes) of keys k0..k1-1 of the item's request, through its block table row.
template <typename CT>
void entry_ptrs(const Problem& p, const Item& it, int64_t k0, int64_t k1, const CT** out) {
  int64_t row = p.req_rows ? p.req_rows[it.req] : it.req;
  const int64_t* blocks = p.table + row * p.table_stride;
  const CT* base = reinterpret_cast<const CT*>(p.cache);
  for (int64_t k = k0; k < k1;) {
    int64_t b = k / p.block_size, off = k % p.block_size;
    int64_t blk = blocks[b];
    TORCH_CHECK(blk >= 0 && blk < p.num_blocks, "paged_attention: block id ", blk,
                " out of range [0, ", p.num_blocks, ")");
    int64_t n = std::min(k1 - k, p.block_size - off);
    const CT* e = base + (blk * p.block_size + off) * p.width;
    for (int64_t j = 0; j < n; ++j) out[k - k0 + j] = e + j * p.width;
    k += n;
  }
}

// Scratch of one thread: fp32 queries, running max/sum, output accumulators, tile scores.
struct Scratch {
  std::vector<float> q, m, l, acc, s;
  std::vector<at::BFloat16> qb;     // bf16 queries for avx512_bf16 dot products
  std::vector<const void*> kp, next_kp;   // this tile's entries, the next tile's
  Scratch(int64_t rows, int64_t dim)
      : q(rows * dim), m(rows), l(rows), acc(rows * dim), s(rows * kTile), qb(rows * dim),
        kp(kTile), next_kp(2 * kTile) {}
};

template <typename QT>
void load_queries(const Problem& p, const Item& it, const Span& s, float* qf) {
  const QT* q = reinterpret_cast<const QT*>(p.q);
  for (int64_t r = 0; r < s.rows; ++r) {
    int64_t tok = s.qstart + it.q0 + (r % s.head_rows) / p.groups;
    int64_t head = (r / s.head_rows) * p.groups + r % p.groups;
    const QT* src = q + tok * p.q_tok + head * p.q_head;
    for (int64_t d = 0; d < p.dim; ++d) qf[r * p.dim + d] = to_f32(src[d]);
  }
}

template <typename QT>
void store_outputs(const Problem& p, const Item& it, const Span& s, const float* acc,
                   const float* l) {
  QT* out = reinterpret_cast<QT*>(p.out);
  for (int64_t r = 0; r < s.rows; ++r) {
    int64_t tok = s.qstart + it.q0 + (r % s.head_rows) / p.groups;
    int64_t head = (r / s.head_rows) * p.groups + r % p.groups;
    QT* dst = out + (tok * p.heads + head) * p.dim;
    float inv = 1.0f / l[r];
    for (int64_t d = 0; d < p.dim; ++d) dst[d] = static_cast<QT>(acc[r * p.dim + d] * inv);
  }
}

// Load the item's queries, reset its running max/sum/output; returns the tile's key pointers.
template <typename QT, typename CT>
const CT** start_item(const Problem& p, const Item& it, const Span& s, Scratch& w) {
  load_queries<QT>(p, it, s, w.q.data());
  std::fill(w.m.begin(), w.m.begin() + s.rows, kNegInf);
  std::fill(w.l.begin(), w.l.begin() + s.rows, 0.0f);
  std::fill(w.acc.begin(), w.acc.begin() + s.rows * p.dim, 0.0f);
  return reinterpret_cast<const CT**>(w.kp.data());
}

// Online-softmax update of row r over its tile scores s[a..b) (others are not visible):
// rescale the row's sum and output by exp(old max - new max), turn the scores into weights.
// Returns false when the row sees nothing in this tile (its weights are all zero).
template <typename ExpFn>
bool softmax_update(float* srow, int64_t n, int64_t a, int64_t b, float* m, float* l,
                    float* acc, int64_t dim, ExpFn exp_span) {
  if (a >= b) {
    std::fill(srow, srow + n, 0.0f);
    return false;
  }
  float mx = *m;
  float sum = exp_span(srow + a, b - a, &mx);
  float corr = std::exp(*m - mx);   // *m = -inf on the first tile: corr = 0, acc is 0 anyway
  std::fill(srow, srow + a, 0.0f);
  std::fill(srow + b, srow + n, 0.0f);
  *l = *l * corr + sum;
  *m = mx;
  if (corr != 1.0f)
    for (int64_t d = 0; d < dim; ++d) acc[d] *= corr;
  return true;
}

// One work item's attention, by one implementation.
using AttendFn = void (*)(const Problem&, const Item& it, const Item* next, Scratch&);

// The AVX512 loop for these dtypes (bf16 or fp32 queries and cache), or nullptr where this
// build has no AVX512 (then the portable loop runs).
AttendFn avx512_attend(bool q_bf16, bool cache_bf16);

}  // namespace wideserve_paged
