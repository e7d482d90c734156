// The copy-and-hash pipeline (copy_hash.h).  Threads are made per call: a region is
// megabytes to gigabytes, a thread start is tens of microseconds, and a thread of our
// own may have its device set without touching the caller's (a Python thread).
#include "copy_hash.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>

#include "copy_engine.h"
#ifdef REFT_WITH_CUDA
#include "cuda_ops.h"
#endif

// xxHash 0.8.4, the library python-xxhash wraps (csrc/third_party/xxhash/README). The
// build has no -march: the default kernel is SSE2 (as python-xxhash's wheel); the AVX2
// one is compiled with a target attribute and chosen at run time, as xxHash's own
// xxh_x86dispatch.c does (same digests: the vector kernels are exact equivalents)
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define REFT_XXH_AVX2 1
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((target("avx2")))
#include <immintrin.h>  // the AVX2 kernel's types (xxh_x86dispatch.c includes it too)
#endif
#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

namespace reft {

namespace {
#ifdef REFT_XXH_AVX2
__attribute__((target("avx2"))) uint64_t xxh3_avx2(const void* p, size_t n) {
  if (n <= XXH3_MIDSIZE_MAX) return XXH3_64bits(p, n);  // short inputs: scalar paths
  return XXH3_hashLong_64b_internal(p, n, XXH3_kSecret, sizeof(XXH3_kSecret),
                                    XXH3_accumulate_avx2, XXH3_scrambleAcc_avx2);
}
#endif

uint64_t (*pick_xxh3())(const void*, size_t) {
#ifdef REFT_XXH_AVX2
  // REFT_CPU_ISA=scalar caps it as it caps the copy kernels
  if (best_isa() != Isa::Scalar) return xxh3_avx2;
#endif
  return [](const void* p, size_t n) -> uint64_t { return XXH3_64bits(p, n); };
}
}  // namespace

uint64_t xxh3_64(const void* p, size_t n) {
  static const auto fn = pick_xxh3();
  return fn(p, n);
}

namespace {
#ifdef REFT_XXH_AVX2
__attribute__((target("avx2"))) void xxh3_update_avx2(XXH3_state_t* s, const void* p, size_t n) {
  XXH3_update(s, static_cast<const xxh_u8*>(p), n, XXH3_accumulate_avx2, XXH3_scrambleAcc_avx2);
}
#endif

void xxh3_update(XXH3_state_t* s, const void* p, size_t n) {
#ifdef REFT_XXH_AVX2
  static const bool avx2 = best_isa() != Isa::Scalar;
  if (avx2) return xxh3_update_avx2(s, p, n);
#endif
  XXH3_64bits_update(s, p, n);
}

// Host pieces that tile [0, zero_from) in order: each 64 KiB block is hashed from its
// source right after it is copied, while it is in cache. Hashing the destination after
// the copy read it back from memory (streaming stores leave it cold): a third pass over
// the snapshot's bytes, which competes with training for memory bandwidth (issue 57).
// The digest is the one-shot XXH3 of the unit's bytes (xxHash's streaming contract).
constexpr size_t kFusedBlock = 64 << 10;

bool tiles_host(const HashUnit& u) {
  size_t at = 0;
  for (const auto& p : u.pieces) {
    if (p.device || p.dst_off != at) return false;
    at += p.n;
  }
  return at == u.zero_from;
}

uint64_t copy_hash_fused(const HashUnit& u, Isa isa, bool nontemporal) {
  XXH3_state_t st;
  XXH3_64bits_reset(&st);
  for (const auto& p : u.pieces)
    for (size_t off = 0; off < p.n; off += kFusedBlock) {
      const size_t n = std::min(kFusedBlock, p.n - off);
      copy_range(u.dst + p.dst_off + off, p.src + off, n, isa, nontemporal);
      xxh3_update(&st, p.src + off, n);
    }
  if (u.zero_from < u.len) {
    std::memset(u.dst + u.zero_from, 0, u.len - u.zero_from);
    xxh3_update(&st, u.dst + u.zero_from, u.len - u.zero_from);
  }
  return XXH3_64bits_digest(&st);
}
}  // namespace

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Shared state of one call.
struct Run {
  const std::vector<HashUnit>& units;
  const PipelineOptions& opt;
  std::vector<uint64_t> digests;
  std::vector<uintptr_t> events;  // per unit with device pieces (0: none)
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  size_t issued = 0;  // units whose copies and event are queued (under mu)
  std::mutex mu;
  std::condition_variable cv;
  std::string error;
  std::atomic<int64_t> wait_ns{0};
  // workers started / finished, and whether the caller has started all it will (under
  // mu): the issuer waits for every worker before it cleans up on its own thread
  int started = 0, finished = 0;
  bool all_started = false;

