// The brgemm loops timed by benchmarks/brgemm_tiles.py (thread CPU time per loop).
#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>
#include <chrono>
#include <time.h>
static double now(){timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec+1e-9*t.tv_nsec;}
#include <vector>
// up: x [M, K] bf16, w [G, K/2, ncols, 2] (ncols per group), C scratch.
// variant 0: for g: for rb(32): call (32 rows)
// variant 1: for g: for rb(mblk): call (mblk rows)
// variant 2: for rb(mblk): for g: call
// variant 3: for g: for kb: for rb(mblk) add_C
double run(const at::Tensor& x, const at::Tensor& w, int64_t variant, int64_t mblk, int64_t kblk, int64_t reps) {
  const int64_t M = x.size(0), K = x.size(1), G = w.size(0), nc = w.size(2);
  const auto* a = x.data_ptr<at::BFloat16>();
  const auto* b = w.data_ptr<at::BFloat16>();
  std::vector<float> c(std::max<int64_t>(M, mblk) * nc * 2 + 64);
  double t0 = now();
  for (int64_t rep = 0; rep < reps; ++rep) {
    if (variant == 1) {
      for (int64_t g = 0; g < G; ++g)
        for (int64_t r = 0; r < M; r += mblk) {
          int64_t m = std::min(mblk, M - r);
          at::native::cpublas::brgemm(m, nc, K, K, nc, nc, false, a + r * K, b + g * K * nc, c.data());
        }
    } else if (variant == 2) {
      for (int64_t r = 0; r < M; r += mblk)
        for (int64_t g = 0; g < G; ++g) {
          int64_t m = std::min(mblk, M - r);
          at::native::cpublas::brgemm(m, nc, K, K, nc, nc, false, a + r * K, b + g * K * nc, c.data());
        }
    } else if (variant == 4) {   // overhead: tiny calls, same shape (mblk=0) or alternating
      for (int64_t i = 0; i < 1000; ++i) {
        at::native::cpublas::brgemm(16, 16, 32, K, nc, nc, false, a, b, c.data());
        if (mblk) at::native::cpublas::brgemm(32, 16, 32, K, nc, nc, false, a, b, c.data());
        else at::native::cpublas::brgemm(16, 16, 32, K, nc, nc, false, a, b, c.data());
      }
    } else if (variant == 3) {
      for (int64_t g = 0; g < G; ++g)
        for (int64_t k0 = 0; k0 < K; k0 += kblk)
          for (int64_t r = 0; r < M; r += mblk) {
            int64_t m = std::min(mblk, M - r);
            at::native::cpublas::brgemm(m, nc, kblk, K, nc, nc, k0 > 0, a + r * K + k0, b + g * K * nc + k0 * nc, c.data() + r * nc);
          }
    }
  }
  at::native::cpublas::brgemm_release();
  return (now() - t0) / reps;
}
TORCH_LIBRARY(bb, m) { m.def("run(Tensor x, Tensor w, int v, int mblk, int kblk, int reps) -> float", &run); }
