// The sum of one array over the N devices of a single-process CPU mesh, as one XLA CPU
// custom call per device inside a shard_map (through jax.ffi): expert parallelism's psum
// of the partial MoE outputs when the "devices" are this process's host devices.
//
// XLA's in-process all-reduce costs 17-30 us per call between two host devices of a
// 2-core machine (a rendezvous that parks and wakes threads), against ~50 us for a whole
// MoE layer of the demo model (docs/expert_parallel.md). Here the devices meet at a
// counting barrier in shared memory that they spin on: each publishes a pointer to its
// partial, waits for all N, sums the N partials in device order (so every device gets
// the same bits), and waits again so that no partial is freed while another device still
// reads it. A waiter yields its core for up to kSpinUs, then sleeps on a futex (`barrier`);
// a device that has not arrived after `kTimeout` fails the call (and the clique) instead
// of hanging the program.
#include <algorithm>
#include <climits>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MOEJAX_PAUSE() _mm_pause()
#else
#define MOEJAX_PAUSE() std::this_thread::yield()
#endif

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <ctime>
#endif

#include "cpu_bf16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using moejax::to_bf16;
using moejax::to_f32;

constexpr int kMaxDevices = 64;
constexpr auto kTimeout = std::chrono::seconds(120);
constexpr int64_t kSpinUs = 1000;

// One mesh's meeting point (one per clique id: one per expert-parallel Plan).
struct Clique {
  std::atomic<int64_t> count{0}, sleepers{0};
  std::atomic<int32_t> gen{0};     // the barrier's generation (a futex word on Linux)
  std::atomic<bool> broken{false};
  std::atomic<const void*> part[kMaxDevices];
  std::atomic<int64_t> size[kMaxDevices];
};

Clique& clique_of(int64_t id) {
  static std::mutex mu;
  static std::map<int64_t, std::unique_ptr<Clique>> cliques;
  std::lock_guard<std::mutex> lock(mu);
  auto& c = cliques[id];
  if (!c) c = std::make_unique<Clique>();
  return *c;
}

#ifdef __linux__
void futex_wait(std::atomic<int32_t>* a, int32_t v) {   // until *a != v (or a spurious wake)
  timespec ts{0, 20 * 1000 * 1000};                     // and at most 20 ms at a time
  syscall(SYS_futex, reinterpret_cast<int32_t*>(a), FUTEX_WAIT_PRIVATE, v, &ts, nullptr, 0);
}
void futex_wake(std::atomic<int32_t>* a) {
  syscall(SYS_futex, reinterpret_cast<int32_t*>(a), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr,
          nullptr, 0);
}
#else
void futex_wait(std::atomic<int32_t>*, int32_t) {
  std::this_thread::sleep_for(std::chrono::microseconds(50));
}
void futex_wake(std::atomic<int32_t>*) {}
#endif

// A central counting barrier over n arrivals; false when it timed out (the clique is then
// marked broken: its counts can no longer be trusted). A waiter spins, yielding its core
// at each turn, for up to kSpinUs, then sleeps on the generation word until the last
// arrival wakes it. Yielding rather than sleeping at once: devices that sleep and wake
// each other at every layer were co-located on one core by the scheduler (a wakee runs
// where its waker ran) and took turns on it, 2.5x slower; a yielding waiter gives a device
// that shares its core the turn, and the other core stays in use.
bool barrier(Clique& c, int64_t n) {
  const int32_t g = c.gen.load(std::memory_order_acquire);
  if (c.count.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
    c.count.store(0, std::memory_order_relaxed);
    c.gen.store(g + 1, std::memory_order_release);
    if (c.sleepers.load(std::memory_order_acquire) > 0) futex_wake(&c.gen);
    return true;
  }
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (int64_t i = 0; c.gen.load(std::memory_order_acquire) == g; ++i) {
    if (i < 64) {
      MOEJAX_PAUSE();
    } else if (clock::now() - start < std::chrono::microseconds(kSpinUs)) {
      std::this_thread::yield();
    } else {
      break;
    }
  }
  while (c.gen.load(std::memory_order_acquire) == g) {
    if (c.broken.load() || clock::now() - start > kTimeout) {
      c.broken.store(true);
      return false;
    }
    c.sleepers.fetch_add(1, std::memory_order_acq_rel);
    if (c.gen.load(std::memory_order_acquire) == g) futex_wait(&c.gen, g);
    c.sleepers.fetch_sub(1, std::memory_order_acq_rel);
  }
  return true;
}

template <typename T>
void sum_parts(Clique& c, int64_t n, int64_t count, T* y) {
  std::vector<float> acc(count, 0.0f);
  for (int64_t d = 0; d < n; ++d) {   // device order: every device adds the same way
    const T* p = static_cast<const T*>(c.part[d].load(std::memory_order_relaxed));
    for (int64_t i = 0; i < count; ++i) acc[i] += to_f32(p[i]);
  }
  for (int64_t i = 0; i < count; ++i) {
    if constexpr (sizeof(T) == 2) {
      y[i] = to_bf16(acc[i]);
    } else {
      y[i] = acc[i];
    }
  }
}

ffi::Error AllReduceImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index, int64_t clique,
                         int64_t devices, ffi::Result<ffi::AnyBuffer> y) {
  const auto t = x.element_type();
  if ((t != ffi::DataType::F32 && t != ffi::DataType::BF16) || y->element_type() != t ||
      y->element_count() != x.element_count() || index.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "moejax_host_all_reduce: expected one f32 or bf16 array and a scalar device index");
  const int64_t d = index.typed_data()[0];
  if (devices < 1 || devices > kMaxDevices || d < 0 || d >= devices)
    return ffi::Error::InvalidArgument(
        "moejax_host_all_reduce: device " + std::to_string(d) + " of " +
        std::to_string(devices) + " (at most " + std::to_string(kMaxDevices) + ")");
  Clique& c = clique_of(clique);
  if (c.broken.load())
    return ffi::Error::Internal(
        "moejax_host_all_reduce: an earlier all-reduce of this expert-parallel mesh timed "
        "out (a device never arrived); make a new engine");
  const int64_t count = static_cast<int64_t>(x.element_count());
  c.part[d].store(x.untyped_data(), std::memory_order_relaxed);
  c.size[d].store(count * (t == ffi::DataType::F32 ? 4 : 2), std::memory_order_relaxed);
  if (!barrier(c, devices))
    return ffi::Error::Internal(
        "moejax_host_all_reduce: a device did not reach the all-reduce within 120 s");
  bool same = true;
  for (int64_t e = 0; e < devices; ++e) same &= c.size[e].load() == c.size[d].load();
  if (same) {
    if (t == ffi::DataType::F32) {
      sum_parts(c, devices, count, static_cast<float*>(y->untyped_data()));
    } else {
      sum_parts(c, devices, count, static_cast<uint16_t*>(y->untyped_data()));
    }
  }
  if (!barrier(c, devices))   // nobody frees a partial another device still reads
    return ffi::Error::Internal(
        "moejax_host_all_reduce: a device did not leave the all-reduce within 120 s");
  if (!same)
    return ffi::Error::Internal(
        "moejax_host_all_reduce: the devices met with arrays of different sizes (two "
        "programs of one expert-parallel mesh ran out of step)");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxHostAllReduce, AllReduceImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("clique")
                                  .Attr<int64_t>("devices")
                                  .Ret<ffi::AnyBuffer>());
