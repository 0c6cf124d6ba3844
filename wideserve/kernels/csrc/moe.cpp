// Fused routed experts on the CPU: one call per MoE layer (docs/cpu_kernels.md, docs/moe.md).
//
//   out[t] = sum_j  w[t, j] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),   e = ids[t, j]
//
// The T*k (token, pick) rows are counting-sorted by expert here, then two phases:
//   1. gate/up GEMM + SwiGLU, parallel over 16-column blocks j of I: a thread takes a range
//      of blocks for every expert, so threads get the same number of rows whatever the
//      routing (an expert-major split gave one thread the experts that happened to be busy);
//      with more threads than that has blocks for, (block, expert) items in block-major
//      order. The activation of every sorted row goes to a scratch [N, Ip] buffer in the
//      model dtype;
//   2. down GEMM + weighted scatter-add, parallel over 64-column groups of the output, so no
//      two threads ever add into the same output element.
// Accumulation is fp32, rounded to the model dtype once. A token's first row (in the order
// phase 2 visits them) stores its fp32 partial sum instead of adding, and its last row adds,
// rounds and writes the output: no zero-filled accumulator and no separate conversion pass
// (both were serial work outside the parallel phases, ~5% of a decode call).
// With `expert_map` ([E, 1]: each logical expert's one physical slot) the ids are logical and
// mapped here; `expert_load` ([L] int64) is incremented in place by the rows each physical
// expert received (the counts the sort makes anyway): the EPLB counters without the torch
// index/bincount/add ops around the call.
//
// Weights come prepacked (wideserve/kernels/moe.py): every expert's [N, K] matrix is cut into
// groups of G blocks of 16 output rows, each group stored as [K/P, G, 16, P] (P = 2 for bf16,
// 1 for fp32), so one 64-byte load holds the next P inputs' weights for 16 outputs, and a
// register tile reads its group as one sequential stream. With AVX512-BF16 one `vdpbf16ps`
// then multiplies a broadcast pair of inputs into 16 fp32 accumulators that run along the
// output dimension: no horizontal reductions. Up groups are (gate block j, up block j), G = 2,
// so the SwiGLU of a block is computed where it is produced; down groups are G = 4 blocks.
// I is padded to a multiple of 16 and d to one of 64 with zero weights (the padded
// activations are exactly 0; the padded output columns are never stored).
//
// The portable path (plain C++, any CPU, and fp32) runs the same tiling with scalar code; it is
// what machines without AVX512-BF16 run and is selected by `portable=True` for tests.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "brgemm.h"
#include "gemm.h"
#include "weight_stream.h"

namespace {

using namespace wideserve_gemm;
constexpr int kRowsUp = 8;       // rows per register tile in phase 1 (gate + up: 16 accs)
constexpr int kRowsDown = 4;     // rows per register tile in phase 2 ...
constexpr int kBlocksDown = 4;   // ... times output blocks (16 accs): a down group

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
};

