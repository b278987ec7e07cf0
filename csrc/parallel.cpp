// The elastic pool (parallel.h): helper threads, the claim word, the futex they sleep on.
#include "parallel.h"

#include <torch/extension.h>

#include <chrono>
#include <climits>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace streamgate::cpu {
namespace {

// The claim word: epoch (32 bits) | next chunk from the front (16) | end of the chunks not yet
// claimed from the back (16); a loop has at most 4 chunks a thread. The caller claims from the
// front and helpers from the back, so each runs contiguous chunks in order (a stream the
// prefetchers follow), and a claim is a compare-exchange of the whole word: a helper holding a
// stale word claims nothing (an epoch repeats only after 2^32 loops).
constexpr int kIdxBits = 16;
constexpr uint64_t kIdxMask = (1ull << kIdxBits) - 1;
constexpr int64_t kMaxChunks = static_cast<int64_t>(kIdxMask);
constexpr uint64_t kEpochMask = (1ull << (64 - 2 * kIdxBits)) - 1;
inline uint64_t pack(uint64_t epoch, uint64_t front, uint64_t back) {
  return (epoch << (2 * kIdxBits)) | (front << kIdxBits) | back;
}
inline int64_t front_of(uint64_t s) { return static_cast<int64_t>((s >> kIdxBits) & kIdxMask); }
inline int64_t back_of(uint64_t s) { return static_cast<int64_t>(s & kIdxMask); }

inline void pause() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// A wait (a helper's for the next loop, the caller's for a helper's chunk) spins on pauses alone
// for this long, then yields the core to any other thread that wants it between looks.
constexpr int64_t kPureSpinNs = 20000;

inline void back_off(int64_t waited_ns) {
  if (waited_ns < kPureSpinNs) {
    for (int i = 0; i < 16; ++i) pause();
  } else {
    sched_yield();
  }
}

inline int64_t ns_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t).count();
}

thread_local bool t_in_loop = false;     // this thread is running a chunk (its loops run inline)

}  // namespace

struct ElasticPool::Impl {
  alignas(64) std::atomic<uint64_t> state{0};
  // The loop being run: valid for the epoch in `state` while it has chunks not done, because
  // the caller waits for all of them before it writes the next loop's.
  alignas(64) void (*call)(const void*, int64_t, int64_t) = nullptr;
  const void* body = nullptr;
  int64_t lo = 0, hi = 0, chunk = 1;
  std::exception_ptr error;              // the first chunk's exception, rethrown by the caller
  std::atomic<bool> failed{false};
  alignas(64) std::atomic<int64_t> done{0};
  alignas(64) std::atomic<int> sleepers{0};
  std::atomic<uint32_t> wake{0};         // futex word: bumped to wake sleepers
  std::atomic<bool> busy{false}, stop{false};
  std::atomic<bool> hold{false};         // helpers claim nothing (tests: helpers the OS never runs)
  int64_t spin_ns = 0;                   // set by configure()
  uint64_t epoch = 0;
  std::vector<std::thread> helpers;

