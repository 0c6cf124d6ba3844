// The fused experts op's expert schedule (csrc/moe.cpp; docs/cpu_kernels.md, "Routed
// experts"): each thread takes whole experts from a shared counter and runs an expert's
// gate/up and then its down GEMM before it takes the next, so no thread waits for the others
// between the two GEMMs and an expert's activations are read back from the thread's own caches.
// Included by csrc/moe.cpp only.
//
// The column schedule (each thread a fixed share of every expert's columns, the two GEMMs in
// two parallel phases) lets each thread add its columns of every row into the output in the
// sorted order of the rows without ever meeting another thread. Here a token's rows belong to
// experts that different threads run, so a row's down result is added to its token's sum
// only when every row before it (in the sorted order) has been: `OrderedSums` keeps, per
// token, the position of the next row due; a thread that finishes a row out of turn parks its
// fp32 result, and the thread that adds the row before it adds the parked one after it. Every
// sum is then the same fp32 sequence as the column schedule's (csrc/moe_common.h's
// down_store): the outputs are bit for bit the same, whatever the threads and their timing.
// Rows rarely wait: a token's picks are ~E/k experts apart in the order the counter hands
// experts out.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "moe_common.h"
#include "moe_tiles.h"
#include "weight_stream.h"

namespace wideserve_moe {

// Whether the expert schedule runs a call of `active` experts of `expert_bytes` (gate/up and
// down) each at `threads` threads, where the caller leaves the choice to the op. Measured on
// the Zen 4 (BENCHMARKS.md, "Zen 4: the decode experts by whole experts"): on the 653M
// model's experts (2.25 MiB each) faster at 1-128 tokens and 1-2 threads (8-64 active
// experts); on the 11M model's (384 KiB) 1.1-1.3x slower at 1-4 tokens (2-8 active experts:
// the counter cannot balance two threads over so few, and the ordering's set-up is a fair part
// of a 12-50 us call) and no faster at 64.
inline bool by_expert_pays(int64_t active, int64_t threads, int64_t expert_bytes) {
  return active >= 4 * threads && expert_bytes >= (int64_t{1} << 20);
}

#ifdef __AVX512BF16__
// The down results of the rows, added into Sums<bf16> in each token's sorted order.
class OrderedSums {
 public:
  OrderedSums(const Rows& rows, const Geometry& g, Sums<at::BFloat16> sums)
      : rows_(rows), g_(g), sums_(sums), start_(rows.tokens + 1, 0), list_(rows.token.size()),
        due_(rows.tokens, 0), parked_(rows.token.size(), 0),
        locks_(new std::atomic<uint8_t>[rows.tokens]),
        park_(aligned_buffer<float>(static_cast<int64_t>(rows.token.size()) * stride())) {
    const int64_t n = static_cast<int64_t>(rows.token.size()), tokens = rows.tokens;
    for (int64_t r = 0; r < n; ++r) ++start_[rows.token[r] + 1];
    for (int64_t t = 0; t < tokens; ++t) start_[t + 1] += start_[t];
    std::vector<int64_t> fill(start_.begin(), start_.end() - 1);
    for (int64_t r = 0; r < n; ++r) list_[fill[rows.token[r]]++] = r;
    for (int64_t t = 0; t < tokens; ++t) locks_[t].store(0, std::memory_order_relaxed);
  }

  // Floats per row of a result: the output's 64-column groups, plus one 16-float block so
  // that consecutive rows do not sit 4 KiB apart (loads of one row would wait on stores to
  // the same offsets of the row before: 4K aliasing).
  int64_t stride() const { return g_.down_groups * kBlocksDown * kLanes + kLanes; }

  // Rows [r0, r1) of one expert are done, row r's fp32 result at local + (r - r0) * stride.
  void finish(int64_t r0, int64_t r1, const float* local) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = rows_.token[r];
      while (locks_[t].exchange(1, std::memory_order_acquire)) _mm_pause();
      const float* own = local + (r - r0) * stride();
      if (list_[start_[t] + due_[t]] == r) {
        add(r, own);
        int64_t q = ++due_[t];
        for (; start_[t] + q < start_[t + 1] && parked_[list_[start_[t] + q]]; ++q)
          add(list_[start_[t] + q], parked(list_[start_[t] + q]));
        due_[t] = q;
      } else {   // a row before it is still being computed: it adds this one after its own
        std::memcpy(parked(r), own, g_.d * sizeof(float));
        parked_[r] = 1;
      }
      locks_[t].store(0, std::memory_order_release);
    }
  }

 private:
  void add(int64_t r, const float* v) {
    for (int64_t grp = 0; grp < g_.down_groups; ++grp) {
      const float* src = v + grp * kBlocksDown * kLanes;
      down_store<kBlocksDown>([&](int n) { return _mm512_loadu_ps(src + n * kLanes); }, rows_,
                              r, g_, grp * kBlocksDown, sums_);
    }
  }
  float* parked(int64_t r) { return park_.get() + r * stride(); }   // pages touched if parked

  const Rows& rows_;
  const Geometry& g_;
  Sums<at::BFloat16> sums_;
  std::vector<int64_t> start_, list_;   // token t's rows, sorted: list_[start_[t] ...]
  std::vector<int64_t> due_;            // per token: the position of its next row to add
  std::vector<uint8_t> parked_;         // per row: its result waits in park_
  std::unique_ptr<std::atomic<uint8_t>[]> locks_;   // per token, over the three above
  Aligned<float> park_;
};
#endif  // __AVX512BF16__