// ids [T, k] -> physical ids: through `expert_map` [E, 1] (logical -> its one physical slot)
// when given, else as they are.
std::vector<int64_t> physical_ids(const at::Tensor& ids, const std::optional<at::Tensor>& map) {
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

Rows sort_rows(const std::vector<int64_t>& ids, int64_t k, const at::Tensor& weights,
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

// ---------------------------------------------------------------- portable (plain C++)

template <typename T, int M>
void up_tile_portable(const T* x, const Rows& rows, int64_t r0, const T* w, const Geometry& g,
                      int64_t j, bool clamp, float limit, T* act) {
  const T* xr[M];
  for (int m = 0; m < M; ++m) xr[m] = x + rows.token[r0 + m] * g.up_pairs * g.pair;
  float acc[M][2][kLanes];
  tile_portable<T, M, 2>(xr, g.up_pairs, g.pair, w, acc);
  for (int m = 0; m < M; ++m) {
    T* a = act + (r0 + m) * g.ip + j * kLanes;
    for (int l = 0; l < kLanes; ++l) a[l] = static_cast<T>(silu_mul(acc[m][0][l], acc[m][1][l],
                                                                     clamp, limit));
  }
}

// Where phase 2 writes: the fp32 partial sums [T, d] and the output [T, d] in the model dtype
// (for fp32 both are the output).
template <typename T>
struct Sums {
  float* partial;
  T* out;
};

template <typename T, int M>
void down_tile_portable(const T* act, const Rows& rows, int64_t r0, const T* w,
                        const Geometry& g, int64_t b, Sums<T> sums) {
  constexpr int NB = kBlocksDown;
  const T* ar[M];
  for (int m = 0; m < M; ++m) ar[m] = act + (r0 + m) * g.ip;
  float acc[M][NB][kLanes];
  tile_portable<T, M, NB>(ar, g.down_pairs, g.pair, w, acc);
  for (int m = 0; m < M; ++m) {
    const int64_t row = rows.token[r0 + m] * g.d;
    float* part = sums.partial + row;
    T* o = sums.out + row;
    const float wt = rows.weight[r0 + m];
    const uint8_t order = rows.order[r0 + m];
    for (int n = 0; n < NB; ++n) {
      const int64_t c0 = (b + n) * kLanes, cols = std::min<int64_t>(kLanes, g.d - c0);
      if (cols <= 0) break;
      for (int64_t l = 0; l < cols; ++l) {
        const float v = wt * acc[m][n][l] + ((order & kFirst) ? 0.0f : part[c0 + l]);
        if (order & kLast) o[c0 + l] = static_cast<T>(v);
        else part[c0 + l] = v;
      }
    }
  }
}

// The most rows the brgemm path gathers per chunk (see the AVX512-BF16 section below).
constexpr int64_t kGatherRows = 256;

// ---------------------------------------------------------------- AVX512-BF16

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

template <int M>
void up_tile_bf16(const at::BFloat16* x, const Rows& rows, int64_t r0, const at::BFloat16* w,
                  const Geometry& g, int64_t j, bool clamp, float limit, at::BFloat16* act) {
  const at::BFloat16* xr[M];
  for (int m = 0; m < M; ++m) xr[m] = x + rows.token[r0 + m] * g.up_pairs * 2;
  __m512 acc[M][2];
  tile_bf16<M, 2>(xr, g.up_pairs, w, acc);
  for (int m = 0; m < M; ++m)
    swiglu_store(acc[m][0], acc[m][1], clamp, limit, act + (r0 + m) * g.ip + j * kLanes);
}

template <int M>
void down_tile_bf16(const at::BFloat16* act, const Rows& rows, int64_t r0,
                    const at::BFloat16* w, const Geometry& g, int64_t b,
                    Sums<at::BFloat16> sums) {
  constexpr int NB = kBlocksDown;
  const at::BFloat16* ar[M];
  for (int m = 0; m < M; ++m) ar[m] = act + (r0 + m) * g.ip;
  __m512 acc[M][NB];
  tile_bf16<M, NB>(ar, g.down_pairs, w, acc);
  for (int m = 0; m < M; ++m)
    down_store<NB>([&](int n) { return acc[m][n]; }, rows, r0 + m, g, b, sums);
}

// An expert with many rows, through brgemm (csrc/brgemm.h) on the same packed groups.
// Measured on an AMX Xeon (BENCHMARKS.md, "Intel Xeon: session 12"), the brgemm calls
// themselves ran at 1.1-1.9 TFLOP/s in 32-row blocks; what held a 2,048-token call to ~430
// GFLOP/s was around them: a [T*k, d] gathered copy of every row (32 MB of fresh pages per
// call at 2,048 tokens), each up call re-reading its A rows from that copy, and the per-call
// lookup. So the up GEMM gathers an expert's rows kGatherRows at a time into a per-thread
// buffer that stays in L2 and runs each gate/up group over all of them in one call (M up to
// kGatherRows), and the down GEMM walks 32-row blocks of the activation with the thread's
// output groups inside (the block's 32 x I activation stays in L1 across the groups).
// (kGatherRows is defined above the AVX512-BF16 section: run_experts reads it on every ISA.)

// Row blocks for brgemm calls over `rows` rows, at most `block` per call: full blocks, then
// the rest as a multiple of 32 and a last part under 32, so every call has one of a few row
// counts (each distinct shape is a ukernel generated once per thread).
template <typename F>
inline void row_blocks(int64_t rows, int64_t block, F&& f) {
  int64_t r = 0;
  for (; r + block <= rows; r += block) f(r, block);
  constexpr int64_t step = wideserve_brgemm::kBlockM;
  const int64_t rest = rows - r, tall = rest / step * step;
  if (tall) f(r, tall);
  if (rest > tall) f(r + tall, rest - tall);
}

// Gate/up groups [j_begin, j_end) of an expert whose rows are [r_begin, r_end) in sorted order:
// the rows gathered from x in chunks of kGatherRows into `buf` ([kGatherRows, 2 * up_pairs]),
// one brgemm per (chunk, group), SwiGLU from the fp32 result. `c`: kGatherRows x 32 floats.
void up_expert_brgemm(const at::BFloat16* x, const Rows& rows, int64_t r_begin, int64_t r_end,
                      const at::BFloat16* w_expert, const Geometry& g, int64_t j_begin,
                      int64_t j_end, bool clamp, float limit, at::BFloat16* act,
                      at::BFloat16* buf, float* c) {
  const int64_t kp = 2 * g.up_pairs, cols = 2 * kLanes;
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kGatherRows) {
    const int64_t n = std::min(kGatherRows, r_end - r0);
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(buf + i * kp, x + rows.token[r0 + i] * kp, kp * sizeof(at::BFloat16));
    for (int64_t j = j_begin; j < j_end; ++j) {
      const at::BFloat16* w = w_expert + j * g.up_group_size();
      row_blocks(n, kGatherRows, [&](int64_t r, int64_t m) {
        wideserve_brgemm::tile(m, cols, kp, kp, buf + r * kp, w, c + r * cols);
      });
      for (int64_t i = 0; i < n; ++i)
        swiglu_store(_mm512_loadu_ps(c + i * cols), _mm512_loadu_ps(c + i * cols + kLanes),
                     clamp, limit, act + (r0 + i) * g.ip + j * kLanes);
    }
  }
}

// Down groups [grp_begin, grp_end) (64 columns each) of an expert with many rows through
// brgemm, 32-row blocks outside, then the weighted sums as down_tile_bf16 makes them.
// `c`: kBlockM x 64 floats.
void down_expert_brgemm(const at::BFloat16* act, const Rows& rows, int64_t r_begin,
                        int64_t r_end, const at::BFloat16* w_expert, const Geometry& g,
                        int64_t grp_begin, int64_t grp_end, Sums<at::BFloat16> sums,
                        float* c) {
  constexpr int64_t cols = kBlocksDown * kLanes;
  for (int64_t r = r_begin; r < r_end; r += wideserve_brgemm::kBlockM) {
    const int64_t m = std::min(wideserve_brgemm::kBlockM, r_end - r);
    for (int64_t grp = grp_begin; grp < grp_end; ++grp) {
      wideserve_brgemm::tile(m, cols, g.ip, g.ip, act + r * g.ip,
                             w_expert + grp * g.down_group_size(), c);
      for (int64_t i = 0; i < m; ++i) {
        const float* ci = c + i * cols;
        down_store<kBlocksDown>([&](int n) { return _mm512_loadu_ps(ci + n * kLanes); }, rows,
                                r + i, g, grp * kBlocksDown, sums);
      }
    }
  }
}
#endif  // __AVX512BF16__

// ---------------------------------------------------------------- tile dispatch

template <typename T, int M>
void up_tile(bool fast, const T* x, const Rows& rows, int64_t r0, const T* w, const Geometry& g,
             int64_t j, bool clamp, float limit, T* act) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (fast) return up_tile_bf16<M>(x, rows, r0, w, g, j, clamp, limit, act);
  }
