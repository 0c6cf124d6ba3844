// One request's causal prefill attention on the CPU's matrix units (docs/cpu_kernels.md,
// "Flash prefill"): blocks of queries against tiles of keys, both products through oneDNN's
// brgemm ukernel (csrc/brgemm.h: AMX tiles where the CPU has them), an online softmax between
// them (flash attention's recurrence) in AVX512, reading the paged K||V cache in place.
//
//   flash_prefill(q [Lq, H, D] bf16, cache [blocks, block_size, 2*Hkv*D] bf16,
//                 block_table [max_blocks] int64, length, scale) -> [Lq, H, D] bf16
//
// q holds the request's last Lq positions (query i at position length - Lq + i, any token
// stride, heads contiguous); the cache holds its positions [0, length) through its block
// table row (entry = [k_0 .. k_{Hkv-1} | v_0 .. v_{Hkv-1}], layers/attention/
// paged_attention_batched.py); query i sees keys 0 .. length - Lq + i. D a multiple of 32.
//
// Two phases. First every key tile (kTileK positions of one KV head) is packed once into
// brgemm's VNNI form: K^T as a [D/2, kTileK, 2] B for S = Q K^T and V as a [kTileK/2, D, 2] B
// for O += P V (a tail tile zero-padded), so each is reused by all H/Hkv query heads and every
// query block. Then per (query head, block of kBlockQ queries): for each visible key tile,
// S in fp32 over the tile's columns some row of the block sees, the running row max and sum
// rescaled, P = 2^(S scale log2 e - max) rounded to bf16, O (fp32) rescaled and accumulated by
// brgemm; O / sum rounded to bf16 at the end. The causal mask only cuts the last tile. Work items pair early and late query blocks so that each
// thread's contiguous share of them holds about as many key tiles as the others'.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "brgemm.h"

namespace {

// Measured on an AMX Xeon (docs/cpu_kernels.md, "Flash prefill"): 256-key tiles were 1.3x
// faster than 64 (fewer brgemm calls, each switching the AMX tile configuration, and fewer
// per-row reductions), 128-row or 32-row query blocks slower than 64.
constexpr int64_t kBlockQ = 64;    // query rows per work item (4 AMX row tiles)
constexpr int64_t kTileK = 256;    // key positions per tile
constexpr int64_t kMaxDim = 256;

#ifdef __AVX512BF16__
// 2^x for x <= 0 (x = -inf gives 0): 2^floor(x) exactly by vscalefps, 2^frac by a degree-6
// polynomial (relative error ~2e-7, far below P's bf16 rounding). Not csrc/gemm.h's exp_ps:
// in base e with its two-step range reduction the kernel was 7-12% slower at 1-2K tokens.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);   // [0, 1)
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

struct Problem {
  const at::BFloat16* q;
  int64_t q_stride;                // elements between consecutive queries
  int64_t lq, length, heads, kv_heads, dim;
  float scale_log2;                // scale * log2(e): the softmax in base 2
  const at::BFloat16* kt;          // packed K^T tiles [Hkv, tiles, D/2, kTileK, 2]
  const at::BFloat16* vp;          // packed V tiles   [Hkv, tiles, kTileK/2, D, 2]
  int64_t tiles;
  at::BFloat16* out;               // [Lq, H, D]
};

// Packs key tile `t` of KV head `h`: positions t*kTileK .. +kTileK. Past `length` a tail
// tile is left as it is except V's rows up to the next multiple of 32 (the most a P V call
// reads), zeroed: P is 0 there, and 0 x a stale NaN would be NaN. K's stale columns only
// reach masked scores, which the softmax never reads.
void pack_tile(const at::BFloat16* cache, int64_t block_size, int64_t width,
               const int64_t* table, int64_t length, int64_t h, int64_t t, int64_t dim,
               int64_t kv_heads, at::BFloat16* kt, at::BFloat16* vp) {
  const int64_t p0 = t * kTileK, n = std::min(kTileK, length - p0);
  auto* kt16 = reinterpret_cast<uint16_t*>(kt);
  auto* vp16 = reinterpret_cast<uint16_t*>(vp);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = p0 + j;
    const auto* e = reinterpret_cast<const uint16_t*>(
        cache + (table[pos / block_size] * block_size + pos % block_size) * width);
    const uint16_t* k = e + h * dim;
    const uint16_t* v = e + (kv_heads + h) * dim;
    for (int64_t d = 0; d < dim; d += 2) {
      kt16[((d >> 1) * kTileK + j) * 2] = k[d];
      kt16[((d >> 1) * kTileK + j) * 2 + 1] = k[d + 1];
    }
    uint16_t* vr = vp16 + (j >> 1) * dim * 2 + (j & 1);
    for (int64_t d = 0; d < dim; ++d) vr[2 * d] = v[d];
  }
  for (int64_t j = n; j < std::min(kTileK, (n + 31) / 32 * 32); ++j) {
    uint16_t* vr = vp16 + (j >> 1) * dim * 2 + (j & 1);
    for (int64_t d = 0; d < dim; ++d) vr[2 * d] = 0;
  }
}

