// The checkpoint formats' decoders of csrc/quant_gemm.cpp (docs/cpu_kernels.md, "Quantised
// experts"): the format of a call, the scale tables, and a weight row's values dequantised to
// fp32 or bf16 - the whole row (the portable loop, brgemm's A tiles, the buffered dot
// products) or 32 values at a time into a register (mxfp4_chunk, nvfp4_chunk, fp8_chunk). Every
// decoder gives the bits of layers/quant.py's dequantisation: code x scale in fp32, x the
// global / fp32 scale, rounded to bf16 to nearest even.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace wideserve_quant {

struct Format {
  int64_t kind;                       // 0 FP8 e4m3 block-scaled, 1 MXFP4, 2 NVFP4
  int64_t bm, bn, halves;
  int64_t rows, cols, row_bytes, srows, scols;
  bool fp32_scale;                    // scales are fp32 multipliers (else one byte each)
  // The scale-grid row of weight row n: with halves == 2 the gate rows use the first grid,
  // the up rows the second.
  int64_t scale_row(int64_t n) const {
    if (halves == 2) {
      const int64_t h = rows / 2, per = (h + bm - 1) / bm;
      return n < h ? n / bm : per + (n - h) / bm;
    }
    return n / bm;
  }
  int64_t half_of(int64_t n) const { return halves == 2 && n >= rows / 2 ? 1 : 0; }
};

inline std::array<float, 256> ue8m0_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const uint32_t bits = b == 0 ? (1u << 22) : b == 255 ? 0x7FC00000u : uint32_t(b) << 23;
    std::memcpy(&t[b], &bits, 4);
  }
  return t;
}

inline std::array<float, 256> e4m3_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> 3) & 0xF, m = b & 7;
    float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
    if ((b & 0x7F) == 0x7F) v = NAN;    // e4m3fn's only NaN
    t[b] = (b & 0x80) ? -v : v;
  }
  return t;
}

constexpr std::array<float, 16> kE2M1 = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f,
                                         -6.0f};
inline const std::array<float, 256> kScale = ue8m0_table();
inline const std::array<float, 256> kE4M3 = e4m3_table();

// The multiplier of scale entry i of a scale row (srow: the row's first byte).
inline float scale_at(const Format& f, const uint8_t* srow, int64_t i) {
  if (f.fp32_scale) {
    float v;
    std::memcpy(&v, srow + 4 * i, 4);
    return v;
  }
  return f.kind == 2 ? kE4M3[srow[i]] : kScale[srow[i]];
}

inline const uint8_t* scale_row_ptr(const Format& f, const uint8_t* s, int64_t n) {
  return s + f.scale_row(n) * f.scols * (f.fp32_scale ? 4 : 1);
}

// ------------------------------------------------------------------ dequantising one row

// Values [k0, k1) of weight row n of one expert as fp32 into dst (k1 - k0 of them; k0 and
// the length are multiples of 16, k1 <= K; the caller zero-fills the padding past K).
// g: the expert's global scales [halves] (NVFP4) or null.
inline void dequant_row_f32(const Format& f, const uint8_t* w, const uint8_t* s,
                            const float* g, int64_t n, int64_t k0, int64_t k1, float* dst) {
  const uint8_t* row = w + n * f.row_bytes;
  const uint8_t* srow = scale_row_ptr(f, s, n);
  const bool scaled = g != nullptr;
  const float global = scaled ? g[f.half_of(n)] : 1.0f;
  int64_t k = k0;
#ifdef __AVX512F__
  // 16 values at a time share one scale when the scale block is a multiple of 16 wide
  for (; f.bn % 16 == 0 && k + 16 <= k1; k += 16) {
    const __m512 scale = _mm512_set1_ps(scale_at(f, srow, k / f.bn));
    __m512 v;
    if (f.kind == 0) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(row + k)));
      const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
      // normal: exponent rebias 7 -> 127 by adding 120 << 23; subnormal (e == 0): m * 2^-9
      const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(
          _mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
      const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512));
      v = _mm512_mask_blend_ps(_mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(8)), normal,
                               sub);
      const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
      v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
      const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F));
      v = _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(NAN));
    } else {
      __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2));
      const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
      v = _mm512_permutexvar_ps(codes, _mm512_loadu_ps(kE2M1.data()));
    }
    __m512 out = _mm512_mul_ps(v, scale);
    if (scaled) out = _mm512_mul_ps(out, _mm512_set1_ps(global));
    _mm512_storeu_ps(dst + (k - k0), out);
  }
#endif
  for (; k < k1; ++k) {
    const float scale = scale_at(f, srow, k / f.bn);
    const float v = f.kind == 0 ? kE4M3[row[k]]
                                : kE2M1[(row[k / 2] >> (4 * (k & 1))) & 0xF];
    float out = v * scale;
    if (scaled) out = out * global;
    dst[k - k0] = out;
  }
}