#endif
  up_tile_portable<T, M>(x, rows, r0, w, g, j, clamp, limit, act);
}

template <typename T, int M>
void down_tile(bool fast, const T* act, const Rows& rows, int64_t r0, const T* w,
               const Geometry& g, int64_t b, Sums<T> sums) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (fast) return down_tile_bf16<M>(act, rows, r0, w, g, b, sums);
  }
#endif
  down_tile_portable<T, M>(act, rows, r0, w, g, b, sums);
}

// The ranges a call reads, in the order an expert-major thread reads them: every active
// expert's gate/up weights, then every active expert's down weights.
template <typename T>
std::vector<wideserve_stream::Range> stream_plan(const T* w13, const T* w2, const Rows& rows,
                                                 int64_t e13, int64_t e2) {
  if (!wideserve_stream::active()) return {};
  std::vector<wideserve_stream::Range> plan;
  plan.reserve(2 * rows.active.size());
  for (const int64_t e : rows.active)
    plan.push_back({reinterpret_cast<const char*>(w13 + e * e13),
                    static_cast<int64_t>(e13 * sizeof(T))});
  for (const int64_t e : rows.active)
    plan.push_back({reinterpret_cast<const char*>(w2 + e * e2),
                    static_cast<int64_t>(e2 * sizeof(T))});
  return plan;
}

