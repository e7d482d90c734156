// Copy engine implementation: memcpy kernels, the async engine, the shared
// pool used by synchronous kernels.
#include "copy_engine.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "xor_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define REFT_X86 1
#endif

namespace reft {

int usable_cpus() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

ThreadPool& shared_pool() {
  static std::mutex mu;
  static ThreadPool* pool = nullptr;  // leaked on purpose: see thread_pool.h
  std::lock_guard<std::mutex> lk(mu);
  if (pool == nullptr || pool->owner_pid() != getpid()) {
    // The caller of parallel_for works too, so usable_cpus()-1 helpers fill
    // the machine; at least one so num_threads=2 is honoured on 1-CPU hosts.
    pool = new ThreadPool(std::max(1, usable_cpus() - 1));
  }
  return *pool;
}

namespace {

#ifdef REFT_X86
// Streaming copy: the destination (a snapshot buffer) is not read again soon,
// so bypassing the cache avoids the read-for-ownership of each destination
// line and keeps the training working set in cache.
//
// Body in blocks of 8 pages, copying 128 (AVX-512) / 64 (AVX2) bytes from each
// page in turn (glibc's large_memcpy_4x idea): several concurrent DRAM streams
// per thread keep more banks busy than one (the measurements of the variants:
// docs/csrc.md).
constexpr size_t kPage = 4096, kPages = 8;

__attribute__((target("avx512f"))) void copy_nt_avx512(uint8_t* d, const uint8_t* s, size_t n) {
  size_t mis = reinterpret_cast<uintptr_t>(d) & 63;
  size_t i = std::min(n, mis ? 64 - mis : 0);
  std::memcpy(d, s, i);
  for (; i + kPages * kPage <= n; i += kPages * kPage) {
    for (size_t j = 0; j < kPage; j += 128) {
      for (size_t p = 0; p < kPages; ++p) {
        const uint8_t* sp = s + i + p * kPage + j;
        __m512i a0 = _mm512_loadu_si512(sp);
        __m512i a1 = _mm512_loadu_si512(sp + 64);
        __m512i* o = (__m512i*)(d + i + p * kPage + j);  // 64-byte aligned after the head
        _mm512_stream_si512(o, a0);
        _mm512_stream_si512(o + 1, a1);
      }
    }
  }
  for (; i + 128 <= n; i += 128) {
    __m512i a0 = _mm512_loadu_si512(s + i);
    __m512i a1 = _mm512_loadu_si512(s + i + 64);
    _mm512_stream_si512((__m512i*)(d + i), a0);
    _mm512_stream_si512((__m512i*)(d + i + 64), a1);
  }
  _mm_sfence();  // order the weakly-ordered stores before completion is published
  std::memcpy(d + i, s + i, n - i);
}

__attribute__((target("avx2"))) void copy_nt_avx2(uint8_t* d, const uint8_t* s, size_t n) {
  size_t mis = reinterpret_cast<uintptr_t>(d) & 31;
  size_t i = std::min(n, mis ? 32 - mis : 0);
  std::memcpy(d, s, i);
  for (; i + kPages * kPage <= n; i += kPages * kPage) {
    for (size_t j = 0; j < kPage; j += 64) {
      for (size_t p = 0; p < kPages; ++p) {
        const uint8_t* sp = s + i + p * kPage + j;
        __m256i a0 = _mm256_loadu_si256((const __m256i*)sp);
        __m256i a1 = _mm256_loadu_si256((const __m256i*)(sp + 32));
        __m256i* o = (__m256i*)(d + i + p * kPage + j);
        _mm256_stream_si256(o, a0);
        _mm256_stream_si256(o + 1, a1);
      }
    }
  }
  for (; i + 64 <= n; i += 64) {
    __m256i a0 = _mm256_loadu_si256((const __m256i*)(s + i));
    __m256i a1 = _mm256_loadu_si256((const __m256i*)(s + i + 32));
    _mm256_stream_si256((__m256i*)(d + i), a0);
    _mm256_stream_si256((__m256i*)(d + i + 32), a1);
  }
  _mm_sfence();
  std::memcpy(d + i, s + i, n - i);
}
#endif

// Splits segments into chunks of at most chunk_bytes (page-multiple offsets
// inside each segment, so each chunk keeps the segment's alignment).
std::vector<CopySegment> make_chunks(const std::vector<CopySegment>& segs, size_t chunk_bytes) {
  std::vector<CopySegment> out;
  for (const auto& s : segs) {
    for (size_t off = 0; off < s.n; off += chunk_bytes) {
      out.push_back({s.dst + off, s.src + off, std::min(chunk_bytes, s.n - off)});
    }
  }
  return out;
}

size_t total_bytes(const std::vector<CopySegment>& segs) {
  size_t t = 0;
  for (const auto& s : segs) t += s.n;
  return t;
}

}  // namespace

void copy_range(uint8_t* dst, const uint8_t* src, size_t n, Isa isa, bool nontemporal) {
  if (n == 0) return;
#ifdef REFT_X86
  if (nontemporal && isa == Isa::Avx512) return copy_nt_avx512(dst, src, n);
  if (nontemporal && isa == Isa::Avx2) return copy_nt_avx2(dst, src, n);
#endif
  (void)isa;
  (void)nontemporal;
  std::memcpy(dst, src, n);
}

void parallel_copy(const std::vector<CopySegment>& segs, int num_threads, Isa isa,
                   int nontemporal, size_t chunk_bytes) {
  const size_t total = total_bytes(segs);
  if (total == 0) return;
  const bool nt = use_nontemporal(nontemporal, total);
  if (chunk_bytes == 0) chunk_bytes = default_chunk_bytes(total, num_threads);
  auto chunks = make_chunks(segs, chunk_bytes);
  shared_pool().parallel_for(chunks.size(), num_threads, [&](size_t i) {
    copy_range(chunks[i].dst, chunks[i].src, chunks[i].n, isa, nt);
  });
}

// ---------------------------------------------------------------- CopyHandle

bool CopyHandle::wait(double timeout_s) {
  if (poll()) return true;
  std::unique_lock<std::mutex> lk(mu_);
  auto pred = [this] { return finished_.load(std::memory_order_acquire); };
  if (timeout_s < 0) {
    cv_.wait(lk, pred);
    return true;
  }
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), pred);
}