#ifdef __AVX512F__
// 32 MXFP4 values (16 code bytes, low nibble first, one UE8M0 scale) as bf16 lanes: the e2m1
// table times the scale, truncated to bf16 (exact), looked up by code with one 16-bit permute.
inline __m512i mxfp4_chunk(const uint8_t* codes, float scale, __m512 table) {
  const __m512i bits = _mm512_srli_epi32(
      _mm512_castps_si512(_mm512_mul_ps(table, _mm512_set1_ps(scale))), 16);
  const __m512i lut = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(bits));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  const __m512i idx = _mm512_cvtepu8_epi16(
      _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)));
  return _mm512_permutexvar_epi16(idx, lut);
}

// 16 fp32 lanes -> their bf16 bits (in the low half of each 32-bit lane), rounded to nearest
// even as dequant_row_bf16_generic rounds (a quiet NaN stays NaN).
inline __m512i bf16_rne_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(
      _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
}

// 32 NVFP4 values (16 code bytes, low nibble first; E4M3 scales s0 for the first 16, s1 for
// the next) times the global scale as bf16 lanes, the bits of dequant_row_f32 then
// dequant_row_bf16_generic: the e2m1 table times the scale (exact: 2 x 4 significant bits)
// looked up by code, times the global scale (the one fp32 rounding), rounded to nearest
// even by `vcvtne2ps2bf16`, which rounds as the generic loop does except that it flushes
// fp32 subnormals: the caller takes this path only for global scales of at least 2^-100
// (nvfp4_global_ok), where no product is subnormal (the smallest nonzero e2m1 x E4M3 is
// 2^-10). NaN and infinite products convert alike.
inline bool nvfp4_global_ok(float g) { return std::fabs(g) >= 0x1p-100f; }

inline __m512i nvfp4_chunk(const uint8_t* codes, float s0, float s1, __m512 global,
                           __m512 table) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  const __m512 v0 = _mm512_mul_ps(_mm512_permutexvar_ps(
      _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)),
      _mm512_mul_ps(table, _mm512_set1_ps(s0))), global);
  const __m512 v1 = _mm512_mul_ps(_mm512_permutexvar_ps(
      _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)),
      _mm512_mul_ps(table, _mm512_set1_ps(s1))), global);
#ifdef __AVX512BF16__
  const __m512bh both = _mm512_cvtne2ps_pbh(v1, v0);   // v0's 16 values low, v1's high
  return reinterpret_cast<const __m512i&>(both);
#else
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(bf16_rne_bits(v0))),
                            _mm512_cvtepi32_epi16(bf16_rne_bits(v1)), 1);
#endif
}

// 32 FP8 e4m3 codes times one scale as bf16 lanes, the same bits as dequant_row_f32 then
// dequant_row_bf16_generic. A code's magnitude bits moved 7 places up are an fp16 whose value
// is the e4m3 value times 2^-8, subnormals included (both formats keep 3 mantissa bits and
// fp16's exponent field is one bit wider), so vcvtph2ps widens 16 codes at once, and the
// product with scale * 2^8 is the exact value times the scale, rounded once as code * scale
// is; e4m3fn's NaN codes (magnitude 0x7F) are set to NaN first. Scales up to 2^100 (the
// caller's check): scale * 2^8 stays finite. `exact`: UE8M0 scales, whose products are bf16
// values already (a truncation) for scales from 2^-100; fp32 scales are rounded to nearest
// even.
inline __m512i fp8_chunk(const uint8_t* codes, float scale, bool exact) {
  const __m512i c =
      _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
  // sign to bit 15, magnitude to bits 7-13 (bit 14, the sign's copy from the shift, cleared)
  const __m512i h = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(c, 8), 1),
                                     _mm512_set1_epi16(static_cast<int16_t>(0xBFFF)));
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(c, _mm512_set1_epi16(0x7F)),
                                                _mm512_set1_epi16(0x7F));
  const __m512 mul = _mm512_set1_ps(scale * 256.0f);
  __m512 v[2];
  for (int half = 0; half < 2; ++half) {
    const __m256i part = half ? _mm512_extracti64x4_epi64(h, 1) : _mm512_castsi512_si256(h);
    v[half] = _mm512_mask_mov_ps(_mm512_cvtph_ps(part),
                                 static_cast<__mmask16>(nan >> (16 * half)), _mm512_set1_ps(NAN));
    v[half] = _mm512_mul_ps(v[half], mul);
  }
  auto high = [&](__m512 x) {            // the bf16 bits in the high half of each lane
    return exact ? _mm512_castps_si512(x) : _mm512_slli_epi32(bf16_rne_bits(x), 16);
  };
  const __m512i lo = high(v[0]), hi = high(v[1]);
  // the high 16 bits of every 32-bit lane, lo's 16 then hi's 16
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37,
                                       35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7,
                                       5, 3, 1);
  return _mm512_permutex2var_epi16(lo, odd, hi);
}
#endif

