// Elastic parallel loops for the step kernels: the calling thread never waits for a helper
// that is not running.
//
// Why: at::parallel_for is an OpenMP region, and a region ends at a barrier that every thread
// of the team must reach. Served, the engine thread and its OpenMP worker share two cores with
// the event loop and a client on the same host; whenever the OS gives the worker's core to one
// of them, each of a step's ~150 regions waits for the worker to be scheduled again. Served
// beside GuideLLM on two cores, two OpenMP threads made what one thread makes in process
// (SmolLM2 bf16, Intel AMX host, 2026-12-05: 34.9 / 157.8 / 272.8 tok/s at 1 / 8 / 32 streams
// served, 35.8 / 164 / 276 on one thread in process, 55.8 / 249 / 396 on two).
//
// Here a loop is cut into chunks that the caller and the helpers claim from one atomic word
// (epoch | chunk count | next chunk). The caller runs chunks until none is left unclaimed and
// then waits only for chunks a helper has claimed and is running; a helper that is asleep or
// descheduled claims nothing, and the caller does its share. Helpers spin for a while after
// their last chunk (`spin_us`; after the first 20 us yielding the core to any other thread that
// wants it, such as the event loop or a client on the same host), then sleep on a futex that
// the next loop wakes. A chunk is a
// contiguous range, as at::parallel_for's, and the kernels split only outputs among chunks,
// never a sum, so results do not depend on who ran what.
//
// Off (0 helpers) until `torch.ops.streamgate.elastic_threads(n)` starts n - 1 helpers; loops
// from a second thread while one runs, or from inside a chunk, fall back to at::parallel_for.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace streamgate::cpu {

class ElasticPool {
 public:
  static ElasticPool& get();
  // Threads that run loops: helpers + the caller (at least 2), or 0 when off.
  int threads() const { return threads_.load(std::memory_order_relaxed); }
  // Start helpers so that `threads` threads run loops (<= 1: stop them, loops go to at::parallel_for).
  void configure(int threads, int64_t spin_us);
  // Run body(begin, end) over [lo, hi) in chunks; false when another thread's loop is running.
  bool run(int64_t lo, int64_t hi, int64_t chunk, void (*call)(const void*, int64_t, int64_t), const void* body);
  // Whether this thread is running a chunk (its loops then run inline).
  static bool in_loop();
  // Helpers stop (true) or resume (false) claiming chunks: tests of a helper that never runs.
  void hold(bool on);

 private:
  struct Impl;
  std::atomic<int> threads_{0};
  std::atomic<Impl*> impl_{nullptr};
};

// at::parallel_for's contract (f(begin, end) over contiguous ranges of at least `grain`), run
// on the elastic pool when it is on: at most four chunks a thread, so that the caller can take
// a late helper's share without waiting for it.
template <typename F>
inline void parallel_for(int64_t lo, int64_t hi, int64_t grain, const F& f) {
  if (hi <= lo) return;
  ElasticPool& pool = ElasticPool::get();
  const int n = pool.threads();
  if (n > 1) {
    if (ElasticPool::in_loop()) {
      f(lo, hi);
      return;
    }
    const int64_t range = hi - lo, g = std::max<int64_t>(1, grain);
    const int64_t chunk = std::max(g, (range + 4 * n - 1) / (4 * n));
    if (chunk >= range) {
      f(lo, hi);
      return;
    }
    auto call = [](const void* body, int64_t b, int64_t e) { (*static_cast<const F*>(body))(b, e); };
    if (pool.run(lo, hi, chunk, call, &f)) return;
  }
  at::parallel_for(lo, hi, grain, f);
}

}  // namespace streamgate::cpu
