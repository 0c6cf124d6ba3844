// Intel AMX tiles driven directly (docs/cpu_kernels.md, "Lossless 12-bit expert weights") for
// routed experts on coded weights: a decode step's few rows against each group, each tile
// step's B decoded into an L1 buffer just before its tile loads (csrc/moe_lossless.h), which
// torch's brgemm, taking whole B matrices, cannot interleave (`blocks`); and a prefill's many
// rows on 2 x 2 tiles over a group decoded once, K in L1-sized ranges (`pair_steps`).
//
// A group of NB blocks of 16 output columns is stored [K/2, NB, 16, 2] bf16 (the panel layout
// of csrc/gemm.h): 16 consecutive K pairs of block n are exactly an AMX B tile (16 rows of 64
// bytes, VNNI) at a row stride of NB * 64 bytes. A (the rows, bf16) is up to 16 rows of 32
// values; C 16 x 16 fp32 per block. The products are brgemm's: the same tile instructions in
// the same K order (the coded op's outputs equal the bf16 op's with brgemm bit for bit).
//
// The tile configuration is per thread and shared with torch's brgemm (oneDNN), which keeps its
// own record of what it last loaded: `Tiles` loads ours, and `release()` (every parallel body
// that used ours, and before any brgemm call after ours) frees the tiles and clears oneDNN's
// record (at::native::cpublas::brgemm_release), so the next brgemm call configures its own.
// Compiled with a target attribute, so the extension's AVX512-BF16 build carries it without
// AMX compiler flags; `available()` checks the CPU and asks Linux for the tile state.
#pragma once

#include <ATen/native/CPUBlas.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__x86_64__) && defined(__linux__)
#define WIDESERVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define WS_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#endif

namespace wideserve_amx {

constexpr int kRows = 16;      // rows of an A / C tile
constexpr int kPairs = 16;     // K pairs of one tile step (32 bf16 values)

#ifdef WIDESERVE_AMX
// CPUID leaf 7: AMX-BF16 (EDX bit 22) and AMX-TILE (bit 24); then Linux's permission to use
// the tile data state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), granted once per process.
inline bool available() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    constexpr long kReqPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqPerm, kXtiledata) == 0;
  }();
  return ok;
}

// GCC's tile intrinsics are inline asm that tell the compiler of no memory they read or write
// (ldtilecfg: 8 bytes of its 64): without this barrier around them, stores into the config,
// the gathered rows or the results can be dropped or moved across the tile instructions.
inline void memory_barrier() { asm volatile("" ::: "memory"); }

// The 64-byte LDTILECFG operand (palette 1).
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// This thread's tiles: 0 = A (m rows), 1 and 2 = B (16 rows), 3..6 = C (m rows), all 64-byte
// rows. Reconfigured only when m changes.
class Tiles {
 public:
  WS_AMX_TARGET void use(int m) {
    if (m == rows_) return;
    Config cfg;
    for (int t = 0; t < 7; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = (t == 1 || t == 2) ? kRows : m;
    }
    memory_barrier();
    _tile_loadconfig(&cfg);
    rows_ = m;
  }
  // The 2 x 2 layout (pair_steps): 0 and 1 = A (16 and mb rows), 2 and 3 = B (16 rows),
  // 4 and 5 = C of A's first 16 rows, 6 and 7 = C of its last mb rows (1 <= mb <= 16).
  WS_AMX_TARGET void use_pair(int mb) {
    if (kPair + mb == rows_) return;
    Config cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = (t == 1 || t >= 6) ? mb : kRows;
    }
    memory_barrier();
    _tile_loadconfig(&cfg);
    rows_ = kPair + mb;
  }
  // Frees the tiles and oneDNN's record of its configuration (header).
  void release() {
    if (rows_ < 0) return;
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
    rows_ = -1;
  }
  ~Tiles() { release(); }

 private:
  static constexpr int kPair = 100;   // rows_ of the 2 x 2 layout: kPair + mb
  int rows_ = -1;
};

