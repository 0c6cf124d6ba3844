// Per-head q/k RMSNorm (Qwen3; optional) and rotate-half RoPE applied in place to the fused
// q||k||v projection output (docs/cpu_kernels.md, "q/k norm + RoPE"). The contract is the
// torch path in models/llama.py (Attention.forward): layers/norm.py's rms_norm per head, then
// layers/rotary.py's apply_rotary:
//
//   qkv      [T, (H + 2*Hkv) * D], fp32 or bf16, rows contiguous; q heads, then k heads, then v
//            (v is not touched)
//   cos, sin [T, D] fp32 (RotaryEmbedding.cos_sin: the two halves of a row are equal)
//   q_weight, k_weight [D] (any float dtype) or both absent: no norm
//
// Rounding follows the torch path where it rounds: the norm is computed in fp32 and its result
// rounded to qkv's dtype; the rotation is then computed in fp32 and rounded once (the torch
// path rounds each product too, so bf16 results may differ from it by an ulp).
//
// Work item: one token (all its q and k heads), split over threads with at::parallel_for.
// Two implementations of the per-head step: a portable one (plain C++) and an AVX512 one
// (D a multiple of 32). `portable=true` forces the first, so both are testable on one machine.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

struct Problem {
  int64_t heads, kv_heads, dim, row_stride;
  const float* cos;
  const float* sin;
  const float* qw;                  // nullptr: no norm
  const float* kw;
  float eps;
};

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// Portable: one head of `dim` values, in place.
template <typename T>
void head_portable(T* x, const float* w, const float* cos, const float* sin, int64_t dim,
                   float eps, float* buf) {
  for (int64_t i = 0; i < dim; ++i) buf[i] = to_f(x[i]);
  if (w != nullptr) {
    float ss = 0.f;
    for (int64_t i = 0; i < dim; ++i) ss += buf[i] * buf[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
    // Rounded to T as the torch path's norm output is.
    for (int64_t i = 0; i < dim; ++i) buf[i] = to_f(static_cast<T>(buf[i] * r * w[i]));
  }
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = buf[i], b = buf[i + half];
    x[i] = static_cast<T>(a * cos[i] - b * sin[i]);
    x[i + half] = static_cast<T>(b * cos[i + half] + a * sin[i + half]);
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
// fp32 -> bf16, round to nearest even (NaN inputs are not expected from a GEMM + norm).
inline __m256i to_bf16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}
template <typename T>
inline __m512 round_trip(__m512 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  __m512i b = _mm512_cvtepu16_epi32(to_bf16(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
}

// AVX512: dim % 32 == 0 (so each half is whole 16-lane vectors), dim <= 256; K heads at once
// (head k at x + k * 16 * N), N = dim / 16 vectors a head. Both as template arguments, so that the
// heads stay in registers, the loops unroll and the K heads' dependency chains (sum of
// squares, reduction, square root, division) interleave: with N known only at run time GCC
// kept one head in a stack array and called this once per head (~60 ns a head on the Zen 4,
// the 653M decode layer's 1,280 heads ~78 us on one thread). The same operations in the same
// order for every head whatever K and N: the results do not depend on them.
template <typename T, int N, int K>
[[gnu::always_inline]] inline void heads_avx512(T* x, const float* w, const float* cos,
                                                const float* sin, float eps) {
  constexpr int HN = N / 2, D = 16 * N;
  __m512 v[K][N];
  for (int k = 0; k < K; ++k)
    for (int j = 0; j < N; ++j) v[k][j] = load16(x + k * D + 16 * j);
  if (w != nullptr) {
    __m512 rv[K];
    for (int k = 0; k < K; ++k) {
      __m512 acc = _mm512_setzero_ps();
      for (int j = 0; j < N; ++j) acc = _mm512_fmadd_ps(v[k][j], v[k][j], acc);
      rv[k] = _mm512_set1_ps(
          1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(D) + eps));
    }
    for (int k = 0; k < K; ++k)
      for (int j = 0; j < N; ++j)
        v[k][j] = round_trip<T>(_mm512_mul_ps(_mm512_mul_ps(v[k][j], rv[k]), load16(w + 16 * j)));
  }
  for (int k = 0; k < K; ++k)
    for (int j = 0; j < HN; ++j) {
      const __m512 a = v[k][j], b = v[k][j + HN];
      const __m512 lo = _mm512_fmsub_ps(a, load16(cos + 16 * j),
                                        _mm512_mul_ps(b, load16(sin + 16 * j)));
      const __m512 hi = _mm512_fmadd_ps(b, load16(cos + 16 * (j + HN)),
                                        _mm512_mul_ps(a, load16(sin + 16 * (j + HN))));
      store16(x + k * D + 16 * j, lo);
      store16(x + k * D + 16 * (j + HN), hi);
    }
}

// Heads [h0, h1) of one row, all with norm weight w: K at a time while K remain, then one.
template <typename T, int N>
inline void head_range(T* row, int64_t h0, int64_t h1, const float* w, const float* cos,
                       const float* sin, float eps) {
  constexpr int K = N <= 4 ? 4 : (N <= 8 ? 2 : 1);   // K x N <= 16 registers of heads
  int64_t h = h0;
  for (; h + K <= h1; h += K) heads_avx512<T, N, K>(row + h * 16 * N, w, cos, sin, eps);
  for (; h < h1; ++h) heads_avx512<T, N, 1>(row + h * 16 * N, w, cos, sin, eps);
}

// Every q and k head of tokens [t0, t1) on the AVX512 path, N = dim / 16.
template <typename T, int N>
void rows_avx512(T* qkv, const Problem& p, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    T* row = qkv + t * p.row_stride;
    const float* c = p.cos + t * p.dim;
    const float* s = p.sin + t * p.dim;
    head_range<T, N>(row, 0, p.heads, p.qw, c, s, p.eps);
    head_range<T, N>(row, p.heads, p.heads + p.kv_heads, p.kw, c, s, p.eps);
  }
}

// dim (a multiple of 32, at most 256) -> rows_avx512<T, dim / 16>.
template <typename T>
void rows_avx512_any(T* qkv, const Problem& p, int64_t t0, int64_t t1) {
  switch (p.dim / 16) {
    case 2: return rows_avx512<T, 2>(qkv, p, t0, t1);
    case 4: return rows_avx512<T, 4>(qkv, p, t0, t1);
    case 6: return rows_avx512<T, 6>(qkv, p, t0, t1);
    case 8: return rows_avx512<T, 8>(qkv, p, t0, t1);
    case 10: return rows_avx512<T, 10>(qkv, p, t0, t1);
    case 12: return rows_avx512<T, 12>(qkv, p, t0, t1);
    case 14: return rows_avx512<T, 14>(qkv, p, t0, t1);
    default: return rows_avx512<T, 16>(qkv, p, t0, t1);
  }
}
#endif

template <typename T>
void run(T* qkv, const Problem& p, int64_t tokens, bool portable) {
#if defined(__AVX512F__)
  const bool vec = !portable && p.dim % 32 == 0 && p.dim <= 256;
#else
  const bool vec = false;
  (void)portable;
#endif
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
#if defined(__AVX512F__)
    if (vec) return rows_avx512_any<T>(qkv, p, t0, t1);
#endif
    std::vector<float> buf(p.dim);
    for (int64_t t = t0; t < t1; ++t) {
      T* row = qkv + t * p.row_stride;
      const float* c = p.cos + t * p.dim;
      const float* s = p.sin + t * p.dim;
      for (int64_t h = 0; h < p.heads + p.kv_heads; ++h)
        head_portable<T>(row + h * p.dim, h < p.heads ? p.qw : p.kw, c, s, p.dim, p.eps,
                         buf.data());
    }
  });
}