double CopyHandle::elapsed() const {
  int64_t ns = elapsed_ns_.load(std::memory_order_acquire);
  if (ns >= 0) return ns * 1e-9;
  return std::chrono::duration<double>(Clock::now() - t_submit_).count();
}

void CopyHandle::finish() {
  elapsed_ns_.store(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t_submit_).count(),
      std::memory_order_release);
  {
    // Publish under the mutex so a waiter cannot miss the notification.
    std::lock_guard<std::mutex> lk(mu_);
    finished_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

void CopyHandle::run_chunks() {
  const size_t n = chunks_.size();
  size_t i;
  while ((i = next_.fetch_add(1)) < n) {
    const CopySegment& c = chunks_[i];
    copy_range(c.dst, c.src, c.n, isa_, nontemporal_);
    if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) finish();
  }
}

// ---------------------------------------------------------------- CopyEngine

CopyEngine::CopyEngine(int num_threads, Isa isa)
    : num_threads_(std::max(1, num_threads)), isa_(isa),
      pool_(new ThreadPool(std::max(1, num_threads))) {}

CopyEngine::~CopyEngine() {
  // In a forked child the workers do not exist: joining would hang.  Leak.
  if (pool_ && pool_->owner_pid() != getpid()) (void)pool_.release();
}

std::shared_ptr<CopyHandle> CopyEngine::submit(const std::vector<CopySegment>& segs,
                                               size_t chunk_bytes, int nontemporal) {
  if (pool_->owner_pid() != getpid()) {
    throw std::runtime_error(
        "CopyEngine was created in another process (fork); create a new engine in this one");
  }
  auto h = std::make_shared<CopyHandle>();
  h->t_submit_ = CopyHandle::Clock::now();
  h->bytes_ = total_bytes(segs);
  h->isa_ = isa_;
  h->nontemporal_ = use_nontemporal(nontemporal, h->bytes_);
  if (chunk_bytes == 0) chunk_bytes = default_chunk_bytes(h->bytes_, num_threads_);
  h->chunks_ = make_chunks(segs, chunk_bytes);
  if (h->chunks_.empty()) {
    h->finish();
    return h;
  }
  // One task per worker that can be busy; each drains the shared chunk list.
  size_t tasks = std::min<size_t>(h->chunks_.size(), size_t(num_threads_));
  for (size_t t = 0; t < tasks; ++t) pool_->enqueue([h] { h->run_chunks(); });
  return h;
}

}  // namespace reft
