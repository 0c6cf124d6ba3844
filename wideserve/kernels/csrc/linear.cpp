// Small-M dense GEMMs on the CPU (docs/cpu_kernels.md, "Linear layers"): the decode step's
// linears, the LM head and the MoE router, over weights packed once (csrc/gemm.h layout).
//
//   gemm_linear(x [M, K], w packed, n, bias?) -> [M, n] = x @ W^T + bias
//   moe_route(x [T, K], w packed, experts, k, renormalize) -> (ids [T, k], weights [T, k])
//
// Both accumulate in fp32 and round once. gemm_linear's output is x's dtype, or fp32 holding
// the x-dtype-rounded values (`widen`: exactly F.linear(x, w).float(), without the second
// pass over the output). moe_route is Qwen3-MoE's router in one pass per row: logits rounded
// to x's dtype (as the torch linear leaves them), softmax in fp32, top-k (torch.topk's order,
// ties included), optional renormalisation of the k weights by their sum, rounded to x's
// dtype.
//
// Work is cut into (chunk of up to kChunkRows rows, group of NB blocks of 16 output columns)
// items under at::parallel_for; within one item a register tile of R rows x NB blocks reads
// the group's packed weights once per R rows, from L1/L2 after the first tile.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "brgemm.h"
#include "gemm.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using namespace wideserve_gemm;

constexpr int64_t kChunkRows = 96;

// Register rows per tile for NB blocks: R x NB fp32 accumulators (24 for NB = 4, 16 below).
template <int NB>
constexpr int tile_rows() { return NB == 4 ? 6 : (NB == 2 ? 8 : 8); }

struct Problem {
  int64_t m, k, n, pairs, pair, groups, nb;   // x [m, k] (k padded to pairs * pair)
  const float* bias;                          // fp32 [n] or nullptr
};

// Stores one row's NB blocks: fp32 accumulators (+ bias) -> the output row, columns from c0.
template <typename T, typename Out, int NB>
inline void store_portable(const float (&acc)[NB][kLanes], const Problem& p, int64_t c0,
                           bool widen, Out* out) {
  for (int b = 0; b < NB; ++b) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const int64_t c = c0 + b * kLanes + l;
      if (c >= p.n) return;
      float v = acc[b][l] + (p.bias ? p.bias[c] : 0.0f);
      if (widen) v = static_cast<float>(static_cast<T>(v));
      out[c] = static_cast<Out>(v);
    }
  }
}

template <typename T, typename Out, int NB, int R>
void tile_rows_portable(const T* x, const T* w, const Problem& p, int64_t r0, int64_t c0,
                        bool widen, Out* out) {
  const T* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (r0 + r) * p.pairs * p.pair;
  float acc[R][NB][kLanes];
  tile_portable<T, R, NB>(xr, p.pairs, static_cast<int>(p.pair), w, acc);
  for (int r = 0; r < R; ++r)
    store_portable<T, Out, NB>(acc[r], p, c0, widen, out + (r0 + r) * p.n);
}

