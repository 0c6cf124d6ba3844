// Routed experts' bf16 weights stored losslessly in 12 bits a value, decoded on the fly
// (docs/cpu_kernels.md, "Lossless 12-bit expert weights"; packed by wideserve/kernels/lossless.py).
//
// A decode step of a MoE model streams every expert's weights from memory once and is bound by
// memory bandwidth; a bf16 weight's high byte (sign and 7 exponent bits) takes few values in a
// trained (or initialised) matrix, so each is stored as a 4-bit code into a 15-entry table of
// the tensor's most frequent high bytes, beside its low byte as it is: 3/4 of the bytes.
// Code 15 escapes: the value is taken, whole, from an exception list in decode order (a few
// in 10^4 weights of the benchmark models), so every weight decodes to exactly its bf16 value
// and the products equal those on the bf16 copy bit for bit.
//
// Layout: the panel-packed bf16 stream of csrc/gemm.h (a group [K/2, NB, 16, 2]) cut into
// chunks of 128 values (four 64-byte vectors), each stored as 192 bytes: L0, L1 (64 low bytes
// each) and C (64 bytes of two codes: low nibble for L0's byte at the same position, high
// nibble for L1's). Byte p = 16 i + j of L0 (lane i, j < 8) is value 8 i + j of vector 0,
// j >= 8 value 8 i + j - 8 of vector 1; L1 the same for vectors 2 and 3: the order in which
// AVX512's per-lane byte unpacks interleave (low, high) into 16-bit words. An AMX tile step
// (16 K pairs of a group of NB blocks) is 4 NB chunks, decoded into an L1 buffer just before
// its tile loads (the next step's bytes prefetched meanwhile: without it the stream read
// ~22 GB/s against ~30 for the bf16 tiles, BENCHMARKS.md). A group's steps are stored as two
// interleaved runs (step_slot), so reading them in order reads two sequential streams.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "page_kick.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace wideserve_moe {

constexpr int64_t kChunkValues = 128, kChunkBytes = 192;
// An AMX tile step of one 16-column block: 16 K pairs x 16 columns x 2 = 512 values.
constexpr int64_t kStepChunksPerBlock = 4;
constexpr int kEscape = 15;

// Where a group's tile steps lie: step s in run s % kStepStreams at place s / kStepStreams, the
// runs one after another; returns step s's slot (in steps from the group's start) of `steps`.
// Read in order, the steps are then kStepStreams sequential streams at once, and one core's
// hardware prefetchers keep more lines in flight over two streams than over one (a read-only
// probe of this loop's pattern ~25% faster, the op ~5%: docs/cpu_kernels.md, "Lossless
// 12-bit expert weights"). The coder (csrc/lossless_encode.cpp, lossless.py) places them so.
constexpr int64_t kStepStreams = 2;
inline int64_t step_slot(int64_t s, int64_t steps) {
  const int64_t run = s % kStepStreams;
  return run * (steps / kStepStreams) + std::min(run, steps % kStepStreams) + s / kStepStreams;
}

#ifdef __AVX512BF16__
// One of w13 / w2 for every expert: groups of `group_bytes` coded bytes, [E, groups, ...];
// exceptions [n] bf16 bits in decode order; starts [E * groups] the first exception of each
// group; table: the 16 high bytes (entry 15 unused) in each 128-bit lane.
// step_chunks: the chunks of one tile step (kStepChunksPerBlock x the group's blocks).
struct LosslessMatrix {
  const uint8_t* data = nullptr;
  const uint16_t* exceptions = nullptr;
  const int64_t* starts = nullptr;
  int64_t groups = 0, group_bytes = 0, step_chunks = 0;
  __m512i table;

  int64_t steps() const { return group_bytes / (step_chunks * kChunkBytes); }

  const uint8_t* group(int64_t e, int64_t j) const {
    return data + (e * groups + j) * group_bytes;
  }
  const uint16_t* exceptions_of(int64_t e, int64_t j) const {
    return exceptions + starts[e * groups + j];
  }
};

struct Lossless {
  LosslessMatrix w13, w2;
};

