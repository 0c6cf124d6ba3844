// The routed-experts op's shared pieces (csrc/moe.cpp, csrc/moe_matrix.h): the sorted rows,
// the packed-layout geometry, and the stores of the SwiGLU activations and the weighted down
// sums. Included by csrc/moe.cpp only.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "gemm.h"

namespace wideserve_moe {

using namespace wideserve_gemm;

// Register tiles: rows x blocks fp32 accumulators, plus a weight register per block, of the
// 32 zmm. Phase 2 at 7 rows (28 + 4) rather than 4 (16 + 4) reads each down group once per 7
// rows (BENCHMARKS.md, "Zen 4: down tiles of 6 rows", and "Zen 4: expert tiles stream their
// weights ahead" for 7).
constexpr int kRowsUp = 8;       // rows per register tile in phase 1 (gate + up: 16 accs)
// ... but an expert of at most kRowsUpOnePass rows runs each gate/up group in one pass (up
// to 28 accs + 2 weight registers): at the 653M model's batch-64 decode (~8 rows an expert,
// 9-14 for a third of them) a second pass re-read each group from L2 for a few rows, and
// one pass took the decode experts to 0.93-0.94 of the time on the Zen 5. Where an expert
// has more rows, passes of 8 stay: with the weights in the caches (the 11M model at 128
// tokens) balanced passes of up to 14 were 1.05x slower (the tile's row pointers spill to
// the stack). BENCHMARKS.md, "Zen 5: the first measurements".
constexpr int kRowsUpOnePass = 14;
constexpr int kRowsDown = 7;     // rows per register tile in phase 2 ...
constexpr int kBlocksDown = 4;   // ... times output blocks (28 accs): a down group

// Tiles of at least these rows ask for their weights a fixed distance ahead of their loads
// (csrc/gemm.h, Ahead::kStream): an up tile of 7+ rows and a down tile of 6+ (a tile does as
// many dot products per 64-byte line as it has rows) compute longer than their weights take
// to arrive, so the hardware prefetcher alone left the memory idle part of the time; smaller
// tiles are bound by the weight stream, which the extra requests slowed (up to 30% at 1-5
// rows). Measured on the Zen 4 (BENCHMARKS.md, "Zen 4: expert tiles stream their weights
// ahead").
constexpr int kStreamRowsUp = 7;
constexpr int kStreamRowsDown = 6;

// The rows of an expert's next register tile when `left` remain, at most `most`. The first
// pass over a weight group reads it from memory, the others from L2: the first pass is a full
// tile (a tile that streams its weights ahead, above), the rest balanced (16 rows at most 7:
// 7 + 5 + 4; a lone row's pass re-reads the whole group for one row's products). Measured on
// the Zen 4 against balanced passes throughout (6 + 5 + 5) and full tiles throughout (7 + 7
// + 2): BENCHMARKS.md, "Zen 4: expert tiles stream their weights ahead".
inline int64_t next_tile_rows(int64_t left, int64_t most, bool first) {
  if (left <= most || first) return std::min(left, most);
  const int64_t passes = (left + most - 1) / most;
  return (left + passes - 1) / passes;
}

// The sorted rows: expert e owns rows [offsets[e], offsets[e + 1]).
// `order` per row: kFirst / kLast bits mark a token's first and last row in sorted order,
// which is the order phase 2 visits them within each thread's columns.
constexpr uint8_t kFirst = 1, kLast = 2;
struct Rows {
  std::vector<int64_t> offsets;
  std::vector<int64_t> token;
  std::vector<float> weight;
  std::vector<uint8_t> order;
  std::vector<int64_t> active;   // experts with at least one row
  int64_t tokens = 0;
};

// ids [T, k] -> physical ids: through `expert_map` [E, 1] (logical -> its one physical slot)
// when given, else as they are.
inline std::vector<int64_t> physical_ids(const at::Tensor& ids,
                                         const std::optional<at::Tensor>& map) {
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  if (!map.has_value() || !map->defined()) return std::vector<int64_t>(id, id + n);
  TORCH_CHECK(map->dim() == 2 && map->size(1) == 1 && map->scalar_type() == at::kLong,
              "moe_fused_experts: expert_map must be an int64 [E, 1] table");
  const at::Tensor table = map->contiguous();
  const int64_t logical = table.size(0);
  const int64_t* to = table.data_ptr<int64_t>();
  std::vector<int64_t> out(n);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < logical, "moe_fused_experts: logical expert id ", id[i],
                " out of range [0, ", logical, ")");
    out[i] = to[id[i]];
  }
  return out;
}

inline Rows sort_rows(const std::vector<int64_t>& ids, int64_t k, const at::Tensor& weights,
                      int64_t experts, int64_t tokens) {
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t* id = ids.data();
  const float* w = weights.data_ptr<float>();
  Rows rows;
  rows.offsets.assign(experts + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < experts, "moe_fused_experts: expert id ", id[i],
                " out of range [0, ", experts, ")");
    ++rows.offsets[id[i] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) {
    if (rows.offsets[e + 1]) rows.active.push_back(e);
    rows.offsets[e + 1] += rows.offsets[e];
  }
  std::vector<int64_t> fill(rows.offsets.begin(), rows.offsets.end() - 1);
  rows.token.resize(n);
  rows.weight.resize(n);
  for (int64_t i = 0; i < n; ++i) {          // stable: rows of one expert stay in token order
    const int64_t r = fill[id[i]]++;
    rows.token[r] = i / k;
    rows.weight[r] = w[i];
  }
  rows.tokens = tokens;
  std::vector<int64_t> last(tokens, -1);
  rows.order.assign(n, 0);
  for (int64_t r = 0; r < n; ++r) {
    int64_t& prev = last[rows.token[r]];
    if (prev < 0) rows.order[r] |= kFirst;
    prev = r;
  }
  for (int64_t t = 0; t < tokens; ++t)
    if (last[t] >= 0) rows.order[last[t]] |= kLast;
  return rows;
}

