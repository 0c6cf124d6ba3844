// Fused routed experts on the CPU: one call per MoE layer (docs/cpu_kernels.md, docs/moe.md).
//
//   out[t] = sum_j  w[t, j] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),   e = ids[t, j]
//
// The T*k (token, pick) rows are counting-sorted by expert here. Where every expert runs on
// the micro-kernel and the call has experts enough (decode sizes), whole experts go to the
// threads, each expert's two GEMMs one after the other (csrc/moe_by_expert.h, the same sums
// bit for bit); otherwise the column schedule, in two phases:
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
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "amx.h"
#include "brgemm.h"
#include "gemm.h"
#include "moe_by_expert.h"
#include "moe_common.h"
#include "moe_lossless.h"
#include "moe_matrix.h"
#include "moe_tiles.h"
#include "weight_stream.h"

namespace {

using namespace wideserve_gemm;
using namespace wideserve_moe;
using wideserve_amx::Tiles;

// The ranges a call reads, in the order an expert-major thread reads them: every active
// expert's gate/up weights, then every active expert's down weights (expert e's at
// w13 + e * bytes13 and w2 + e * bytes2: the bf16 packs, or the coded bytes).
inline std::vector<wideserve_stream::Range> stream_plan(const void* w13, int64_t bytes13,
                                                        const void* w2, int64_t bytes2,
                                                        const Rows& rows) {
  if (!wideserve_stream::active()) return {};
  std::vector<wideserve_stream::Range> plan;
  plan.reserve(2 * rows.active.size());
  for (const int64_t e : rows.active)
    plan.push_back({static_cast<const char*>(w13) + e * bytes13, bytes13});
  for (const int64_t e : rows.active)
    plan.push_back({static_cast<const char*>(w2) + e * bytes2, bytes2});
  return plan;
}

// The weight group a thread multiplies after group j of active expert i, its range of groups
// being [begin, end) of every expert (`w`: the packs, `per_expert` / `size`: an expert's and
// a group's elements): the next of its range, else the first of the next active expert's
// range, else none.
template <typename T>
const T* next_group(const T* w, int64_t per_expert, int64_t size, const Rows& rows, int64_t i,
                    int64_t j, int64_t begin, int64_t end) {
  const int64_t active = static_cast<int64_t>(rows.active.size());
  if (j + 1 < end) return w + rows.active[i] * per_expert + (j + 1) * size;
  return i + 1 < active ? w + rows.active[i + 1] * per_expert + begin * size : nullptr;
}

enum Kernel : int64_t { kMicro = 0, kBrgemm = 1, kAmx = 2, kTiles = 3 };

// Per-thread scratch of a call, left uninitialised (a zero-filled 256-row buffer per call
// cost more than a decode call's few brgemm rows): gathered rows, fp32 results, and for coded
// weights (csrc/moe_lossless.h) two decoded steps and a decoded group.
template <typename T>
struct Scratch {
  Aligned<T> buf;
  Aligned<float> c;
  Aligned<at::BFloat16> steps, group;
};

#ifndef __AVX512BF16__
struct Lossless {};
#endif

// `big` (bf16 fast path only, else 0: none): experts with at least that many rows run their
// GEMMs through brgemm (csrc/brgemm.h: AMX where present), the others through the
// micro-kernel tiles. `coded` (bf16 on AMX only): the weights in the lossless 12-bit form
// (csrc/moe_lossless.h) instead of w13 / w2, experts of up to 16 rows on AMX tiles decoding
// step by step, the others on AMX tiles over each group decoded once. The split of work between
// threads is the same for every kernel.
template <typename T>
void run_experts(bool fast, const T* x, const T* w13, const T* w2, const Rows& rows,
                 const Geometry& g, bool clamp, float limit, T* act, Sums<T> sums,
                 int64_t big, const Lossless* coded = nullptr) {
  const int64_t e13 = g.up_groups * g.up_group_size();
  const int64_t e2 = g.down_groups * g.down_group_size();
  const int64_t active = static_cast<int64_t>(rows.active.size());
  std::vector<Kernel> kernel(active, kMicro);
  int64_t chunk = 0;   // the most rows a gathered chunk (brgemm or whole-group tiles) holds
  bool any_big = false, any_amx = false, any_tiles = false;
  for (int64_t i = 0; i < active && fast; ++i) {
    const int64_t e = rows.active[i], n = rows.offsets[e + 1] - rows.offsets[e];
    kernel[i] = coded ? (n <= wideserve_amx::kRows ? kAmx : kTiles)
                      : big > 0 && n >= big ? kBrgemm : kMicro;
    if (kernel[i] == kBrgemm || kernel[i] == kTiles)
      chunk = std::max(chunk, std::min(n, kGatherRows));
    any_big |= kernel[i] == kBrgemm;
    any_amx |= kernel[i] == kAmx || kernel[i] == kTiles;
    any_tiles |= kernel[i] == kTiles;
  }
#ifdef WIDESERVE_AMX
  constexpr int64_t amx_rows = wideserve_amx::kRows;
#else
  constexpr int64_t amx_rows = 0;
#endif
  const int64_t gather = std::max(chunk, any_amx ? amx_rows : 0) * 2 * g.up_pairs;
  const int64_t scratch = any_big || any_amx
      ? std::max({chunk * (any_tiles ? kBlocksDown : 2) * kLanes,
                  wideserve_brgemm::kBlockM * kBlocksDown * kLanes,
                  amx_rows * kBlocksDown * kLanes})
      : 0;
  // coded: two decoded steps of a down group (the widest), one whole decoded group
  const int64_t steps = coded ? 2 * kStepChunksPerBlock * kBlocksDown * kChunkValues : 0;
  const int64_t group = coded ? std::max(g.up_group_size(), g.down_group_size()) : 0;
  auto buffers = [&]() {
    return Scratch<T>{aligned_buffer<T>(gather), aligned_buffer<float>(scratch),
                      aligned_buffer<at::BFloat16>(steps), aligned_buffer<at::BFloat16>(group)};
  };
  // Phase 1. Each thread takes a range of blocks j for every expert (experts outside, so its
  // weights stream in order, as they do at one thread), when there are blocks enough for
  // that; else (block j, expert) items, block-major. Either way a thread's rows do not depend
  // on the routing (the header says why).
  auto up_groups = [&](int64_t i, int64_t j_begin, int64_t j_end, Scratch<T>& sc,
                       Tiles& tiles) {
    const int64_t e = rows.active[i];
    T* buf = sc.buf.get();
    float* c = sc.c.get();
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      const int64_t r0 = rows.offsets[e], r1 = rows.offsets[e + 1];
#ifdef WIDESERVE_AMX
      if (kernel[i] == kAmx && coded) {
        auto steps_of = [&](int64_t j) {
          return DecodedSteps(coded->w13, e, j, sc.steps.get());
        };
        return up_expert_amx(x, rows, r0, r1, steps_of, g, j_begin, j_end, clamp, limit, act,
                             buf, c, tiles);
      }
      if (kernel[i] == kTiles && coded) {
        auto group_of = [&](int64_t j) {
          return decode_group(coded->w13, e, j, sc.group.get());
        };
        return up_expert_tiles(x, rows, r0, r1, group_of, g, j_begin, j_end, clamp, limit,
                               act, buf, c, tiles);
      }
#endif
      if (kernel[i] == kBrgemm) {
        tiles.release();
        return up_expert_brgemm(x, rows, r0, r1, Groups{w13 + e * e13, g.up_group_size()}, g,
                                j_begin, j_end, clamp, limit, act, buf, c);
      }
    }
#endif
    for (int64_t j = j_begin; j < j_end; ++j) {
      const T* w = w13 + e * e13 + j * g.up_group_size();
      // streamed ahead by the first pass over the group, the one that reads it from memory
      const T* next = next_group(w13, e13, g.up_group_size(), rows, i, j, j_begin, j_end);
      group_tiles<kRowsUp, kRowsUpOnePass>(
          rows.offsets[e], rows.offsets[e + 1], [&](auto m, int64_t r, bool first) {
            up_tile<T, decltype(m)::value>(fast, x, rows, r, w, g, j, clamp, limit, act,
                                           first ? next : nullptr);
          });
    }
  };
  const bool expert_major = g.up_groups >= 2 * at::get_num_threads();
  // Weight streaming (csrc/weight_stream.h): the experts' weights (coded: their coded bytes;
  // the few exceptions are left to the caches) in the order the first thread reads them,
  // where every thread walks the experts in order; its place reported per expert. Not in
  // the block-major split, whose threads each read across experts.
  std::vector<wideserve_stream::Range> plan;
  if (expert_major) {
#ifdef __AVX512BF16__
    if (coded)
      plan = stream_plan(coded->w13.data, coded->w13.groups * coded->w13.group_bytes,
                         coded->w2.data, coded->w2.groups * coded->w2.group_bytes, rows);
#endif
    if (!coded)
      plan = stream_plan(w13, e13 * static_cast<int64_t>(sizeof(T)), w2,
                         e2 * static_cast<int64_t>(sizeof(T)), rows);
  }
  const wideserve_stream::Session stream(std::move(plan));
  auto reached = [&](int64_t index) {
    if (stream.on() && at::get_thread_num() == 0) stream.at(index);
  };
  if (expert_major) {
    at::parallel_for(0, g.up_groups, 1, [&](int64_t begin, int64_t end) {
      Scratch<T> sc = buffers();
      Tiles tiles;
      for (int64_t i = 0; i < active; ++i) {
        reached(i);
        up_groups(i, begin, end, sc, tiles);
      }
      if (any_big) wideserve_brgemm::release();
    });
  } else {
    at::parallel_for(0, g.up_groups * active, 1, [&](int64_t begin, int64_t end) {
      Scratch<T> sc = buffers();
      Tiles tiles;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t j = item / active;
        up_groups(item % active, j, j + 1, sc, tiles);
      }
      if (any_big) wideserve_brgemm::release();
    });
  }
  // Phase 2: down groups; each thread owns its columns of `out` for all rows. Within a
  // thread's range the expert loop is outside, so its weights stream in order.
  at::parallel_for(0, g.down_groups, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> sc = buffers();
    float* c = sc.c.get();
    Tiles tiles;
    for (int64_t i = 0; i < active; ++i) {
      const int64_t e = rows.active[i];
      reached(active + i);
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        const int64_t r0 = rows.offsets[e], r1 = rows.offsets[e + 1];
#ifdef WIDESERVE_AMX
        if (kernel[i] == kAmx && coded) {
          auto steps_of = [&](int64_t grp) {
            return DecodedSteps(coded->w2, e, grp, sc.steps.get());
          };
          down_expert_amx(act, rows, r0, r1, steps_of, g, begin, end, sums, c, tiles);
          continue;
        }
        if (kernel[i] == kTiles && coded) {
          auto group_of = [&](int64_t grp) {
            return decode_group(coded->w2, e, grp, sc.group.get());
          };
          down_expert_tiles(act, rows, r0, r1, group_of, g, begin, end, sums, c, tiles);
          continue;
        }
#endif
        if (kernel[i] == kBrgemm) {
          tiles.release();
          down_expert_brgemm(act, rows, r0, r1, Groups{w2 + e * e2, g.down_group_size()}, g,
                             begin, end, sums, c);
          continue;
        }
      }
#endif
      for (int64_t grp = begin; grp < end; ++grp) {
        const T* w = w2 + e * e2 + grp * g.down_group_size();
        const T* next = next_group(w2, e2, g.down_group_size(), rows, i, grp, begin, end);
        group_tiles<kRowsDown>(rows.offsets[e], rows.offsets[e + 1], [&](auto m, int64_t r,
                                                                        bool first) {
          down_tile<T, decltype(m)::value>(fast, act, rows, r, w, g, grp * kBlocksDown, sums,
                                           first ? next : nullptr);
        });
      }
    }
    if (any_big) wideserve_brgemm::release();
  });
}