// c[m][16 NB] (ldc floats) = a [m, K] (lda elements) x a group of NB = 2 or 4 blocks,
// K = 32 * steps, B of step s from `step_b(s)` (rows of NB * 64 bytes). Tiles configured for
// m rows (Tiles::use); C in tiles 3.., B in 1 and 2 by turns.
template <int NB, typename StepB>
WS_AMX_TARGET inline void blocks(const at::BFloat16* a, int64_t lda, int64_t steps,
                                 StepB&& step_b, float* c, int64_t ldc) {
  static_assert(NB == 2 || NB == 4, "AMX groups of 2 or 4 blocks");
  constexpr int64_t b_stride = NB * 64;
  memory_barrier();
  _tile_zero(3);
  _tile_zero(4);
  if constexpr (NB == 4) {
    _tile_zero(5);
    _tile_zero(6);
  }
  const at::BFloat16* next = steps > 0 ? step_b(0) : nullptr;
  for (int64_t s = 0; s < steps; ++s) {
    const at::BFloat16* w = next;
    if (s + 1 < steps) next = step_b(s + 1);
    memory_barrier();
    _tile_loadd(0, a + s * 2 * kPairs, lda * 2);
    _tile_loadd(1, w, b_stride);
    _tile_loadd(2, w + 32, b_stride);
    _tile_dpbf16ps(3, 0, 1);
    _tile_dpbf16ps(4, 0, 2);
    if constexpr (NB == 4) {
      _tile_loadd(1, w + 64, b_stride);
      _tile_loadd(2, w + 96, b_stride);
      _tile_dpbf16ps(5, 0, 1);
      _tile_dpbf16ps(6, 0, 2);
    }
  }
  _tile_stored(3, c, ldc * 4);
  _tile_stored(4, c + 16, ldc * 4);
  if constexpr (NB == 4) {
    _tile_stored(5, c + 32, ldc * 4);
    _tile_stored(6, c + 48, ldc * 4);
  }
  memory_barrier();
}
// c [16 + mb, 32] (ldc floats) = a [16 + mb, K] (lda elements) x two blocks of 16 columns of a
// group of NB blocks (`b`: its first block's values at step 0, rows of NB * 64 bytes), over
// tile steps [s_begin, s_end); `accumulate`: onto c's values (a K range split across calls:
// fp32 in and out, so the sums equal one pass over the whole range). Tiles: use_pair(mb).
template <int NB>
WS_AMX_TARGET inline void pair_steps(const at::BFloat16* a, int64_t lda, int64_t s_begin,
                                     int64_t s_end, const at::BFloat16* b, float* c,
                                     int64_t ldc, bool accumulate) {
  constexpr int64_t b_stride = NB * 64, step_values = kPairs * NB * 32;
  float* c1 = c + kRows * ldc;
  memory_barrier();
  if (accumulate) {
    _tile_loadd(4, c, ldc * 4);
    _tile_loadd(5, c + 16, ldc * 4);
    _tile_loadd(6, c1, ldc * 4);
    _tile_loadd(7, c1 + 16, ldc * 4);
  } else {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t s = s_begin; s < s_end; ++s) {
    const at::BFloat16* w = b + s * step_values;
    _tile_loadd(0, a + s * 2 * kPairs, lda * 2);
    _tile_loadd(1, a + kRows * lda + s * 2 * kPairs, lda * 2);
    _tile_loadd(2, w, b_stride);
    _tile_loadd(3, w + 32, b_stride);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
  }
  _tile_stored(4, c, ldc * 4);
  _tile_stored(5, c + 16, ldc * 4);
  _tile_stored(6, c1, ldc * 4);
  _tile_stored(7, c1 + 16, ldc * 4);
  memory_barrier();
}
#else
inline bool available() { return false; }
class Tiles {   // nothing to configure or free without AMX
 public:
  void release() {}
};
#endif

}  // namespace wideserve_amx
