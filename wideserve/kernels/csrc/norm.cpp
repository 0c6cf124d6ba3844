// Fused residual add + RMS norm, RMS norm, and row argmax for the CPU decode step
// (docs/cpu_kernels.md, "Norms and greedy argmax").
//
// The torch reference (layers/norm.py, executor/sampler.py) runs each norm as ~8 small ops
// (upcast, pow, mean, add, rsqrt, two muls, downcast) and the residual add as one more; at
// decode sizes (tens of rows of a few hundred values) each op costs more in dispatch and
// allocation than in arithmetic. These kernels make one pass per row: the residual sum is
// rounded to the activation dtype exactly as torch's add rounds it, then normalised in fp32
// with the reference's order of operations, (x * rsqrt(mean(x^2) + eps)) * w, then rounded.
// Only the sum of squares is accumulated in a different order (16 lanes), so results agree
// with torch to fp32 rounding of that sum.
//
// Two implementations of each loop: a portable one (plain C++) and an AVX512 one, taken when
// the width is a multiple of 16. `portable=true` forces the first, so both are testable.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }
template <typename T> inline T from_f(float v) { return static_cast<T>(v); }

// ---------------------------------------------------------------- portable rows
// One row: optionally h = round(h + delta) (written to sum_out), then out = norm(h) * w.
template <typename T>
void row_portable(const T* h, const T* delta, T* sum_out, const float* w, T* out, int64_t d,
                  float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < d; ++i) {
    float x = to_f(h[i]);
    if (delta) {
      T s = from_f<T>(x + to_f(delta[i]));
      sum_out[i] = s;
      x = to_f(s);
    }
    ss += x * x;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  const T* src = delta ? sum_out : h;
  for (int64_t i = 0; i < d; ++i) {
    float y = to_f(src[i]) * inv;
    out[i] = from_f<T>(w ? y * w[i] : y);
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int i = 0; i < 16; ++i) p[i] = static_cast<at::BFloat16>(tmp[i]);
#endif
}
// Round to T and back, so the sum used by the norm is the sum that is stored.
inline __m512 round_trip(float*, __m512 v) { return v; }
inline __m512 round_trip(at::BFloat16* p, __m512 v) { store16(p, v); return load16(p); }

template <typename T>
void row_avx512(const T* h, const T* delta, T* sum_out, const float* w, T* out, int64_t d,
                float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    __m512 x = load16(h + i);
    if (delta) {
      x = _mm512_add_ps(x, load16(delta + i));
      store16(sum_out + i, x);
      x = round_trip(sum_out + i, x);
    }
    acc = _mm512_fmadd_ps(x, x, acc);
  }
  const float ss = _mm512_reduce_add_ps(acc);
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(ss / static_cast<float>(d) + eps));
  const T* src = delta ? sum_out : h;
  for (int64_t i = 0; i < d; i += 16) {
    __m512 y = _mm512_mul_ps(load16(src + i), inv);
    if (w) y = _mm512_mul_ps(y, _mm512_loadu_ps(w + i));
    store16(out + i, y);
  }
}
#endif

template <typename T>
void norm_rows(const at::Tensor& h, const at::Tensor* delta, at::Tensor* sum, const float* w,
               at::Tensor& out, double eps, bool portable) {
  const int64_t d = h.size(-1), rows = h.numel() / std::max<int64_t>(d, 1);
  auto fn = row_portable<T>;
#if defined(__AVX512F__)
  if (!portable && d % 16 == 0) fn = row_avx512<T>;
#endif
  const T* hp = h.data_ptr<T>();
  const T* dp = delta ? delta->data_ptr<T>() : nullptr;
  T* sp = sum ? sum->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r)
      fn(hp + r * d, dp ? dp + r * d : nullptr, sp ? sp + r * d : nullptr, w, op + r * d, d, e);
  });
}

void check_act(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu(), what, " must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what,
              " must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, what, " must have at least one dimension");
}

