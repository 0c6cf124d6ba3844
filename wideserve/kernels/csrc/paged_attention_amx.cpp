// The q.k score products of the paged attention op on AMX tiles (paged_attention.h;
// docs/cpu_kernels.md, "Paged attention"), for bf16 queries and cache where the CPU has
// AMX-BF16 and the OS lets this process use it. The AVX512 loop calls amx_scores for each run
// of up to 64 keys of a tile instead of its own dot products; the softmax and the value
// products stay its own (fp32).
//
// Scores come out transposed: C[key][row] = k . q_row, keys down a tile's 16 rows. So a tile
// of keys is an A operand read straight from the cache (16 entries, one stride apart, when
// they are consecutive in a block; else copied to a staging buffer first), and the queries,
// fixed over an item, are the B operand, packed once per item. A KV head's query rows are only
// some of a C tile's 16 columns: the B tile of head h zeroes the others, so the heads whose
// rows share a C tile accumulate into it one after the other (a decode with 4 query heads per
// KV head fills one C tile with 4 KV heads). Four C tiles (64 keys) are in flight at once. The
// products are exact bf16 products summed in fp32, as vdpbf16ps sums them (only the order of
// the sums differs). Each C block is then transposed into the score rows the softmax reads.
#include "paged_attention.h"

#include <cstring>

#if defined(__AVX512BF16__) && defined(__linux__) && defined(__x86_64__)
#include <ATen/native/CPUBlas.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

namespace wideserve_paged {
namespace {

constexpr int64_t kGroups = 4;            // 16-key groups (C tiles) in flight

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (16 keys x 16 rows fp32); 4, 5: A (16 keys x 32 bf16); 6: B (16 pairs of
// 2 bf16 x 16 rows).
TileConfig tile_config() {
  TileConfig c;
  for (int t = 0; t < 7; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  return c;
}

bool request_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
  // Linux hands out the tile state only to processes that ask (ARCH_REQ_XCOMP_PERM,
  // XFEATURE_XTILEDATA); asking again is harmless (torch's oneDNN asks the same way).
  return tile && bf16 && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

// r[c] <- lane c of every r[k] (a 16 x 16 transpose of 32-bit elements in registers).
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  for (int i = 0; i < 4; ++i) {   // r[4i + e], per 128-bit lane L: rows 4i..4i+3, column 4L+e
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
  }
  for (int e = 0; e < 4; ++e) {
    __m512 v0 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x44);
    __m512 v1 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x44);
    __m512 v2 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xEE);
    __m512 v3 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xEE);
    t[e] = _mm512_shuffle_f32x4(v0, v1, 0x88);
    t[4 + e] = _mm512_shuffle_f32x4(v0, v1, 0xDD);
    t[8 + e] = _mm512_shuffle_f32x4(v2, v3, 0x88);
    t[12 + e] = _mm512_shuffle_f32x4(v2, v3, 0xDD);
  }
  for (int c = 0; c < 16; ++c) r[c] = t[c];
}

// out[c][k] = scale * in[k][c] for the 16 x 16 block in (row stride 16 floats); output rows
// c < rows are stored, at out + c * kTile.
inline void transpose_store(const float* in, float* out, int64_t rows, float scale) {
  __m512 r[16];
  for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_ps(in + 16 * k);
  transpose16(r);
  const __m512 vs = _mm512_set1_ps(scale);
  for (int c = 0; c < rows; ++c) _mm512_storeu_ps(out + c * kTile, _mm512_mul_ps(r[c], vs));
}

// One C block (16 score rows from cb * 16) of NG key groups: every head with rows in the
// block, every 32 columns of the head dim.
template <int NG>
void block_scores(const AmxScores& a, int64_t cb, const char* const* base, const int64_t* stride,
                  const at::BFloat16* b) {
  if constexpr (NG > 0) _tile_zero(0);
  if constexpr (NG > 1) _tile_zero(1);
  if constexpr (NG > 2) _tile_zero(2);
  if constexpr (NG > 3) _tile_zero(3);
  const int64_t r0 = cb * 16, r1 = std::min(a.rows, r0 + 16);
  for (int64_t h = r0 / a.head_rows; h <= (r1 - 1) / a.head_rows; ++h)
    for (int64_t d = 0; d < a.dim; d += 32, b += 512) {
      const int64_t off = (h * a.dim + d) * 2;       // bytes into an entry (or staged row)
      _tile_loadd(6, b, 64);
      if constexpr (NG > 0) { _tile_loadd(4, base[0] + off, stride[0]); _tile_dpbf16ps(0, 4, 6); }
      if constexpr (NG > 1) { _tile_loadd(5, base[1] + off, stride[1]); _tile_dpbf16ps(1, 5, 6); }
      if constexpr (NG > 2) { _tile_loadd(4, base[2] + off, stride[2]); _tile_dpbf16ps(2, 4, 6); }
      if constexpr (NG > 3) { _tile_loadd(5, base[3] + off, stride[3]); _tile_dpbf16ps(3, 5, 6); }
    }
  if constexpr (NG > 0) _tile_stored(0, a.stage_c, 64);
  if constexpr (NG > 1) _tile_stored(1, a.stage_c + 256, 64);
  if constexpr (NG > 2) _tile_stored(2, a.stage_c + 512, 64);
  if constexpr (NG > 3) _tile_stored(3, a.stage_c + 768, 64);
}

