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