// fp32 (--batch-invariant runs fp32 linears here, since MKL's fp32 GEMM rounds a row
// differently with M): every output is one fused multiply-add chain over k = 0..K-1 from 0,
// then + bias, in both the portable loop (std::fma) and the AVX-512 one (one zmm per 16
// outputs), so the two give the same bits and a row's bits do not depend on M or on the
// row's place in a tile. The bf16 tiles above keep tile_portable (csrc/gemm.h), which
// csrc/moe.cpp shares.
template <int NB, int R>
void tile_rows_fp32_portable(const float* x, const float* w, const Problem& p, int64_t r0,
                             int64_t c0, float* out) {
  float acc[R][NB][kLanes] = {};
  for (int64_t k = 0; k < p.pairs; ++k) {
    for (int n = 0; n < NB; ++n) {
      const float* wk = w + (k * NB + n) * kLanes;
      for (int r = 0; r < R; ++r) {
        const float xv = x[(r0 + r) * p.pairs + k];
        for (int l = 0; l < kLanes; ++l) acc[r][n][l] = std::fma(xv, wk[l], acc[r][n][l]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    store_portable<float, float, NB>(acc[r], p, c0, false, out + (r0 + r) * p.n);
}

#ifdef __AVX512F__
template <int NB, int R>
void tile_rows_fp32(const float* x, const float* w, const Problem& p, int64_t r0, int64_t c0,
                    float* out) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_setzero_ps();
  const float* xr = x + r0 * p.pairs;
  for (int64_t k = 0; k < p.pairs; ++k) {
    __m512 wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = _mm512_loadu_ps(w + (k * NB + n) * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(xr[r * p.pairs + k]);
      for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_fmadd_ps(xb, wv[n], acc[r][n]);
    }
  }
  for (int n = 0; n < NB; ++n) {
    const int64_t c = c0 + n * kLanes, cols = std::min<int64_t>(kLanes, p.n - c);
    if (cols <= 0) break;
    const __mmask16 mask = cols == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + c) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out + (r0 + r) * p.n + c, mask, _mm512_add_ps(acc[r][n], bias));
  }
}
#endif

inline bool fp32_fast_path_compiled() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

#ifdef __AVX512BF16__
template <typename Out, int NB, int R>
void tile_rows_bf16(const at::BFloat16* x, const at::BFloat16* w, const Problem& p, int64_t r0,
                    int64_t c0, bool widen, Out* out, const at::BFloat16* next,
                    NextShare share) {
  const at::BFloat16* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (r0 + r) * p.pairs * 2;
  __m512 acc[R][NB];
  tile_bf16<R, NB>(xr, p.pairs, w, acc, next, share);
  for (int b = 0; b < NB; ++b) {
    const int64_t c = c0 + b * kLanes, cols = std::min<int64_t>(kLanes, p.n - c);
    if (cols <= 0) break;
    const __mmask16 mask = cols == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + c) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_add_ps(acc[r][b], bias);
      const __m256bh h = _mm512_cvtneps_pbh(v);
      Out* o = out + (r0 + r) * p.n + c;
      if constexpr (std::is_same_v<Out, float>) {
        // widen: the bf16-rounded value (bf16 -> fp32 is a 16-bit shift); else fp32 as is
        const __m512 f = widen ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h)),
                                     16))
                               : v;
        _mm512_mask_storeu_ps(o, mask, f);
      } else {
        _mm256_mask_storeu_epi16(o, mask, reinterpret_cast<const __m256i&>(h));
      }
    }
  }
}
#endif

// `next`: the group this thread multiplies after this one (nullptr: none), asked for in equal
// shares by the group's tiles. All of it in the first tile (the earlier form) left that tile
// waiting on fill buffers: the 653M decode linears at 64 rows, weights from memory, 1-3%
// slower (BENCHMARKS.md, "Zen 4: the last tenth of the decode roofline").
template <typename T, typename Out, int NB>
void run_group(bool fast, const T* x, const T* w, const Problem& p, int64_t r_begin,
               int64_t r_end, int64_t c0, bool widen, Out* out, const T* next) {
  constexpr int R = tile_rows<NB>();
  const int64_t tiles = (r_end - r_begin + R - 1) / R;
  for (int64_t r = r_begin; r < r_end; r += R) {
    with_rows<R>(r_end - r, [&](auto rows) {
      constexpr int RR = decltype(rows)::value;
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (fast) return tile_rows_bf16<Out, NB, RR>(x, w, p, r, c0, widen, out, next,
                                                     NextShare{(r - r_begin) / R, tiles});
      }
#endif
      if constexpr (std::is_same_v<T, float>) {
#ifdef __AVX512F__
        if (fast) return tile_rows_fp32<NB, RR>(x, w, p, r, c0, out);
#endif
        return tile_rows_fp32_portable<NB, RR>(x, w, p, r, c0, out);
      }
      tile_rows_portable<T, Out, NB, RR>(x, w, p, r, c0, widen, out);
    });
  }
}

template <typename T, typename Out>
void run_linear(bool fast, const T* x, const T* w, const Problem& p, bool widen, Out* out) {
  const int64_t chunks = (p.m + kChunkRows - 1) / kChunkRows;
  const int64_t group_size = p.pairs * p.nb * kLanes * p.pair;
  // Below ~1M multiply-adds (~10 us of one core) a second thread's fork/join costs more than
  // it saves: one item range, run inline.
  const int64_t items = chunks * p.groups;
  const int64_t grain = p.m * p.n * p.k < (int64_t{1} << 20) ? items : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / p.groups, g = item % p.groups;
      const int64_t r0 = chunk * kChunkRows, r1 = std::min(p.m, r0 + kChunkRows);
      const T* wg = w + g * group_size;
      const T* next = item + 1 < end ? w + ((item + 1) % p.groups) * group_size : nullptr;
      const int64_t c0 = g * p.nb * kLanes;
      switch (p.nb) {
        case 1: run_group<T, Out, 1>(fast, x, wg, p, r0, r1, c0, widen, out, next); break;
        case 2: run_group<T, Out, 2>(fast, x, wg, p, r0, r1, c0, widen, out, next); break;
        default: run_group<T, Out, 4>(fast, x, wg, p, r0, r1, c0, widen, out, next); break;
      }
    }
  });
}

