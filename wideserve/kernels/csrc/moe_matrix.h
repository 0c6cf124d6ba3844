// Routed experts on the CPU's matrix units (csrc/moe.cpp calls these per expert): torch's
// brgemm (oneDNN, AMX where present) for bf16 experts with many rows, and AMX tiles driven
// directly (csrc/amx.h) for coded ones, the few rows of a decode step and a prefill's many.
// Included by csrc/moe.cpp only.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "brgemm.h"
#include "moe_common.h"

namespace wideserve_moe {

#ifdef __AVX512BF16__
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

// Rows [r0, r0 + n) of x gathered (in sorted order) into buf [n, kp].
inline void gather_rows(const at::BFloat16* x, const Rows& rows, int64_t r0, int64_t n,
                        int64_t kp, at::BFloat16* buf) {
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(buf + i * kp, x + rows.token[r0 + i] * kp, kp * sizeof(at::BFloat16));
}

// The SwiGLU of n rows' gate / up results c [n, 32] (block j) into act's rows r0...
inline void swiglu_rows(const float* c, int64_t n, int64_t r0, int64_t j, const Geometry& g,
                        bool clamp, float limit, at::BFloat16* act) {
  constexpr int64_t cols = 2 * kLanes;
  for (int64_t i = 0; i < n; ++i)
    swiglu_store(_mm512_loadu_ps(c + i * cols), _mm512_loadu_ps(c + i * cols + kLanes), clamp,
                 limit, act + (r0 + i) * g.ip + j * kLanes);
}

// The packed groups of one expert's matrix as they lie (`group(j)`: group j's bf16 panel).
struct Groups {
  const at::BFloat16* w;
  int64_t size;
  const at::BFloat16* operator()(int64_t j) const { return w + j * size; }
};

// Gate/up groups [j_begin, j_end) of an expert whose rows are [r_begin, r_end) in sorted order:
// the rows gathered from x in chunks of kGatherRows into `buf` ([kGatherRows, 2 * up_pairs]),
// one brgemm per (chunk, group), SwiGLU from the fp32 result. `c`: kGatherRows x 32 floats.
inline void up_expert_brgemm(const at::BFloat16* x, const Rows& rows, int64_t r_begin,
                             int64_t r_end, const Groups& group, const Geometry& g,
                             int64_t j_begin, int64_t j_end, bool clamp, float limit,
                             at::BFloat16* act, at::BFloat16* buf, float* c) {
  const int64_t kp = 2 * g.up_pairs, cols = 2 * kLanes;
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kGatherRows) {
    const int64_t n = std::min(kGatherRows, r_end - r0);
    gather_rows(x, rows, r0, n, kp, buf);
    for (int64_t j = j_begin; j < j_end; ++j) {
      const at::BFloat16* w = group(j);
      row_blocks(n, kGatherRows, [&](int64_t r, int64_t m) {
        wideserve_brgemm::tile(m, cols, kp, kp, buf + r * kp, w, c + r * cols);
      });
      swiglu_rows(c, n, r0, j, g, clamp, limit, act);
    }
  }
}

// Down groups [grp_begin, grp_end) (64 columns each) of an expert with many rows through
// brgemm, then the weighted sums as down_tile_bf16 makes them. `c`: kBlockM x 64 floats.
// 32-row blocks outside: the block's activation stays in L1 across the groups.
inline void down_expert_brgemm(const at::BFloat16* act, const Rows& rows, int64_t r_begin,
                               int64_t r_end, const Groups& group, const Geometry& g,
                               int64_t grp_begin, int64_t grp_end, Sums<at::BFloat16> sums,
                               float* c) {
  constexpr int64_t cols = kBlocksDown * kLanes;
  auto block = [&](int64_t r, int64_t grp, const at::BFloat16* w) {
    const int64_t m = std::min(wideserve_brgemm::kBlockM, r_end - r);
    wideserve_brgemm::tile(m, cols, g.ip, g.ip, act + r * g.ip, w, c);
    for (int64_t i = 0; i < m; ++i) {
      const float* ci = c + i * cols;
      down_store<kBlocksDown>([&](int n) { return _mm512_loadu_ps(ci + n * kLanes); }, rows,
                              r + i, g, grp * kBlocksDown, sums);
    }
  };
  for (int64_t r = r_begin; r < r_end; r += wideserve_brgemm::kBlockM)
    for (int64_t grp = grp_begin; grp < grp_end; ++grp) block(r, grp, group(grp));
}