// Scratch of one thread: S / P of a block, its output accumulator, row max and sum. Left
// uninitialised (attend_block writes each before reading it): a zero fill of its ~110 KB
// was most of a one-row call's time.
struct Scratch {
  std::unique_ptr<float[]> s, o, mx, sum;
  std::unique_ptr<at::BFloat16[]> p;
  explicit Scratch(int64_t dim)
      : s(new float[kBlockQ * kTileK]), o(new float[kBlockQ * dim]), mx(new float[kBlockQ]),
        sum(new float[kBlockQ]), p(new at::BFloat16[kBlockQ * kTileK]) {}
};

// One row of a tile: the `visible` first of its `width` scores (the rest masked) update the
// row's running max (base 2, scaled) and sum; P = 2^(s - max) rounded to bf16 into `p`
// (zeros past `visible`); returns the factor the row's accumulator is rescaled by.
inline float softmax_row(const float* s, int64_t visible, int64_t width, float scale_log2,
                         float* mx, float* sum, at::BFloat16* p) {
  const int64_t vecs = (visible + 15) / 16;
  const __m512 sc = _mm512_set1_ps(scale_log2);
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < vecs; ++c) {
    const int64_t left = visible - c * 16;
    const __mmask16 keep = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    m = _mm512_mask_max_ps(m, keep, m, _mm512_loadu_ps(s + c * 16));
  }
  // max of the scaled scores: scale > 0, so the max of the raw ones scaled
  const float new_max = std::max(*mx, _mm512_reduce_max_ps(m) * scale_log2);
  const float alpha = std::exp2(*mx - new_max);    // 0 on a row's first tile (max -inf)
  const __m512 nm = _mm512_set1_ps(new_max);
  __m512 total = _mm512_setzero_ps();
  for (int64_t c = 0; c < vecs; ++c) {
    const int64_t left = visible - c * 16;
    const __mmask16 keep = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 e = _mm512_maskz_mov_ps(
        keep, exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s + c * 16), sc, nm)));
    total = _mm512_add_ps(total, e);
    const __m256bh b = _mm512_cvtneps_pbh(e);
    std::memcpy(p + c * 16, &b, sizeof(b));
  }
  if (vecs * 16 < width)
    std::memset(p + vecs * 16, 0, (width - vecs * 16) * sizeof(at::BFloat16));
  *mx = new_max;
  *sum = *sum * alpha + _mm512_reduce_add_ps(total);
  return alpha;
}

// Query block `qb` of head `h`: every key tile it sees, then its rows written out. Per tile:
// S by one brgemm, the softmax, O += P V by another over the tile's columns in use.
void attend_block(const Problem& pr, int64_t h, int64_t qb, Scratch& w) {
  const int64_t d = pr.dim, r0 = qb * kBlockQ, rows = std::min(kBlockQ, pr.lq - r0);
  const int64_t first_pos = pr.length - pr.lq + r0;          // position of row 0
  const int64_t last_tile = (first_pos + rows - 1) / kTileK;
  const int64_t hk = h / (pr.heads / pr.kv_heads);
  const at::BFloat16* q = pr.q + r0 * pr.q_stride + h * d;
  std::fill(w.o.get(), w.o.get() + rows * d, 0.0f);
  std::fill(w.mx.get(), w.mx.get() + rows, -std::numeric_limits<float>::infinity());
  std::fill(w.sum.get(), w.sum.get() + rows, 0.0f);
  const int64_t tile_elems = kTileK * d;
  for (int64_t t = 0; t <= last_tile; ++t) {
    const at::BFloat16* kt = pr.kt + (hk * pr.tiles + t) * tile_elems;
    const at::BFloat16* vp = pr.vp + (hk * pr.tiles + t) * tile_elems;
    // columns any row of the block sees in this tile, rounded up to 32 (brgemm's K step)
    const int64_t cols = std::min(kTileK, (first_pos + rows - t * kTileK + 31) / 32 * 32);
    at::native::cpublas::brgemm(rows, cols, d, pr.q_stride, kTileK, kTileK, /*add_C=*/false,
                                q, kt, w.s.get(), /*is_vnni=*/true);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min(cols, first_pos + r - t * kTileK + 1);
      if (visible <= 0) {
        std::memset(w.p.get() + r * kTileK, 0, cols * sizeof(at::BFloat16));
        continue;
      }
      const float alpha = softmax_row(w.s.get() + r * kTileK, visible, cols, pr.scale_log2,
                                      &w.mx[r], &w.sum[r], w.p.get() + r * kTileK);
      if (alpha != 1.0f) {
        float* o = w.o.get() + r * d;
        const __m512 a = _mm512_set1_ps(alpha);
        for (int64_t c = 0; c < d; c += 16)
          _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), a));
      }
    }
    at::native::cpublas::brgemm(rows, d, cols, kTileK, d, d, /*add_C=*/true, w.p.get(), vp,
                                w.o.get(), /*is_vnni=*/true);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / w.sum[r];
    const float* o = w.o.get() + r * d;
    at::BFloat16* out = pr.out + ((r0 + r) * pr.heads + h) * d;
    for (int64_t c = 0; c < d; c += 16) {
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + c),
                                                          _mm512_set1_ps(inv)));
      std::memcpy(out + c, &b, sizeof(b));
    }
  }
}
#endif  // __AVX512BF16__

