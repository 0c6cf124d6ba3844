// Grouped expert GEMMs on weights kept in their checkpoint format (docs/cpu_kernels.md,
// "Quantised experts"; formats in wideserve/layers/quant.py, their decoders in
// csrc/quant_decode.h):
//
//   quant_grouped_linear(x [N, K], counts [L], w [L, R, Kb] uint8, scale [L, Sr, Sc],
//                        fmt, block_rows, block_cols, halves, brgemm_min_rows?, portable,
//                        global_scale? [L, halves] fp32)
//     -> out [N, R] = x_e @ dequant(W_e)^T for the rows x_e of each expert e (rows sorted by
//        expert, counts[e] of them), accumulated in fp32, rounded once to x's dtype.
//
// fmt 0: FP8 e4m3 codes (Kb = K) with one UE8M0 scale per block_rows x block_cols tile;
// fmt 1: MXFP4, two e2m1 codes per byte, low nibble first (Kb = K / 2), one UE8M0 scale per
// block_cols values of a row (block_rows = 1); fmt 2: NVFP4, e2m1 codes as MXFP4 with one
// FP8-E4M3 scale byte per block_cols values (16) and a per-tensor fp32 global scale per
// expert and half (`global_scale`): w = code * scale * global. Scales are uint8 (UE8M0 for
// fmt 0 / 1, E4M3 for fmt 2) or fp32 multipliers as stored (HF `weight_scale_inv` of FP8
// checkpoints that are not powers of two, e.g. Qwen3 FP8). `halves` = 2 for a gate/up stack
// whose gate and up halves each have their own scale grid, one after the other (a layout of
// the checkpoint's bytes: w1 and w3 are separate tensors there).
//
// No dequantised copy of a weight is ever kept: each work item (expert, tile of output rows)
// dequantises its rows into registers or a small buffer that stays in L1/L2 and runs the dot
// products on it. The dequantisation is the torch reference's (layers/quant.py): code times
// scale in fp32 (exact for UE8M0 and E4M3 scales), times the global / fp32 scale (one fp32
// rounding), rounded to bf16 to nearest even (exact for FP8 / MXFP4 with UE8M0 scales), so
// results equal a matmul on the dequantised weight up to the order of the fp32 sums.
//   - few rows (bf16, AVX512-BF16; tile_bf16): MXFP4 and NVFP4 up to 8 rows dequantised into
//     registers and dotted straight away, else 4 weight rows at a time into a bf16 buffer;
//     `vdpbf16ps` dot products, one chain per (weight row, input row);
//   - at least `brgemm_min_rows` rows (bf16, where torch's brgemm takes bf16): the
//     expert's rows transposed once into brgemm's VNNI B layout, the weight tile (32 rows x
//     a K chunk) dequantised row-major as A, C^T = W x^T accumulated over the K chunks;
//   - fp32 inputs and the portable build: the weight row into an fp32 buffer, dot products
//     with 16 partial sums (vectorised by the compiler).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "brgemm.h"
#include "quant_decode.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChunk = 32;        // K is padded to whole chunks of 32 values
constexpr int64_t kSmallTile = 16;    // weight rows per work item on the dot-product paths
constexpr int64_t kBigTile = 32;      // weight rows per brgemm A tile
constexpr int64_t kBigK = 512;        // K values per brgemm call (A tile: 32 x 512 bf16)

using namespace wideserve_quant;

// ------------------------------------------------------------------ the three paths

struct Job {
  const Format& f;
  int64_t kp;                         // K padded to kChunk
  const uint8_t* w;                   // [L, R, row_bytes]
  const uint8_t* s;                   // [L, Sr, Sc]
  const float* g;                     // [L, halves] global scales, or null
  const std::vector<int64_t>& offsets;
  int64_t expert_w, expert_s;         // bytes per expert
  const float* global(int64_t e) const { return g ? g + e * f.halves : nullptr; }
};