// ---- AMX tiles driven directly, for experts with few rows (a decode step's 1-16) on coded
// weights (csrc/moe_lossless.h): the thread's tiles configured once per row count
// (Tiles::use), each group one run of tile steps whose B is decoded just before its loads.
// Needs K = d and I (padded) multiples of 32 (moe_fused_experts_lossless checks); every output
// row depends on its own input row only, as with brgemm.
#ifdef WIDESERVE_AMX

// Gate/up groups [j_begin, j_end) of an expert whose rows are [r_begin, r_end): 16 rows at a
// time gathered into `buf` ([16, d]), SwiGLU from the fp32 tiles. `c`: 16 x 32 floats.
// `steps_of(j)`: group j's B operand step by step (DecodedSteps on a coded group).
template <typename StepsOf>
void up_expert_amx(const at::BFloat16* x, const Rows& rows, int64_t r_begin,
                   int64_t r_end, StepsOf&& steps_of, const Geometry& g,
                   int64_t j_begin, int64_t j_end, bool clamp, float limit,
                   at::BFloat16* act, at::BFloat16* buf, float* c,
                   wideserve_amx::Tiles& tiles) {
  const int64_t kp = 2 * g.up_pairs, steps = g.up_pairs / wideserve_amx::kPairs;
  constexpr int64_t cols = 2 * kLanes;
  for (int64_t r0 = r_begin; r0 < r_end; r0 += wideserve_amx::kRows) {
    const int64_t n = std::min<int64_t>(wideserve_amx::kRows, r_end - r0);
    gather_rows(x, rows, r0, n, kp, buf);
    tiles.use(static_cast<int>(n));
    for (int64_t j = j_begin; j < j_end; ++j) {
      wideserve_amx::blocks<2>(buf, kp, steps, steps_of(j), c, cols);
      swiglu_rows(c, n, r0, j, g, clamp, limit, act);
    }
  }
}

// Down groups [grp_begin, grp_end) of an expert with rows [r_begin, r_end): the activation's
// rows read in place, 16 at a time. `c`: 16 x 64 floats.
template <typename StepsOf>
void down_expert_amx(const at::BFloat16* act, const Rows& rows, int64_t r_begin,
                     int64_t r_end, StepsOf&& steps_of, const Geometry& g,
                     int64_t grp_begin, int64_t grp_end, Sums<at::BFloat16> sums,
                     float* c, wideserve_amx::Tiles& tiles) {
  constexpr int64_t cols = kBlocksDown * kLanes;
  const int64_t steps = g.down_pairs / wideserve_amx::kPairs;
  for (int64_t r = r_begin; r < r_end; r += wideserve_amx::kRows) {
    const int64_t m = std::min<int64_t>(wideserve_amx::kRows, r_end - r);
    tiles.use(static_cast<int>(m));
    for (int64_t grp = grp_begin; grp < grp_end; ++grp) {
      wideserve_amx::blocks<kBlocksDown>(act + r * g.ip, g.ip, steps, steps_of(grp), c,
                                                cols);
      for (int64_t i = 0; i < m; ++i) {
        const float* ci = c + i * cols;
        down_store<kBlocksDown>([&](int n) { return _mm512_loadu_ps(ci + n * kLanes); }, rows,
                                r + i, g, grp * kBlocksDown, sums);
      }
    }
  }
}

// ---- Coded experts with many rows (a prefill's) on AMX tiles driven directly: each group
// decoded once (decode_group, csrc/moe_lossless.h) into an aligned buffer, then every row of
// the expert passes over it on 2 x 2 tiles (32 rows x 32 columns of C), the K range in chunks
// of kTileSteps steps so that a chunk of the decoded group (kTileSteps x 2 KB = 32 KB) stays
// in L1 while the 32-row blocks pass; C is carried between chunks in fp32, so the sums equal
// one pass over K (and the outputs brgemm's on the bf16 packs, bit for bit). Brgemm over each
// decoded group, the first design, ran a 2,048-token call ~25% slower (BENCHMARKS.md,
// "Lossless 12-bit expert weights"); on the bf16 packs this loop measured within noise of
// brgemm, which the kernel choice keeps there.
constexpr int64_t kTileSteps = 16;

