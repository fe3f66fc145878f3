// What starpo-jax's CPU kernels share (starpo_jax/models/cpu_kernels.py builds them into one library):
// a vector register of floats, a few operations on it, and the tasks spread over XLA's intra-op
// threads.

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace starpo {

namespace ffi = xla::ffi;

// A vector register of floats: sixteen where the CPU has AVX-512, else eight (AVX2's, or two NEON
// registers on Arm). The kernels keep their sums in registers rather than in memory. A build can
// choose the width (-DSTARPO_VECTOR_FLOATS=8 or 16: the tests build both).
#if defined(STARPO_VECTOR_FLOATS)
constexpr int64_t W = STARPO_VECTOR_FLOATS;
#elif defined(__AVX512F__)
constexpr int64_t W = 16;
#else
constexpr int64_t W = 8;
#endif
static_assert(W == 8 || W == 16, "STARPO_VECTOR_FLOATS: 8 or 16");
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(float))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// Lane j of fold<S>(a, b): each S-lane segment of a and of b folded in half (a lane plus the one
// S/2 further), a's half first, then b's.
constexpr int fold_lane(int S, int j, bool upper) {
  const int within = j % S, lane = j / S * S + within % (S / 2) + (upper ? S / 2 : 0);
  return within < S / 2 ? lane : lane + W;
}

template <int S, size_t... J>
inline vf fold(vf a, vf b, std::index_sequence<J...>) {
  return __builtin_shufflevector(a, b, fold_lane(S, J, false)...) +
         __builtin_shufflevector(a, b, fold_lane(S, J, true)...);
}

template <int S>
inline vf fold(vf a, vf b) {
  return fold<S>(a, b, std::make_index_sequence<W>{});
}

inline float sum(vf v) {
  v = fold<W>(v, v);
  v = fold<W / 2>(v, v);
  v = fold<W / 4>(v, v);
  if constexpr (W == 16) v = fold<2>(v, v);
  return v[0];
}

// exp(x) for x <= 0 (scores less their maximum), to about 2 float32 ulps: Cephes' expf, the exponent
// split off as a power of two. Below -87.3 it returns exp(-87.3), ~1e-38, where the exact value is
// smaller still: nothing a softmax whose largest term is 1 can see.
inline vf exp_nonpositive(vf x) {
  const vf lowest = vf{} - 87.3f, round = vf{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  x = x < lowest ? lowest : x;
  const vf n = (x * 1.44269504f + round) - round;
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf poly = vf{} + 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const vf e = poly * r * r + r + 1.f;
  const vi two_to_n = (__builtin_convertvector(n, vi) + 127) << 23;
  return e * reinterpret_cast<const vf&>(two_to_n);
}

// Asks the memory for the 64-byte lines that hold the floats [p, p + n) (p at a line's start), to be
// read soon: into the core's nearest cache (Locality 3, __builtin_prefetch's default), or its
// second-level cache (2) for what is read after other work.
template <int Locality = 3>
inline void ask_for(const float* p, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) __builtin_prefetch(p + c, 0, Locality);
}

// f(n) with n a compile-time constant (std::integral_constant), for n in [1, N]; N where n is larger:
// the kernels' register tiles are unrolled by it.
template <int N, class F>
void with_constant(int64_t n, F f) {
  if constexpr (N > 1)
    if (n < N) return with_constant<N - 1>(n, f);
  f(std::integral_constant<int, N>{});
}

// A short wait in a spinning loop: tells the core it may let the other hardware thread run.
inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

// Pauses the caller spins through (~0.1 ms) for the helpers' last tasks before it sleeps: woken from
// a sleep, it lost tens of microseconds a call, as much as a decode step's smaller products take.
constexpr int SPINS = 4000;

// The tasks handed out one at a time to whichever thread asks next; the caller waits for all of
// them to finish. Shared, so that a helper the pool starts late finds no task left and nothing freed.
struct Tasks {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  std::mutex mu;
  std::condition_variable all_done;
};

// run(t, next) for t in [0, count), spread over the calling thread and XLA's intra-op threads; next
// is the task the same thread runs after t (taken before t runs), or count where none is left.
template <class F>
void run_tasks(ffi::ThreadPool& pool, int64_t count, F run) {
  auto tasks = std::make_shared<Tasks>();
  auto work = [=]() {
    int64_t done = 0;
    for (int64_t t = tasks->next.fetch_add(1), next; t < count; t = next, ++done) {
      next = std::min(tasks->next.fetch_add(1), count);
      run(t, next);
    }
    if (done && tasks->finished.fetch_add(done) + done == count) {
      std::lock_guard<std::mutex> lock(tasks->mu);
      tasks->all_done.notify_all();
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work(); });
  work();
  for (int spin = 0; spin < SPINS && tasks->finished.load() != count; ++spin) pause();
  std::unique_lock<std::mutex> lock(tasks->mu);
  tasks->all_done.wait(lock, [&] { return tasks->finished == count; });
}

}  // namespace starpo