// The V rows of keys j0..j0+31 of head `voff` (elements into an entry) as B tiles: for each
// 32 columns from c0, two tiles of 16 key pairs x 16 columns, a pair of keys per 32-bit
// element: `lo` columns c0 + {0-3, 8-11, 16-19, 24-27}, `hi` the others (unpacklo/hi_epi16
// order, undone by unpermute). Keys past n are zero.
inline void pack_values(const at::BFloat16* const* keys, int64_t n, int64_t j0, int64_t voff,
                        int64_t cols, at::BFloat16* out) {
  for (int64_t pair = 0; pair < 16; ++pair) {
    const int64_t j = j0 + 2 * pair;
    const at::BFloat16* x = j < n ? keys[j] + voff : nullptr;
    const at::BFloat16* y = j + 1 < n ? keys[j + 1] + voff : nullptr;
    for (int64_t c = 0; c < cols; c += 32) {
      __m512i vx = x ? _mm512_loadu_si512(x + c) : _mm512_setzero_si512();
      __m512i vy = y ? _mm512_loadu_si512(y + c) : _mm512_setzero_si512();
      at::BFloat16* t = out + c / 32 * 1024 + pair * 32;
      _mm512_storeu_si512(t, _mm512_unpacklo_epi16(vx, vy));
      _mm512_storeu_si512(t + 512, _mm512_unpackhi_epi16(vx, vy));
    }
  }
}

// acc[c0 .. c0 + 32) += the lo/hi tiles' row (see pack_values), columns back in order.
inline void add_unpermuted(const float* lo, const float* hi, float* acc) {
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11,
                                          10, 9, 8);
  __m512 l = _mm512_loadu_ps(lo), h = _mm512_loadu_ps(hi);
  _mm512_storeu_ps(acc, _mm512_add_ps(_mm512_loadu_ps(acc), _mm512_permutex2var_ps(l, first, h)));
  _mm512_storeu_ps(acc + 16, _mm512_add_ps(_mm512_loadu_ps(acc + 16),
                                           _mm512_permutex2var_ps(l, second, h)));
}

// One row block's P.V over NC/2 groups of 32 columns from c0 (NC C tiles: lo/hi pairs).
template <int NC>
void block_values(const AmxValues& a, int64_t r0, int64_t c0) {
  const int64_t r1 = std::min(a.rows, r0 + 16);
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NC > 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t j0 = 0; j0 < a.n; j0 += 32) {
    for (int64_t h = r0 / a.head_rows; h <= (r1 - 1) / a.head_rows; ++h) {
      // A: this head's rows' weights of keys j0..j0+31 as bf16, the block's other rows zero
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t r = r0 + c;
        __m512i v = _mm512_setzero_si512();
        if (r < r1 && r / a.head_rows == h) {
          const float* p = a.s + r * kTile + j0;
          const int64_t left = a.n - j0;   // keys of this chunk in the tile
          const __mmask16 m0 = left >= 16 ? 0xFFFF : (1u << left) - 1;
          const __mmask16 m1 = left >= 32 ? 0xFFFF : (1u << std::max<int64_t>(0, left - 16)) - 1;
          v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, p + 16),
                                           _mm512_maskz_loadu_ps(m0, p));
        }
        _mm512_storeu_si512(a.stage_p + c * 32, v);
      }
      pack_values(a.keys, a.n, j0, a.voff + h * a.dim + c0, NC * 16, a.stage_v);
      _tile_loadd(4, a.stage_p, 64);
      _tile_loadd(5, a.stage_v, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, a.stage_v + 512, 64);
      _tile_dpbf16ps(1, 4, 6);
      if constexpr (NC > 2) {
        _tile_loadd(5, a.stage_v + 1024, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, a.stage_v + 1536, 64);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
  }
  _tile_stored(0, a.stage_c, 64);
  _tile_stored(1, a.stage_c + 256, 64);
  if constexpr (NC > 2) {
    _tile_stored(2, a.stage_c + 512, 64);
    _tile_stored(3, a.stage_c + 768, 64);
  }
  for (int64_t c = 0; c < r1 - r0; ++c)
    for (int64_t g = 0; g < NC / 2; ++g)
      add_unpermuted(a.stage_c + 512 * g + 16 * c, a.stage_c + 512 * g + 256 + 16 * c,
                     a.acc + (r0 + c) * a.dim + c0 + 32 * g);
}

}  // namespace

