// Asynchronous chunked host copy engine (CPU side).
//
// The snapshot scheduler hands over a list of (dst, src, nbytes) byte ranges
// and gets a CopyHandle back at once; the engine's own persistent threads
// split the ranges into chunks and copy them while Python keeps running.  The
// caller polls the handle between pipeline stages or waits on it (GIL released
// by the binding).  Handles complete roughly in submission order (FIFO queue).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "cpu_isa.h"
#include "thread_pool.h"

namespace reft {

struct CopySegment {
  uint8_t* dst;
  const uint8_t* src;
  size_t n;
};

// Single-threaded copy of n bytes; non-temporal stores when asked and the ISA
// has them, else std::memcpy.  Regions must not overlap.
void copy_range(uint8_t* dst, const uint8_t* src, size_t n, Isa isa, bool nontemporal);

// Blocking multi-threaded copy on the shared pool (calling thread included).
void parallel_copy(const std::vector<CopySegment>& segs, int num_threads, Isa isa,
                   int nontemporal, size_t chunk_bytes);

class CopyHandle {
 public:
  bool poll() const { return finished_.load(std::memory_order_acquire); }
  // Blocks until done or timeout (seconds; < 0 waits forever).  Returns done.
  bool wait(double timeout_s);
  size_t bytes() const { return bytes_; }
  size_t num_chunks() const { return chunks_.size(); }
  bool nontemporal() const { return nontemporal_; }
  // Seconds from submit() to completion (to now while still running).
  double elapsed() const;

 private:
  friend class CopyEngine;
  using Clock = std::chrono::steady_clock;
  void run_chunks();  // executed by engine workers, several at once
  void finish();

  std::vector<CopySegment> chunks_;
  std::atomic<size_t> next_{0};
  std::atomic<size_t> done_{0};
  std::atomic<bool> finished_{false};
  size_t bytes_ = 0;
  bool nontemporal_ = false;
  Isa isa_ = Isa::Scalar;
  Clock::time_point t_submit_;
  std::atomic<int64_t> elapsed_ns_{-1};
  std::mutex mu_;
  std::condition_variable cv_;
};

class CopyEngine {
 public:
  CopyEngine(int num_threads, Isa isa);
  ~CopyEngine();
  // chunk_bytes == 0 picks a size from the total and the thread count;
  // nontemporal: -1 auto (by total size), 0 never, 1 always.
  std::shared_ptr<CopyHandle> submit(const std::vector<CopySegment>& segs, size_t chunk_bytes,
                                     int nontemporal);
  int num_threads() const { return num_threads_; }
  Isa isa() const { return isa_; }

 private:
  int num_threads_;
  Isa isa_;
  std::unique_ptr<ThreadPool> pool_;
};

// Number of CPUs this process may run on (affinity / cgroup cpuset aware).
int usable_cpus();

}  // namespace reft
