// The small-M GEMM micro-kernel shared by the CPU ops (docs/cpu_kernels.md, "Linear layers"):
// csrc/linear.cpp (dense linears, the LM head, the router) and csrc/moe.cpp (routed experts).
//
// Weight layout ("panel packed"): a [N, K] matrix is cut into groups of NB blocks of 16
// output rows, each group stored as [K/P, NB, 16, P] (P = 2 bf16 inputs per 32-bit lane, as
// `vdpbf16ps` wants them, or 1 for fp32). One 64-byte load then holds the next P inputs'
// weights for 16 outputs, and a register tile of M input rows x NB blocks reads its group as
// one sequential stream. With AVX512-BF16 one `vdpbf16ps` multiplies a broadcast pair of
// inputs into 16 fp32 accumulators that run along the output dimension: no horizontal sums.
// The packing is done once, in Python (wideserve/kernels/gemm.py), padded with zero weights.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace wideserve_gemm {

constexpr int64_t kLanes = 16;   // output columns per packed block (one zmm of fp32)

// Runtime row count (1..MaxM) -> the tile instantiated for it.
template <int M, typename F>
inline void with_rows(int64_t m, F&& f) {
  if constexpr (M > 1) {
    if (m < M) return with_rows<M - 1>(m, f);
  }
  f(std::integral_constant<int, M>{});
}

// Portable: acc[m][n][:] = x[m] . (block n of the group at w), the group laid out
// [pairs, NB, 16, P]; x[m] holds pairs * P values.
template <typename T, int M, int NB>
inline void tile_portable(const T* const* x, int64_t pairs, int pair, const T* w,
                          float (&acc)[M][NB][kLanes]) {
  std::memset(acc, 0, sizeof(acc));
  for (int64_t p = 0; p < pairs; ++p) {
    for (int n = 0; n < NB; ++n) {
      const T* wp = w + (p * NB + n) * kLanes * pair;
      for (int m = 0; m < M; ++m) {
        for (int q = 0; q < pair; ++q) {
          const float xv = static_cast<float>(x[m][p * pair + q]);
          for (int l = 0; l < kLanes; ++l)
            acc[m][n][l] += xv * static_cast<float>(wp[l * pair + q]);
        }
      }
    }
  }
}

