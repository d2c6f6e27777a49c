// Spare threads: helpers that take chunks of a few-row GEMM, or tasks of the paged attention, only
// while a core would otherwise sit idle, so that a lone request's step gets the second core
// without costing anything when the other workers need it (docs/design.md#spare-threads).
//
// Why not OpenMP: each engine worker computes on one thread (`num_threads: 1`), because in a
// busy cluster every core already runs a worker; a second OpenMP thread per engine either spins
// on a core another worker needs or, told to sleep (OMP_WAIT_POLICY=PASSIVE), pays a wake-up per
// parallel region (the served batch-1 step got slower: docs/benchmarks.md#int8-avx2). Here:
// * only for a caller on one intra-op thread (at::get_num_threads() == 1): with more, OpenMP's
//   own team splits the call as before, and its spinning threads would starve the helpers;
// * helpers run at SCHED_IDLE, so any ordinary thread on their core goes first;
// * the caller takes chunks too, from the same counter, so it never waits for a helper to start;
// * nor for one to finish: a chunk a helper took and stalled on (it lost its core) is computed
//   again by the caller once nothing has been published for kStallNs (or for four of the
//   caller's own chunk times, where chunks are longer), and the first to publish a chunk (an
//   atomic per chunk) wins. Chunks split only output columns, so whoever computes one, its bits
//   are the same. A helper computes from what the job owns into the job's buffer, and
//   only the caller writes the output, so the caller may return while a stalled helper still
//   holds the job: jobs live in a ring of slots, each reused once its last helper has left, and
//   a call that finds no free slot computes alone.
// * helpers spin kSpinNs after a job (a step's GEMMs come tens of microseconds apart), then sleep
//   on a condition variable; the caller wakes them only when one sleeps.

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem_spare {

constexpr int64_t kSpinNs = 200000;  // a helper's spin after its last job, before it sleeps
constexpr int64_t kStallNs = 50000;  // nothing published this long (at least): the caller takes the rest

constexpr int kSlots = 4;
constexpr int64_t kLocked = int64_t{1} << 40;  // taken off a slot's refs while the caller refills it

enum : uint8_t { kOpen = 0, kByCaller = 1, kByHelper = 2 };

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// compute(i, out): chunk i's results (chunk_floats floats) into out, reading only what the
// function owns: a stalled helper may still run it after the caller has returned.
using Compute = std::function<void(int64_t, float*)>;
// write(i, in): chunk i's results into the output; run by the caller's thread only.
using Write = std::function<void(int64_t, const float*)>;

// One call's chunks, in a slot of the ring.
struct Job {
  void refill(int64_t chunks, int64_t floats, Compute fn) {
    n = chunks;
    chunk_floats = floats;
    compute = std::move(fn);
    if (state_size < n) {
      state.reset(new std::atomic<uint8_t>[n]);
      state_size = n;
    }
    for (int64_t i = 0; i < n; ++i) state[i].store(kOpen, std::memory_order_relaxed);
    results.resize(n * chunk_floats);
    next.store(0);
    left.store(n);
  }
  // The first to publish chunk i wins; the other's result is dropped.
  bool publish(int64_t i, uint8_t by) {
    uint8_t open = kOpen;
    if (!state[i].compare_exchange_strong(open, by)) return false;
    left.fetch_sub(1);
    return true;
  }

  int64_t n = 0, chunk_floats = 0;
  Compute compute;
  std::atomic<int64_t> next{0}, left{0};
  std::unique_ptr<std::atomic<uint8_t>[]> state;
  int64_t state_size = 0;
  std::vector<float> results;  // the helpers' chunks: chunk i at i * chunk_floats
};

struct Slot {
  std::atomic<int64_t> refs{0};    // helpers inside; -kLocked while the caller refills it
  std::atomic<uint64_t> epoch{0};  // the call it holds
  Job job;
};

// One per process, made by the spare_threads extension; the GEMM extensions are handed its
// address (engine/kernels.py), so that every kernel shares the same helpers.
class Pool {
 public:
  // Starts or stops helpers until there are n. delay_us > 0 (tests only) makes each helper sleep
  // that long after taking a chunk, as if it lost its core: the caller's take-back path.
  void resize(int n, int64_t delay_us) {
    std::lock_guard<std::mutex> resizing(resize_mu_);
    std::lock_guard<std::mutex> no_call(caller_mu_);  // not under a running call
    stop_helpers();
    delay_us_ = delay_us;
    for (int i = 0; i < n; ++i) helpers_.emplace_back([this] { helper_loop(); });
  }

  int size() const { return static_cast<int>(helpers_.size()); }

  // Whether the GEMMs share their chunks now: helpers exist and the engine has not switched
  // sharing off (it does while it holds many requests: a loaded worker, whose many-row steps
  // would wait on a helper that got a core for a moment and lost it; engine/model_runner.py).
  bool active() const { return !helpers_.empty() && sharing_.load(std::memory_order_relaxed); }
  void set_sharing(bool on) { sharing_.store(on, std::memory_order_relaxed); }

  // Chunks computed by a helper, and chunks the caller computed again after a helper stalled.
  std::vector<int64_t> stats() const { return {helped_.load(), taken_back_.load()}; }

  // Computes and writes chunks [0, n); returns once all are written. One caller shares at a
  // time (the engine's step thread): the kernels run without the GIL, so a second thread's call
  // (two engines in one process) or a resize may come meanwhile, and computes alone or waits.
  void run(int64_t n, int64_t chunk_floats, Compute compute, const Write& write) {
    thread_local std::vector<float> scratch;
    scratch.resize(chunk_floats);
    std::unique_lock<std::mutex> sole(caller_mu_, std::try_to_lock);
    Slot* slot = helpers_.empty() || !sole.owns_lock() ? nullptr : free_slot();
    if (slot == nullptr) {  // no helpers, another caller, or every slot held by a stalled one
      for (int64_t i = 0; i < n; ++i) {
        compute(i, scratch.data());
        write(i, scratch.data());
      }
      return;
    }
    Job& job = slot->job;
    job.refill(n, chunk_floats, std::move(compute));
    const uint64_t epoch = ++epoch_count_;
    slot->epoch.store(epoch);
    slot->refs.fetch_add(kLocked);  // open to helpers
    published_.store(epoch << 8 | static_cast<uint64_t>(slot - slots_));
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    auto mine = [&](int64_t i) {
      job.compute(i, scratch.data());
      if (!job.publish(i, kByCaller)) return false;
      write(i, scratch.data());
      return true;
    };
    const int64_t start = now_ns();
    int64_t own = 0;
    for (int64_t i; (i = job.next.fetch_add(1)) < n; ++own) mine(i);
    // A stall: nothing published for kStallNs, or for 4 of the caller's own chunks if longer.
    const int64_t stall = std::max(kStallNs, own > 0 ? 4 * (now_ns() - start) / own : kStallNs);
    int64_t last = job.left.load(), since = now_ns();
    while (last > 0) {
      relax();
      const int64_t left = job.left.load();
      if (left != last) {
        last = left;
        since = now_ns();
      } else if (now_ns() - since > stall) {
        for (int64_t i = 0; i < n; ++i)
          if (job.state[i].load() == kOpen && mine(i)) taken_back_.fetch_add(1);
        last = job.left.load();
      }
    }
    published_.store(0);
    for (int64_t i = 0; i < n; ++i)
      if (job.state[i].load() == kByHelper) write(i, job.results.data() + i * chunk_floats);
  }

 private:
  // A slot no helper holds, locked for refilling; null when every one is held.
  Slot* free_slot() {
    for (Slot& slot : slots_) {
      int64_t idle = 0;
      if (slot.refs.compare_exchange_strong(idle, -kLocked)) return &slot;
    }
    return nullptr;
  }

  void stop_helpers() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (std::thread& t : helpers_) t.join();
    helpers_.clear();
    stop_.store(false);
  }

  void helper_loop() {
    sched_param idle{};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);  // best effort: Linux only
    uint64_t seen = published_.load();
    auto fresh = [&] {
      const uint64_t now = published_.load();
      return now != 0 && now != seen;
    };
    while (!stop_.load()) {
      const int64_t spin_until = now_ns() + kSpinNs;
      while (!fresh() && now_ns() < spin_until && !stop_.load()) relax();
      if (!fresh()) {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1);
        cv_.wait(lock, [&] { return stop_.load() || fresh(); });
        sleepers_.fetch_sub(1);
        continue;
      }
      const uint64_t call = published_.load();
      if (call == 0) continue;
      seen = call;
      // In only while the slot still holds this call: a negative count is a refill under way.
      Slot& slot = slots_[call & 0xff];
      if (slot.refs.fetch_add(1) >= 0 && slot.epoch.load() == call >> 8) work(slot.job);
      slot.refs.fetch_sub(1);
    }
  }

  void work(Job& job) {
    for (int64_t i; (i = job.next.fetch_add(1)) < job.n;) {
      if (delay_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
      if (job.state[i].load() != kOpen) continue;
      job.compute(i, job.results.data() + i * job.chunk_floats);
      if (job.publish(i, kByHelper)) helped_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  Slot slots_[kSlots];
  std::vector<std::thread> helpers_;
  std::mutex resize_mu_, mu_, caller_mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> published_{0};  // epoch << 8 | slot of the call running now; 0: none
  uint64_t epoch_count_ = 0;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false}, sharing_{true};
  std::atomic<int64_t> helped_{0}, taken_back_{0};
  int64_t delay_us_ = 0;
};

// The process's pool as the GEMM extensions see it (null: none attached, no helpers).
inline Pool*& attached() {
  static Pool* pool = nullptr;
  return pool;
}

}  // namespace tandem_spare
