// One mHC site in three calls, for small decode steps (docs/cpu_kernels.md, "Fused mHC").
//
// The torch form (layers/mhc.py, models/deepseek_v41/common.py) runs a site as ~65 small ops
// at one row (flatten and RMS, the projection, sigmoids, softmax, Sinkhorn's passes, the
// collapse and the expand), a few microseconds each in dispatch and allocation against
// nanoseconds of arithmetic. These make one pass per row:
//   mhc_coeffs   x [T, n, d] -> pre [T, n], post [T, n], comb [T, n, n] (fp32)
//   mhc_collapse x, pre -> [T, d]: sum_j pre_j x_j, in x's dtype
//   mhc_expand   x, post, comb, y -> [T, n, d]: post_k y + sum_j comb[j, k] x_j, in x's dtype
// The maths is the reference's in fp32, in its order of operations, except that the sums of
// the RMS and of the projection are taken in 16 lanes and the projection is scaled by the
// RMS after the dot product (V4 scales before: the same value up to fp32 rounding), and exp
// is the C library's. So the coefficients agree with torch to fp32 rounding, not bit for bit:
// the layers use these only where the default mode allows a batch-size dependent rounding
// (the small-batch path in bf16, never under --batch-invariant). The collapse and the expand
// multiply and add in torch's order with no fused multiply-add (contraction is off in this
// file), so the collapse, and V4.1's elementwise expand, equal torch's bits.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }

// Sum of a[i] * b[i], 16 lanes where AVX512 is compiled in.
inline float dot(const float* a, const float* b, int64_t k) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= k; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < k; ++i) s += a[i] * b[i];
  return s;
}

inline float sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }

// Divides each of the n lines of c (line o: c[o * along + i * across], i < n) by its sum + eps.
void normalize_lines(float* c, int64_t n, int64_t along, int64_t across, float eps) {
  for (int64_t o = 0; o < n; ++o) {
    float* line = c + o * along;
    float s = 0.f;
    for (int64_t i = 0; i < n; ++i) s += line[i * across];
    s += eps;
    for (int64_t i = 0; i < n; ++i) line[i * across] /= s;
  }
}

// Sinkhorn over one row's comb [n, n] (row-major: c[a * n + b]), as layers/mhc.py `sinkhorn`:
// a column pass, then (row, column) passes; eps added to every sum.
void sinkhorn(float* c, int64_t n, int64_t iters, float eps) {
  normalize_lines(c, n, 1, n, eps);                 // columns
  for (int64_t it = 1; it < iters; ++it) {
    normalize_lines(c, n, n, 1, eps);               // rows
    normalize_lines(c, n, 1, n, eps);
  }
}

template <typename T>
void coeffs_rows(const T* x, const float* fn, const float* base, const float* scale, int64_t rows,
                 int64_t n, int64_t d, int64_t iters, float hc_eps, float norm_eps, float* pre,
                 float* post, float* comb) {
  const int64_t k = n * d, width = (2 + n) * n;
  std::vector<float> flat(k), mixes(width);
  for (int64_t t = 0; t < rows; ++t) {
    const T* xt = x + t * k;
    for (int64_t i = 0; i < k; ++i) flat[i] = to_f(xt[i]);
    const float r = 1.f / std::sqrt(dot(flat.data(), flat.data(), k) / static_cast<float>(k) +
                                    norm_eps);
    for (int64_t j = 0; j < width; ++j) mixes[j] = dot(flat.data(), fn + j * k, k) * r;
    float* pt = pre + t * n;
    float* qt = post + t * n;
    float* ct = comb + t * n * n;
    for (int64_t i = 0; i < n; ++i) {
      pt[i] = sigmoid(mixes[i] * scale[0] + base[i]) + hc_eps;
      qt[i] = 2.f * sigmoid(mixes[n + i] * scale[1] + base[n + i]);
    }
    for (int64_t a = 0; a < n; ++a) {      // softmax over each row of the [n, n] logits
      float* row = ct + a * n;
      float mx = -INFINITY;
      for (int64_t b = 0; b < n; ++b) {
        const int64_t j = 2 * n + a * n + b;
        row[b] = mixes[j] * scale[2] + base[j];
        mx = std::max(mx, row[b]);
      }
      float s = 0.f;
      for (int64_t b = 0; b < n; ++b) s += (row[b] = std::exp(row[b] - mx));
      for (int64_t b = 0; b < n; ++b) row[b] = row[b] / s + hc_eps;
    }
    sinkhorn(ct, n, iters, hc_eps);
  }
}

template <typename T>
void collapse_rows(const T* x, const float* pre, T* out, int64_t rows, int64_t n, int64_t d) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* xt = x + t * n * d;
    const float* pt = pre + t * n;
    T* ot = out + t * d;
    for (int64_t i = 0; i < d; ++i) {
      float s = pt[0] * to_f(xt[i]);
      for (int64_t j = 1; j < n; ++j) s += pt[j] * to_f(xt[j * d + i]);
      ot[i] = static_cast<T>(s);
    }
  }
}