// `big` (bf16 fast path only, else 0: none): experts with at least that many rows run their
// GEMMs through brgemm (csrc/brgemm.h: AMX where present), the others through the
// micro-kernel tiles. The split of work between threads is the same for both.
template <typename T>
void run_experts(bool fast, const T* x, const T* w13, const T* w2, const Rows& rows,
                 const Geometry& g, bool clamp, float limit, T* act, Sums<T> sums,
                 int64_t big) {
  const int64_t e13 = g.up_groups * g.up_group_size();
  const int64_t e2 = g.down_groups * g.down_group_size();
  const int64_t active = static_cast<int64_t>(rows.active.size());
  int64_t chunk = 0;   // the most rows a gathered chunk holds (0: no expert on brgemm)
  for (const int64_t e : rows.active) {
    const int64_t n = rows.offsets[e + 1] - rows.offsets[e];
    if (big > 0 && n >= big) chunk = std::max(chunk, std::min(n, kGatherRows));
  }
  const bool any_big = chunk > 0;
  auto is_big = [&](int64_t e) {
    return any_big && rows.offsets[e + 1] - rows.offsets[e] >= big;
  };
  // Per-thread brgemm scratch, sized to this call and left uninitialised (a zero-filled
  // 256-row buffer per call cost more than a decode call's few brgemm rows).
  const int64_t gather = chunk * 2 * g.up_pairs;
  const int64_t scratch = any_big ? std::max(chunk * 2 * kLanes,
                                             wideserve_brgemm::kBlockM * kBlocksDown * kLanes)
                                  : 0;
  auto buffers = [&]() {
    return std::make_pair(std::unique_ptr<T[]>(new T[gather]),
                          std::unique_ptr<float[]>(new float[scratch]));
  };
  // Phase 1. Each thread takes a range of blocks j for every expert (experts outside, so its
  // weights stream in order, as they do at one thread), when there are blocks enough for
  // that; else (block j, expert) items, block-major. Either way a thread's rows do not depend
  // on the routing (the header says why).
  auto up_groups = [&](int64_t e, int64_t j_begin, int64_t j_end, T* buf, float* c) {
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (is_big(e))
        return up_expert_brgemm(x, rows, rows.offsets[e], rows.offsets[e + 1], w13 + e * e13,
                                g, j_begin, j_end, clamp, limit, act, buf, c);
    }
#endif
    for (int64_t j = j_begin; j < j_end; ++j) {
      const T* w = w13 + e * e13 + j * g.up_group_size();
      for (int64_t r = rows.offsets[e]; r < rows.offsets[e + 1]; r += kRowsUp) {
        with_rows<kRowsUp>(rows.offsets[e + 1] - r, [&](auto m) {
          up_tile<T, decltype(m)::value>(fast, x, rows, r, w, g, j, clamp, limit, act);
        });
      }
    }
  };
  const bool expert_major = g.up_groups >= 2 * at::get_num_threads();
  // Weight streaming (csrc/weight_stream.h): the experts' weights in the order the first
  // thread reads them, where every thread walks the experts in order; its place reported
  // per expert. Not in the block-major split, whose threads each read across experts.
  const wideserve_stream::Session stream(expert_major ? stream_plan(w13, w2, rows, e13, e2)
                                                      : std::vector<wideserve_stream::Range>());
  auto reached = [&](int64_t index) {
    if (stream.on() && at::get_thread_num() == 0) stream.at(index);
  };
  if (expert_major) {
    at::parallel_for(0, g.up_groups, 1, [&](int64_t begin, int64_t end) {
      const auto [buf, c] = buffers();
      for (int64_t i = 0; i < active; ++i) {
        reached(i);
        up_groups(rows.active[i], begin, end, buf.get(), c.get());
      }
      if (any_big) wideserve_brgemm::release();
    });
  } else {
    at::parallel_for(0, g.up_groups * active, 1, [&](int64_t begin, int64_t end) {
      const auto [buf, c] = buffers();
      for (int64_t item = begin; item < end; ++item) {
        const int64_t j = item / active;
        up_groups(rows.active[item % active], j, j + 1, buf.get(), c.get());
      }
      if (any_big) wideserve_brgemm::release();
    });
  }
  // Phase 2: down groups; each thread owns its columns of `out` for all rows. Within a
  // thread's range the expert loop is outside, so its weights stream in order.
  at::parallel_for(0, g.down_groups, 1, [&](int64_t begin, int64_t end) {
    const std::unique_ptr<float[]> c(new float[scratch]);
    for (int64_t i = 0; i < active; ++i) {
      const int64_t e = rows.active[i];
      reached(active + i);
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (is_big(e)) {
          down_expert_brgemm(act, rows, rows.offsets[e], rows.offsets[e + 1], w2 + e * e2, g,
                             begin, end, sums, c.get());
          continue;
        }
      }
#endif
      for (int64_t grp = begin; grp < end; ++grp) {
        const T* w = w2 + e * e2 + grp * g.down_group_size();
        for (int64_t r = rows.offsets[e]; r < rows.offsets[e + 1]; r += kRowsDown) {
          with_rows<kRowsDown>(rows.offsets[e + 1] - r, [&](auto m) {
            down_tile<T, decltype(m)::value>(fast, act, rows, r, w, g, grp * kBlocksDown,
                                             sums);
          });
        }
      }
    }
    if (any_big) wideserve_brgemm::release();
  });
}