// What both ops check and build before the experts run: the sorted rows (EPLB's counters
// updated), the output and the activation scratch; `run(x, rows, act, out, partial)` then
// fills `out` (never called when no row has an expert: the output is zeros).
template <typename Run>
at::Tensor fused_call(const char* name, const at::Tensor& x_in, const at::Tensor& topk_ids,
                      const at::Tensor& topk_weights, int64_t experts, const Geometry& g,
                      const std::optional<at::Tensor>& expert_map,
                      const std::optional<at::Tensor>& expert_load, Run&& run) {
  const int64_t d = x_in.size(1);
  at::Tensor x = x_in.contiguous();
  if (d % g.pair) x = at::constant_pad_nd(x, {0, 1});   // the last bf16 pair reads one past d
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor wts = topk_weights.to(at::kFloat).contiguous();
  const Rows rows = sort_rows(physical_ids(ids, expert_map), ids.size(1), wts, experts,
                              x_in.size(0));
  if (expert_load.has_value() && expert_load->defined()) {   // EPLB's counters, in place
    TORCH_CHECK(expert_load->dim() == 1 && expert_load->size(0) == experts &&
                    expert_load->scalar_type() == at::kLong && expert_load->is_contiguous(),
                name, ": expert_load must be a contiguous int64 [", experts, "]");
    int64_t* load = expert_load->data_ptr<int64_t>();
    for (int64_t e = 0; e < experts; ++e) load[e] += rows.offsets[e + 1] - rows.offsets[e];
  }
  // k == 0 leaves tokens without rows: their sum is the empty one
  if (rows.active.empty() || ids.size(1) == 0) return at::zeros({x_in.size(0), d},
                                                                x_in.options());
  at::Tensor out = at::empty({x_in.size(0), d}, x_in.options());
  at::Tensor act = at::empty({ids.numel(), g.ip}, x_in.options());
  // bf16: partial sums are needed only while a token has rows still to come
  at::Tensor partial = at::empty(
      x_in.scalar_type() == at::kBFloat16 && ids.size(1) > 1 ? at::IntArrayRef({x_in.size(0), d})
                                                             : at::IntArrayRef({0}),
      x_in.options().dtype(at::kFloat));
  run(x, rows, act, out, partial);
  return out;
}