template <typename T>
void expand_rows(const T* x, const float* post, const float* comb, const T* y, T* out,
                 int64_t rows, int64_t n, int64_t d) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* xt = x + t * n * d;
    const T* yt = y + t * d;
    const float* ct = comb + t * n * n;
    for (int64_t k = 0; k < n; ++k) {
      T* ot = out + (t * n + k) * d;
      const float pk = post[t * n + k];
      for (int64_t i = 0; i < d; ++i) {
        float mixed = ct[k] * to_f(xt[i]);
        for (int64_t j = 1; j < n; ++j) mixed += ct[j * n + k] * to_f(xt[j * d + i]);
        ot[i] = static_cast<T>(pk * to_f(yt[i]) + mixed);
      }
    }
  }
}

void check_streams(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3, "mHC: x must be a CPU tensor [T, n, d]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "mHC: x must be float32 or bfloat16, got ", x.scalar_type());
}

at::Tensor f32(const at::Tensor& t, at::IntArrayRef shape, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.sizes() == shape,
              "mHC: ", what, " must be a CPU float32 tensor of shape ", shape, ", got ",
              t.scalar_type(), " ", t.sizes());
  return t.contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mhc_coeffs_op(
    const at::Tensor& x, const at::Tensor& fn, const at::Tensor& base, const at::Tensor& scale,
    int64_t iters, double hc_eps, double norm_eps) {
  check_streams(x);
  TORCH_CHECK(iters >= 1, "mHC: sinkhorn iterations must be >= 1, got ", iters);
  const int64_t rows = x.size(0), n = x.size(1), d = x.size(2), width = (2 + n) * n;
  const at::Tensor w = f32(fn, {width, n * d}, "fn");
  const at::Tensor b = f32(base, {width}, "base");
  const at::Tensor s = f32(scale, {3}, "scale");
  const at::Tensor xc = x.contiguous();
  auto opts = x.options().dtype(at::kFloat);
  at::Tensor pre = at::empty({rows, n}, opts), post = at::empty({rows, n}, opts);
  at::Tensor comb = at::empty({rows, n, n}, opts);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "mhc_coeffs", [&] {
    coeffs_rows<scalar_t>(xc.data_ptr<scalar_t>(), w.data_ptr<float>(), b.data_ptr<float>(),
                          s.data_ptr<float>(), rows, n, d, iters, static_cast<float>(hc_eps),
                          static_cast<float>(norm_eps), pre.data_ptr<float>(),
                          post.data_ptr<float>(), comb.data_ptr<float>());
  });
  return {pre, post, comb};
}

at::Tensor mhc_collapse_op(const at::Tensor& x, const at::Tensor& pre) {
  check_streams(x);
  const int64_t rows = x.size(0), n = x.size(1), d = x.size(2);
  TORCH_CHECK(n >= 1, "mHC: no streams");
  const at::Tensor p = f32(pre, {rows, n}, "pre");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({rows, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "mhc_collapse", [&] {
    collapse_rows<scalar_t>(xc.data_ptr<scalar_t>(), p.data_ptr<float>(),
                            out.data_ptr<scalar_t>(), rows, n, d);
  });
  return out;
}

at::Tensor mhc_expand_op(const at::Tensor& x, const at::Tensor& post, const at::Tensor& comb,
                         const at::Tensor& y) {
  check_streams(x);
  const int64_t rows = x.size(0), n = x.size(1), d = x.size(2);
  TORCH_CHECK(n >= 1, "mHC: no streams");
  TORCH_CHECK(y.device().is_cpu() && y.scalar_type() == x.scalar_type() &&
                  y.sizes() == at::IntArrayRef({rows, d}),
              "mHC: y must be [T, d] in x's dtype, got ", y.scalar_type(), " ", y.sizes());
  const at::Tensor q = f32(post, {rows, n}, "post");
  const at::Tensor c = f32(comb, {rows, n, n}, "comb");
  const at::Tensor xc = x.contiguous(), yc = y.contiguous();
  at::Tensor out = at::empty({rows, n, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "mhc_expand", [&] {
    expand_rows<scalar_t>(xc.data_ptr<scalar_t>(), q.data_ptr<float>(), c.data_ptr<float>(),
                          yc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n, d);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("mhc_coeffs(Tensor x, Tensor fn, Tensor base, Tensor scale, int iters, float hc_eps, "
        "float norm_eps) -> (Tensor, Tensor, Tensor)");
  m.def("mhc_collapse(Tensor x, Tensor pre) -> Tensor");
  m.def("mhc_expand(Tensor x, Tensor post, Tensor comb, Tensor y) -> Tensor");
}

TORCH_LIBRARY_IMPL(wideserve, CPU, m) {
  m.impl("mhc_coeffs", &mhc_coeffs_op);
  m.impl("mhc_collapse", &mhc_collapse_op);
  m.impl("mhc_expand", &mhc_expand_op);
}