// Hands out the active experts (indices into rows.active, in order) one at a time to the
// threads of a parallel region; each thread takes its next expert before it runs the current
// one, so that the current one's last weight group can ask for the next one's first.
class ExpertCounter {
 public:
  explicit ExpertCounter(int64_t active) : active_(active) {}
  // Every thread makes its own state (make()), then run(state, i, next) for each expert i it
  // takes, `next` being the one it runs after it (-1: none).
  template <typename Make, typename Run>
  void run_all(Make&& make, Run&& run) {
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      auto state = make();
      int64_t cur = next_.fetch_add(1);
      while (cur < active_) {
        const int64_t nxt = next_.fetch_add(1);
        run(state, cur, nxt < active_ ? nxt : -1);
        cur = nxt;
      }
    });
  }

 private:
  const int64_t active_;
  std::atomic<int64_t> next_{0};
};

#ifdef __AVX512BF16__
// The expert schedule, every expert on the micro-kernel tiles: a thread runs expert i's
// gate/up groups, then its down groups into its own fp32 results, which OrderedSums adds in
// order. The last gate/up group asks for the expert's first down group ahead, the last down
// group for the first gate/up group of the thread's next expert. `most`: the rows of the
// busiest expert (each thread's results buffer holds that many).
inline void run_by_expert(const at::BFloat16* x, const at::BFloat16* w13,
                          const at::BFloat16* w2, const Rows& rows, int64_t most,
                          const Geometry& g, bool clamp, float limit, at::BFloat16* act,
                          Sums<at::BFloat16> sums) {
  using T = at::BFloat16;
  const int64_t usz = g.up_group_size(), dsz = g.down_group_size();
  const int64_t e13 = g.up_groups * usz, e2 = g.down_groups * dsz;
  OrderedSums ordered(rows, g, sums);
  const int64_t stride = ordered.stride();
  ExpertCounter counter(static_cast<int64_t>(rows.active.size()));
  counter.run_all([&] { return aligned_buffer<float>(most * stride); },
                  [&](Aligned<float>& results, int64_t i, int64_t following) {
    const int64_t e = rows.active[i], r0 = rows.offsets[e], r1 = rows.offsets[e + 1];
    for (int64_t j = 0; j < g.up_groups; ++j) {
      const T* w = w13 + e * e13 + j * usz;
      const T* next = j + 1 < g.up_groups ? w + usz : w2 + e * e2;
      group_tiles<kRowsUp, kRowsUpOnePass>(r0, r1, [&](auto m, int64_t r, bool first) {
        up_tile_bf16<decltype(m)::value>(x, rows, r, w, g, j, clamp, limit, act,
                                         first ? next : nullptr);
      });
    }
    const T* after = following >= 0 ? w13 + rows.active[following] * e13 : nullptr;
    for (int64_t grp = 0; grp < g.down_groups; ++grp) {
      const T* w = w2 + e * e2 + grp * dsz;
      const T* next = grp + 1 < g.down_groups ? w + dsz : after;
      group_tiles<kRowsDown>(r0, r1, [&](auto m, int64_t r, bool first) {
        down_tile_results<decltype(m)::value>(act, r0, r, w, g, grp * kBlocksDown,
                                              results.get(), stride, first ? next : nullptr);
      });
    }
    ordered.finish(r0, r1, results.get());
  });
}
#endif  // __AVX512BF16__

// How the threads share a call's experts: "columns" (run_experts: every expert's columns
// split between them, two phases), "experts" (run_by_expert: whole experts from a counter),
// or left to the op (by_expert_pays, where every expert runs on the micro-kernel).
enum class Schedule { kAuto, kColumns, kExperts };

inline Schedule parse_schedule(const std::optional<c10::string_view>& s) {
  if (!s.has_value()) return Schedule::kAuto;
  if (*s == "columns") return Schedule::kColumns;
  if (*s == "experts") return Schedule::kExperts;
  TORCH_CHECK(false, "moe_fused_experts: schedule must be 'columns', 'experts' or None, got '",
              std::string(*s), "'");
}

// Whether a bf16 call runs on the expert schedule; `micro`: every expert would run on the
// AVX512-BF16 micro-kernel (the fast path, none at the brgemm threshold).
inline bool use_by_expert(Schedule s, bool micro, const Rows& rows, const Geometry& g) {
  if (s == Schedule::kColumns) return false;
  TORCH_CHECK(s == Schedule::kAuto || micro, "moe_fused_experts: schedule='experts' runs every "
              "expert on the AVX512-BF16 micro-kernel: it needs bf16 inputs, this build's "
              "AVX512-BF16 path, portable=False and no expert with brgemm_min_rows rows");
  if (s == Schedule::kExperts) return true;
  const int64_t expert_bytes = (g.up_groups * g.up_group_size() +
                                g.down_groups * g.down_group_size()) * 2;
  return micro && !wideserve_stream::active() &&
         by_expert_pays(static_cast<int64_t>(rows.active.size()), at::get_num_threads(),
                        expert_bytes);
}

}  // namespace wideserve_moe