void check_routing(const char* name, const at::Tensor& x, const at::Tensor& topk_ids,
                   const at::Tensor& topk_weights) {
  TORCH_CHECK(x.dim() == 2, name, ": x must be [T, d]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) &&
                  topk_weights.sizes() == topk_ids.sizes(),
              name, ": topk_ids and topk_weights must both be [T, k]");
}

at::Tensor moe_fused_experts(const at::Tensor& x_in, const at::Tensor& topk_ids,
                             const at::Tensor& topk_weights, const at::Tensor& w13,
                             const at::Tensor& w2, int64_t intermediate,
                             std::optional<double> limit, bool portable,
                             const std::optional<at::Tensor>& expert_map,
                             const std::optional<at::Tensor>& expert_load,
                             std::optional<int64_t> brgemm_min_rows,
                             std::optional<c10::string_view> schedule_name) {
  check_routing("moe_fused_experts", x_in, topk_ids, topk_weights);
  const Schedule schedule = parse_schedule(schedule_name);
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
  const bool fast = !portable && bf16_fast_path_compiled();
  const bool clamp = limit.has_value();
  const float lim = clamp ? static_cast<float>(*limit) : 0.0f;
  return fused_call("moe_fused_experts", x_in, topk_ids, topk_weights, experts, g, expert_map,
                    expert_load, [&](const at::Tensor& x, const Rows& rows, at::Tensor& act,
                                     at::Tensor& out, at::Tensor& partial) {
    if (dtype == at::kBFloat16) {
      // experts with at least brgemm_min_rows rows run on brgemm (the kernel choice's
      // threshold, layers/experts.py); None: none do
      const int64_t big = brgemm_min_rows.has_value()
                              ? std::max<int64_t>(*brgemm_min_rows, 1) : 0;
      int64_t most = 0;
      for (const int64_t e : rows.active)
        most = std::max(most, rows.offsets[e + 1] - rows.offsets[e]);
      const bool micro = fast && (big == 0 || most < big);
      if (use_by_expert(schedule, micro, rows, g)) {
#ifdef __AVX512BF16__
        run_by_expert(x.data_ptr<at::BFloat16>(), w13.data_ptr<at::BFloat16>(),
                      w2.data_ptr<at::BFloat16>(), rows, most, g, clamp, lim,
                      act.data_ptr<at::BFloat16>(),
                      {partial.data_ptr<float>(), out.data_ptr<at::BFloat16>()});
#endif
        return;
      }
      run_experts<at::BFloat16>(fast, x.data_ptr<at::BFloat16>(),
                                w13.data_ptr<at::BFloat16>(), w2.data_ptr<at::BFloat16>(),
                                rows, g, clamp, lim, act.data_ptr<at::BFloat16>(),
                                {partial.data_ptr<float>(), out.data_ptr<at::BFloat16>()},
                                fast ? big : 0);
    } else {
      TORCH_CHECK(schedule != Schedule::kExperts, "moe_fused_experts: schedule='experts' is "
                  "for bf16 inputs only");
      run_experts<float>(false, x.data_ptr<float>(), w13.data_ptr<float>(),
                         w2.data_ptr<float>(), rows, g, clamp, lim, act.data_ptr<float>(),
                         {out.data_ptr<float>(), out.data_ptr<float>()}, 0);
    }
  });
}

