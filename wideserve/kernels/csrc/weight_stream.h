// Weight streaming (docs/cpu_kernels.md, "Weight streaming"): a helper thread on a core the
// engine leaves idle reads the weights a fused op is about to use, ahead of the thread that
// computes, and demotes each line to the shared last-level cache (CLDEMOTE).
//
// A prefill-sized MoE call on one thread alternates between reading an expert's weights from
// memory (the core waits) and multiplying them (memory idles): measured on an AMX Xeon, a
// 128-token call's time is the sum of the two, with no overlap. The helper turns the reads
// into last-level-cache hits while the compute thread multiplies the expert before.
//
// The compute side (csrc/moe.cpp) posts its plan, the weight ranges in the order it will
// read them, reports the range it is on, and finishes; the helper stays at least one range
// ahead (the range being computed is already in flight) and at most `lead` bytes ahead, skips
// what the compute thread passed, and drops a plan as soon as a newer one or the finish
// comes. A caller may queue tensors for the next plan's tail (weight_stream_queue: the next
// decoder layer's attention weights, queued by models/lean_decode.py before a MoE call): they
// are streamed after the tracked ranges, and go on streaming once the op is done, until the
// next plan. The compute thread never waits for the helper: with the helper descheduled (it runs
// at SCHED_IDLE, so the front end it shares a core with always goes first) the op runs as
// it would without it.
#pragma once

#include <cstdint>
#include <vector>

namespace wideserve_stream {

struct Range {
  const char* data;
  int64_t bytes;
};

// Whether a helper runs in this process (started, not stopped, not inherited over a fork).
bool active();

struct State;

// One op's plan: posted on construction (replacing the helper's current plan, the compute
// thread on range 0) when a helper runs and `ranges` hold two or more ranges and at least
// the helper's minimum of bytes; at(i) reports that the compute thread is on range i (non-
// decreasing); destruction (also when the op throws) ends the tracked ranges.
class Session {
 public:
  explicit Session(std::vector<Range> ranges);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  bool on() const { return state_ != nullptr; }
  void at(int64_t index) const;

 private:
  State* state_ = nullptr;
};

}  // namespace wideserve_stream