  Run(const std::vector<HashUnit>& u, const PipelineOptions& o)
      : units(u), opt(o), digests(u.size(), 0), events(u.size(), 0) {}

  void fail(const std::string& what) {
    std::lock_guard<std::mutex> lk(mu);
    if (error.empty()) error = what;
    failed.store(true);
    cv.notify_all();
  }
};

bool has_device(const HashUnit& u) {
  for (const auto& p : u.pieces)
    if (p.device) return true;
  return false;
}

#ifdef REFT_WITH_CUDA
// Queues every unit's device copies in unit order (the DMA engine never idles between
// them), an event after each unit's; the workers follow the events. Then, once every
// worker is done, it cleans up here, on a thread of ours with the rank's device set:
// the caller's thread makes no CUDA call (on a thread that never set a device, the
// first one would make a context on GPU 0).
void cleanup(Run& r);

void issue(Run& r) {
  try {
    gpu::set_device(r.opt.device);
    if (r.opt.after_event) gpu::stream_wait_event(r.opt.stream, r.opt.after_event);
    for (size_t i = 0; i < r.units.size() && !r.failed.load(); ++i) {
      const HashUnit& u = r.units[i];
      if (has_device(u)) {
        for (const auto& p : u.pieces)
          if (p.device) gpu::memcpy_async_raw(u.dst + p.dst_off, p.src, p.n, r.opt.stream);
        r.events[i] = gpu::record_new_event(r.opt.stream);
      }
      std::lock_guard<std::mutex> lk(r.mu);
      r.issued = i + 1;
      r.cv.notify_all();
    }
  } catch (const std::exception& e) {
    r.fail(e.what());
  }
  cleanup(r);
}

void cleanup(Run& r) {
  {
    std::unique_lock<std::mutex> lk(r.mu);
    r.cv.wait(lk, [&] { return r.all_started && r.finished == r.started; });
  }
  try {
    gpu::set_device(r.opt.device);  // (a failed issue may not have set it)
    // on a failure, copies queued before it may still run: none may outlive the call
    if (r.failed.load()) gpu::stream_synchronize(r.opt.stream);
  } catch (...) {
  }
  for (uintptr_t ev : r.events)
    if (ev) try { gpu::event_destroy(ev); } catch (...) {}
}
#endif

// A worker's end, counted for the issuer's cleanup.
void finish(Run& r) {
  std::lock_guard<std::mutex> lk(r.mu);
  ++r.finished;
  r.cv.notify_all();
}

void work_units(Run& r);

void work(Run& r) {
  work_units(r);
  finish(r);
}

void work_units(Run& r) {
  try {
#ifdef REFT_WITH_CUDA
    if (r.opt.device >= 0) gpu::set_device(r.opt.device);
#endif
    const size_t n = r.units.size();
    size_t i;
    while (!r.failed.load() && (i = r.next.fetch_add(1)) < n) {
      const HashUnit& u = r.units[i];
      if (has_device(u)) {
#ifdef REFT_WITH_CUDA
        auto t0 = Clock::now();
        {
          std::unique_lock<std::mutex> lk(r.mu);
          r.cv.wait(lk, [&] { return r.issued > i || r.failed.load(); });
        }
        if (r.failed.load()) return;
        gpu::event_synchronize(r.events[i]);  // blocking-sync event: the thread sleeps
        r.wait_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
            Clock::now() - t0).count());
#else
        throw std::runtime_error("a device piece, but reft_ext._C was built without CUDA");
#endif
      }
      if (tiles_host(u)) {
        r.digests[i] = copy_hash_fused(u, r.opt.isa, r.opt.nontemporal);
        continue;
      }
      // (hashed from the destination below: cached stores, whatever opt.nontemporal says)
      for (const auto& p : u.pieces)
        if (!p.device) copy_range(u.dst + p.dst_off, p.src, p.n, r.opt.isa, false);
      if (u.zero_from < u.len) std::memset(u.dst + u.zero_from, 0, u.len - u.zero_from);
      r.digests[i] = xxh3_64(u.dst, u.len);
    }
  } catch (const std::exception& e) {
    r.fail(e.what());
  }
}

}  // namespace