bool lossless_available() {
#ifdef WIDESERVE_AMX
  return wideserve_amx::available();
#else
  return false;
#endif
}

#ifdef WIDESERVE_AMX
// One coded matrix's tensors checked against the geometry: data [E, groups, group bytes]
// uint8, exceptions [n] int16 (bf16 bits), starts [E * groups] int64 (each group's first
// exception, within n), table [16] uint8.
LosslessMatrix coded_matrix(const char* which, const at::Tensor& data,
                            const at::Tensor& exceptions, const at::Tensor& starts,
                            const at::Tensor& table, int64_t experts, int64_t groups,
                            int64_t values, int64_t blocks) {
  const int64_t bytes = values / kChunkValues * kChunkBytes;
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() &&
                  data.sizes() == at::IntArrayRef({experts, groups, bytes}),
              "moe_fused_experts_lossless: ", which, " must be a contiguous uint8 [", experts,
              ", ", groups, ", ", bytes, "], got ", data.sizes(),
              " (code it with wideserve.kernels.lossless.encode_experts)");
  TORCH_CHECK(exceptions.scalar_type() == at::kShort && exceptions.dim() == 1 &&
                  exceptions.is_contiguous() && starts.scalar_type() == at::kLong &&
                  starts.is_contiguous() && starts.numel() == experts * groups &&
                  table.scalar_type() == at::kByte && table.numel() == 16 &&
                  table.is_contiguous(),
              "moe_fused_experts_lossless: ", which, "'s exceptions (int16), starts (int64 [",
              experts * groups, "]) or table (uint8 [16]) malformed");
  const int64_t* st = starts.data_ptr<int64_t>();
  for (int64_t i = 0; i < starts.numel(); ++i)
    TORCH_CHECK(st[i] >= 0 && st[i] <= exceptions.numel(), "moe_fused_experts_lossless: ",
                which, " starts[", i, "] = ", st[i], " outside [0, ", exceptions.numel(), "]");
  LosslessMatrix m;
  m.data = data.data_ptr<uint8_t>();
  m.exceptions = reinterpret_cast<const uint16_t*>(exceptions.data_ptr<int16_t>());
  m.starts = st;
  m.groups = groups;
  m.group_bytes = bytes;
  m.step_chunks = kStepChunksPerBlock * blocks;
  m.table = _mm512_broadcast_i32x4(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(table.data_ptr<uint8_t>())));
  return m;
}
#endif