at::Tensor moe_fused_experts(const at::Tensor& x_in, const at::Tensor& topk_ids,
                             const at::Tensor& topk_weights, const at::Tensor& w13,
                             const at::Tensor& w2, int64_t intermediate,
                             std::optional<double> limit, bool portable,
                             const std::optional<at::Tensor>& expert_map,
                             const std::optional<at::Tensor>& expert_load,
                             std::optional<int64_t> brgemm_min_rows) {
  TORCH_CHECK(x_in.dim() == 2, "moe_fused_experts: x must be [T, d]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x_in.size(0) &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "moe_fused_experts: topk_ids and topk_weights must both be [T, k]");
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "moe_fused_experts: bfloat16 or float32 only, got ", dtype);
  TORCH_CHECK(w13.scalar_type() == dtype && w2.scalar_type() == dtype,
              "moe_fused_experts: packed weights must have the dtype of x");
  const int64_t pair = dtype == at::kBFloat16 ? 2 : 1, d = x_in.size(1);
  const Geometry g = geometry(d, intermediate, pair);
  const int64_t experts = w13.size(0);
  TORCH_CHECK(w13.sizes() == at::IntArrayRef({experts, g.up_groups, g.up_pairs, 2, kLanes,
                                              pair}) &&
                  w2.sizes() == at::IntArrayRef({experts, g.down_groups, g.down_pairs,
                                                 kBlocksDown, kLanes, pair}),
              "moe_fused_experts: packed weights ", w13.sizes(), " / ", w2.sizes(),
              " do not match hidden ", d, ", intermediate ", intermediate,
              " (pack them with wideserve.kernels.moe.pack_experts)");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "moe_fused_experts: packed weights "
              "must be contiguous");
  at::Tensor x = x_in.contiguous();
  if (d % pair) x = at::constant_pad_nd(x, {0, 1});   // the last bf16 pair reads one past d
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor wts = topk_weights.to(at::kFloat).contiguous();
  const Rows rows = sort_rows(physical_ids(ids, expert_map), ids.size(1), wts, experts,
                              x_in.size(0));
  if (expert_load.has_value() && expert_load->defined()) {   // EPLB's counters, in place
    TORCH_CHECK(expert_load->dim() == 1 && expert_load->size(0) == experts &&
                    expert_load->scalar_type() == at::kLong && expert_load->is_contiguous(),
                "moe_fused_experts: expert_load must be a contiguous int64 [", experts, "]");
    int64_t* load = expert_load->data_ptr<int64_t>();
    for (int64_t e = 0; e < experts; ++e) load[e] += rows.offsets[e + 1] - rows.offsets[e];
  }
  // k == 0 leaves tokens without rows: their sum is the empty one
  if (rows.active.empty() || ids.size(1) == 0) return at::zeros({x_in.size(0), d},
                                                                x_in.options());
  at::Tensor out = at::empty({x_in.size(0), d}, x_in.options());
  at::Tensor act = at::empty({ids.numel(), g.ip}, x_in.options());
  const bool fast = !portable && bf16_fast_path_compiled();
  const bool clamp = limit.has_value();
  const float lim = clamp ? static_cast<float>(*limit) : 0.0f;
  if (dtype == at::kBFloat16) {
    // partial sums are needed only while a token has rows still to come
    at::Tensor partial = at::empty(ids.size(1) > 1 ? at::IntArrayRef({x_in.size(0), d})
                                                   : at::IntArrayRef({0}),
                                   x_in.options().dtype(at::kFloat));
    // experts with at least brgemm_min_rows rows run on brgemm (the kernel choice's
    // threshold, layers/experts.py); None: none do
    const int64_t big = brgemm_min_rows.has_value() ? std::max<int64_t>(*brgemm_min_rows, 1)
                                                    : 0;
    run_experts<at::BFloat16>(fast, x.data_ptr<at::BFloat16>(), w13.data_ptr<at::BFloat16>(),
                              w2.data_ptr<at::BFloat16>(), rows, g, clamp, lim,
                              act.data_ptr<at::BFloat16>(),
                              {partial.data_ptr<float>(), out.data_ptr<at::BFloat16>()},
                              fast ? big : 0);
  } else {
    run_experts<float>(false, x.data_ptr<float>(), w13.data_ptr<float>(), w2.data_ptr<float>(),
                       rows, g, clamp, lim, act.data_ptr<float>(),
                       {out.data_ptr<float>(), out.data_ptr<float>()}, 0);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("moe_fused_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, "
        "Tensor w2, int intermediate, float? limit=None, bool portable=False, "
        "Tensor? expert_map=None, Tensor(a!)? expert_load=None, int? brgemm_min_rows=None) "
        "-> Tensor");
  m.def("moe_fast_path_compiled() -> bool", &bf16_fast_path_compiled);
}

TORCH_LIBRARY_IMPL(wideserve, CPU, m) {
  m.impl("moe_fused_experts", &moe_fused_experts);
}
