// Persistent worker pool shared by the copy engine and the XOR kernels.
//
// Why a pool and not std::thread per call: a snapshot is issued as many small
// pieces (one per pipeline bubble); spawning threads per piece costs tens of
// microseconds each and shows up at that granularity.  Workers are started once
// and sleep on a condition variable between jobs.
//
// Fork safety: a forked child inherits the pool object but none of its threads
// (and perhaps a locked mutex).  Owners record the pid that built the pool and
// never touch it from another process (see owner_pid()).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace reft {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads) : owner_pid_(getpid()) {
    num_threads = std::max(1, num_threads);
    threads_.reserve(num_threads);
    for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this] { worker_loop(); });
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();  // queued tasks are drained first
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(threads_.size()); }
  pid_t owner_pid() const { return owner_pid_; }

  // Fire-and-forget task; FIFO order, so earlier submissions start first.
  void enqueue(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(std::move(fn));
    }
    cv_.notify_one();
  }

  // Runs fn(i) for every i in [0, n) using the calling thread plus up to
  // max_threads-1 pool workers, and returns when all n calls have finished.
  // Work is handed out through an atomic counter so a slow (preempted) thread
  // never holds up a fixed share of the range.
  void parallel_for(size_t n, int max_threads, const std::function<void(size_t)>& fn) {
    if (n == 0) return;
    int helpers = std::min<long>(std::min(max_threads, size() + 1) - 1, static_cast<long>(n) - 1);
    if (helpers <= 0) {
      for (size_t i = 0; i < n; ++i) fn(i);
      return;
    }
    struct State {
      std::atomic<size_t> next{0};
      std::atomic<size_t> done{0};
      size_t n = 0;
      const std::function<void(size_t)>* fn = nullptr;
      std::mutex mu;
      std::condition_variable cv;
    };
    auto st = std::make_shared<State>();
    st->n = n;
    st->fn = &fn;
    // A helper that starts after the range is exhausted exits without touching
    // fn, which may by then be gone (the caller returned): `next` guards it.
    auto run = [](State* s) {
      size_t i;
      while ((i = s->next.fetch_add(1)) < s->n) {
        (*s->fn)(i);
        if (s->done.fetch_add(1) + 1 == s->n) {
          std::lock_guard<std::mutex> lk(s->mu);
          s->cv.notify_all();
        }
      }
    };
    for (int h = 0; h < helpers; ++h) enqueue([st, run] { run(st.get()); });
    run(st.get());
    std::unique_lock<std::mutex> lk(st->mu);
    st->cv.wait(lk, [&] { return st->done.load() == st->n; });
  }

 private:
  void worker_loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  pid_t owner_pid_;
  std::vector<std::thread> threads_;
  std::deque<std::function<void()>> queue_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
};

// Process-wide pool for synchronous kernels (XOR, blocking memcpy).  Rebuilt
// lazily in a forked child; the parent's object is leaked there on purpose
// (its threads do not exist in the child, so it cannot be joined).
ThreadPool& shared_pool();

}  // namespace reft
