// The lossless 12-bit coding of packed bf16 expert weights (kernels/lossless.py `encode`; the
// layout and why: csrc/moe_lossless.h, docs/cpu_kernels.md "Lossless 12-bit expert weights").
// Portable C++ on every build: it runs once per weight change, not per step, but in torch ops
// it took ~0.56 s per 151 MB layer of the 653M benchmark model (two threads), ~0.17 s here:
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

namespace {

constexpr int64_t kChunk = 128, kChunkBytes = 192;
constexpr int kEscape = 15;

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

// packed bf16 [E, groups, ...] -> (data [E, groups, bytes] uint8, exceptions [n] int16,
// starts [E * groups] int64, table [16] uint8).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lossless_encode(
    const at::Tensor& packed_in) {
  TORCH_CHECK(packed_in.scalar_type() == at::kBFloat16 && packed_in.dim() >= 3,
              "lossless_encode: a packed bf16 [E, groups, ...] stack");
  const at::Tensor packed = packed_in.contiguous();
  const int64_t E = packed.size(0), groups = packed.size(1);
  const int64_t values = E * groups ? packed.numel() / (E * groups) : 0;
  TORCH_CHECK(values % kChunk == 0, "lossless_encode: a group of ", values,
              " values is not whole chunks of ", kChunk);
  const auto* bits = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const std::array<uint8_t, 16> table = table_of(bits, packed.numel());
  std::array<uint8_t, 256> code_of;
  code_of.fill(kEscape);
  for (int i = 0; i < kEscape; ++i) code_of[table[i]] = static_cast<uint8_t>(i);
  const std::array<int, kChunk> perm = chunk_order();
  const int64_t chunks = values / kChunk, n_groups = E * groups;
  at::Tensor data = at::empty({E, groups, chunks * kChunkBytes}, at::kByte);
  at::Tensor starts = at::empty({n_groups}, at::kLong);
  uint8_t* out = data.data_ptr<uint8_t>();
  int64_t* start = starts.data_ptr<int64_t>();
  std::vector<int64_t> escapes(n_groups, 0);
  // Pass 1: every group's bytes and how many of its values escape.
  at::parallel_for(0, n_groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t grp = g0; grp < g1; ++grp) {
      for (int64_t c = 0; c < chunks; ++c) {
        const uint16_t* v = bits + grp * values + c * kChunk;
        uint8_t* o = out + (grp * chunks + c) * kChunkBytes;
        uint8_t codes[kChunk];
        for (int q = 0; q < kChunk; ++q) {
          const uint16_t word = v[perm[q]];
          o[q] = static_cast<uint8_t>(word & 0xFF);
          codes[q] = code_of[word >> 8];
          escapes[grp] += codes[q] == kEscape;
        }
        for (int p = 0; p < 64; ++p)
          o[kChunk + p] = static_cast<uint8_t>(codes[p] | (codes[64 + p] << 4));
      }
    }
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
      for (int64_t c = 0; c < chunks; ++c) {
        const uint16_t* v = bits + grp * values + c * kChunk;
        for (int q = 0; q < kChunk; ++q)
          if (code_of[v[perm[q]] >> 8] == kEscape) *e++ = v[perm[q]];
      }
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