bool amx_ready() {
  static const bool ready = request_amx();
  return ready;
}

int64_t amx_packed_elements(int64_t rows, int64_t head_rows, int64_t dim) {
  int64_t tiles = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    tiles += (std::min(rows, r0 + 16) - 1) / head_rows - r0 / head_rows + 1;
  return tiles * (dim / 32) * 512;
}

// A B tile is 16 pairs of head-dim columns x 16 rows, a pair (2 bf16) per 32-bit element:
// the transpose of the rows' 32-bit words, rows of other heads zero.
void amx_pack_queries(const at::BFloat16* q, int64_t rows, int64_t head_rows, int64_t dim,
                      at::BFloat16* out) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t r1 = std::min(rows, r0 + 16);
    for (int64_t h = r0 / head_rows; h <= (r1 - 1) / head_rows; ++h)
      for (int64_t d = 0; d < dim; d += 32, out += 512) {
        __m512 r[16];
        for (int64_t c = 0; c < 16; ++c) {
          const int64_t row = r0 + c;
          r[c] = row < r1 && row / head_rows == h
                     ? _mm512_loadu_ps(reinterpret_cast<const float*>(q + row * dim + d))
                     : _mm512_setzero_ps();
        }
        transpose16(r);
        for (int64_t pair = 0; pair < 16; ++pair)
          _mm512_storeu_ps(reinterpret_cast<float*>(out + pair * 32), r[pair]);
      }
  }
}

void amx_begin() {
  static const TileConfig config = tile_config();
  _tile_loadconfig(&config);
}

void amx_end() {
  _tile_release();
  // torch's brgemm keeps the tile configuration it last loaded per thread and skips loading
  // it again: tell it that the tiles were given up.
  at::native::cpublas::brgemm_release(true);
}

void amx_scores(const AmxScores& a, int64_t j0) {
  const int64_t ng = std::min<int64_t>(kGroups, (a.n - j0 + 15) / 16);
  const int64_t k_elems = a.kv_heads * a.dim;     // an entry's K half
  const char* base[kGroups];
  int64_t stride[kGroups];
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t j = j0 + 16 * g, valid = std::min<int64_t>(16, a.n - j);
    if (valid == 16 && a.keys[j + 15] == a.keys[j] + 15 * a.width) {
      base[g] = reinterpret_cast<const char*>(a.keys[j]);   // 16 consecutive entries
      stride[g] = a.width * 2;
    } else {   // a block edge or the tile's end: the K halves copied, missing keys zero
      at::BFloat16* dst = a.stage_k + g * 16 * k_elems;
      for (int64_t i = 0; i < valid; ++i)
        std::memcpy(dst + i * k_elems, a.keys[j + i], k_elems * 2);
      std::memset(static_cast<void*>(dst + valid * k_elems), 0, (16 - valid) * k_elems * 2);
      base[g] = reinterpret_cast<const char*>(dst);
      stride[g] = k_elems * 2;
    }
  }
  const at::BFloat16* b = a.qpack;
  for (int64_t cb = 0; cb * 16 < a.rows; ++cb) {
    const int64_t r0 = cb * 16, r1 = std::min(a.rows, r0 + 16);
    switch (ng) {
      case 1: block_scores<1>(a, cb, base, stride, b); break;
      case 2: block_scores<2>(a, cb, base, stride, b); break;
      case 3: block_scores<3>(a, cb, base, stride, b); break;
      default: block_scores<4>(a, cb, base, stride, b); break;
    }
    b += ((r1 - 1) / a.head_rows - r0 / a.head_rows + 1) * (a.dim / 32) * 512;
    for (int64_t g = 0; g < ng; ++g)
      transpose_store(a.stage_c + 256 * g, a.s + r0 * kTile + j0 + 16 * g, r1 - r0, a.scale);
  }
}

void amx_values(const AmxValues& a) {
  for (int64_t r0 = 0; r0 < a.rows; r0 += 16) {
    int64_t c0 = 0;
    for (; c0 + 64 <= a.dim; c0 += 64) block_values<4>(a, r0, c0);
    if (c0 < a.dim) block_values<2>(a, r0, c0);     // dim % 64 == 32
  }
}

}  // namespace wideserve_paged

#pragma GCC pop_options

#else   // no AVX512-BF16 build, or not x86-64 Linux

namespace wideserve_paged {
bool amx_ready() { return false; }
int64_t amx_packed_elements(int64_t, int64_t, int64_t) { return 0; }
void amx_pack_queries(const at::BFloat16*, int64_t, int64_t, int64_t, at::BFloat16*) {}
void amx_begin() {}
void amx_end() {}
void amx_scores(const AmxScores&, int64_t) {}
void amx_values(const AmxValues&) {}
}  // namespace wideserve_paged

#endif
