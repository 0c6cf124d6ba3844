// The fused experts op's register tiles (csrc/moe.cpp, csrc/moe_by_expert.h): one weight
// group of one expert times up to kRowsUp / kRowsDown of its rows, in plain C++ (any CPU, and
// fp32) and on the AVX512-BF16 micro-kernel (csrc/gemm.h), and the loop over a group's
// passes. Included by csrc/moe.cpp only.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "gemm.h"
#include "moe_common.h"

namespace wideserve_moe {

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


// ---------------------------------------------------------------- AVX512-BF16

#ifdef __AVX512BF16__

// `next`: the group this thread multiplies after this one, streamed ahead by tiles of
// kStreamRowsUp rows and more (nullptr: none).
template <int M>
void up_tile_bf16(const at::BFloat16* x, const Rows& rows, int64_t r0, const at::BFloat16* w,
                  const Geometry& g, int64_t j, bool clamp, float limit, at::BFloat16* act,
                  const at::BFloat16* next) {
  const at::BFloat16* xr[M];
  for (int m = 0; m < M; ++m) xr[m] = x + rows.token[r0 + m] * g.up_pairs * 2;
  __m512 acc[M][2];
  if constexpr (M >= kStreamRowsUp) {
    tile_bf16<M, 2, Ahead::kStream>(xr, g.up_pairs, w, acc, next);
  } else {
    tile_bf16<M, 2>(xr, g.up_pairs, w, acc);
  }
  for (int m = 0; m < M; ++m)
    swiglu_store(acc[m][0], acc[m][1], clamp, limit, act + (r0 + m) * g.ip + j * kLanes);
}

// The down products of rows [r0, r0 + M) (their activations) with one down group, `next`
// streamed ahead by tiles of kStreamRowsDown rows and more. Always inlined, like tile_bf16
// (csrc/gemm.h): `acc` must be a local array of the caller for it to stay in registers.
template <int M>
[[gnu::always_inline]] inline void down_products(const at::BFloat16* act, int64_t r0,
                                                 const at::BFloat16* w, const Geometry& g,
                                                 const at::BFloat16* next,
                                                 __m512 (&acc)[M][kBlocksDown]) {
  const at::BFloat16* ar[M];
  for (int m = 0; m < M; ++m) ar[m] = act + (r0 + m) * g.ip;
  if constexpr (M >= kStreamRowsDown) {
    tile_bf16<M, kBlocksDown, Ahead::kStream>(ar, g.down_pairs, w, acc, next);
  } else {
    tile_bf16<M, kBlocksDown>(ar, g.down_pairs, w, acc);
  }
}

template <int M>
void down_tile_bf16(const at::BFloat16* act, const Rows& rows, int64_t r0,
                    const at::BFloat16* w, const Geometry& g, int64_t b,
                    Sums<at::BFloat16> sums, const at::BFloat16* next) {
  __m512 acc[M][kBlocksDown];
  down_products<M>(act, r0, w, g, next, acc);
  for (int m = 0; m < M; ++m)
    down_store<kBlocksDown>([&](int n) { return acc[m][n]; }, rows, r0 + m, g, b, sums);
}

// The expert schedule's down tile (csrc/moe_by_expert.h): rows [r, r + M)'s unweighted fp32
// results to out + (row - r0) * stride, for OrderedSums to add in order.
template <int M>
void down_tile_results(const at::BFloat16* act, int64_t r0, int64_t r, const at::BFloat16* w,
                       const Geometry& g, int64_t b, float* out, int64_t stride,
                       const at::BFloat16* next) {
  __m512 acc[M][kBlocksDown];
  down_products<M>(act, r, w, g, next, acc);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < kBlocksDown; ++n)
      _mm512_storeu_ps(out + (r + m - r0) * stride + (b + n) * kLanes, acc[m][n]);
}

#endif  // __AVX512BF16__

// ---------------------------------------------------------------- tile dispatch

// tile(m, r, first) over the register tiles of one weight group for rows [r0, r1) of its
// expert (m: the tile's rows as an integral constant; `first`: the pass that reads the group
// from memory, and the one that asks for the next group ahead): one tile where the rows are
// at most `One`, else passes of at most `Most` rows.
template <int Most, int One = Most, typename Tile>
void group_tiles(int64_t r0, int64_t r1, Tile&& tile) {
  static_assert(One >= Most);
  if constexpr (One > Most) {
    if (r1 - r0 <= One) return with_rows<One>(r1 - r0, [&](auto m) { tile(m, r0, true); });
  }
  for (int64_t r = r0, n; r < r1; r += n) {
    const bool first = r == r0;
    n = next_tile_rows(r1 - r, Most, first);
    with_rows<Most>(n, [&](auto m) { tile(m, r, first); });
  }
}

// `next` (bf16 fast path): the weight group read after this tile's, or nullptr.
template <typename T, int M>
void up_tile(bool fast, const T* x, const Rows& rows, int64_t r0, const T* w, const Geometry& g,
             int64_t j, bool clamp, float limit, T* act, const T* next) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (fast) return up_tile_bf16<M>(x, rows, r0, w, g, j, clamp, limit, act, next);
  }
#endif
  up_tile_portable<T, M>(x, rows, r0, w, g, j, clamp, limit, act);
}

template <typename T, int M>
void down_tile(bool fast, const T* act, const Rows& rows, int64_t r0, const T* w,
               const Geometry& g, int64_t b, Sums<T> sums, const T* next) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (fast) return down_tile_bf16<M>(act, rows, r0, w, g, b, sums, next);
  }
#endif
  down_tile_portable<T, M>(act, rows, r0, w, g, b, sums);
}

}  // namespace wideserve_moe