// The same as bf16, rounded to nearest even as torch's .to(bfloat16) rounds (exact, i.e. a
// truncation, where the fp32 value is a bf16 value: FP8 / MXFP4 with UE8M0 scales).
inline void dequant_row_bf16_generic(const Format& f, const uint8_t* w, const uint8_t* s,
                                     const float* g, int64_t n, int64_t k0, int64_t k1,
                                     float* tmp, at::BFloat16* dst);

inline void dequant_row_bf16(const Format& f, const uint8_t* w, const uint8_t* s,
                             const float* g, int64_t n, int64_t k0, int64_t k1, float* tmp,
                             at::BFloat16* dst) {
#ifdef __AVX512F__
  if (f.kind == 1 && !f.fp32_scale && f.bn % 32 == 0 && k0 % 32 == 0) {
    // MXFP4 straight to bf16, 32 values (16 bytes, one scale) per step: the e2m1 table times
    // the scale, truncated to bf16 (exact), looked up by code with one 16-bit permute.
    const uint8_t* row = w + n * f.row_bytes;
    const uint8_t* srow = s + f.scale_row(n) * f.scols;
    const __m512 table = _mm512_loadu_ps(kE2M1.data());
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32)
      _mm512_storeu_si512(dst + (k - k0),
                          mxfp4_chunk(row + k / 2, kScale[srow[k / f.bn]], table));
    if (k < k1) dequant_row_bf16_generic(f, w, s, g, n, k, k1, tmp, dst + (k - k0));
    return;
  }
  if (f.kind == 2 && !f.fp32_scale && f.bn == 16 && k0 % 32 == 0 && g != nullptr &&
      nvfp4_global_ok(g[f.half_of(n)])) {
    // NVFP4, 32 values (16 bytes, two E4M3 scales) per step (nvfp4_chunk)
    const uint8_t* row = w + n * f.row_bytes;
    const uint8_t* srow = s + f.scale_row(n) * f.scols;
    const __m512 table = _mm512_loadu_ps(kE2M1.data());
    const __m512 global = _mm512_set1_ps(g[f.half_of(n)]);
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32)
      _mm512_storeu_si512(dst + (k - k0), nvfp4_chunk(row + k / 2, kE4M3[srow[k / 16]],
                                                      kE4M3[srow[k / 16 + 1]], global, table));
    if (k < k1) dequant_row_bf16_generic(f, w, s, g, n, k, k1, tmp, dst + (k - k0));
    return;
  }
  if (f.kind == 0 && f.bn % 32 == 0 && k0 % 32 == 0) {
    // FP8 e4m3, 32 values (one scale) per step (fp8_chunk); a scale it cannot take exactly
    // goes through the fp32 path, as does a partial last chunk.
    const uint8_t* row = w + n * f.row_bytes;
    const uint8_t* srow = scale_row_ptr(f, s, n);
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
      const float scale = scale_at(f, srow, k / f.bn);
      // fp8_chunk's range: scale * 2^8 finite, and UE8M0 products normal (a subnormal
      // fp32 product is not always a bf16 value: it would need rounding, not truncation)
      if (!(std::fabs(scale) <= 0x1p100f) || (!f.fp32_scale && scale < 0x1p-100f)) break;
      _mm512_storeu_si512(dst + (k - k0), fp8_chunk(row + k, scale, !f.fp32_scale));
    }
    if (k < k1) dequant_row_bf16_generic(f, w, s, g, n, k, k1, tmp, dst + (k - k0));
    return;
  }
#endif
  dequant_row_bf16_generic(f, w, s, g, n, k0, k1, tmp, dst);
}

inline void dequant_row_bf16_generic(const Format& f, const uint8_t* w, const uint8_t* s,
                                     const float* g, int64_t n, int64_t k0, int64_t k1,
                                     float* tmp, at::BFloat16* dst) {
  dequant_row_f32(f, w, s, g, n, k0, k1, tmp);
  const int64_t len = k1 - k0;
  int64_t k = 0;
#ifdef __AVX512F__
  // round to nearest even: bits + 0x7FFF + lsb of the kept half (a quiet NaN stays NaN)
  for (; k + 16 <= len; k += 16) {
    const __m512i b = _mm512_castps_si512(_mm512_loadu_ps(tmp + k));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i bits = _mm512_srli_epi32(
        _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), _mm512_cvtepi32_epi16(bits));
  }
#endif
  for (; k < len; ++k) {
    uint32_t bits;
    std::memcpy(&bits, tmp + k, 4);
    const uint16_t top = uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    std::memcpy(dst + k, &top, 2);
  }
}

}  // namespace wideserve_quant
