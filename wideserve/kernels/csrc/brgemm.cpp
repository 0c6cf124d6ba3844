// Dense bf16 linears through oneDNN's brgemm ukernel (csrc/brgemm.h) over the micro-kernel's
// packed weight (docs/cpu_kernels.md, "Kernel choice"):
//
//   gemm_linear_brgemm(x [M, K], w packed, n, bias?, widen) -> [M, n] = x @ W^T + bias
//
// the same contract as gemm_linear (csrc/linear.cpp): fp32 accumulation, bias added in fp32,
// one rounding to bf16 (RNE); `widen` returns those rounded values as fp32. Work items are
// (group of 16 NB output columns, block of 32 rows), group-major, so a thread's consecutive
// items reuse one weight group from L2. bf16 only (brgemm's VNNI form).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "brgemm.h"
#include "page_kick.h"

namespace {

constexpr int64_t kLanes = 16;

template <typename Out>
void run(const at::BFloat16* x, const at::BFloat16* w, int64_t m, int64_t kp, int64_t n,
         int64_t groups, int64_t nb, const float* bias, bool widen, Out* out) {
  const int64_t cols = nb * kLanes, group_size = kp * cols;
  const int64_t blocks = (m + wideserve_brgemm::kBlockM - 1) / wideserve_brgemm::kBlockM;
  at::parallel_for(0, groups * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(wideserve_brgemm::kBlockM * cols);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / blocks, r0 = (item % blocks) * wideserve_brgemm::kBlockM;
      const int64_t rows = std::min(wideserve_brgemm::kBlockM, m - r0);
      // the next group's pages kicked while this one runs (csrc/page_kick.h): a decode
      // step's 17 linears of the 653M model (M = 64, cold) 3.9-4.3 -> 3.1-3.7 ms back to
      // back, medians ~4.8 -> ~4.55 ms with other work between (benchmarks/decode_linears.py)
      if (r0 == 0 && g + 1 < groups) wideserve_kick::pages(w + (g + 1) * group_size,
                                                           group_size * 2);
      wideserve_brgemm::tile(rows, cols, kp, kp, x + r0 * kp, w + g * group_size, acc.data());
      const int64_t c0 = g * cols, valid = std::min(cols, n - c0);
      for (int64_t r = 0; r < rows; ++r)
        wideserve_brgemm::store_row<Out>(acc.data() + r * cols, bias ? bias + c0 : nullptr,
                                         valid, widen, out + (r0 + r) * n + c0);
    }
    wideserve_brgemm::release();
  });
}

at::Tensor gemm_linear_brgemm(const at::Tensor& x_in, const at::Tensor& w, int64_t n,
                              const std::optional<at::Tensor>& bias, bool widen) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16,
              "gemm_linear_brgemm: x must be a bfloat16 [M, K]");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 5 && w.is_contiguous(),
              "gemm_linear_brgemm: the packed weight must be a contiguous bfloat16 "
              "[groups, K/2, NB, 16, 2] tensor (wideserve.kernels.gemm.pack_linear)");
  const int64_t m = x_in.size(0), k = x_in.size(1);
  const int64_t groups = w.size(0), pairs = w.size(1), nb = w.size(2);
  TORCH_CHECK((nb == 1 || nb == 2 || nb == 4) && w.size(3) == kLanes && w.size(4) == 2 &&
                  pairs == (k + 1) / 2 && n > 0 && groups == (n + nb * kLanes - 1) /
                  (nb * kLanes),
              "gemm_linear_brgemm: packed weight ", w.sizes(), " does not match K ", k, ", N ",
              n, " (pack it with wideserve.kernels.gemm.pack_linear)");
  at::Tensor b;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n,
                "gemm_linear_brgemm: bias must be [", n, "]");
    b = bias->to(at::kFloat).contiguous();
    bp = b.data_ptr<float>();
  }
  at::Tensor out = at::empty({m, n}, x_in.options().dtype(widen ? at::kFloat : at::kBFloat16));
  if (m == 0) return out;
  at::Tensor x = x_in.contiguous();
  if (k % 2) x = at::constant_pad_nd(x, {0, 1});   // the packed weight's zero pair
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = w.data_ptr<at::BFloat16>();
  if (widen) run<float>(xp, wp, m, 2 * pairs, n, groups, nb, bp, true, out.data_ptr<float>());
  else run<at::BFloat16>(xp, wp, m, 2 * pairs, n, groups, nb, bp, false,
                         out.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace

at::Tensor wideserve_brgemm::linear(const at::Tensor& x, const at::Tensor& w, int64_t n,
                                    const std::optional<at::Tensor>& bias, bool widen) {
  return gemm_linear_brgemm(x, w, n, bias, widen);
}

namespace {

// Whether torch's brgemm runs bf16 on this CPU (wideserve_brgemm::runs); elsewhere the kernel
// choice never offers it.
bool brgemm_available() { return wideserve_brgemm::runs(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("gemm_linear_brgemm(Tensor x, Tensor w, int n, Tensor? bias=None, bool widen=False) "
        "-> Tensor");
  m.def("brgemm_available() -> bool", &brgemm_available);
}

TORCH_LIBRARY_IMPL(wideserve, CPU, m) {
  m.impl("gemm_linear_brgemm", &gemm_linear_brgemm);
}
