// DeepSeek-V4/V4.1 attention of a block of queries, one query row at a time, in an order that
// does not depend on the block's key layout (--batch-invariant; docs/cpu_kernels.md, "Batch
// invariance"; the readable torch form is layers/attention/v4_batched.py `_softmax_attend`):
//
//   v4_attend_rows(q [C, Q*H, D], keys [C, N, D], bias [C, Q, N] fp32 (0 / -inf),
//                  sinks [H] fp32, scale, sink_slot, own? [C, Q, k, D], chosen? [C, Q, k] bool)
//     -> [C, Q, H, D] in q's dtype
//
// A query reads the columns j of its block whose bias is finite, in column order, then its
// own picked entries (`own`, where `chosen`) in pick order; the sink column always, with the
// sink logit as its score and nothing added to the output. Prefill blocks of 32 queries, a
// one-query block and a decode step lay a query's keys out at other columns with other
// masked columns between them, but the readable columns come in the same order in all of
// them (window positions ascending, the sink, entries ascending, picks): so a query's
// result does not depend on the layout, and blocks of many queries can replace the one
// query per block the mode needed with torch's batched products.
//
// Precision as the torch form: q . k accumulated in fp32 and rounded to q's dtype, then
// scaled and biased in fp32; softmax in fp32; probabilities rounded to q's dtype; p . v
// accumulated in fp32 and rounded once. Every sum runs over the readable columns in that
// order (the dot over D in fixed lanes of d), so masked rows, whatever they hold (stale
// data, NaN), never reach the result.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "gemm.h"

namespace {

template <typename T>
inline float dot(const T* a, const float* b, int64_t d) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, float>) {
    if (d % 16 == 0) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < d; i += 16) {
        __m512 av;
        if constexpr (std::is_same_v<T, float>) {
          av = _mm512_loadu_ps(a + i);
        } else {
          av = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i))), 16));
        }
        acc = _mm512_fmadd_ps(av, _mm512_loadu_ps(b + i), acc);
      }
      return _mm512_reduce_add_ps(acc);
    }
  }
#endif
  float acc = 0.0f;
  for (int64_t i = 0; i < d; ++i) acc = std::fma(static_cast<float>(a[i]), b[i], acc);
  return acc;
}

// acc[0..d) += p * v[0..d) (fp32)
template <typename T>
inline void axpy(float p, const T* v, float* acc, int64_t d) {
  for (int64_t i = 0; i < d; ++i) acc[i] = std::fma(p, static_cast<float>(v[i]), acc[i]);
}

// x[j] = exp(x[j] - mx) for j < n, returning their sum: 16 lanes by j (lane j % 16) and a
// fixed reduction of the lanes, so the result depends on the sequence x alone.
inline float exp_sum(float* x, int64_t n, float mx) {
#ifdef __AVX512BF16__
  __m512 sum = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(mx);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(
        k, wideserve_gemm::exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), m)));
    _mm512_mask_storeu_ps(x + j, k, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
#else
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] - mx);
    total += x[j];
  }
  return total;
#endif
}

struct Shape {
  int64_t C, Q, H, D, N, K;   // K: own picks per query (0: none)
  float scale;
  int64_t sink_slot;
};

// Scratch of one thread: the readable columns of a query slot (their key rows and biases),
// one head's fp32 query and scores, the output accumulator.
template <typename T>
struct Scratch {
  std::vector<const T*> cols;
  std::vector<float> col_bias, score, qf, acc;
};