// A thread's scratch array, 64-byte aligned and zero-filled when (re)allocated; get(n) keeps
// the contents while n fits. The dequantised rows the dot products and brgemm read with
// 64-byte loads: in a std::vector (16-byte aligned) every load split a cache line whenever
// the heap placed it so, which ran the buffered dot products 2-2.5x slower at 16-64 rows
// (BENCHMARKS.md, "Quantised experts: NVFP4 in registers, the brgemm threshold measured").
template <typename T>
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(p_); }
  T* get(int64_t n) {
    if (n > cap_) {
      std::free(p_);
      const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
      p_ = static_cast<T*>(std::aligned_alloc(64, bytes));
      TORCH_CHECK(p_ != nullptr, "quant_grouped_linear: out of memory");
      std::memset(static_cast<void*>(p_), 0, bytes);
      cap_ = n;
    }
    return p_;
  }

 private:
  T* p_ = nullptr;
  int64_t cap_ = 0;
};

// Portable / fp32: rows [r0, r1) of x (fp32, [N, kp]) times weight rows [n0, n1) of expert e.
template <typename T>
void tile_f32(const Job& j, const float* x, int64_t e, int64_t n0, int64_t n1, T* out,
              std::vector<float>& wrow) {
  const int64_t r0 = j.offsets[e], r1 = j.offsets[e + 1], R = j.f.rows;
  const uint8_t* w = j.w + e * j.expert_w;
  const uint8_t* s = j.s + e * j.expert_s;
  // A bf16 caller's weight is the bf16 one (as a dequantise-at-load path holds it): rounded
  // where the format's values are not all bf16 values (NVFP4, fp32 scales).
  const bool round = std::is_same_v<T, at::BFloat16> && (j.g != nullptr || j.f.fp32_scale);
  for (int64_t n = n0; n < n1; ++n) {
    dequant_row_f32(j.f, w, s, j.global(e), n, 0, j.f.cols, wrow.data());
    if (round)
      for (int64_t k = 0; k < j.f.cols; ++k) wrow[k] = float(at::BFloat16(wrow[k]));
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * j.kp;
      float part[16] = {};
      for (int64_t k = 0; k < j.kp; k += 16)
        for (int l = 0; l < 16; ++l) part[l] += xr[k + l] * wrow[k + l];
      float sum = 0.0f;
      for (int l = 0; l < 16; ++l) sum += part[l];
      out[r * R + n] = static_cast<T>(sum);
    }
  }
}

#ifdef __AVX512BF16__
inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// The shared skeleton: NW weight rows from n against M input rows from r, one `vdpbf16ps`
// chain per pair over the 32-value chunks in order; chunk(i, k) gives weight row n + i's
// values [k, k + 32) as bf16 lanes for k < whole, tail(i, k) the chunks from `whole` on. The
// first nw results are written. A tail that calls a function runs in its own loop after the
// chunks: inside the main loop such a call (even on a branch never taken) had GCC store every
// accumulator after every chunk to keep them across it.
template <int NW, int M, typename Chunk, typename Tail>
void dot_chains(const Job& j, const at::BFloat16* x, int64_t n, int64_t r, int nw,
                at::BFloat16* out, int64_t whole, Chunk chunk, Tail tail) {
  __m512 acc[NW][M];
  for (int i = 0; i < NW; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
  auto step = [&](int64_t k, auto&& get) {
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = as_bh(_mm512_loadu_si512(x + (r + m) * j.kp + k));
    for (int i = 0; i < NW; ++i) {
      const __m512bh wv = as_bh(get(i, k));
      for (int m = 0; m < M; ++m) acc[i][m] = _mm512_dpbf16_ps(acc[i][m], wv, xv[m]);
    }
  };
  int64_t k = 0;
  for (; k < whole; k += kChunk) step(k, chunk);
  for (; k < j.kp; k += kChunk) step(k, tail);
  for (int i = 0; i < nw; ++i)
    for (int m = 0; m < M; ++m)
      out[(r + m) * j.f.rows + n + i] =
          static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[i][m]));
}