// Checks the packed weight against x and n; returns the problem (x padded to whole pairs).
Problem problem(const at::Tensor& x, const at::Tensor& w, int64_t n, const char* op) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be [M, K]");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, op,
              ": bfloat16 or float32 only, got ", dtype);
  TORCH_CHECK(w.scalar_type() == dtype, op, ": the packed weight must have the dtype of x");
  TORCH_CHECK(w.dim() == 5 && w.is_contiguous(), op, ": the packed weight must be a contiguous "
              "[groups, K/P, NB, 16, P] tensor (wideserve.kernels.gemm.pack_linear)");
  Problem p;
  p.pair = dtype == at::kBFloat16 ? 2 : 1;
  p.m = x.size(0);
  p.k = x.size(1);
  p.n = n;
  p.groups = w.size(0);
  p.pairs = w.size(1);
  p.nb = w.size(2);
  TORCH_CHECK((p.nb == 1 || p.nb == 2 || p.nb == 4) && w.size(3) == kLanes &&
                  w.size(4) == p.pair && p.pairs == (p.k + p.pair - 1) / p.pair &&
                  n > 0 && p.groups == (n + p.nb * kLanes - 1) / (p.nb * kLanes),
              op, ": packed weight ", w.sizes(), " does not match K ", p.k, ", N ", n,
              " (pack it with wideserve.kernels.gemm.pack_linear)");
  p.bias = nullptr;
  return p;
}

at::Tensor padded_rows(const at::Tensor& x, int64_t pair) {
  at::Tensor xc = x.contiguous();
  if (x.size(1) % pair) xc = at::constant_pad_nd(xc, {0, 1});   // the last pair reads one past K
  return xc;
}

at::Tensor gemm_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t n,
                       const std::optional<at::Tensor>& bias, bool widen, bool portable) {
  Problem p = problem(x_in, w, n, "gemm_linear");
  const auto dtype = x_in.scalar_type();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "gemm_linear: bias must be [", n, "]");
    b = bias->to(at::kFloat).contiguous();
    p.bias = b.data_ptr<float>();
  }
  at::Tensor out = at::empty({p.m, n}, x_in.options().dtype(widen ? at::kFloat : dtype));
  if (p.m == 0) return out;
  const at::Tensor x = padded_rows(x_in, p.pair);
  const bool fast = !portable && bf16_fast_path_compiled();
  if (dtype == at::kBFloat16) {
    const auto* xp = x.data_ptr<at::BFloat16>();
    const auto* wp = w.data_ptr<at::BFloat16>();
    if (widen) run_linear<at::BFloat16, float>(fast, xp, wp, p, true, out.data_ptr<float>());
    else run_linear<at::BFloat16, at::BFloat16>(fast, xp, wp, p, false,
                                                 out.data_ptr<at::BFloat16>());
  } else {
    run_linear<float, float>(!portable && fp32_fast_path_compiled(), x.data_ptr<float>(),
                             w.data_ptr<float>(), p, false, out.data_ptr<float>());
  }
  return out;
}

// Softmax of one row of logits into queue[e] = (probability, e). NaN anywhere: all NaN.
void softmax_row(const float* logits, int64_t experts, bool fast,
                 std::vector<std::pair<float, int64_t>>& queue) {
#ifdef __AVX512BF16__
  if (fast) {   // 16 experts at a time; exp_ps is within ~1 ulp of std::exp
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t e = 0; e < experts; e += kLanes) {
      const __mmask16 m = experts - e >= kLanes ? __mmask16(0xFFFF)
                                                 : __mmask16((1u << (experts - e)) - 1);
      const __m512 v = _mm512_mask_loadu_ps(vmax, m, logits + e);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vmax = _mm512_max_ps(vmax, v);
    }
    const float mx = nan ? NAN : _mm512_reduce_max_ps(vmax);
    alignas(64) float probs[kLanes];
    float sum = 0.0f;
    for (int64_t e = 0; e < experts; e += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, experts - e);
      const __mmask16 m = n == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(m, logits + e);
      const __m512 ex = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(v, _mm512_set1_ps(mx))));
      _mm512_store_ps(probs, ex);
      sum += _mm512_reduce_add_ps(ex);
      for (int64_t l = 0; l < n; ++l) queue[e + l] = {probs[l], e + l};
    }
    if (nan) sum = NAN;
    for (int64_t e = 0; e < experts; ++e) queue[e].first = nan ? NAN : queue[e].first / sum;
    return;
  }
