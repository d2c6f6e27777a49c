// The process's spare threads (spare_threads.h): made here once, handed to the GEMM extensions by
// address (engine/kernels.py), so that every kernel shares the same helpers.

#include <torch/extension.h>

#include <cstdint>
#include <vector>

tandem_spare::Pool& the_pool() {
  static tandem_spare::Pool* pool = new tandem_spare::Pool();  // never destroyed (helpers run on)
  return *pool;
}

// n helpers (0: none); delay_us > 0 is for tests only (a helper stalls after taking a chunk).
void set_spare_threads(int64_t n, int64_t delay_us) {
  TORCH_CHECK(n >= 0 && delay_us >= 0, "set_spare_threads: n and delay_us must be >= 0");
  the_pool().resize(static_cast<int>(n), delay_us);
}

// Off: the GEMMs compute alone, the helpers sleep (the engine's switch, spare_threads.h).
void set_spare_sharing(bool on) { the_pool().set_sharing(on); }

// [helpers, chunks a helper computed, chunks the caller took back from a stalled helper].
std::vector<int64_t> spare_stats() {
  std::vector<int64_t> out{the_pool().size()};
  for (int64_t v : the_pool().stats()) out.push_back(v);
  return out;
}

int64_t spare_pool_address() { return reinterpret_cast<int64_t>(&the_pool()); }