// Routed experts on lossless 12-bit weights (csrc/moe_lossless.h): the products equal
// moe_fused_experts' on the bf16 packs with brgemm for every expert, bit for bit.
at::Tensor moe_fused_experts_lossless(
    const at::Tensor& x_in, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const at::Tensor& w13, const at::Tensor& w13_exceptions, const at::Tensor& w13_starts,
    const at::Tensor& w13_table, const at::Tensor& w2, const at::Tensor& w2_exceptions,
    const at::Tensor& w2_starts, const at::Tensor& w2_table, int64_t intermediate,
    std::optional<double> limit, const std::optional<at::Tensor>& expert_map,
    const std::optional<at::Tensor>& expert_load) {
  check_routing("moe_fused_experts_lossless", x_in, topk_ids, topk_weights);
  TORCH_CHECK(lossless_available(), "moe_fused_experts_lossless: needs a CPU with AMX-BF16 "
              "and this extension's AVX512-BF16 build (moe_lossless_available() is false)");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16,
              "moe_fused_experts_lossless: bfloat16 only, got ", x_in.scalar_type());
  const Geometry g = geometry(x_in.size(1), intermediate, 2);
  TORCH_CHECK(g.up_pairs % wideserve_amx::kPairs == 0 && g.down_pairs % wideserve_amx::kPairs == 0,
              "moe_fused_experts_lossless: hidden ", g.d, " and intermediate (padded) ", g.ip,
              " must be multiples of 32");