#endif
  float mx = -INFINITY;
  bool nan = false;
  for (int64_t e = 0; e < experts; ++e) {
    nan |= std::isnan(logits[e]);
    mx = std::max(mx, logits[e]);
  }
  float sum = 0.0f;
  for (int64_t e = 0; e < experts; ++e) {
    queue[e] = {nan ? NAN : std::exp(logits[e] - mx), e};
    sum += queue[e].first;
  }
  for (int64_t e = 0; e < experts; ++e) queue[e].first /= sum;
}

// One row's routing from its logits (already rounded to x's dtype). The top-k runs the same
// standard-library selection as torch.topk on the CPU (ATen/native/TopKImpl.h: a partial
// sort when k * 64 <= E, else nth_element and a sort of the k - 1 before it, NaN largest),
// so equal probabilities, common with bf16-rounded logits, pick the same experts.
void route_row(const float* logits, int64_t experts, int64_t k, bool renormalize, bool fast,
               std::vector<std::pair<float, int64_t>>& queue, int64_t* ids, float* weights) {
  softmax_row(logits, experts, fast, queue);
  const auto before = [](const std::pair<float, int64_t>& a,
                         const std::pair<float, int64_t>& b) {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  };
  if (k * 64 <= experts) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), before);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), before);
    std::sort(queue.begin(), queue.begin() + k - 1, before);
  }
  float total = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = queue[j].second;
    weights[j] = queue[j].first;
    total += queue[j].first;
  }
  if (renormalize)
    for (int64_t j = 0; j < k; ++j) weights[j] /= total;
}

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x_in, const at::Tensor& w,
                                             int64_t experts, int64_t k, bool renormalize,
                                             bool portable, bool brgemm) {
  TORCH_CHECK(experts > 0 && k >= 1 && k <= experts, "moe_route: need 1 <= k <= experts, got k ",
              k, ", experts ", experts);
  const Problem p = problem(x_in, w, experts, "moe_route");
  const auto dtype = x_in.scalar_type();
  at::Tensor ids = at::empty({p.m, k}, x_in.options().dtype(at::kLong));
  at::Tensor weights = at::empty({p.m, k}, x_in.options().dtype(at::kFloat));
  if (p.m > 0) {
    // the logits in fp32, rounded to x's dtype as a torch linear would leave them
    // (through brgemm, csrc/brgemm.h, where the kernel choice picked it for this many rows)
    const bool widen = dtype == at::kBFloat16;
    const at::Tensor logits =
        brgemm && widen && !portable
            ? wideserve_brgemm::linear(x_in, w, experts, std::nullopt, true)
            : gemm_linear(x_in, w, experts, std::nullopt, widen, portable);
    const float* lg = logits.data_ptr<float>();
    int64_t* id = ids.data_ptr<int64_t>();
    float* wt = weights.data_ptr<float>();
    const bool fast = !portable && bf16_fast_path_compiled();
    at::parallel_for(0, p.m, 64, [&](int64_t begin, int64_t end) {
      std::vector<std::pair<float, int64_t>> queue(experts);
      for (int64_t t = begin; t < end; ++t)
        route_row(lg + t * experts, experts, k, renormalize, fast, queue, id + t * k,
                  wt + t * k);
    });
  }
  return {ids, dtype == at::kFloat ? weights : weights.to(dtype)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("gemm_linear(Tensor x, Tensor w, int n, Tensor? bias=None, bool widen=False, "
        "bool portable=False) -> Tensor");
  m.def("moe_route(Tensor x, Tensor w, int experts, int k, bool renormalize, "
        "bool portable=False, bool brgemm=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(wideserve, CPU, m) {
  m.impl("gemm_linear", &gemm_linear);
  m.impl("moe_route", &moe_route);
}