// One query slot (c, qi): every head.
template <typename T>
void attend_slot(const Shape& s, const T* q, const T* keys, const float* bias,
                 const float* sinks, const T* own, const bool* chosen, int64_t c, int64_t qi,
                 Scratch<T>& w, T* out) {
  w.cols.clear();
  w.col_bias.clear();
  int64_t sink_at = -1;
  const int64_t slot = c * s.Q + qi;
  const float* brow = bias + slot * s.N;
  for (int64_t j = 0; j < s.N; ++j) {
    if (j == s.sink_slot) {
      sink_at = static_cast<int64_t>(w.cols.size());
      w.cols.push_back(nullptr);
      w.col_bias.push_back(0.0f);
    } else if (brow[j] > -INFINITY) {
      w.cols.push_back(keys + (c * s.N + j) * s.D);
      w.col_bias.push_back(brow[j]);
    }
  }
  for (int64_t e = 0; e < s.K; ++e) {
    if (chosen[slot * s.K + e]) {
      w.cols.push_back(own + (slot * s.K + e) * s.D);
      w.col_bias.push_back(0.0f);
    }
  }
  const int64_t n = static_cast<int64_t>(w.cols.size());
  w.score.resize(n);
  for (int64_t h = 0; h < s.H; ++h) {
    const T* qh = q + (slot * s.H + h) * s.D;
    for (int64_t i = 0; i < s.D; ++i) w.qf[i] = static_cast<float>(qh[i]);
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      if (j == sink_at) {
        w.score[j] = sinks[h];
      } else {
        const float d = static_cast<float>(static_cast<T>(dot(w.cols[j], w.qf.data(), s.D)));
        w.score[j] = d * s.scale + w.col_bias[j];
      }
      mx = std::max(mx, w.score[j]);
    }
    const float total = exp_sum(w.score.data(), n, mx);
    std::fill(w.acc.begin(), w.acc.end(), 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      if (j == sink_at) continue;             // a zero value row: adds nothing
      axpy(static_cast<float>(static_cast<T>(w.score[j] / total)), w.cols[j], w.acc.data(),
           s.D);
    }
    T* o = out + (slot * s.H + h) * s.D;
    for (int64_t i = 0; i < s.D; ++i) o[i] = static_cast<T>(w.acc[i]);
  }
}

at::Tensor v4_attend_rows(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& bias,
                          const at::Tensor& sinks, double scale, int64_t sink_slot,
                          const std::optional<at::Tensor>& own,
                          const std::optional<at::Tensor>& chosen) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && bias.dim() == 3,
              "v4_attend_rows: q [C, Q*H, D], keys [C, N, D], bias [C, Q, N]");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() &&
                  (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat),
              "v4_attend_rows: q and keys must both be bfloat16 or both float32");
  TORCH_CHECK(bias.scalar_type() == at::kFloat && sinks.scalar_type() == at::kFloat,
              "v4_attend_rows: bias and sinks must be float32");
  Shape s;
  s.C = q.size(0);
  s.Q = bias.size(1);
  s.D = q.size(2);
  s.N = keys.size(1);
  s.H = sinks.size(0);
  TORCH_CHECK(keys.size(0) == s.C && keys.size(2) == s.D && bias.size(0) == s.C &&
                  bias.size(2) == s.N && s.Q * s.H == q.size(1) && sink_slot >= 0 &&
                  sink_slot < s.N,
              "v4_attend_rows: shapes q ", q.sizes(), ", keys ", keys.sizes(), ", bias ",
              bias.sizes(), ", sinks ", sinks.sizes(), ", sink slot ", sink_slot,
              " do not match");
  s.K = 0;
  if (own.has_value()) {
    TORCH_CHECK(chosen.has_value() && own->dim() == 4 && own->size(0) == s.C &&
                    own->size(1) == s.Q && own->size(3) == s.D &&
                    own->scalar_type() == q.scalar_type() &&
                    chosen->scalar_type() == at::kBool &&
                    chosen->sizes() == own->sizes().slice(0, 3),
                "v4_attend_rows: own [C, Q, k, D] in q's dtype with chosen [C, Q, k] bool");
    s.K = own->size(2);
  }
  s.scale = static_cast<float>(scale);
  s.sink_slot = sink_slot;
  const at::Tensor qc = q.contiguous(), kc = keys.contiguous(), bc = bias.contiguous(),
                   sc = sinks.contiguous();
  at::Tensor oc, cc;
  if (s.K) {
    oc = own->contiguous();
    cc = chosen->contiguous();
  }
  at::Tensor out = at::empty({s.C, s.Q, s.H, s.D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "v4_attend_rows", [&] {
    const auto* qp = qc.data_ptr<scalar_t>();
    const auto* kp = kc.data_ptr<scalar_t>();
    const auto* op = s.K ? oc.data_ptr<scalar_t>() : nullptr;
    const bool* cp = s.K ? cc.data_ptr<bool>() : nullptr;
    auto* out_p = out.data_ptr<scalar_t>();
    at::parallel_for(0, s.C * s.Q, 16, [&](int64_t begin, int64_t end) {
      Scratch<scalar_t> w;
      w.qf.resize(s.D);
      w.acc.resize(s.D);
      for (int64_t r = begin; r < end; ++r)
        attend_slot<scalar_t>(s, qp, kp, bc.data_ptr<float>(), sc.data_ptr<float>(), op, cp,
                              r / s.Q, r % s.Q, w, out_p);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("v4_attend_rows(Tensor q, Tensor keys, Tensor bias, Tensor sinks, float scale, "
        "int sink_slot, Tensor? own=None, Tensor? chosen=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(wideserve, CPU, m) { m.impl("v4_attend_rows", &v4_attend_rows); }
