// The lossless 12-bit coding of packed bf16 expert weights (kernels/lossless.py `encode`; the
// layout and why: csrc/moe_lossless.h, docs/cpu_kernels.md "Lossless 12-bit expert weights").
// Portable C++ on every build: it runs once per weight change, not per step, but in torch ops
// it took ~0.56 s per 151 MB layer of the 653M benchmark model (two threads), ~0.09 s here:
// seconds of start-up for a small model, minutes for a large one otherwise. The same bytes as
// lossless.py's `encode_reference`, which the tests hold it to.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <tuple>
#include <vector>

#ifdef __AVX512BW__
#include <immintrin.h>
#endif

#include "moe_lossless.h"

namespace {

using wideserve_moe::kChunkBytes;
using wideserve_moe::kEscape;
constexpr int64_t kChunk = wideserve_moe::kChunkValues;

// perm[q]: the chunk value (vector v * 32 + word w) stored at coded position q (the order
// AVX512's per-lane byte unpacks rebuild, lossless.py `_chunk_order`).
std::array<int, kChunk> chunk_order() {
  std::array<int, kChunk> perm{};
  for (int v = 0; v < 4; ++v)
    for (int w = 0; w < 32; ++w)
      perm[(v / 2) * 64 + 16 * (w / 8) + w % 8 + 8 * (v % 2)] = v * 32 + w;
  return perm;
}

// The 15 most frequent high bytes, most frequent first, ties to the smaller byte.
std::array<uint8_t, 16> table_of(const uint16_t* bits, int64_t n) {
  const int threads = at::get_num_threads();
  std::vector<std::array<int64_t, 256>> counts(threads);
  for (auto& c : counts) c.fill(0);
  at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
    auto& c = counts[at::get_thread_num()];
    for (int64_t i = b; i < e; ++i) ++c[bits[i] >> 8];
  });
  std::array<int64_t, 256> total{};
  for (const auto& c : counts)
    for (int h = 0; h < 256; ++h) total[h] += c[h];
  std::array<int, 256> order{};
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return total[a] > total[b]; });
  std::array<uint8_t, 16> table{};
  for (int i = 0; i < kEscape; ++i) table[i] = static_cast<uint8_t>(order[i]);
  return table;
}

// One chunk's coding (kChunk values at v -> kChunkBytes at o), its escape count; and its
// escaped values, whole, in decode order. Plain C++ through `perm`, or AVX512BW: the low and
// high bytes of two vectors in the decoder's unpack order are exactly `vpackuswb` of their
// masked and shifted words (per 128-bit lane: the first vector's 8 words, then the second's),
// and a high byte's code is found by 15 byte compares against the table.
struct Coder {
#ifdef __AVX512BW__
  __m512i table[kEscape];      // each high byte of the table, broadcast

  explicit Coder(const std::array<uint8_t, 16>& high) {
    for (int i = 0; i < kEscape; ++i) table[i] = _mm512_set1_epi8(static_cast<char>(high[i]));
  }

  // Vectors q, q + 1 of a chunk as (low bytes, high bytes) in the coded order.
  static void split(const uint16_t* v, int q, __m512i& lo, __m512i& hi) {
    const __m512i a = _mm512_loadu_si512(v + 32 * q), b = _mm512_loadu_si512(v + 32 * q + 32);
    const __m512i byte = _mm512_set1_epi16(0xFF);
    lo = _mm512_packus_epi16(_mm512_and_si512(a, byte), _mm512_and_si512(b, byte));
    hi = _mm512_packus_epi16(_mm512_srli_epi16(a, 8), _mm512_srli_epi16(b, 8));
  }
  __m512i codes(__m512i hi) const {
    __m512i c = _mm512_set1_epi8(kEscape);
    for (int i = 0; i < kEscape; ++i)
      c = _mm512_mask_mov_epi8(c, _mm512_cmpeq_epi8_mask(hi, table[i]),
                               _mm512_set1_epi8(static_cast<char>(i)));
    return c;
  }
  int64_t encode(const uint16_t* v, uint8_t* o) const {
    __m512i l0, h0, l1, h1;
    split(v, 0, l0, h0);
    split(v, 2, l1, h1);
    const __m512i c0 = codes(h0), c1 = codes(h1), esc = _mm512_set1_epi8(kEscape);
    _mm512_storeu_si512(o, l0);
    _mm512_storeu_si512(o + 64, l1);
    _mm512_storeu_si512(o + 128, _mm512_or_si512(c0, _mm512_slli_epi16(c1, 4)));
    return __builtin_popcountll(_mm512_cmpeq_epi8_mask(c0, esc)) +
           __builtin_popcountll(_mm512_cmpeq_epi8_mask(c1, esc));
  }
  void exceptions(const uint16_t* v, uint16_t*& e) const {
    const __m512i esc = _mm512_set1_epi8(kEscape);
    for (int half = 0; half < 2; ++half) {
      __m512i lo, hi;
      split(v, 2 * half, lo, hi);
      for (__mmask64 k = _mm512_cmpeq_epi8_mask(codes(hi), esc); k; k &= k - 1) {
        const int p = __builtin_ctzll(k), lane = p >> 4, j = p & 15;
        *e++ = v[half * 64 + (j < 8 ? 0 : 32) + lane * 8 + (j & 7)];
      }
    }
  }
#else
  std::array<uint8_t, 256> code_of;
  std::array<int, kChunk> perm = chunk_order();

