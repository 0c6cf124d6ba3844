// Batch-reduce GEMM tiles through torch's `at::native::cpublas::brgemm` (oneDNN's ukernel:
// AMX tiles where the CPU has them, AVX512 otherwise) over the micro-kernel's packed weights
// (docs/cpu_kernels.md, "Kernel choice").
//
// The panel layout of csrc/gemm.h, a group of NB blocks of 16 output rows stored as
// [K/2, NB, 16, 2] bf16, is exactly the VNNI layout brgemm takes for a B of K x (16 NB)
// (ld_b = 16 NB): one packed copy of a weight serves both the micro-kernel (small M) and
// brgemm (larger M), so choosing between them per call costs no memory.
#pragma once

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace wideserve_brgemm {

constexpr int64_t kBlockM = 32;   // rows per brgemm call: 2 AMX tiles of 16 rows

// c [m, ldc] fp32 = a [m, K] (row stride lda, bf16, K even) x the packed group w (K x cols).
inline void tile(int64_t m, int64_t cols, int64_t k, int64_t lda, const at::BFloat16* a,
                 const at::BFloat16* w, float* c) {
  at::native::cpublas::brgemm(m, cols, k, lda, cols, cols, /*add_C=*/false, a, w, c,
                              /*is_vnni=*/true);
}

// Frees the AMX tile configuration this thread's brgemm calls set (once per parallel body).
inline void release() { at::native::cpublas::brgemm_release(/*is_vnni=*/true); }

// Whether torch's brgemm takes bf16 on a VNNI B here. Its oneDNN ukernel does so from
// avx512_core up (AMX tiles where present, AVX512-BF16 dot products on a Zen 4), and the call
// raises elsewhere. torch exposes only `could_pack`, true with AMX alone (the packing AMX
// needs), which kept brgemm off every AVX512-BF16 CPU without AMX, where it runs and was
// measured faster than the micro-kernel at some shapes (BENCHMARKS.md, "AMD EPYC Zen 4:
// brgemm without AMX"). So one 1 x 16 x 2 call is made once, and its result checked.
inline bool runs() {
  static const bool ok = [] {
    try {
      alignas(64) at::BFloat16 a[2] = {at::BFloat16(1.0f), at::BFloat16(2.0f)};
      alignas(64) at::BFloat16 b[2 * 16];            // [K/2 = 1, 16, 2]: column n = (n, 1)
      for (int n = 0; n < 16; ++n) {
        b[2 * n] = at::BFloat16(static_cast<float>(n));
        b[2 * n + 1] = at::BFloat16(1.0f);
      }
      alignas(64) float c[16];
      tile(1, 16, 2, 2, a, b, c);
      release();
      for (int n = 0; n < 16; ++n)
        if (c[n] != static_cast<float>(n + 2)) return false;
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return ok;
}

// One output row: out[c] = round(acc[c] + bias[c]) for c < cols (RNE, as the micro-kernel
// and Tensor.to round). `widen`: the rounded value stored as fp32.
template <typename Out>
inline void store_row(const float* acc, const float* bias, int64_t cols, bool widen, Out* out) {
  int64_t c = 0;
#ifdef __AVX512BF16__
  for (; c < cols; c += 16) {
    const int64_t n = std::min<int64_t>(16, cols - c);
    const __mmask16 mask = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    __m512 v = _mm512_maskz_loadu_ps(mask, acc + c);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + c));
    const __m256bh h = _mm512_cvtneps_pbh(v);
    if constexpr (std::is_same_v<Out, float>) {
      const __m512 f = widen ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                   _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h)),
                                   16))
                             : v;
      _mm512_mask_storeu_ps(out + c, mask, f);
    } else {
      _mm256_mask_storeu_epi16(out + c, mask, reinterpret_cast<const __m256i&>(h));
    }
  }
#else
  for (; c < cols; ++c) {
    float v = acc[c] + (bias ? bias[c] : 0.0f);
    if (widen) v = static_cast<float>(static_cast<at::BFloat16>(v));
    out[c] = static_cast<Out>(v);
  }
#endif
}

// gemm_linear_brgemm (csrc/brgemm.cpp), for the other ops' GEMMs (moe_route's logits).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t n,
                  const std::optional<at::Tensor>& bias, bool widen);

}  // namespace wideserve_brgemm