std::vector<uint64_t> copy_and_hash(const std::vector<HashUnit>& units,
                                    const PipelineOptions& opt, PipelineStats* stats) {
  const auto t0 = Clock::now();
  for (const auto& u : units) {
    if (u.len && u.dst == nullptr) throw std::invalid_argument("unit destination is null");
    if (u.zero_from > u.len) throw std::invalid_argument("unit zero_from beyond its length");
    for (const auto& p : u.pieces) {
      if (p.dst_off + p.n > u.len) throw std::invalid_argument("piece beyond its unit");
      if (p.n && p.src == nullptr) throw std::invalid_argument("piece source is null");
    }
  }
  bool device = std::any_of(units.begin(), units.end(), has_device);
#ifndef REFT_WITH_CUDA
  if (device) throw std::runtime_error("device pieces need reft_ext._C built with CUDA/ROCm");
#endif
  if (device && opt.device < 0) throw std::invalid_argument("device pieces need a device");
  Run r(units, opt);
  const int n = std::max(1, std::min<int>(opt.num_threads, int(std::max<size_t>(1, units.size()))));
  if (!device && n == 1) {
    // host bytes, one thread: the calling thread is it (GIL released by the binding).
    // A thread made and joined per region of every snapshot was most of a small
    // snapshot's cost in context switches (issue 57)
    work_units(r);
    if (r.failed.load()) throw std::runtime_error("copy_and_hash: " + r.error);
    if (stats) {
      stats->seconds = since(t0);
      stats->threads = 1;
    }
    return r.digests;
  }
  std::vector<std::thread> threads;
  threads.reserve(n + 1);
  std::string spawn_error;
  // a thread that cannot be made (EAGAIN: the process's or user's thread limit) fails
  // the call: the threads already made are stopped and joined, then the error raised
  // (a joinable std::thread destroyed would terminate the process)
  try {
#ifdef REFT_WITH_CUDA
    if (device) threads.emplace_back([&r] { issue(r); });
#else
    (void)device;
#endif
    for (int t = 0; t < n; ++t) {
      threads.emplace_back([&r] { work(r); });
      std::lock_guard<std::mutex> lk(r.mu);
      ++r.started;
    }
  } catch (const std::system_error& e) {
    spawn_error = "could not start thread " + std::to_string(threads.size() + 1) + " of " +
                  std::to_string(n + (device ? 1 : 0)) + ": " + e.what();
    r.fail(spawn_error);
  }
  {
    std::lock_guard<std::mutex> lk(r.mu);
    r.all_started = true;
    r.cv.notify_all();
  }
#ifdef REFT_WITH_CUDA
#endif
  for (auto& t : threads) t.join();
  if (r.failed.load()) throw std::runtime_error("copy_and_hash: " + r.error);
  if (stats) {
    stats->seconds = since(t0);
    stats->event_wait_s = r.wait_ns.load() * 1e-9;
    stats->threads = n;
  }
  return std::move(r.digests);
}

}  // namespace reft
