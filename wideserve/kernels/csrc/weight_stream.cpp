// Weight streaming's helper thread (csrc/weight_stream.h; docs/cpu_kernels.md, "Weight
// streaming").
//
//   weight_stream_start(cpus, lead_bytes, min_plan_bytes, idle) -> bool   (False: one runs)
//   weight_stream_stop()
//   weight_stream_active() -> bool
//   weight_stream_queue(tensors)   the tensors the next posted plan streams after its own
//   weight_stream_stats() -> [running, plans, ranges, bytes, sched_idle, pinned]
//
// One helper per process. Its state lives on the heap and is never freed: a process that
// exits without stop() must not destroy a condition variable the thread waits on. A child
// forked from a process with a helper has no helper (threads do not survive a fork): the
// pid recorded at start tells it so.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "weight_stream.h"

namespace wideserve_stream {

struct State {
  pid_t pid = 0;
  int64_t lead = 0;             // the most bytes streamed ahead of the compute thread
  int64_t min_plan = 0;         // plans with fewer bytes are not streamed
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Range> plan;      // guarded by mu
  std::vector<Range> pending;   // guarded by mu: queued for the next plan's tail
  int64_t tracked = 0;          // guarded by mu: the plan's ranges the compute thread reports
  uint64_t posted = 0;          // guarded by mu: the generation of `plan`
  bool stop = false;            // guarded by mu
  std::atomic<uint64_t> live{0};      // the generation being computed; 0: none
  std::atomic<int64_t> at{0};         // the range the compute thread is on
  std::atomic<bool> running{false};
  std::atomic<int64_t> plans{0}, ranges{0}, bytes{0};
  std::atomic<bool> sched_idle{false}, pinned{false};
  std::atomic<bool> ready{false};     // the helper has set its CPUs and policy
};

namespace {

constexpr int64_t kLine = 64;
constexpr int64_t kChunk = 4096;   // bytes read between checks of the compute thread's place
constexpr int64_t kLag = 8;        // lines between a line's read and its demotion

inline void pause() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// CLDEMOTE [p]: move the line toward the shared cache. Encoded as the hint-NOP it is on CPUs
// without the instruction (0F 1C /0), so it needs no compiler flag and no CPU check.
inline void demote(const char* p) {
#if defined(__x86_64__)
  asm volatile(".byte 0x0f, 0x1c, 0x07" : : "D"(p) : "memory");
#else
  (void)p;
#endif
}

std::atomic<State*> g_state{nullptr};   // set under g_start_mu; read by the compute thread
std::mutex g_start_mu;

// Reads range `r` line by line, demoting each kLag lines behind; false when the plan ended or
// the compute thread reached this range (what is left of it would arrive too late).
bool stream_range(State& s, uint64_t gen, int64_t index, const Range& r) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(r.data) & ~uintptr_t(kLine - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(r.data) + r.bytes;
  uint64_t sink = 0;
  uintptr_t p = first;
  while (p < end) {
    const uintptr_t stop = std::min(end, p + kChunk);
    for (; p < stop; p += kLine) {
      sink += *reinterpret_cast<const volatile uint8_t*>(p);
      if (p >= first + kLag * kLine) demote(reinterpret_cast<const char*>(p - kLag * kLine));
    }
    if (s.live.load(std::memory_order_relaxed) != gen ||
        s.at.load(std::memory_order_relaxed) >= index) {
      asm volatile("" : : "r"(sink));
      return false;
    }
  }
  for (uintptr_t q = p >= first + kLag * kLine ? p - kLag * kLine : first; q < end; q += kLine)
    demote(reinterpret_cast<const char*>(q));
  asm volatile("" : : "r"(sink));
  s.bytes.fetch_add(r.bytes, std::memory_order_relaxed);
  s.ranges.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// Streams one plan: always ahead of the compute thread's range, at most `lead` bytes ahead.
void stream_plan(State& s, uint64_t gen, const std::vector<Range>& plan) {
  const int64_t n = static_cast<int64_t>(plan.size());
  std::vector<int64_t> before(n + 1, 0);   // bytes of ranges [0, i)
  for (int64_t i = 0; i < n; ++i) before[i + 1] = before[i] + plan[i].bytes;
  int64_t i = 1;
  int spins = 0;
  while (i < n && s.live.load(std::memory_order_acquire) == gen) {
    const int64_t at = s.at.load(std::memory_order_relaxed);
    if (i <= at) {
      i = at + 1;
      continue;
    }
    if (i > at + 1 && before[i + 1] - before[at + 1] > s.lead) {
      if (++spins % 1024 == 0) std::this_thread::yield();
      pause();
      continue;
    }
    stream_range(s, gen, i, plan[i]);
    ++i;
  }
}

void helper_main(State* s, std::vector<int64_t> cpus, bool idle) {
#if defined(__linux__)
  if (!cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (const int64_t c : cpus) CPU_SET(static_cast<int>(c), &set);
    s->pinned = pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
  }
  if (idle) {
    sched_param param{};
    param.sched_priority = 0;
    s->sched_idle = pthread_setschedparam(pthread_self(), SCHED_IDLE, &param) == 0;
  }
#endif
  s->ready.store(true, std::memory_order_release);
  uint64_t seen = 0;
  std::vector<Range> plan;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(s->mu);
      s->cv.wait(lock, [&] { return s->stop || s->posted != seen; });
      if (s->stop) return;
      seen = s->posted;
      plan = s->plan;
    }
    stream_plan(*s, seen, plan);
  }
}

State* current() {
  State* s = g_state.load(std::memory_order_acquire);
  return s != nullptr && s->running.load(std::memory_order_acquire) && s->pid == getpid()
             ? s : nullptr;
}

// A new plan replaces the current one, the queued tail appended.
void post(State* s, std::vector<Range> ranges) {
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->tracked = static_cast<int64_t>(ranges.size());
    ranges.insert(ranges.end(), s->pending.begin(), s->pending.end());
    s->pending.clear();
    s->plan = std::move(ranges);
    s->at.store(0, std::memory_order_relaxed);
    s->live.store(++s->posted, std::memory_order_release);
  }
  s->plans.fetch_add(1, std::memory_order_relaxed);
  s->cv.notify_one();
}

}  // namespace

