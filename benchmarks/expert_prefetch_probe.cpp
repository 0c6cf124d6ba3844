// The fused experts' decode-step weight stream, synthetic, to set the micro-kernel's read-ahead
// (csrc/gemm.h Ahead::kStream, csrc/moe_common.h kStreamRowsUp / kStreamRowsDown) on a CPU:
// BENCHMARKS.md, "Zen 4: expert tiles stream their weights ahead".
//
//   g++ -O3 -march=native -fopenmp -std=c++17 benchmarks/expert_prefetch_probe.cpp -o /tmp/probe
//   /tmp/probe [rounds=200] > probe.txt; python benchmarks/expert_prefetch_probe.py probe.txt
//
// Eight layers of the 653M model's experts (64 x [gate/up 768 x 1,024 | down 1,024 x 384] bf16,
// packed as the op packs them: up groups of 2 blocks, down groups of 4) on 2 MiB pages, read
// by 2 threads as the op's expert-major split reads them (thread t: its half of every expert's
// groups, experts in turn), through register tiles of M rows with vdpbf16ps, each variant with
// and without a software prefetch DIST bytes ahead of its loads (into L2, running on into the
// thread's next group). Each round first reads the same bytes with plain loads: the machine's
// bandwidth at that moment, by which the script bins the rounds (a shared host's moves within
// seconds). Output: one line a round, GB/s of weights for each variant.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

using bf = unsigned short;
constexpr long D = 1024, I = 384, E = 64, L = 8;
constexpr long kUpGroup = 2 * 16 * D, kDownGroup = 4 * 16 * I;   // elements
constexpr long kExpert = 24 * kUpGroup + 16 * kDownGroup;
float sink[2 * 4096];

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline __m512 dp(__m512 acc, __m512i w, const bf* pair) {
  __asm__("vdpbf16ps (%2)%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "r"(pair));
  return acc;
}

// M rows x NB blocks over one group of `pairs` steps; DIST > 0: prefetch DIST bytes ahead.
template <int M, int NB, int DIST>
__attribute__((noinline)) void tile(const bf* const* x, long pairs, const bf* w, float* out,
                                    const bf* next) {
  __asm__ volatile("" ::: "memory");
  __m512 acc[M][NB];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  constexpr long step = NB * 64, ahead = DIST / step;
  for (long p = 0; p < pairs; ++p) {
    __m512i wv[NB];
    if constexpr (DIST > 0) {
      const char* q = p + ahead < pairs ? (const char*)w + (p + ahead) * step
                                        : (const char*)next + (p + ahead - pairs) * step;
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) _mm_prefetch(q + n * 64, _MM_HINT_T1);
    }
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) wv[n] = _mm512_loadu_si512(w + (p * NB + n) * 32);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) acc[m][n] = dp(acc[m][n], wv[n], x[m] + 2 * p);
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) _mm512_storeu_ps(out + (m * NB + n) * 16, acc[m][n]);
}

using Tile = void (*)(const bf* const*, long, const bf*, float*, const bf*);
struct Variant {
  const char* name;
  bool up;
  Tile first, rest;   // rest: a second pass over each group (nullptr: none)
};

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 200;
  const long bytes = L * E * kExpert * 2;
  bf* w = static_cast<bf*>(std::aligned_alloc(1 << 21, bytes));
  madvise(w, bytes, MADV_HUGEPAGE);
  for (long i = 0; i < bytes / 2; ++i) w[i] = 0x3f80 ^ (i & 7);
  bf* x = static_cast<bf*>(std::aligned_alloc(64, 16 * D * 2));
  for (long i = 0; i < 16 * D; ++i) x[i] = 0x3f80;
  const std::vector<Variant> variants = {
      {"up1", true, tile<1, 2, 0>, nullptr},       {"up1_8k", true, tile<1, 2, 8192>, nullptr},
      {"up4", true, tile<4, 2, 0>, nullptr},       {"up4_8k", true, tile<4, 2, 8192>, nullptr},
      {"up6", true, tile<6, 2, 0>, nullptr},       {"up6_8k", true, tile<6, 2, 8192>, nullptr},
      {"up7", true, tile<7, 2, 0>, nullptr},       {"up7_8k", true, tile<7, 2, 8192>, nullptr},
      {"up8", true, tile<8, 2, 0>, nullptr},       {"up8_4k", true, tile<8, 2, 4096>, nullptr},
      {"up8_8k", true, tile<8, 2, 8192>, nullptr}, {"up8_16k", true, tile<8, 2, 16384>, nullptr},
      {"up10_5+5", true, tile<5, 2, 0>, tile<5, 2, 0>},
      {"up10_8+2_8k", true, tile<8, 2, 8192>, tile<2, 2, 0>},
      {"dn4", false, tile<4, 4, 0>, nullptr},      {"dn4_8k", false, tile<4, 4, 8192>, nullptr},
      {"dn5", false, tile<5, 4, 0>, nullptr},      {"dn5_8k", false, tile<5, 4, 8192>, nullptr},
      {"dn6", false, tile<6, 4, 0>, nullptr},      {"dn6_8k", false, tile<6, 4, 8192>, nullptr},
      {"dn7", false, tile<7, 4, 0>, nullptr},      {"dn7_8k", false, tile<7, 4, 8192>, nullptr},
      {"dn8_4+4", false, tile<4, 4, 0>, tile<4, 4, 0>},
      {"dn8_7+1_8k", false, tile<7, 4, 8192>, tile<1, 4, 0>},
  };
  for (int r = 0; r < rounds; ++r) {
    double t0 = now();
    for (int l = 0; l < L; ++l) {
#pragma omp parallel num_threads(2)
      {
        const int t = omp_get_thread_num();
        const char* p = reinterpret_cast<const char*>(w + l * E * kExpert) + t * E * kExpert;
        __m512i a = _mm512_setzero_si512(), b = a;
        for (long o = 0; o < E * kExpert; o += 128) {
          a = _mm512_xor_si512(a, _mm512_loadu_si512(p + o));
          b = _mm512_xor_si512(b, _mm512_loadu_si512(p + o + 64));
        }
        _mm512_storeu_si512(sink + t * 4096, _mm512_xor_si512(a, b));
      }
    }
    std::printf("read %.1f", L * E * kExpert * 2.0 / (now() - t0) / 1e9);
    for (const Variant& v : variants) {
      t0 = now();
      for (int l = 0; l < L; ++l) {
        const bf* lw = w + l * E * kExpert;
#pragma omp parallel num_threads(2)
        {
          const int t = omp_get_thread_num();
          const bf* xr[16];
          for (int m = 0; m < 16; ++m) xr[m] = x + m * D;
          const long groups = v.up ? 12 : 8, size = v.up ? kUpGroup : kDownGroup;
          const long base = v.up ? 0 : 24 * kUpGroup, pairs = v.up ? D / 2 : I / 2;
          for (long e = 0; e < E; ++e) {
            for (long j = groups * t; j < groups * (t + 1); ++j) {
              const bf* g = lw + e * kExpert + base + j * size;
              const bf* next = j + 1 < groups * (t + 1)
                                   ? g + size
                                   : lw + std::min(e + 1, E - 1) * kExpert + base + groups * t * size;
              v.first(xr, pairs, g, sink + t * 4096, next);
              if (v.rest) v.rest(xr, pairs, g, sink + t * 4096, next);
            }
          }
        }
      }
      const double moved = (v.up ? 24.0 * kUpGroup : 16.0 * kDownGroup) * 2 * E * L;
      std::printf("  %s %.1f", v.name, moved / (now() - t0) / 1e9);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  return sink[0] == 12345.0f;
}
