// Work sharing for the CPU kernels: parallel_for runs fn(0..total-1) on the calling thread
// and on helpers, either tasks on XLA's intra-op pool or the kernel's own helper threads
// that stay awake between the calls of a decode step (Spinners).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace moejax {

namespace ffi = xla::ffi;

// Work shared by parallel_for: fn(0..total-1), indices claimed from a shared counter; the
// caller waits only for claimed ones, so a helper that starts late finds nothing left and
// never touches fn's captures after the call returned.
struct PforState {
  std::function<void(int64_t)> fn;
  int64_t total;
  std::atomic<int64_t> next{0}, done{0};
};

inline void pfor_work(PforState& st) {
  for (int64_t i; (i = st.next.fetch_add(1)) < st.total;) {
    st.fn(i);
    st.done.fetch_add(1, std::memory_order_release);
  }
}

// How long a spinner stays awake after a job (MOEJAX_CPU_SPIN_US; 0: no spinners).
inline std::atomic<int64_t> g_spin_us{[] {
  const char* e = std::getenv("MOEJAX_CPU_SPIN_US");
  return e ? std::max<int64_t>(0, std::atoll(e)) : int64_t{1000};
}()};

// Whether a decode loop runs (cpu_kernel.decoding(), through moejax_set_decoding): only
// then does a spinner stay awake after a job; else it sleeps right after it, so no core
// spins while the program does something else between decode calls.
inline std::atomic<bool> g_decoding{false};

// Helper threads of our own for decode-sized calls. A task on XLA's intra-op pool woke
// 100-600 us after it was scheduled on the 2-core machine, against calls of 0.1-1 ms, so
// the second core joined late or not at all. A spinner stays awake for g_spin_us after
// each job, as llama.cpp's threads spin at barriers, so the calls of one decode step find
// it awake (it joined within 5-20 us); it spins with yield, so it gives its core to any
// other runnable thread, then sleeps on a condition variable. It spins only while
// g_decoding is set (inside a decode loop); outside one it sleeps right after each job.
class Spinners {
 public:
  explicit Spinners(int n) {
    for (int i = 0; i < n; ++i) std::thread([this] { loop(); }).detach();
  }
  void post(std::shared_ptr<PforState> job) {
    {
      std::lock_guard<std::mutex> l(mu_);
      job_ = std::move(job);
      gen_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load() > 0) cv_.notify_all();
  }

 private:
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() +
                         std::chrono::microseconds(g_spin_us.load(std::memory_order_relaxed));
      while (gen_.load(std::memory_order_acquire) == seen) {
        if (!g_decoding.load(std::memory_order_relaxed) ||
            std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> l(mu_);
          ++sleepers_;
          cv_.wait(l, [&] { return gen_.load() != seen; });
          --sleepers_;
          break;
        }
        std::this_thread::yield();
      }
      std::shared_ptr<PforState> job;
      {
        std::lock_guard<std::mutex> l(mu_);
        seen = gen_.load();
        job = job_;
      }
      pfor_work(*job);
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> sleepers_{0};
  std::shared_ptr<PforState> job_;
};

// Runs fn(0..total-1) on the calling thread and on helpers: the spinners for a `decode`
// call (a few rows) while g_spin_us > 0, else tasks on XLA's intra-op pool (a prompt's
// calls are long enough that a late start costs little, and a spinner would compete with
// XLA's own multithreaded GEMMs between them).
inline void parallel_for(ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> fn,
                  bool decode) {
  auto s = std::make_shared<PforState>();
  s->fn = std::move(fn);
  s->total = total;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  if (decode && g_spin_us.load(std::memory_order_relaxed) > 0) {
    static Spinners* spinners =   // never destroyed: detached threads keep using it
        new Spinners(std::max<int>(1, static_cast<int>(pool.num_threads()) - 1));
    if (helpers > 0) spinners->post(s);
  } else {
    for (int64_t i = 0; i < helpers; ++i) pool.Schedule([s] { pfor_work(*s); });
  }
  pfor_work(*s);
  while (s->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

// The operands of the expert kernels (cpu_kernel.cc's routed experts, cpu_host.cc's host
// experts) after what `b` binds first: x, ids [S32], gates [F32], gate_up, down -> y.
template <typename B>
inline auto experts_operands(B b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

// The binding of the expert kernels: XLA's intra-op pool, then the operands.
inline auto experts_binding() {
  return experts_operands(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>());
}

// experts_binding with the layer of the stacked weights first (an int32 scalar).
inline auto experts_at_binding() {
  return experts_operands(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::S32>>());
}

}  // namespace moejax