#ifdef __AVX512BF16__
inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// acc + w . {pair, pair, ...}: vdpbf16ps with the input pair broadcast from memory
// ({1to16}), one instruction where the intrinsics make two (GCC 12 does not fold a
// vpbroadcastd into vdpbf16ps). On the Zen 4 the separate broadcasts held the micro-kernel to
// ~70% of the dot products' peak with the weights in the caches: the fused experts at 8 rows
// an expert 131-137 -> 188-196 GMAC/s, the bf16 `torch.mm` peak being 195-216 (BENCHMARKS.md,
// "Zen 4: the micro-kernel's broadcasts folded"). The same products in the same order: the
// results are bit for bit those of the intrinsics. The asm reads `pair` without a memory
// operand (an "m" operand or a memory clobber kept the accumulators in memory, stored after
// every product): tile_bf16 orders every earlier store before its loop with a compiler
// barrier, and nothing stores into the inputs while the loop runs.
inline __m512 dp_bcast(__m512 acc, __m512i w, const at::BFloat16* pair) {
  __asm__("vdpbf16ps (%2)%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "r"(pair));
  return acc;
}

// How a tile asks for weights ahead of its loads, `next` being the group read after this one.
// kSpread: its share of `next` into L2 during the tile (NextShare, below), one 64-byte line
// per block per pair (a GEMM whose groups are each read once, the LM head, otherwise waits on
// L3 at each group's start). kStream: the line kStreamAhead bytes past each load, running on
// into `next` at the group's end, so the lines a compute-bound tile reads arrive a fixed
// distance ahead of it.
enum class Ahead { kSpread, kStream };

// kSpread's share of `next`: share `index` of `count` equal runs of its pairs, one pair every
// `count` steps of the tile, so that the tiles of a group (csrc/linear.cpp, run_group) ask
// for the next group evenly over the whole group. The default, one share of one, asks for all
// of it in this tile: at a step's rate, faster than one core's fill buffers let the lines in
// (docs/cpu_kernels.md, "Page kicks"), which held the group's first tile to the memory's pace.
struct NextShare {
  int64_t index = 0, count = 1;
};

// 8 KB: on the Zen 4 with the host at ~60 GB/s, the 653M experts from memory at ~8 rows ran
// 2-4% slower than with none at 4 KB, 9-13% faster at 8-16 KB (BENCHMARKS.md, "Zen 4: expert
// tiles stream their weights ahead"); on the Zen 5 at ~63 GB/s, 4 / 16 / 32 KB were 1.04 /
// 1.02 / 1.03x the time of 8 KB, none 1.22x ("Zen 5: the first measurements").
constexpr int64_t kStreamAhead = 8192;

// AVX512-BF16: the same product, bf16 pairs, fp32 accumulators in registers. `next`
// (optional): the group to ask for ahead of the loads, as `A` says (above); `share`: kSpread's
// part of it. Always inlined, so that `acc` is the caller's local array: an out-of-line copy
// takes it by reference, and since the weight loads may alias it GCC then stores every
// accumulator after every product (csrc/moe_tiles.h's down_products; the fused experts' down
// GEMM at half the dots' rate).
template <int M, int NB, Ahead A = Ahead::kSpread>
[[gnu::always_inline]] inline void tile_bf16(const at::BFloat16* const* x, int64_t pairs,
                                             const at::BFloat16* w, __m512 (&acc)[M][NB],
                                             const at::BFloat16* next = nullptr,
                                             NextShare share = {}) {
  __asm__ volatile("" ::: "memory");   // the inputs' stores before dp_bcast's reads
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  constexpr int64_t step_values = NB * 2 * kLanes;   // one pair's weights for NB blocks
  constexpr int64_t ahead = kStreamAhead / (step_values * 2);   // in steps
  // kSpread: the next pair of `next` to ask for, the end of this share, steps until the next
  // request (a countdown: a division per step would cost more than the request)
  const int64_t run = (pairs + share.count - 1) / share.count;
  int64_t ask = share.index * run, wait = 0;
  const int64_t run_end = std::min(pairs, ask + run);
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i wv[NB];
    if constexpr (A == Ahead::kStream) {
      const int64_t s = p + ahead;   // the step whose lines are asked for: never past `next`
      const at::BFloat16* q = s < pairs                           ? w + s * step_values
                              : next != nullptr && s < 2 * pairs ? next + (s - pairs) * step_values
                                                                 : nullptr;
      if (q != nullptr)
        for (int n = 0; n < NB; ++n)
          _mm_prefetch(reinterpret_cast<const char*>(q + n * 2 * kLanes), _MM_HINT_T1);
    } else if (next != nullptr && wait-- == 0) {
      if (ask < run_end)
        for (int n = 0; n < NB; ++n)
          _mm_prefetch(reinterpret_cast<const char*>(next + (ask * NB + n) * 2 * kLanes),
                       _MM_HINT_T1);
      ++ask;
      wait = share.count - 1;
    }
    for (int n = 0; n < NB; ++n) wv[n] = _mm512_loadu_si512(w + (p * NB + n) * 2 * kLanes);
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < NB; ++n) acc[m][n] = dp_bcast(acc[m][n], wv[n], x[m] + 2 * p);
  }
}

inline __m512 exp_ps(__m512 x) {
  // exp(x) = 2^n * e^r, n = round(x / ln 2), |r| <= ln 2 / 2: Cephes' degree-6 polynomial
  // for e^r (about 1 ulp), the 2^n scaling by vscalefps (exact, and saturating).
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                    _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif  // __AVX512BF16__

inline bool bf16_fast_path_compiled() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

}  // namespace wideserve_gemm