// c [n, 16 NB] (ldc floats) = a [n, K] (lda elements) x a group of NB blocks at w (its bf16
// panel), K = 32 * steps: pairs of blocks over 2 x 2 tiles, a last block of under 17 rows on
// the one-A layout over the whole K.
template <int NB>
void tile_rows(const at::BFloat16* a, int64_t lda, int64_t n, int64_t steps,
               const at::BFloat16* w, float* c, int64_t ldc, wideserve_amx::Tiles& tiles) {
  constexpr int64_t pair_rows = 2 * wideserve_amx::kRows;
  const int64_t full = n / pair_rows * pair_rows;
  const int64_t tall = n - full > wideserve_amx::kRows ? n : full;   // rows on 2 x 2 tiles
  for (int64_t s0 = 0; s0 < steps; s0 += kTileSteps) {
    const int64_t s1 = std::min(steps, s0 + kTileSteps);
    for (int64_t h = 0; h < NB / 2; ++h) {
      for (int64_t r = 0; r < tall; r += pair_rows) {
        tiles.use_pair(static_cast<int>(std::min(pair_rows, tall - r) - wideserve_amx::kRows));
        wideserve_amx::pair_steps<NB>(a + r * lda, lda, s0, s1, w + h * 4 * kLanes,
                                      c + r * ldc + h * 2 * kLanes, ldc, s0 > 0);
      }
    }
  }
  if (tall < n) {
    tiles.use(static_cast<int>(n - tall));
    constexpr int64_t step_values = wideserve_amx::kPairs * NB * kLanes * 2;
    wideserve_amx::blocks<NB>(a + tall * lda, lda, steps,
                              [&](int64_t s) { return w + s * step_values; },
                              c + tall * ldc, ldc);
  }
}

// Gate/up groups [j_begin, j_end) of an expert with many rows: up to kGatherRows rows
// gathered into `buf` (64-byte aligned), then group by group (`group(j)`: its bf16 panel,
// a coded group decoded once) over all of them, SwiGLU from `c` ([kGatherRows, 32] floats).
template <typename GroupOf>
void up_expert_tiles(const at::BFloat16* x, const Rows& rows, int64_t r_begin, int64_t r_end,
                     GroupOf&& group, const Geometry& g, int64_t j_begin, int64_t j_end,
                     bool clamp, float limit, at::BFloat16* act, at::BFloat16* buf, float* c,
                     wideserve_amx::Tiles& tiles) {
  const int64_t kp = 2 * g.up_pairs, steps = g.up_pairs / wideserve_amx::kPairs;
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kGatherRows) {
    const int64_t n = std::min(kGatherRows, r_end - r0);
    gather_rows(x, rows, r0, n, kp, buf);
    for (int64_t j = j_begin; j < j_end; ++j) {
      tile_rows<2>(buf, kp, n, steps, group(j), c, 2 * kLanes, tiles);
      swiglu_rows(c, n, r0, j, g, clamp, limit, act);
    }
  }
}

// Down groups [grp_begin, grp_end) of an expert with many rows: the activation's rows read
// in place, kGatherRows at a time, group by group; `c`: [kGatherRows, 64] floats.
template <typename GroupOf>
void down_expert_tiles(const at::BFloat16* act, const Rows& rows, int64_t r_begin,
                       int64_t r_end, GroupOf&& group, const Geometry& g, int64_t grp_begin,
                       int64_t grp_end, Sums<at::BFloat16> sums, float* c,
                       wideserve_amx::Tiles& tiles) {
  constexpr int64_t cols = kBlocksDown * kLanes;
  const int64_t steps = g.down_pairs / wideserve_amx::kPairs;
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kGatherRows) {
    const int64_t n = std::min(kGatherRows, r_end - r0);
    for (int64_t grp = grp_begin; grp < grp_end; ++grp) {
      tile_rows<kBlocksDown>(act + r0 * g.ip, g.ip, n, steps, group(grp), c, cols, tiles);
      for (int64_t i = 0; i < n; ++i) {
        const float* ci = c + i * cols;
        down_store<kBlocksDown>([&](int b) { return _mm512_loadu_ps(ci + b * kLanes); }, rows,
                                r0 + i, g, grp * kBlocksDown, sums);
      }
    }
  }
}
#endif  // WIDESERVE_AMX
#endif  // __AVX512BF16__

}  // namespace wideserve_moe