// MXFP4 with UE8M0 scales (Kind 1) and NVFP4 (Kind 2), up to 8 rows (tile_bf16): NW weight
// rows [n, n + NW) against M input rows from r, 32 values a step, each weight chunk
// dequantised into a register (mxfp4_chunk, nvfp4_chunk) and dotted straight away: no row
// buffer written and read back, and NW x M independent `vdpbf16ps` chains where a one-row
// loop waited on one (a 1-row call ran ~3x below what the codes' bytes allow, BENCHMARKS.md
// "Quantised experts at decode sizes"). Every (weight row, input row) sum takes the same
// chunks in the same order as the buffered loop: outputs bit for bit the same, whatever NW
// and M (so a row's result does not depend on the rows beside it). A last partial chunk (K
// not a multiple of 32) comes from dequant_row_bf16 through `tail` (zero past K, as the
// caller's padded x is). g: the expert's global scales (NVFP4).
template <int Kind, int NW, int M>
void fused_rows(const Job& j, const at::BFloat16* x, const uint8_t* w, const uint8_t* s,
                const float* g, int64_t n, int64_t r, at::BFloat16* out,
                std::vector<float>& tmp, at::BFloat16* tail) {
  const Format& f = j.f;
  const __m512 table = _mm512_loadu_ps(kE2M1.data());
  const uint8_t* rows[NW];
  const uint8_t* srows[NW];
  __m512 global[NW];
  for (int i = 0; i < NW; ++i) {
    rows[i] = w + (n + i) * f.row_bytes;
    srows[i] = s + f.scale_row(n + i) * f.scols;
    global[i] = _mm512_set1_ps(Kind == 2 ? g[f.half_of(n + i)] : 1.0f);
  }
  const int64_t whole = f.cols / kChunk * kChunk;
  auto chunk = [&](int i, int64_t k) {
    if constexpr (Kind == 1)
      return mxfp4_chunk(rows[i] + k / 2, kScale[srows[i][k / f.bn]], table);
    else
      return nvfp4_chunk(rows[i] + k / 2, kE4M3[srows[i][k / 16]], kE4M3[srows[i][k / 16 + 1]],
                         global[i], table);
  };
  dot_chains<NW, M>(j, x, n, r, NW, out, whole, chunk, [&](int i, int64_t k) {
    dequant_row_bf16(f, w, s, g, n + i, k, f.cols, tmp.data(), tail);
    return _mm512_loadu_si512(tail);
  });
}

// Weight rows [n0, n1) against input rows [r, r + M): four weight rows a pass (two from five
// input rows: 16 accumulators either way), the rest one at a time.
template <int Kind, int M>
void fused_tile(const Job& j, const at::BFloat16* x, const uint8_t* w, const uint8_t* s,
                const float* g, int64_t n0, int64_t n1, int64_t r, at::BFloat16* out,
                std::vector<float>& tmp, at::BFloat16* tail) {
  constexpr int NW = M <= 4 ? 4 : 2;
  int64_t n = n0;
  for (; n + NW <= n1; n += NW) fused_rows<Kind, NW, M>(j, x, w, s, g, n, r, out, tmp, tail);
  for (; n < n1; ++n) fused_rows<Kind, 1, M>(j, x, w, s, g, n, r, out, tmp, tail);
}