// Packed-layout geometry, derived from the shapes and checked against the packed tensors.
struct Geometry {
  int64_t d, inter, ip, pair;          // hidden, intermediate, I padded to 16, P
  int64_t up_groups, up_pairs;         // w13 [E, up_groups, up_pairs, 2, 16, P]
  int64_t down_groups, down_pairs;     // w2  [E, down_groups, down_pairs, 4, 16, P]
  int64_t up_group_size() const { return up_pairs * 2 * kLanes * pair; }
  int64_t down_group_size() const { return down_pairs * kBlocksDown * kLanes * pair; }
};

Geometry geometry(int64_t d, int64_t inter, int64_t pair) {
  Geometry g;
  g.d = d;
  g.inter = inter;
  g.ip = (inter + kLanes - 1) / kLanes * kLanes;
  g.pair = pair;
  g.up_groups = g.ip / kLanes;
  g.up_pairs = (d + pair - 1) / pair;
  g.down_groups = (d + kBlocksDown * kLanes - 1) / (kBlocksDown * kLanes);
  g.down_pairs = g.ip / pair;
  return g;
}

inline float silu_mul(float gate, float up, bool clamp, float limit) {
  if (clamp) {  // DeepSeek-V4: the gate is clamped from above only, up both ways
    gate = std::min(gate, limit);
    up = std::min(std::max(up, -limit), limit);
  }
  return gate / (1.0f + std::exp(-gate)) * up;
}

// Decoded weights are what AMX tiles and brgemm read as B: 64-byte aligned, so that no
// 64-byte tile row straddles two cache lines (a prefill through brgemm on a 16-byte aligned
// decoded group ran 1.7x slower).
struct FreeAligned {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using Aligned = std::unique_ptr<T[], FreeAligned>;

template <typename T>
Aligned<T> aligned_buffer(int64_t n) {   // n <= 0: none
  if (n <= 0) return Aligned<T>();
  const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
  return Aligned<T>(static_cast<T*>(std::aligned_alloc(64, bytes)));
}

// Where phase 2 writes: the fp32 partial sums [T, d] and the output [T, d] in the model dtype
// (for fp32 both are the output).
template <typename T>
struct Sums {
  float* partial;
  T* out;
};

// The most rows the brgemm path gathers per chunk (see the AVX512-BF16 section below).
constexpr int64_t kGatherRows = 256;

#ifdef __AVX512BF16__
// 16 activations silu(gate) * up (DeepSeek-V4's clamp when `clamp`), rounded to bf16 (RNE).
inline void swiglu_store(__m512 gate, __m512 up, bool clamp, float limit, at::BFloat16* dst) {
  if (clamp) {
    const __m512 lim = _mm512_set1_ps(limit);
    gate = _mm512_min_ps(gate, lim);
    up = _mm512_min_ps(_mm512_max_ps(up, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
  }
  const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gate));
  const __m512 a = _mm512_mul_ps(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                 up);
  const __m256bh packed = _mm512_cvtneps_pbh(a);
  std::memcpy(dst, &packed, sizeof(packed));
}

// One row's weighted down-projection sum for 16-column blocks n < NB from fp32 values
// acc(n): the first row of a token stores, later ones add, the last rounds and writes.
template <int NB, typename Acc>
inline void down_store(Acc&& acc, const Rows& rows, int64_t r, const Geometry& g, int64_t b,
                       Sums<at::BFloat16> sums) {
  const int64_t row = rows.token[r] * g.d;
  float* part = sums.partial + row;
  at::BFloat16* o = sums.out + row;
  const __m512 wt = _mm512_set1_ps(rows.weight[r]);
  const uint8_t order = rows.order[r];
  for (int n = 0; n < NB; ++n) {
    const int64_t c0 = (b + n) * kLanes, cols = std::min<int64_t>(kLanes, g.d - c0);
    if (cols <= 0) break;
    const __mmask16 mask = cols == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    const __m512 cur = (order & kFirst) ? _mm512_setzero_ps()
                                        : _mm512_maskz_loadu_ps(mask, part + c0);
    const __m512 v = _mm512_fmadd_ps(wt, acc(n), cur);
    if (order & kLast) {   // RNE, as at::Tensor::to(kBFloat16) rounds
      const __m256i packed = reinterpret_cast<const __m256i&>(
          static_cast<const __m256bh&>(_mm512_cvtneps_pbh(v)));
      _mm256_mask_storeu_epi16(o + c0, mask, packed);
    } else {
      _mm512_mask_storeu_ps(part + c0, mask, v);
    }
  }
}
#endif  // __AVX512BF16__

}  // namespace wideserve_moe