#ifdef WIDESERVE_AMX
  const int64_t experts = w13.size(0);
  Lossless coded{coded_matrix("w13", w13, w13_exceptions, w13_starts, w13_table, experts,
                              g.up_groups, g.up_group_size(), 2),
                 coded_matrix("w2", w2, w2_exceptions, w2_starts, w2_table, experts,
                              g.down_groups, g.down_group_size(), kBlocksDown)};
  const bool clamp = limit.has_value();
  const float lim = clamp ? static_cast<float>(*limit) : 0.0f;
  return fused_call("moe_fused_experts_lossless", x_in, topk_ids, topk_weights, experts, g,
                    expert_map, expert_load,
                    [&](const at::Tensor& x, const Rows& rows, at::Tensor& act,
                        at::Tensor& out, at::Tensor& partial) {
    run_experts<at::BFloat16>(true, x.data_ptr<at::BFloat16>(), nullptr, nullptr, rows, g,
                              clamp, lim, act.data_ptr<at::BFloat16>(),
                              {partial.data_ptr<float>(), out.data_ptr<at::BFloat16>()}, 0,
                              &coded);
  });
#else
  return at::Tensor();   // unreachable: lossless_available() is false
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("moe_fused_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, "
        "Tensor w2, int intermediate, float? limit=None, bool portable=False, "
        "Tensor? expert_map=None, Tensor(a!)? expert_load=None, int? brgemm_min_rows=None, "
        "str? schedule=None) -> Tensor");
  m.def("moe_fused_experts_lossless(Tensor x, Tensor topk_ids, Tensor topk_weights, "
        "Tensor w13, Tensor w13_exceptions, Tensor w13_starts, Tensor w13_table, Tensor w2, "
        "Tensor w2_exceptions, Tensor w2_starts, Tensor w2_table, int intermediate, "
        "float? limit=None, Tensor? expert_map=None, Tensor(a!)? expert_load=None) -> Tensor");
  m.def("moe_fast_path_compiled() -> bool", &bf16_fast_path_compiled);
  m.def("moe_lossless_available() -> bool", &lossless_available);
}

TORCH_LIBRARY_IMPL(wideserve, CPU, m) {
  m.impl("moe_fused_experts", &moe_fused_experts);
  m.impl("moe_fused_experts_lossless", &moe_fused_experts_lossless);
}