template <int Kind>
void fused_rows_of(int64_t m, const Job& j, const at::BFloat16* x, const uint8_t* w,
                   const uint8_t* s, const float* g, int64_t n0, int64_t n1, int64_t r,
                   at::BFloat16* out, std::vector<float>& tmp, at::BFloat16* tail) {
  switch (m) {
    case 0: break;
    case 1: fused_tile<Kind, 1>(j, x, w, s, g, n0, n1, r, out, tmp, tail); break;
    case 2: fused_tile<Kind, 2>(j, x, w, s, g, n0, n1, r, out, tmp, tail); break;
    case 3: fused_tile<Kind, 3>(j, x, w, s, g, n0, n1, r, out, tmp, tail); break;
    case 4: fused_tile<Kind, 4>(j, x, w, s, g, n0, n1, r, out, tmp, tail); break;
    case 5: fused_tile<Kind, 5>(j, x, w, s, g, n0, n1, r, out, tmp, tail); break;
    case 6: fused_tile<Kind, 6>(j, x, w, s, g, n0, n1, r, out, tmp, tail); break;
    case 7: fused_tile<Kind, 7>(j, x, w, s, g, n0, n1, r, out, tmp, tail); break;
    default: fused_tile<Kind, 8>(j, x, w, s, g, n0, n1, r, out, tmp, tail); break;
  }
}

// Four dequantised weight rows (wr, bf16 [kp] each) against input rows [r, r + M); the first
// nw results written.
template <int M>
void dot_rows(const Job& j, const at::BFloat16* x, const at::BFloat16* const* wr, int nw,
              int64_t n, int64_t r, at::BFloat16* out) {
  auto row = [&](int i, int64_t k) { return _mm512_loadu_si512(wr[i] + k); };
  dot_chains<4, M>(j, x, n, r, nw, out, j.kp, row, row);
}

// The formats decoded in registers at few rows: MXFP4 with UE8M0 scales, NVFP4 with the
// expert's global scales `g` in nvfp4_chunk's range.
bool fused_decode(const Format& f, const float* g) {
  if (f.fp32_scale) return false;
  if (f.kind == 1) return f.bn % 32 == 0;
  if (f.kind != 2 || f.bn != 16 || g == nullptr) return false;
  for (int64_t h = 0; h < f.halves; ++h)
    if (!nvfp4_global_ok(g[h])) return false;
  return true;
}

// bf16, few rows (no brgemm for this expert): its rows against weight rows [n0, n1).
void tile_bf16(const Job& j, const at::BFloat16* x, int64_t e, int64_t n0, int64_t n1,
               at::BFloat16* out, std::vector<float>& tmp, at::BFloat16* wrow) {
  const int64_t r0 = j.offsets[e], r1 = j.offsets[e + 1];
  const uint8_t* w = j.w + e * j.expert_w;
  const uint8_t* s = j.s + e * j.expert_s;
  // MXFP4 / NVFP4 up to 8 rows: decoded in registers, one pass (more rows: each pass would
  // decode the weights again, where the buffered rows below are decoded once for all passes)
  if (fused_decode(j.f, j.global(e)) && r1 - r0 <= 8) {
    at::BFloat16* tail = wrow;             // kChunk values, zero past K (the caller's fill)
    if (j.f.kind == 1)
      fused_rows_of<1>(r1 - r0, j, x, w, s, nullptr, n0, n1, r0, out, tmp, tail);
    else
      fused_rows_of<2>(r1 - r0, j, x, w, s, j.global(e), n0, n1, r0, out, tmp, tail);
    return;
  }
  // Other formats, and MXFP4 / NVFP4 from 9 rows: four weight rows at a time dequantised into
  // `wrow` ([4, kp], zero past K; a tile's missing rows read a fifth, zero row), then dotted
  // with the expert's rows 4 at a time: 16 independent chains where one weight row's chain
  // alone left a 1-row call waiting on vdpbf16ps latency. The chunks of a (weight row, input
  // row) sum run in the same order whatever the rows beside them.
  for (int64_t n = n0; n < n1; n += 4) {
    const int nw = static_cast<int>(std::min<int64_t>(4, n1 - n));
    const at::BFloat16* wr[4];
    for (int i = 0; i < 4; ++i) {
      wr[i] = wrow + (i < nw ? i : 4) * j.kp;
      if (i < nw)
        dequant_row_bf16(j.f, w, s, j.global(e), n + i, 0, j.f.cols, tmp.data(),
                         wrow + i * j.kp);
    }
    for (int64_t r = r0; r < r1; r += 4) {
      switch (std::min<int64_t>(4, r1 - r)) {
        case 1: dot_rows<1>(j, x, wr, nw, n, r, out); break;
        case 2: dot_rows<2>(j, x, wr, nw, n, r, out); break;
        case 3: dot_rows<3>(j, x, wr, nw, n, r, out); break;
        default: dot_rows<4>(j, x, wr, nw, n, r, out); break;
      }
    }
  }
}
#endif