  explicit Coder(const std::array<uint8_t, 16>& high) {
    code_of.fill(kEscape);
    for (int i = 0; i < kEscape; ++i) code_of[high[i]] = static_cast<uint8_t>(i);
  }

  int64_t encode(const uint16_t* v, uint8_t* o) const {
    uint8_t codes[kChunk];
    int64_t escapes = 0;
    for (int q = 0; q < kChunk; ++q) {
      const uint16_t word = v[perm[q]];
      o[q] = static_cast<uint8_t>(word & 0xFF);
      codes[q] = code_of[word >> 8];
      escapes += codes[q] == kEscape;
    }
    for (int p = 0; p < 64; ++p)
      o[kChunk + p] = static_cast<uint8_t>(codes[p] | (codes[64 + p] << 4));
    return escapes;
  }
  void exceptions(const uint16_t* v, uint16_t*& e) const {
    for (int q = 0; q < kChunk; ++q)
      if (code_of[v[perm[q]] >> 8] == kEscape) *e++ = v[perm[q]];
  }
#endif
};

// A group's tile steps (16 K pairs of its NB blocks, 4 NB chunks) and where chunk c of the
// group is stored: its step's slot (wideserve_moe::step_slot), in order within the step. A
// K not in whole steps (no AMX op takes it) is one step.
struct Steps {
  int64_t count, chunks;
  Steps(int64_t pairs, int64_t group_chunks)
      : count(pairs > 0 && pairs % 16 == 0 ? pairs / 16 : 1), chunks(group_chunks / count) {}
  int64_t place(int64_t c) const {
    return wideserve_moe::step_slot(c / chunks, count) * chunks + c % chunks;
  }
};

// packed bf16 [E, groups, pairs, NB, 16, 2] -> (data [E, groups, bytes] uint8, exceptions [n]
// int16, starts [E * groups] int64, table [16] uint8).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lossless_encode(
    const at::Tensor& packed_in) {
  TORCH_CHECK(packed_in.scalar_type() == at::kBFloat16 && packed_in.dim() == 6,
              "lossless_encode: a packed bf16 [E, groups, pairs, NB, 16, 2] stack");
  const at::Tensor packed = packed_in.contiguous();
  const int64_t E = packed.size(0), groups = packed.size(1);
  const int64_t values = E * groups ? packed.numel() / (E * groups) : 0;
  TORCH_CHECK(values % kChunk == 0, "lossless_encode: a group of ", values,
              " values is not whole chunks of ", kChunk);
  const auto* bits = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const std::array<uint8_t, 16> table = table_of(bits, packed.numel());
  const Coder coder(table);
  const int64_t chunks = values / kChunk, n_groups = E * groups;
  const Steps steps(packed.size(2), chunks);
  at::Tensor data = at::empty({E, groups, chunks * kChunkBytes}, at::kByte);
  at::Tensor starts = at::empty({n_groups}, at::kLong);
  uint8_t* out = data.data_ptr<uint8_t>();
  int64_t* start = starts.data_ptr<int64_t>();
  std::vector<int64_t> escapes(n_groups, 0);
  // Pass 1: every group's bytes and how many of its values escape.
  at::parallel_for(0, n_groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t grp = g0; grp < g1; ++grp)
      for (int64_t c = 0; c < chunks; ++c)
        escapes[grp] += coder.encode(bits + grp * values + c * kChunk,
                                     out + (grp * chunks + steps.place(c)) * kChunkBytes);
  });
  int64_t total = 0;
  for (int64_t grp = 0; grp < n_groups; ++grp) {
    start[grp] = total;
    total += escapes[grp];
  }
  // Pass 2: the escaped values, whole, in decode order from each group's start.
  at::Tensor exceptions = at::empty({total}, at::kShort);
  auto* exc = reinterpret_cast<uint16_t*>(exceptions.data_ptr());
  at::parallel_for(0, n_groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t grp = g0; grp < g1; ++grp) {
      if (!escapes[grp]) continue;
      uint16_t* e = exc + start[grp];
      for (int64_t c = 0; c < chunks; ++c) coder.exceptions(bits + grp * values + c * kChunk, e);
    }
  });
  at::Tensor table_t = at::empty({16}, at::kByte);
  std::memcpy(table_t.data_ptr<uint8_t>(), table.data(), 16);
  return {data, exceptions, starts, table_t};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("lossless_encode(Tensor packed) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(wideserve, CPU, m) {
  m.impl("lossless_encode", &lossless_encode);
}