void qk_norm_rope_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                   const std::optional<at::Tensor>& q_weight,
                   const std::optional<at::Tensor>& k_weight, int64_t heads, int64_t kv_heads,
                   int64_t dim, double eps, bool portable) {
  TORCH_CHECK(qkv.dim() == 2, "qk_norm_rope_: qkv must be [T, (H + 2*Hkv) * D]");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16,
              "qk_norm_rope_: qkv must be fp32 or bf16");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && dim > 0 && dim % 2 == 0,
              "qk_norm_rope_: bad head shape");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim && qkv.stride(1) == 1,
              "qk_norm_rope_: qkv width ", qkv.size(1), " != (H + 2*Hkv) * D or not row-contiguous");
  const int64_t tokens = qkv.size(0);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == tokens && t->size(1) == dim,
                "qk_norm_rope_: cos/sin must be contiguous fp32 [T, D]");
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(),
              "qk_norm_rope_: q_weight and k_weight come together");
  // The weights in fp32, converted here (a torch .to() per call costs more than the kernel).
  std::vector<float> qw, kw;
  if (q_weight.has_value()) {
    for (auto pair : {std::pair{&*q_weight, &qw}, std::pair{&*k_weight, &kw}}) {
      const at::Tensor* src = pair.first;
      std::vector<float>* dst = pair.second;
      TORCH_CHECK(src->numel() == dim && src->dim() == 1, "qk_norm_rope_: norm weights must be [D]");
      TORCH_CHECK(src->device().is_cpu(), "qk_norm_rope_: norm weights must be on the CPU");
      dst->resize(dim);
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src->scalar_type(), "qk_norm_w", [&] {
        const scalar_t* w = src->data_ptr<scalar_t>();
        const int64_t st = src->stride(0);
        for (int64_t i = 0; i < dim; ++i) (*dst)[i] = static_cast<float>(w[i * st]);
      });
    }
  }
  if (tokens == 0) return;
  Problem p{heads, kv_heads, dim, qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
            qw.empty() ? nullptr : qw.data(), kw.empty() ? nullptr : kw.data(), static_cast<float>(eps)};
  if (qkv.scalar_type() == at::kBFloat16)
    run<at::BFloat16>(qkv.data_ptr<at::BFloat16>(), p, tokens, portable);
  else
    run<float>(qkv.data_ptr<float>(), p, tokens, portable);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("qk_norm_rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor? q_weight, "
        "Tensor? k_weight, int heads, int kv_heads, int dim, float eps, "
        "bool portable=False) -> ()");
}

TORCH_LIBRARY_IMPL(wideserve, CPU, m) {
  m.impl("qk_norm_rope_", &qk_norm_rope_);
}