bool active() { return current() != nullptr; }

Session::Session(std::vector<Range> ranges) {
  State* s = current();
  if (s == nullptr) return;
  int64_t total = 0;
  for (const Range& r : ranges) total += r.bytes;
  if (ranges.size() < 2 || total < s->min_plan) {
    std::lock_guard<std::mutex> lock(s->mu);
    s->pending.clear();                  // queued for this call's tail: not streamed
    return;
  }
  post(s, std::move(ranges));
  state_ = s;
}

// The tracked ranges are done; a queued tail goes on streaming (it is for what runs next)
// until the next plan, else the plan ends here.
Session::~Session() {
  if (state_ == nullptr) return;
  int64_t tracked, size;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    tracked = state_->tracked;
    size = static_cast<int64_t>(state_->plan.size());
  }
  if (tracked < size) state_->at.store(tracked - 1, std::memory_order_relaxed);
  else state_->live.store(0, std::memory_order_release);
}

void Session::at(int64_t index) const {
  if (state_ != nullptr) state_->at.store(index, std::memory_order_relaxed);
}

namespace {

bool weight_stream_start(std::vector<int64_t> cpus, int64_t lead_bytes, int64_t min_plan_bytes,
                         bool idle) {
  TORCH_CHECK(lead_bytes > 0, "weight_stream_start: lead_bytes must be positive");
  TORCH_CHECK(min_plan_bytes >= 0, "weight_stream_start: min_plan_bytes must be >= 0");
  for (const int64_t c : cpus)
    TORCH_CHECK(c >= 0 && c < CPU_SETSIZE, "weight_stream_start: CPU ", c, " out of range");
  std::lock_guard<std::mutex> guard(g_start_mu);
  if (current() != nullptr) return false;
  auto* s = new State();   // never freed (the header says why)
  s->pid = getpid();
  s->lead = lead_bytes;
  s->min_plan = min_plan_bytes;
  s->thread = std::thread(helper_main, s, std::move(cpus), idle);
  while (!s->ready.load(std::memory_order_acquire)) std::this_thread::yield();
  s->running.store(true, std::memory_order_release);
  g_state.store(s, std::memory_order_release);
  return true;
}

void weight_stream_stop() {
  std::lock_guard<std::mutex> guard(g_start_mu);
  State* s = current();
  if (s == nullptr) return;
  s->running.store(false, std::memory_order_release);
  s->live.store(0, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->stop = true;
  }
  s->cv.notify_one();
  s->thread.join();
}

bool weight_stream_active() { return current() != nullptr; }

void weight_stream_queue(const std::vector<at::Tensor>& tensors) {
  State* s = current();
  if (s == nullptr) return;
  std::vector<Range> ranges;
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(),
                "weight_stream_queue: tensors must be contiguous CPU tensors");
    if (t.numel() > 0)
      ranges.push_back({static_cast<const char*>(t.data_ptr()),
                        static_cast<int64_t>(t.nbytes())});
  }
  std::lock_guard<std::mutex> lock(s->mu);
  s->pending = std::move(ranges);
}

std::vector<int64_t> weight_stream_stats() {
  State* s = current();
  if (s == nullptr) return {0, 0, 0, 0, 0, 0};
  return {1, s->plans.load(), s->ranges.load(), s->bytes.load(), s->sched_idle.load(),
          s->pinned.load()};
}

}  // namespace
}  // namespace wideserve_stream

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("weight_stream_start(int[] cpus, int lead_bytes, int min_plan_bytes, bool idle=True) "
        "-> bool",
        &wideserve_stream::weight_stream_start);
  m.def("weight_stream_stop() -> ()", &wideserve_stream::weight_stream_stop);
  m.def("weight_stream_stats() -> int[]", &wideserve_stream::weight_stream_stats);
  m.def("weight_stream_active() -> bool", &wideserve_stream::weight_stream_active);
  m.def("weight_stream_queue(Tensor[] tensors) -> ()", &wideserve_stream::weight_stream_queue);
}