// Decodes `chunks` chunks at src into dst (bf16 bits), escaped values from *exc in order.
inline void decode_chunks(const uint8_t* src, int64_t chunks, __m512i table,
                          const uint16_t*& exc, uint16_t* dst) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), escape = _mm512_set1_epi8(kEscape);
  for (int64_t c = 0; c < chunks; ++c, src += kChunkBytes, dst += kChunkValues) {
    const __m512i l0 = _mm512_loadu_si512(src), l1 = _mm512_loadu_si512(src + 64);
    const __m512i codes = _mm512_loadu_si512(src + 128);
    const __m512i lo = _mm512_and_si512(codes, nibble);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble);
    const __m512i h0 = _mm512_shuffle_epi8(table, lo), h1 = _mm512_shuffle_epi8(table, hi);
    _mm512_storeu_si512(dst, _mm512_unpacklo_epi8(l0, h0));
    _mm512_storeu_si512(dst + 32, _mm512_unpackhi_epi8(l0, h0));
    _mm512_storeu_si512(dst + 64, _mm512_unpacklo_epi8(l1, h1));
    _mm512_storeu_si512(dst + 96, _mm512_unpackhi_epi8(l1, h1));
    __mmask64 k0 = _mm512_cmpeq_epi8_mask(lo, escape), k1 = _mm512_cmpeq_epi8_mask(hi, escape);
    if (__builtin_expect((k0 | k1) != 0, 0)) {   // positions in order: L0's, then L1's
      for (int half = 0; half < 2; ++half) {
        for (__mmask64 k = half ? k1 : k0; k; k &= k - 1) {
          const int p = __builtin_ctzll(k), lane = p >> 4, j = p & 15;
          dst[half * 64 + (j < 8 ? 0 : 32) + lane * 8 + (j & 7)] = *exc++;
        }
      }
    }
  }
}

// Page kicks (csrc/page_kick.h) kKickSteps steps ahead of the step decoded: the op at a
// 64-request decode step, 8 layers: 40.0-40.7 -> 37.2-38.3 ms at two threads, 81.7 -> 72.0 at
// one (2-6 steps ahead and 1-4 lines a page measured).
constexpr int64_t kKickSteps = 4;

// The AMX tiles' B operand of a coded group, step by step (wideserve_amx::blocks' step_b):
// step s decoded into one of two halves of `buf` (2 x chunks x 128 values), the next step's
// bytes prefetched. Steps must be asked for in order (the exception cursor moves on).
struct DecodedSteps {
  const uint8_t* src;            // the group's first byte; its steps placed by step_slot
  int64_t chunks, steps;         // chunks per step, steps of the group
  __m512i table;
  const uint16_t* exc;
  at::BFloat16* buf;

  DecodedSteps(const LosslessMatrix& m, int64_t e, int64_t j, at::BFloat16* buf)
      : src(m.group(e, j)), chunks(m.step_chunks), steps(m.steps()), table(m.table),
        exc(m.exceptions_of(e, j)), buf(buf) {}

  const at::BFloat16* operator()(int64_t s) {
    const int64_t step_bytes = chunks * kChunkBytes;
    // after the last step, the next group's first (slot 0 of the group that follows)
    const uint8_t* next = src + (s + 1 < steps ? step_slot(s + 1, steps) : steps) * step_bytes;
    for (int64_t b = 0; b < step_bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + b), _MM_HINT_T0);
    // the first lines of every page that step s + kKickSteps starts in (past the group's
    // last step: the bytes that follow it, the next group's)
    const int64_t t = s + kKickSteps;
    wideserve_kick::pages(src + (t < steps ? step_slot(t, steps) : t) * step_bytes, step_bytes);
    at::BFloat16* out = buf + (s & 1) * chunks * kChunkValues;
    decode_chunks(src + step_slot(s, steps) * step_bytes, chunks, table, exc,
                  reinterpret_cast<uint16_t*>(out));
    return out;
  }
};

// A whole coded group decoded into `out` (bf16, the panel layout, steps in order): for
// experts with enough rows that the decode is paid once for all of them (csrc/moe_matrix.h,
// tile_rows).
inline const at::BFloat16* decode_group(const LosslessMatrix& m, int64_t e, int64_t j,
                                        at::BFloat16* out) {
  const uint16_t* exc = m.exceptions_of(e, j);
  const int64_t steps = m.steps(), step_bytes = m.step_chunks * kChunkBytes;
  for (int64_t s = 0; s < steps; ++s)
    decode_chunks(m.group(e, j) + step_slot(s, steps) * step_bytes, m.step_chunks, m.table,
                  exc, reinterpret_cast<uint16_t*>(out) + s * m.step_chunks * kChunkValues);
  return out;
}
#endif  // __AVX512BF16__

}  // namespace wideserve_moe
