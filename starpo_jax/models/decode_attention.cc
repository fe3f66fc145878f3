// A decode step's attention on CPU, as an XLA FFI kernel (starpo_jax/models/cpu_attention.py says
// why and when it is used).
//
// Each row's one new token (its queries q [kv_heads, group, dim]) attends to the first length[row]
// slots of its cached keys and values [kv_heads, slots, dim] and to its own new key and value
// [kv_heads, dim]; the slots past length are never read. Every (row, kv head) pair is one task, and
// the tasks are spread over XLA's intra-op threads. Leading dimensions before the row's are
// flattened into rows (vmap adds one). Float32 throughout; the softmax is normalised after its sums.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Sizes {
  int64_t kv_heads, group, slots, dim;
};

// One (row, kv head): scores against the `length` cached keys and the new key, their exponentials,
// then the weighted sum of the values. `p` is scratch of group * (length + 1) floats.
void attend_one(const Sizes& s, float scale, int64_t length, const float* q, const float* keys,
                const float* values, const float* k_new, const float* v_new, float* out,
                std::vector<float>& p) {
  const int64_t G = s.group, D = s.dim, n = length + 1;
  p.resize(G * n);
  for (int64_t i = 0; i < n; ++i) {
    const float* k = i < length ? keys + i * D : k_new;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
      p[g * n + i] = dot * scale;
    }
  }
  std::vector<float> total(G, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    float* pg = p.data() + g * n;
    const float top = *std::max_element(pg, pg + n);
    for (int64_t i = 0; i < n; ++i) {
      pg[i] = std::exp(pg[i] - top);
      total[g] += pg[i];
    }
  }
  std::fill(out, out + G * D, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const float* v = i < length ? values + i * D : v_new;
    for (int64_t g = 0; g < G; ++g) {
      const float w = p[g * n + i];
      float* o = out + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += w * v[d];
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] /= total[g];
}

// The tasks handed out one at a time to whichever thread asks next; the caller waits for all of
// them to finish. Shared, so that a helper the pool starts late finds no task left and nothing freed.
struct Tasks {
  std::atomic<int64_t> next{0};
  int64_t finished = 0;
  std::mutex mu;
  std::condition_variable all_done;
};

}  // namespace

static ffi::Error DecodeAttention(ffi::ThreadPool pool, float scale, ffi::Buffer<ffi::F32> q,
                                  ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                                  ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> k_new,
                                  ffi::Buffer<ffi::F32> v_new, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = keys.dimensions();
  const int64_t r = qd.size();
  if (r < 3 || kd.size() != static_cast<size_t>(r))
    return ffi::Error::InvalidArgument("decode attention: q and the caches need the same rank, at least 3");
  const Sizes s{qd[r - 3], qd[r - 2], kd[r - 2], qd[r - 1]};
  const int64_t count = q.element_count() / (s.group * s.dim);  // rows x kv heads
  if (lengths.element_count() * s.kv_heads != count)
    return ffi::Error::InvalidArgument("decode attention: one length per row");
  const float *qp = q.typed_data(), *kp = keys.typed_data(), *vp = values.typed_data();
  const float *knp = k_new.typed_data(), *vnp = v_new.typed_data();
  const int32_t* lp = lengths.typed_data();
  float* op = out->typed_data();
  auto tasks = std::make_shared<Tasks>();
  auto work = [=]() {
    std::vector<float> p;
    int64_t done = 0;
    for (int64_t t; (t = tasks->next.fetch_add(1)) < count; ++done) {
      const int64_t length = std::clamp<int64_t>(lp[t / s.kv_heads], 0, s.slots);
      const int64_t cache = t * s.slots * s.dim, query = t * s.group * s.dim;
      attend_one(s, scale, length, qp + query, kp + cache, vp + cache, knp + t * s.dim, vnp + t * s.dim,
                 op + query, p);
    }
    if (done) {
      std::lock_guard<std::mutex> lock(tasks->mu);
      tasks->finished += done;
      if (tasks->finished == count) tasks->all_done.notify_all();
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work(); });
  work();
  std::unique_lock<std::mutex> lock(tasks->mu);
  tasks->all_done.wait(lock, [&] { return tasks->finished == count; });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(starpo_decode_attention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<float>("scale")
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [..., kv_heads, group, dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // keys [..., kv_heads, slots, dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // values, as keys
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lengths [...]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_new [..., kv_heads, dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_new, as k_new
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [..., kv_heads, group, dim]