  // Claim (from the front, or the back) and run chunks of the current loop until none is
  // left; true if any ran.
  bool work(bool front) {
    bool ran = false;
    uint64_t s = state.load(std::memory_order_acquire);
    while (front_of(s) < back_of(s)) {
      const uint64_t claimed = front ? s + (1ull << kIdxBits) : s - 1;
      if (!state.compare_exchange_weak(s, claimed, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      const int64_t i = front ? front_of(s) : back_of(s) - 1;
      const int64_t b = lo + i * chunk, e = std::min(hi, b + chunk);
      try {
        call(body, b, e);
      } catch (...) {
        if (!failed.exchange(true)) error = std::current_exception();
      }
      done.fetch_add(1, std::memory_order_release);
      ran = true;
      s = state.load(std::memory_order_acquire);
    }
    return ran;
  }

  void helper() {
    pthread_setname_np(pthread_self(), "sg-elastic");    // as top -H and /proc show it
    t_in_loop = true;
    auto last = std::chrono::steady_clock::now();
    while (!stop.load(std::memory_order_relaxed)) {
      if (hold.load(std::memory_order_relaxed)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      if (work(false)) {
        last = std::chrono::steady_clock::now();
        continue;
      }
      if (const int64_t idle = ns_since(last); idle < spin_ns) {
        back_off(idle);
        continue;
      }
      // Sleep until the next loop. The caller publishes a loop then reads `sleepers`; a helper
      // counts itself in then reads the loop (both sequentially consistent), so one of them
      // sees the other: no loop starts unseen by a sleeping helper.
      const uint32_t seq = wake.load(std::memory_order_seq_cst);
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      const uint64_t s = state.load(std::memory_order_seq_cst);
      if (front_of(s) >= back_of(s) && !stop.load())
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake), FUTEX_WAIT_PRIVATE, seq, nullptr, nullptr, 0);
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
      last = std::chrono::steady_clock::now();
    }
  }

  void wake_all() {
    wake.fetch_add(1, std::memory_order_seq_cst);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
  }

  void shut_down() {
    while (busy.exchange(true, std::memory_order_acquire)) std::this_thread::yield();
    stop.store(true);
    wake_all();
    for (auto& t : helpers) t.join();
  }
};

ElasticPool& ElasticPool::get() {
  static ElasticPool pool;
  return pool;
}

bool ElasticPool::in_loop() { return t_in_loop; }

void ElasticPool::configure(int threads, int64_t spin_us) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  threads_.store(0);                     // new loops go to at::parallel_for while helpers change
  // A stopped pool stays allocated: a loop that read the old pointer finds it busy or stopped.
  if (Impl* old = impl_.exchange(nullptr)) old->shut_down();
  if (threads <= 1) return;
  auto* impl = new Impl();
  impl->spin_ns = std::max<int64_t>(0, spin_us) * 1000;
  for (int i = 1; i < threads; ++i) impl->helpers.emplace_back([impl] { impl->helper(); });
  impl_.store(impl);
  threads_.store(threads);
}

bool ElasticPool::run(int64_t lo, int64_t hi, int64_t chunk, void (*call)(const void*, int64_t, int64_t),
                      const void* body) {
  Impl* p = impl_.load(std::memory_order_acquire);
  const int64_t n = (hi - lo + chunk - 1) / chunk;
  if (p == nullptr || n > kMaxChunks || p->busy.exchange(true, std::memory_order_acquire)) return false;
  if (p->stop.load()) {
    p->busy.store(false);
    return false;
  }
  p->call = call, p->body = body, p->lo = lo, p->hi = hi, p->chunk = chunk;
  p->done.store(0, std::memory_order_relaxed);
  p->epoch = (p->epoch + 1) & kEpochMask;
  p->state.store(pack(p->epoch, 0, n), std::memory_order_seq_cst);
  if (p->sleepers.load(std::memory_order_seq_cst) > 0) p->wake_all();
  t_in_loop = true;
  p->work(true);
  t_in_loop = false;
  // Chunks a helper is running: pauses, then yielding, in case the helper waits for this core.
  const auto waiting = std::chrono::steady_clock::now();
  while (p->done.load(std::memory_order_acquire) < n) back_off(ns_since(waiting));
  std::exception_ptr error;
  if (p->failed.load()) {
    error = p->error;
    p->error = nullptr;
    p->failed.store(false);
  }
  p->busy.store(false, std::memory_order_release);
  if (error) std::rethrow_exception(error);
  return true;
}

void ElasticPool::hold(bool on) {
  if (Impl* p = impl_.load()) p->hold.store(on);
}

// threads < 0: only report; threads 0 or 1 turns the pool off. Returns the threads that run
// loops (0: off).
int64_t elastic_threads(int64_t threads, int64_t spin_us) {
  if (threads >= 0) ElasticPool::get().configure(static_cast<int>(threads), spin_us);
  return ElasticPool::get().threads();
}

// hold: the helpers stop claiming chunks (a test of loops whose helpers never run).
void elastic_hold(bool hold) { ElasticPool::get().hold(hold); }

TORCH_LIBRARY_FRAGMENT(streamgate, m) {
  m.def("elastic_threads(int threads=-1, int spin_us=200) -> int", &elastic_threads);
  m.def("elastic_hold(bool hold) -> ()", &elastic_hold);
}

}  // namespace streamgate::cpu