// bf16, many rows, through brgemm: C^T [rows of W, M] = W_tile [32, kc] x (x_e^T in VNNI).
// xt: the expert's rows as [kp/2, mp, 2] (mp = rows rounded up to 16, zero columns).
void tile_brgemm(const Job& j, const at::BFloat16* xt, int64_t mp, int64_t e, int64_t n0,
                 int64_t n1, at::BFloat16* out, std::vector<float>& tmp,
                 Scratch<at::BFloat16>& a_buf, Scratch<float>& c_buf) {
  const int64_t r0 = j.offsets[e], m = j.offsets[e + 1] - r0, R = j.f.rows;
  const uint8_t* w = j.w + e * j.expert_w;
  const uint8_t* s = j.s + e * j.expert_s;
  const int64_t rows = n1 - n0;
  at::BFloat16* a = a_buf.get(kBigTile * kBigK);
  float* c = c_buf.get(rows * mp);
  for (int64_t k0 = 0; k0 < j.kp; k0 += kBigK) {
    const int64_t kc = std::min(kBigK, j.kp - k0), valid = std::min(j.f.cols, k0 + kc) - k0;
    for (int64_t n = n0; n < n1; ++n) {
      at::BFloat16* dst = a + (n - n0) * kc;
      if (valid > 0)
        dequant_row_bf16(j.f, w, s, j.global(e), n, k0, k0 + valid, tmp.data(), dst);
      std::memset(static_cast<void*>(dst + std::max<int64_t>(valid, 0)), 0,
                  (kc - std::max<int64_t>(valid, 0)) * sizeof(at::BFloat16));
    }
    at::native::cpublas::brgemm(rows, mp, kc, kc, mp, mp, /*add_C=*/k0 > 0, a,
                                xt + k0 * mp, c, /*is_vnni=*/true);
  }
  for (int64_t i = 0; i < m; ++i)
    for (int64_t n = n0; n < n1; ++n)
      out[(r0 + i) * R + n] = static_cast<at::BFloat16>(c[(n - n0) * mp + i]);
}

// x_e [m, kp] -> [kp/2, mp, 2] (brgemm's VNNI B: pairs of K for each column), zero-padded.
void pack_vnni(const at::BFloat16* x, int64_t m, int64_t kp, int64_t mp, at::BFloat16* xt) {
  std::memset(static_cast<void*>(xt), 0, kp * mp * sizeof(at::BFloat16));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < kp / 2; ++p) {
      xt[(p * mp + i) * 2] = x[i * kp + 2 * p];
      xt[(p * mp + i) * 2 + 1] = x[i * kp + 2 * p + 1];
    }
}

// Wherever torch's brgemm takes bf16 (csrc/brgemm.h `runs`): AMX tiles, or AVX512-BF16 dot
// products on a CPU without AMX. From how many rows an expert takes it is the caller's
// measured choice (kernel-choice family "quant_experts", layers/experts.py).
bool brgemm_runs() { return wideserve_brgemm::runs(); }

// ------------------------------------------------------------------ the op