std::vector<float> weight_f32(const c10::optional<at::Tensor>& weight, int64_t d) {
  if (!weight.has_value()) return {};
  TORCH_CHECK(weight->dim() == 1 && weight->size(0) == d, "weight must be [", d, "], got ",
              weight->sizes());
  at::Tensor w = weight->to(at::kFloat).contiguous();
  return std::vector<float>(w.data_ptr<float>(), w.data_ptr<float>() + d);
}

void dispatch(const at::Tensor& h, const at::Tensor* delta, at::Tensor* sum,
              const std::vector<float>& w, at::Tensor& out, double eps, bool portable) {
  const float* wp = w.empty() ? nullptr : w.data();
  if (h.scalar_type() == at::kBFloat16)
    norm_rows<at::BFloat16>(h, delta, sum, wp, out, eps, portable);
  else
    norm_rows<float>(h, delta, sum, wp, out, eps, portable);
}

at::Tensor rms_norm_op(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps,
                       bool portable) {
  check_act(x, "x");
  at::Tensor h = x.contiguous();
  at::Tensor out = at::empty_like(h);
  dispatch(h, nullptr, nullptr, weight_f32(weight, h.size(-1)), out, eps, portable);
  return out;
}

// (h + delta, rms_norm(h + delta) * weight): the decoder layer's residual add and the next
// norm in one pass. Out of place: callers may still hold h.
std::tuple<at::Tensor, at::Tensor> add_rms_norm_op(const at::Tensor& h, const at::Tensor& delta,
                                                   const c10::optional<at::Tensor>& weight,
                                                   double eps, bool portable) {
  check_act(h, "h");
  TORCH_CHECK(delta.sizes() == h.sizes() && delta.scalar_type() == h.scalar_type(),
              "delta must match h: ", delta.sizes(), " ", delta.scalar_type(), " vs ",
              h.sizes(), " ", h.scalar_type());
  at::Tensor hc = h.contiguous(), dc = delta.contiguous();
  at::Tensor sum = at::empty_like(hc), out = at::empty_like(hc);
  dispatch(hc, &dc, &sum, weight_f32(weight, hc.size(-1)), out, eps, portable);
  return {sum, out};
}

// ---------------------------------------------------------------- argmax over rows
// torch.argmax semantics: the first index of the maximum; a NaN counts as the maximum (first
// NaN wins). The vector path finds the max, then the first lane equal to it; a row holding a
// NaN falls back to the scalar loop.
int64_t argmax_portable(const float* x, int64_t n) {
  int64_t best = 0;
  float m = x[0];
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > m) { m = x[i]; best = i; }
  }
  return best;
}

#if defined(__AVX512F__)
int64_t argmax_avx512(const float* x, int64_t n) {
  const int64_t nv = n / 16 * 16;
  if (nv == 0) return argmax_portable(x, n);
  __m512 mv = _mm512_loadu_ps(x);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < nv; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mv = _mm512_max_ps(mv, v);
  }
  float m = _mm512_reduce_max_ps(mv);
  for (int64_t i = nv; i < n; ++i) {
    if (std::isnan(x[i])) nan = 1;
    else if (x[i] > m) m = x[i];
  }
  if (nan) return argmax_portable(x, n);
  const __m512 target = _mm512_set1_ps(m);
  for (int64_t i = 0; i < nv; i += 16) {
    __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (int64_t i = nv; i < n; ++i)
    if (x[i] == m) return i;
  return 0;   // unreachable: m is an element
}
#endif

at::Tensor argmax_rows_op(const at::Tensor& x, bool portable) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "x must be a CPU float32 [R, V] tensor, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) > 0, "argmax over an empty dimension");
  at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  auto fn = argmax_portable;
#if defined(__AVX512F__)
  if (!portable) fn = argmax_avx512;
#endif
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r) op[r] = fn(xp + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps, bool portable=False) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor delta, Tensor? weight, float eps, bool portable=False)"
        " -> (Tensor, Tensor)");
  m.def("argmax_rows(Tensor x, bool portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(wideserve, CPU, m) {
  m.impl("rms_norm", &rms_norm_op);
  m.impl("add_rms_norm", &add_rms_norm_op);
  m.impl("argmax_rows", &argmax_rows_op);
}
