#include "cpu/thread_pool.h"

#include "fusedce/cpu_threads.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace fusedce {
namespace cpu {
namespace {

class ThreadPool {
 public:
  explicit ThreadPool(int workers) {
    for (int k = 0; k < workers; ++k) threads_.emplace_back([this] { worker_loop(); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  int workers() const { return static_cast<int>(threads_.size()); }

  void run(int64_t n, int64_t grain, int helpers, const std::function<void(int64_t, int64_t)>& fn) {
    // One job at a time: a second caller waits here rather than mixing blocks of two jobs.
    std::lock_guard<std::mutex> job_lock(job_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_ = n;
      grain_ = grain;
      next_.store(0);
      helpers_wanted_ = helpers;
      active_ = 0;
      ++generation_;
      published_.store(generation_, std::memory_order_release);
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mu_);
    // Workers that joined must finish their blocks; late ones see no work and do not join.
    helpers_wanted_ = 0;
    done_.wait(lock, [this] { return active_ == 0; });
    fn_ = nullptr;
  }

 private:
  void drain() {
    for (;;) {
      const int64_t begin = next_.fetch_add(grain_);
      if (begin >= n_) return;
      (*fn_)(begin, std::min(n_, begin + grain_));
    }
  }

  void worker_loop() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      // Before sleeping, look for the next job for a short while, yielding the core to anything
      // else runnable: calls come in bursts (a row kernel per layer, forward then backward), and
      // a sleeping worker takes tens to hundreds of microseconds to wake on a virtual machine,
      // a tenth of a small call.
      lock.unlock();
      for (int k = 0; k < kLookBeforeSleep && published_.load(std::memory_order_acquire) == seen; ++k) {
        std::this_thread::yield();
      }
      lock.lock();
      wake_.wait(lock, [&] { return stop_ || (generation_ != seen && helpers_wanted_ > 0); });
      if (stop_) return;
      seen = generation_;
      --helpers_wanted_;
      ++active_;
      lock.unlock();
      drain();
      lock.lock();
      if (--active_ == 0) done_.notify_all();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex job_mu_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, grain_ = 1;
  std::atomic<int64_t> next_{0};
  int helpers_wanted_ = 0;
  int active_ = 0;
  uint64_t generation_ = 0;
  std::atomic<uint64_t> published_{0};  // generation_, readable without mu_ (the workers' look)
  bool stop_ = false;
  static constexpr int kLookBeforeSleep = 200;  // yields: ~0.1-0.4 ms when nothing else runs
};

ThreadPool& pool() {
  static ThreadPool instance(hardware_threads() - 1);
  return instance;
}

std::atomic<CpuParallelFor> host_parallel_for{nullptr};

/// What the host's parallel_for runs: the blocks of one parallel_for call, each as fn sees it.
struct Blocks {
  int64_t n, grain;
  const std::function<void(int64_t, int64_t)>* fn;
  static void run(void* ctx, int64_t begin, int64_t end) {
    const Blocks& b = *static_cast<const Blocks*>(ctx);
    for (int64_t k = begin; k < end; ++k) (*b.fn)(k * b.grain, std::min(b.n, (k + 1) * b.grain));
  }
};

}  // namespace

int hardware_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

void parallel_for(int64_t n, int64_t grain, int max_threads,
                  const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t blocks = (n + grain - 1) / grain;
  int threads = max_threads > 0 ? max_threads : hardware_threads();
  threads = static_cast<int>(std::min<int64_t>(threads, blocks));
  if (threads <= 1) {
    for (int64_t b = 0; b < n; b += grain) fn(b, std::min(n, b + grain));
    return;
  }
  if (const CpuParallelFor host = host_parallel_for.load(std::memory_order_acquire)) {
    Blocks work{n, grain, &fn};
    host(blocks, threads, &work, &Blocks::run);
    return;
  }
  ThreadPool& p = pool();
  p.run(n, grain, std::min(threads - 1, p.workers()), fn);
}

}  // namespace cpu

void set_cpu_parallel_for(CpuParallelFor parallel_for) {
  cpu::host_parallel_for.store(parallel_for, std::memory_order_release);
}

}  // namespace fusedce