Format check_format(const at::Tensor& w, const at::Tensor& scale, int64_t k, int64_t fmt,
                    int64_t bm, int64_t bn, int64_t halves) {
  TORCH_CHECK(fmt >= 0 && fmt <= 2,
              "quant_grouped_linear: fmt must be 0 (FP8), 1 (MXFP4) or 2 (NVFP4)");
  TORCH_CHECK(halves == 1 || halves == 2, "quant_grouped_linear: halves must be 1 or 2");
  TORCH_CHECK(bm > 0 && bn > 0 && (fmt == 0 || bm == 1),
              "quant_grouped_linear: bad scale block ", bm, " x ", bn);
  TORCH_CHECK(w.dim() == 3 && w.element_size() == 1 && w.is_contiguous(),
              "quant_grouped_linear: w must be contiguous 1-byte codes [L, R, Kb]");
  const bool fp32_scale = scale.scalar_type() == at::kFloat;
  TORCH_CHECK(scale.dim() == 3 && (scale.scalar_type() == at::kByte || fp32_scale) &&
                  scale.is_contiguous(),
              "quant_grouped_linear: scale must be contiguous uint8 (UE8M0 / E4M3 bytes) or "
              "float32 [L, Sr, Sc]");
  Format f{fmt, bm, bn, halves, w.size(1), k, w.size(2), scale.size(1), scale.size(2),
           fp32_scale};
  TORCH_CHECK(f.row_bytes == (fmt == 0 ? k : (k + 1) / 2) && (fmt == 0 || k % 2 == 0),
              "quant_grouped_linear: w ", w.sizes(), " does not hold K = ", k, " values");
  TORCH_CHECK(f.rows % halves == 0, "quant_grouped_linear: R must split into halves");
  const int64_t per = (f.rows / halves + bm - 1) / bm;
  TORCH_CHECK(scale.size(0) == w.size(0) && f.srows == halves * per &&
                  f.scols == (k + bn - 1) / bn,
              "quant_grouped_linear: scale ", scale.sizes(), " does not match w ", w.sizes(),
              " with block ", bm, " x ", bn, " and halves ", halves);
  return f;
}

at::Tensor quant_grouped_linear(const at::Tensor& x_in, const at::Tensor& counts,
                                const at::Tensor& w_in, const at::Tensor& scale, int64_t fmt,
                                int64_t block_rows, int64_t block_cols, int64_t halves,
                                std::optional<int64_t> brgemm_min_rows, bool portable,
                                const std::optional<at::Tensor>& global_scale) {
  TORCH_CHECK(x_in.dim() == 2, "quant_grouped_linear: x must be [N, K]");
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "quant_grouped_linear: x must be bfloat16 or float32, got ", dtype);
  const at::Tensor w = w_in.scalar_type() == at::kByte ? w_in : w_in.view(at::kByte);
  const Format f = check_format(w, scale, x_in.size(1), fmt, block_rows, block_cols, halves);
  const int64_t experts = w.size(0), n_rows = x_in.size(0);
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == experts,
              "quant_grouped_linear: counts must be [", experts, "]");
  at::Tensor gs;
  if (global_scale.has_value()) {
    gs = *global_scale;
    TORCH_CHECK(gs.scalar_type() == at::kFloat && gs.is_contiguous() && gs.dim() == 2 &&
                    gs.size(0) == experts && gs.size(1) == halves,
                "quant_grouped_linear: global_scale must be contiguous float32 [", experts,
                ", ", halves, "]");
  }
  TORCH_CHECK(fmt != 2 || gs.defined(), "quant_grouped_linear: NVFP4 needs global_scale");
  const at::Tensor cnt = counts.to(at::kLong).contiguous();
  std::vector<int64_t> offsets(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t c = cnt.data_ptr<int64_t>()[e];
    TORCH_CHECK(c >= 0, "quant_grouped_linear: negative count for expert ", e);
    offsets[e + 1] = offsets[e] + c;
  }
  TORCH_CHECK(offsets[experts] == n_rows, "quant_grouped_linear: counts sum to ",
              offsets[experts], ", x has ", n_rows, " rows");
  at::Tensor out = at::empty({n_rows, f.rows}, x_in.options());
  if (n_rows == 0 || f.rows == 0) return out;
  const int64_t kp = (f.cols + kChunk - 1) / kChunk * kChunk;
  const Job job{f, kp, w.data_ptr<uint8_t>(),
                static_cast<const uint8_t*>(scale.data_ptr()),
                gs.defined() ? gs.data_ptr<float>() : nullptr, offsets,
                f.rows * f.row_bytes, f.srows * f.scols * scale.element_size()};
  if (f.cols == 0) return out.zero_();
  std::vector<int64_t> active;
  for (int64_t e = 0; e < experts; ++e)
    if (offsets[e + 1] > offsets[e]) active.push_back(e);
