// A token sampled from each row's logits on CPU, as an XLA FFI kernel: jax.random.categorical's
// Gumbel-max draw, the same noise bits (starpo_jax/models/cpu_kernels.py says why and when it is
// used).
//
// Row r of a batch draws the noise of jax's partitionable threefry stream: the element (r, c) of a
// [of_rows, V] draw is Threefry-2x32 of the counters (0, r * V + c) under the step's key, the two
// words xor'ed, turned into a uniform u in [tiny, 1) as jax.random.uniform does, and into the Gumbel
// noise -log(-log u). The token is the first index of the row's largest logit + noise (NaN counted
// as +inf), or of its largest logit where the row is greedy. Its log-prob is log_softmax(logits) at
// the token. Each row is one task on XLA's intra-op threads; its logits stay in the core's cache
// between the draw's pass and the log-sum-exp's. The logarithms are Cephes' to about one float32
// ulp, so the noise can differ from XLA's in its last bits: a token only where two candidates tie
// to that precision. Leading dimensions before the batch's are flattened into rows (vmap adds one),
// each with its own key.

#include "cpu_kernels.h"

namespace {

using namespace starpo;

typedef uint32_t vu __attribute__((vector_size(W * sizeof(float))));

constexpr int DRAWN = 2;  // vectors of noise drawn together: two hashes' dependent chains interleave

inline vu rotate_left(vu x, int r) { return (x << r) | (x >> (32 - r)); }

// Threefry-2x32 (20 rounds) of the counters (0, c) under the key (k0, k1), the two words xor'ed: the
// 32 bits jax's partitionable threefry stream draws at flat index c; N vectors of counters at once.
template <int N>
inline void threefry_bits(uint32_t k0, uint32_t k1, vu (&c)[N]) {
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  constexpr int rotations[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  vu x0[N], x1[N];
  for (int n = 0; n < N; ++n) x0[n] = vu{} + ks[0], x1[n] = c[n] + ks[1];
  for (int i = 0; i < 5; ++i) {
    for (int r : rotations[i % 2])
      for (int n = 0; n < N; ++n) {
        x0[n] += x1[n];
        x1[n] = x0[n] ^ rotate_left(x1[n], r);
      }
    for (int n = 0; n < N; ++n) x0[n] += ks[(i + 1) % 3], x1[n] += ks[(i + 2) % 3] + uint32_t(i + 1);
  }
  for (int n = 0; n < N; ++n) c[n] = x0[n] ^ x1[n];
}

// log(x) for positive normal x: Cephes' logf, to about one float32 ulp.
inline vf log_positive(vf x) {
  const vi bits = reinterpret_cast<const vi&>(x);
  vf e = __builtin_convertvector((bits >> 23) - 126, vf);
  const vi mantissa = (bits & 0x007fffff) | 0x3f000000;  // x = m 2^e, m in [0.5, 1)
  vf m = reinterpret_cast<const vf&>(mantissa);
  const auto low = m < 0.707106781186547524f;  // then m in [sqrt(1/2), sqrt(2)) as 2m: log1p near 0
  e = low ? e - 1.f : e;
  m = low ? m + m - 1.f : m - 1.f;
  const vf z = m * m;
  vf y = vf{} + 7.0376836292e-2f;
  for (float c : {-1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f, -1.6668057665e-1f,
                  2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f})
    y = y * m + c;
  y = y * m * z + e * -2.12194440e-4f - z * 0.5f;
  return m + y + e * 0.693359375f;
}

// jax.random.gumbel's noise from 32 random bits: u = the bits' top 23 as a float in [0, 1), lifted
// to at least the smallest normal float, then -log(-log u).
inline vf gumbel(vu bits) {
  constexpr float tiny = 1.17549435e-38f;
  const vu one_to_two = (bits >> 9) | 0x3f800000u;
  const vf u = (reinterpret_cast<const vf&>(one_to_two) - 1.f) + tiny;
  return -log_positive(-log_positive(u < tiny ? vf{} + tiny : u));
}

struct Best {
  float value = -INFINITY;
  int32_t index = 0;
  void take(float v, int32_t i) {
    v = v != v ? INFINITY : v;  // NaN as +inf, as first_argmax
    if (v > value || (v == value && i < index)) value = v, index = i;
  }
};

// The first index of the largest of x[c] (+ noise), and the largest x, over one row of V logits
// whose noise counters start at `first`.
template <bool NOISY>
std::pair<int32_t, float> row_argmax(const float* x, int64_t V, uint32_t k0, uint32_t k1, uint32_t first) {
  vu lane;
  for (int j = 0; j < W; ++j) lane[j] = j;
  const vi lane_index = __builtin_convertvector(lane, vi);
  vf best = vf{} - INFINITY, top = vf{} - INFINITY;
  vi at = lane_index;
  int64_t c = 0;
  for (; c + DRAWN * W <= V; c += DRAWN * W) {
    vu bits[DRAWN];
    if constexpr (NOISY) {
      for (int n = 0; n < DRAWN; ++n) bits[n] = lane + (first + uint32_t(c + n * W));
      threefry_bits<DRAWN>(k0, k1, bits);
    }
    for (int n = 0; n < DRAWN; ++n) {
      const vf logit = load(x + c + n * W);
      top = logit > top ? logit : top;
      vf v = NOISY ? logit + gumbel(bits[n]) : logit;
      v = v != v ? vf{} + INFINITY : v;
      const auto better = v > best;  // strictly: a lane keeps its first maximum
      best = better ? v : best;
      at = better ? lane_index + int32_t(c + n * W) : at;
    }
  }
  Best b;
  float largest = -INFINITY;
  for (int j = 0; j < W; ++j) b.take(best[j], at[j]), largest = std::max(largest, top[j]);
  for (; c < V; ++c) {
    float v = x[c];
    largest = std::max(largest, v);
    if constexpr (NOISY) {
      vu bits[1] = {vu{} + (first + uint32_t(c))};
      threefry_bits<1>(k0, k1, bits);
      v += gumbel(bits[0])[0];
    }
    b.take(v, int32_t(c));
  }
  return {b.index, largest};
}

// log Σ exp(x - largest) over one row: each block of columns summed in vector lanes, the blocks'
// totals in double, so that no float sum runs long (XLA's reduction rounds about as little).
constexpr int64_t SUMMED = 64 * W;  // columns a block's lanes sum

float log_sum_exp_less(const float* x, int64_t V, float largest) {
  double total = 0;
  int64_t c = 0;
  while (c + W <= V) {
    vf sums = {};
    for (const int64_t end = std::min(V / W * W, c + SUMMED); c < end; c += W) sums += exp_nonpositive(load(x + c) - largest);
    total += sum(sums);
  }
  for (; c < V; ++c) total += std::exp(x[c] - largest);
  return float(std::log(total));
}

}  // namespace

static ffi::Error GumbelSample(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::U32> keys,
                               ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::PRED> greedy,
                               ffi::ResultBuffer<ffi::S32> tokens, ffi::ResultBuffer<ffi::F32> logprobs) {
  const auto d = logits.dimensions();
  const int64_t count = rows.element_count();
  if (d.size() < 2 || logits.element_count() != count * d.back() || greedy.element_count() != count ||
      keys.element_count() * d[d.size() - 2] != 2 * count)
    return ffi::Error::InvalidArgument("gumbel sample: logits [..., rows, vocabulary], a key [..., 2] and a row "
                                       "index and greedy flag per row");
  const int64_t V = d.back(), batch = d[d.size() - 2];
  const float* x = logits.typed_data();
  const uint32_t* k = keys.typed_data();
  const int32_t* index = rows.typed_data();
  const bool* argmax_only = greedy.typed_data();
  int32_t* token = tokens->typed_data();
  float* logprob = logprobs->typed_data();
  run_tasks(pool, count, [=](int64_t row, int64_t) {
    const float* own = x + row * V;
    const uint32_t k0 = k[2 * (row / batch)], k1 = k[2 * (row / batch) + 1];
    const auto [chosen, largest] = argmax_only[row]
        ? row_argmax<false>(own, V, k0, k1, 0)
        : row_argmax<true>(own, V, k0, k1, uint32_t(index[row]) * uint32_t(V));
    token[row] = chosen;
    logprob[row] = (own[chosen] - largest) - log_sum_exp_less(own, V, largest);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(starpo_gumbel_sample, GumbelSample,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [..., rows, vocabulary], scaled
                                  .Arg<ffi::Buffer<ffi::U32>>()   // keys [..., 2]: the step's threefry key
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows [..., rows]: each row's index in the draw
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // greedy [..., rows]: argmax, no noise
                                  .Ret<ffi::Buffer<ffi::S32>>()   // tokens [..., rows]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // logprobs [..., rows]