at::Tensor flash_prefill(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& table,
                         int64_t length, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "flash_prefill: q must be a bfloat16 [Lq, H, D] with contiguous heads");
  TORCH_CHECK(cache.dim() == 3 && cache.scalar_type() == at::kBFloat16 && cache.is_contiguous(),
              "flash_prefill: cache must be a contiguous bfloat16 [blocks, block_size, W]");
  TORCH_CHECK(table.dim() == 1 && table.scalar_type() == at::kLong && table.is_contiguous(),
              "flash_prefill: block_table must be a contiguous int64 [max_blocks] row");
  const int64_t lq = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t blocks = cache.size(0), block_size = cache.size(1), width = cache.size(2);
  TORCH_CHECK(dim % 32 == 0 && dim <= kMaxDim, "flash_prefill: head dim ", dim,
              " is not a multiple of 32 up to ", kMaxDim);
  TORCH_CHECK(width % (2 * dim) == 0 && heads % (width / (2 * dim)) == 0,
              "flash_prefill: cache width ", width, " does not hold K||V of heads of ", dim,
              " for ", heads, " query heads");
  const int64_t kv_heads = width / (2 * dim);
  TORCH_CHECK(lq <= length, "flash_prefill: ", lq, " queries but only ", length, " positions");
  const int64_t used = (length + block_size - 1) / block_size;
  TORCH_CHECK(used <= table.size(0), "flash_prefill: ", length, " positions need ", used,
              " blocks, the table row has ", table.size(0));
  const int64_t* tb = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < used; ++i)
    TORCH_CHECK(tb[i] >= 0 && tb[i] < blocks, "flash_prefill: block ", tb[i],
                " out of range [0, ", blocks, ")");
  at::Tensor out = at::empty({lq, heads, dim}, q.options());
  if (lq == 0) return out;
#ifdef __AVX512BF16__
  const int64_t tiles = (length + kTileK - 1) / kTileK;
  at::Tensor kt = at::empty({kv_heads, tiles, kTileK * dim}, q.options());
  at::Tensor vp = at::empty({kv_heads, tiles, kTileK * dim}, q.options());
  const auto* cp = cache.data_ptr<at::BFloat16>();
  auto* ktp = kt.data_ptr<at::BFloat16>();
  auto* vpp = vp.data_ptr<at::BFloat16>();
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      pack_tile(cp, block_size, width, tb, length, i / tiles, i % tiles, dim, kv_heads,
                ktp + i * kTileK * dim, vpp + i * kTileK * dim);
  });
  const Problem pr{q.data_ptr<at::BFloat16>(), q.stride(0), lq, length, heads, kv_heads, dim,
                   static_cast<float>(scale * M_LOG2E), ktp, vpp, tiles,
                   out.data_ptr<at::BFloat16>()};
  const int64_t qblocks = (lq + kBlockQ - 1) / kBlockQ;
  at::parallel_for(0, qblocks * heads, 1, [&](int64_t begin, int64_t end) {
    Scratch w(dim);
    for (int64_t item = begin; item < end; ++item) {
      // items in pairs of query blocks (0, last), (1, last - 1), ...: a contiguous share
      // of them holds about its share of the key tiles
      const int64_t j = item / heads, h = item % heads;
      const int64_t qb = j % 2 == 0 ? j / 2 : qblocks - 1 - j / 2;
      attend_block(pr, h, qb, w);
    }
    wideserve_brgemm::release();
  });
  return out;
#else
  TORCH_CHECK(false, "flash_prefill: not compiled for this CPU (needs AVX512-BF16)");
  return out;
#endif
}

// Whether flash_prefill runs here: compiled with AVX512-BF16 and torch's brgemm takes bf16.
bool flash_prefill_available() {
#ifdef __AVX512BF16__
  return wideserve_brgemm::runs();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("flash_prefill(Tensor q, Tensor cache, Tensor block_table, int length, float scale) "
        "-> Tensor");
  m.def("flash_prefill_available() -> bool", &flash_prefill_available);
}

TORCH_LIBRARY_IMPL(wideserve, CPU, m) {
  m.impl("flash_prefill", &flash_prefill);
}