#ifdef __AVX512BF16__
  const bool fast = !portable && dtype == at::kBFloat16;
#else
  const bool fast = false;
#endif
  if (!fast) {
    const at::Tensor x = at::constant_pad_nd(x_in.to(at::kFloat), {0, kp - f.cols})
                             .contiguous();
    const float* xp = x.data_ptr<float>();
    const int64_t tiles = (f.rows + kSmallTile - 1) / kSmallTile;
    const int64_t items = static_cast<int64_t>(active.size()) * tiles;
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> wrow(kp, 0.0f);
      for (int64_t it = begin; it < end; ++it) {
        const int64_t e = active[it / tiles], n0 = (it % tiles) * kSmallTile;
        const int64_t n1 = std::min(f.rows, n0 + kSmallTile);
        if (dtype == at::kFloat) tile_f32(job, xp, e, n0, n1, out.data_ptr<float>(), wrow);
        else tile_f32(job, xp, e, n0, n1, out.data_ptr<at::BFloat16>(), wrow);
      }
    });
    return out;
  }
#ifdef __AVX512BF16__
  const at::Tensor x = at::constant_pad_nd(x_in, {0, kp - f.cols}).contiguous();
  const auto* xp = x.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t big = brgemm_min_rows.has_value() && brgemm_runs()
                          ? std::max<int64_t>(*brgemm_min_rows, 1) : 0;
  // Experts with at least `big` rows: their rows in VNNI once, shared by all their tiles.
  std::vector<int64_t> xt_at(experts + 1, 0), mp(experts, 0);
  for (const int64_t e : active) {
    const int64_t m = offsets[e + 1] - offsets[e];
    if (big > 0 && m >= big) mp[e] = (m + 15) / 16 * 16;
  }
  for (int64_t e = 0; e < experts; ++e) xt_at[e + 1] = xt_at[e] + kp * mp[e];
  at::Tensor xt = at::empty({xt_at[experts]}, x_in.options());
  auto* xtp = xt.data_ptr<at::BFloat16>();
  at::parallel_for(0, static_cast<int64_t>(active.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = active[i];
      if (mp[e]) pack_vnni(xp + offsets[e] * kp, offsets[e + 1] - offsets[e], kp, mp[e],
                           xtp + xt_at[e]);
    }
  });
  // Work items: (expert, tile of output rows), the brgemm experts' tiles of kBigTile rows.
  std::vector<std::array<int64_t, 3>> items;
  for (const int64_t e : active) {
    const int64_t tile = mp[e] ? kBigTile : kSmallTile;
    for (int64_t n0 = 0; n0 < f.rows; n0 += tile)
      items.push_back({e, n0, std::min(f.rows, n0 + tile)});
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(std::max(kp, kBigK));
    Scratch<at::BFloat16> wrow, a;               // tile_bf16's rows; brgemm's A tile
    Scratch<float> c;
    bool used = false;
    for (int64_t it = begin; it < end; ++it) {
      const auto [e, n0, n1] = items[it];
      if (mp[e]) {
        tile_brgemm(job, xtp + xt_at[e], mp[e], e, n0, n1, op, tmp, a, c);
        used = true;
      } else {
        tile_bf16(job, xp, e, n0, n1, op, tmp, wrow.get(5 * kp));
      }
    }
    if (used) at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("quant_grouped_linear(Tensor x, Tensor counts, Tensor w, Tensor scale, int fmt, "
        "int block_rows, int block_cols, int halves, int? brgemm_min_rows=None, "
        "bool portable=False, Tensor? global_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(wideserve, CPU, m) {
  m.impl("quant_grouped_linear", &quant_grouped_linear);
}
