// Attention of new tokens to a KV cache on CPU, as an XLA FFI kernel: a decode step's one token per
// row, or a block of a prompt's tokens (starpo_jax/models/cpu_kernels.py says why and when it is
// used).
//
// Token t of a row (its queries q [tokens, kv_heads, group, dim]) attends to the first length[row]
// slots of the row's cached keys and values [kv_heads, slots, dim], then to the block's own new
// keys and values [tokens, kv_heads, dim] up to its own (causal); the slots past length are never
// read. A row's tokens from num_new[row] on are padding: their outputs are zeros. Every (row, kv
// head) pair is one task (or a few rows' pairs: below), its tokens one after the other (the row's
// keys stay in the core's cache), and the tasks are spread over XLA's intra-op threads. A decode
// step's token scores W cached keys at a time, their sums across vector lanes taken together; while
// a row sums its values (already in the core's cache), it asks the memory for the keys and values
// its thread reads next (the chunk's next row's, or the next task's), so that the memory keeps
// streaming: a decode step's attention is bound by reading the cache. Rows whose caches begin with
// the same prompt (one prefix group) are a task together, a few at a time: each reads the prompt's
// slots from the first one's cache, already in the core's cache after the first row, and sums them
// as it would its own. Leading dimensions before the row's are flattened into rows (vmap adds one).
// Float32 throughout; the softmax is normalised after its sums.

#include <vector>

#include "cpu_kernels.h"

namespace {

using namespace starpo;

struct Sizes {
  int64_t tokens, kv_heads, group, slots, dim;
};

constexpr int TILE = 6;  // a block's keys of a scores tile, queries of a values tile: 6 x VMAX vectors of sums
constexpr int VMAX = W == 16 ? 4 : 2;  // vectors of a value row summed at once (AVX-512 has 32 registers)
constexpr int64_t AHEAD = 16;  // keys ahead of the scores' loop whose key and value rows are prefetched

constexpr int bit_reversed(int j) {
  int r = 0;
  for (int b = 1; b < W; b <<= 1, j >>= 1) r = r * 2 + (j & 1);
  return r;
}

// The W vectors' sums across their lanes, as one vector: lane j is the sum of v[j]'s lanes. Pairs
// are folded level by level (log2 W levels, W - 1 folds in all, where W separate sums take W log2 W):
// each level halves every segment and interleaves a pair's halves, so that the vectors taken in
// bit-reversed order come out in order.
inline vf lane_sums(const vf (&v)[W]) {
  vf t[W];
  for (int j = 0; j < W; ++j) t[bit_reversed(j)] = v[j];
  for (int j = 0; j < W / 2; ++j) t[j] = fold<W>(t[2 * j], t[2 * j + 1]);
  for (int j = 0; j < W / 4; ++j) t[j] = fold<W / 2>(t[2 * j], t[2 * j + 1]);
  for (int j = 0; j < W / 8; ++j) t[j] = fold<W / 4>(t[2 * j], t[2 * j + 1]);
  if constexpr (W == 16) t[0] = fold<2>(t[0], t[1]);
  return t[0];
}

// The keys (or values) one token attends to: the cache's first `held` rows, then the block's new
// ones, `stride` floats apart (the block's other kv heads lie between them). The first `shared` of
// the cached rows are read from `prefix`, another row's cache that holds the same (a prompt that
// rows share: read from memory once for all of them, then from the core's cache).
struct Rows {
  const float* cache;
  const float* fresh;
  int64_t held, stride, dim;
  const float* prefix = nullptr;
  int64_t shared = 0;
  const float* operator[](int64_t i) const {
    return i < held ? (i < shared ? prefix : cache) + i * dim : fresh + (i - held) * stride;
  }
};

// Asks the memory for the cached key and value rows [from, to), those the cache holds, the values
// with less urgency (read after all the scores).
inline void prefetch_rows(const Rows& keys, const Rows& values, int64_t from, int64_t to) {
  for (int64_t i = from; i < std::min(to, keys.held); ++i) {
    ask_for(keys[i], keys.dim);
    ask_for<2>(values[i], values.dim);
  }
}

// One query's scores against W cached keys in a row (k the first), each DV = dim / W vectors long:
// the W dot products in vectors of partial sums, summed across their lanes together (lane_sums).
template <int DV>
inline vf tile_scores(const float* q, const float* k) {
  vf qv[DV], acc[W];
  for (int c = 0; c < DV; ++c) qv[c] = load(q + c * W);
  for (int r = 0; r < W; ++r) {
    acc[r] = qv[0] * load(k + r * DV * W);
    for (int c = 1; c < DV; ++c) acc[r] += qv[c] * load(k + (r * DV + c) * W);
  }
  return lane_sums(acc);
}

// f(DV) for the dim's vectors, DV a compile-time constant where it is 1, 2, 4 or 8; false otherwise.
template <class F>
bool with_vectors(int64_t DV, F f) {
  switch (DV) {
    case 1: return f(std::integral_constant<int, 1>{}), true;
    case 2: return f(std::integral_constant<int, 2>{}), true;
    case 4: return f(std::integral_constant<int, 4>{}), true;
    case 8: return f(std::integral_constant<int, 8>{}), true;
    default: return false;
  }
}

// Scores of G queries [G, D] (scaled) against the first n keys: p[g * stride + i]. The cached keys W
// at a time (tile_scores), every query in turn while the tile stays in the core's nearest cache; the
// rest one at a time.
void scores(int64_t G, const float* q, const Rows& keys, const Rows& values, int64_t n, float* p, int64_t stride) {
  const int64_t D = keys.dim, tiled = D % W == 0 ? std::min(n, keys.held) / W * W : 0;
  const bool in_tiles = with_vectors(D / W, [&](auto dv) {
    for (int64_t i0 = 0; i0 < tiled; i0 += W) {
      prefetch_rows(keys, values, i0 + AHEAD, i0 + AHEAD + W);
      for (int64_t g = 0; g < G; ++g) store(p + g * stride + i0, tile_scores<decltype(dv)::value>(q + g * D, keys[i0]));
    }
  });
  for (int64_t i = in_tiles ? tiled : 0; i < n; ++i) {
    prefetch_rows(keys, values, i + AHEAD, i + AHEAD + 1);
    for (int64_t g = 0; g < G; ++g) {
      vf acc = {};
      for (int64_t c = 0; c < D; c += W) acc += load(q + g * D + c) * load(keys[i] + c);
      p[g * stride + i] = sum(acc);
    }
  }
}

// The cached key and value rows a thread reads next: `rows` of each from `keys` and `values` (none
// where rows is 0).
struct Ahead {
  const float *keys = nullptr, *values = nullptr;
  int64_t rows = 0;
};

// Weighted sums of the values for R queries, V vectors of the dim from d0, the sums in registers:
// sums[r * dim + d] = sum_i w[r * per_query + i * per_key] * value_i[d], for d in [d0, d0 + V * W).
// `ahead`: a key and a value row of them asked of the memory per value read, so that the memory keeps
// streaming while this pass sums values already in the core's cache.
template <int R, int V>
void weighted_values(const float* w, int64_t per_query, int64_t per_key, const Rows& values, int64_t n, int64_t d0,
                     float* sums, const Ahead& ahead) {
  vf acc[R][V] = {};
  for (int64_t i = 0; i < n; ++i) {
    if (i < ahead.rows) {
      ask_for<2>(ahead.keys + i * values.dim, values.dim);
      ask_for<2>(ahead.values + i * values.dim, values.dim);
    }
    const float* v = values[i] + d0;
    vf vv[V];
    for (int j = 0; j < V; ++j) vv[j] = load(v + j * W);
    for (int r = 0; r < R; ++r) {
      const vf weight = vf{} + w[r * per_query + i * per_key];
      for (int j = 0; j < V; ++j) acc[r][j] += weight * vv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) store(sums + r * values.dim + d0 + j * W, acc[r][j]);
}

// weighted_values over the dim from d0, as many vectors at a time as remain, up to VMAX; returns
// where the next call starts.
template <int R>
int64_t weighted_values_from(const float* w, int64_t per_query, int64_t per_key, const Rows& values, int64_t n,
                             int64_t d0, float* sums, Ahead ahead = {}) {
  const int64_t left = (values.dim - d0) / W;
  if (d0 != 0) ahead = {};  // asked for once, in the first pass
  if (VMAX >= 4 && left >= 4) return weighted_values<R, 4>(w, per_query, per_key, values, n, d0, sums, ahead), d0 + 4 * W;
  if (left >= 2) return weighted_values<R, 2>(w, per_query, per_key, values, n, d0, sums, ahead), d0 + 2 * W;
  return weighted_values<R, 1>(w, per_query, per_key, values, n, d0, sums, ahead), d0 + W;
}

// Each query's sums over its softmax total: out[g * D + d] /= total[g] for G queries.
void normalise(int64_t G, int64_t D, const float* total, float* out) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] /= total[g];
}

// The same two passes one float at a time, for a head size the vectors do not divide.
void scores_scalar(int64_t G, const float* q, const Rows& keys, int64_t n, float* p, int64_t stride) {
  const int64_t D = keys.dim;
  for (int64_t i = 0; i < n; ++i) {
    const float* k = keys[i];
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += q[g * D + d] * k[d];
      p[g * stride + i] = dot;
    }
  }
}

void weighted_values_scalar(int64_t G, const float* p, int64_t stride, const Rows& values, int64_t n,
                            const float* total, float* out) {
  const int64_t D = values.dim;
  std::fill(out, out + G * D, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const float* v = values[i];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += p[g * stride + i] * v[d];
  }
  normalise(G, D, total, out);
}

// f(block size, first query) over the queries in blocks of up to four, so that a block's sums fit
// in the registers.
template <class F>
void in_blocks(int64_t G, F f) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) with_constant<4>(std::min<int64_t>(4, G - g0), [&](auto gb) { f(gb, g0); });
}

// Each query's softmax weights in place of its scores, unnormalised; total[g] their sum.
void softmax_weights(int64_t G, int64_t n, float* p, float* total) {
  for (int64_t g = 0; g < G; ++g) {
    float* pg = p + g * n;
    vf tops = vf{} - INFINITY;
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const vf x = load(pg + i);
      tops = x > tops ? x : tops;
    }
    float top = -INFINITY;
    for (int j = 0; j < W; ++j) top = std::max(top, tops[j]);
    for (; i < n; ++i) top = std::max(top, pg[i]);
    vf totals = {};
    for (i = 0; i + W <= n; i += W) {
      const vf e = exp_nonpositive(load(pg + i) - top);
      store(pg + i, e);
      totals += e;
    }
    total[g] = sum(totals);
    for (; i < n; ++i) total[g] += pg[i] = std::exp(pg[i] - top);
  }
}

// One token of a (row, kv head): scores against its n keys, their exponentials, then the weighted
// sum of the values. `scratch` holds the scaled queries, the scores and the totals.
void attend_one(int64_t G, float scale, const float* q, const Rows& keys, const Rows& values, int64_t n,
                float* out, std::vector<float>& scratch, Ahead ahead = {}) {
  const int64_t D = keys.dim;
  scratch.resize(G * D + G * n + G);
  float *q_scaled = scratch.data(), *p = q_scaled + G * D, *total = p + G * n;
  for (int64_t i = 0; i < G * D; ++i) q_scaled[i] = q[i] * scale;
  if (D % W != 0) {
    scores_scalar(G, q_scaled, keys, n, p, n);
    softmax_weights(G, n, p, total);
    return weighted_values_scalar(G, p, n, values, n, total, out);
  }
  scores(G, q_scaled, keys, values, n, p, n);
  softmax_weights(G, n, p, total);
  in_blocks(G, [&](auto gb, int64_t g0) {
    constexpr int GB = decltype(gb)::value;
    for (int64_t d0 = 0; d0 < D;)
      d0 = weighted_values_from<GB>(p + g0 * n, n, 1, values, n, d0, out + g0 * D, g0 == 0 ? ahead : Ahead{});
  });
  normalise(G, D, total, out);
}

// A block's tokens of one (row, kv head) together, as two matrix products in register tiles with the
// softmax between: M = tokens x group queries (token-major) against the n keys the last of them sees.
// The scores are kept transposed, st[key][query] (a row of Mp queries, M rounded up to vectors), so
// that both products broadcast one operand's element against a vector of the other's: the scores
// broadcast a key's element against the queries (qt[dim][query], packed once), and the values a
// query's weight against a value's row.

template <int R, int V>
void scores_tile(const Rows& keys, int64_t i0, const float* qt, int64_t Mp, int64_t m0, float* st) {
  const float* k[R];
  for (int r = 0; r < R; ++r) k[r] = keys[i0 + r];
  vf acc[R][V] = {};
  for (int64_t d = 0; d < keys.dim; ++d) {
    vf qv[V];
    for (int j = 0; j < V; ++j) qv[j] = load(qt + d * Mp + m0 + j * W);
    for (int r = 0; r < R; ++r) {
      const vf kb = vf{} + k[r][d];
      for (int j = 0; j < V; ++j) acc[r][j] += kb * qv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) store(st + (i0 + r) * Mp + m0 + j * W, acc[r][j]);
}

// Tokens [0, real) of a (row, kv head) whose keys `held` cached rows precede; q the first token's
// queries, `step` floats from one token's to the next's (as out). D a multiple of W.
void attend_block(int64_t G, float scale, const float* q, int64_t step, int64_t real, const Rows& keys,
                  const Rows& values, float* out, std::vector<float>& scratch, Ahead ahead) {
  const int64_t D = keys.dim, M = real * G, Mp = (M + W - 1) / W * W, n = keys.held + real;
  scratch.assign(D * Mp + n * Mp + M * D + Mp, 0.f);
  float *qt = scratch.data(), *st = qt + D * Mp, *sums = st + n * Mp, *total = sums + M * D;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t d = 0; d < D; ++d) qt[d * Mp + m] = q[(m / G) * step + (m % G) * D + d] * scale;
  for (int64_t i0 = 0; i0 < n; i0 += TILE) {  // each key read from memory once, for every query
    prefetch_rows(keys, values, i0 + AHEAD, i0 + AHEAD + TILE);
    for (int64_t m0 = 0; m0 < Mp; m0 += 2 * W)
      with_constant<TILE>(std::min<int64_t>(TILE, n - i0), [&](auto r) {
        if (Mp - m0 >= 2 * W) return scores_tile<decltype(r)::value, 2>(keys, i0, qt, Mp, m0, st);
        scores_tile<decltype(r)::value, 1>(keys, i0, qt, Mp, m0, st);
      });
  }
  // The softmax over each query's keys, a vector of queries at a time: query m (token m / G) sees
  // keys i <= held + m / G; the others weigh 0.
  for (int64_t m0 = 0; m0 < Mp; m0 += W) {
    vf token, top = vf{} - INFINITY, totals = {};
    for (int j = 0; j < W; ++j) token[j] = static_cast<float>((m0 + j) / G);
    auto seen = [&](int64_t i) { return vf{} + static_cast<float>(i - keys.held) <= token; };
    for (int64_t i = 0; i < n; ++i) {
      const vf x = load(st + i * Mp + m0);
      top = seen(i) ? (x > top ? x : top) : top;
    }
    for (int64_t i = 0; i < n; ++i) {
      const vf e = seen(i) ? exp_nonpositive(load(st + i * Mp + m0) - top) : vf{};
      store(st + i * Mp + m0, e);
      totals += e;
    }
    store(total + m0, totals);
  }
  for (int64_t m0 = 0; m0 < M; m0 += TILE)
    with_constant<TILE>(std::min<int64_t>(TILE, M - m0), [&](auto r) {
      for (int64_t d0 = 0; d0 < D;)
        d0 = weighted_values_from<decltype(r)::value>(st + m0, 1, Mp, values, n, d0, sums + m0 * D,
                                                      m0 == 0 ? ahead : Ahead{});
    });
  for (int64_t m = 0; m < M; ++m)
    for (int64_t d = 0; d < D; ++d) out[(m / G) * step + (m % G) * D + d] = sums[m * D + d] / total[m];
}

// Rows whose caches begin with the same slots (one `groups` id within a batch: the leading
// dimensions' index, row / batch) are attended together, in chunks of up to CHUNK rows, each chunk's
// rows reading the shared slots from its first row's cache: `order` lists the rows chunk by chunk (a
// group's rows in batch order), and chunk c is order[starts[c]] to order[starts[c + 1] - 1].
constexpr int64_t CHUNK = 8;

struct Chunks {
  std::vector<int64_t> order, starts;
};

Chunks chunked(const int32_t* groups, int64_t rows, int64_t batch) {
  auto group = [&](int64_t row) { return std::make_pair(row / batch, groups[row]); };
  Chunks c;
  c.order.resize(rows);
  for (int64_t i = 0; i < rows; ++i) c.order[i] = i;
  std::stable_sort(c.order.begin(), c.order.end(), [&](int64_t a, int64_t b) { return group(a) < group(b); });
  for (int64_t i = 0; i < rows; ++i)
    if (i == 0 || i - c.starts.back() == CHUNK || group(c.order[i]) != group(c.order[i - 1])) c.starts.push_back(i);
  c.starts.push_back(rows);
  return c;
}

}  // namespace

static ffi::Error CachedAttention(ffi::ThreadPool pool, float scale, ffi::Buffer<ffi::F32> q,
                                  ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                                  ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> num_new,
                                  ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                                  ffi::Buffer<ffi::S32> groups, ffi::Buffer<ffi::S32> shared,
                                  ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = keys.dimensions();
  const int64_t r = qd.size();
  if (r < 4 || kd.size() != static_cast<size_t>(r - 1) || kd[r - 4] != qd[r - 3] || kd[r - 2] != qd[r - 1])
    return ffi::Error::InvalidArgument("cached attention: q [..., tokens, kv_heads, group, dim] and the caches "
                                       "[..., kv_heads, slots, dim] do not match");
  const Sizes s{qd[r - 4], qd[r - 3], qd[r - 2], kd[r - 3], qd[r - 1]};  // kd: one dimension fewer
  const int64_t rows = lengths.element_count();
  if (q.element_count() != rows * s.tokens * s.kv_heads * s.group * s.dim || num_new.element_count() != rows ||
      groups.element_count() != rows || shared.element_count() != rows)
    return ffi::Error::InvalidArgument("cached attention: one length, count of new tokens, prefix group and "
                                       "shared length per row");
  const float *qp = q.typed_data(), *kp = keys.typed_data(), *vp = values.typed_data();
  const float *knp = k_new.typed_data(), *vnp = v_new.typed_data();
  const int32_t *lp = lengths.typed_data(), *np_ = num_new.typed_data(), *sp = shared.typed_data();
  float* op = out->typed_data();
  const auto ld = lengths.dimensions();
  const Chunks chunks = chunked(groups.typed_data(), rows, ld.size() == 0 ? 1 : std::max<int64_t>(1, ld.back()));
  const int64_t count = (static_cast<int64_t>(chunks.starts.size()) - 1) * s.kv_heads;
  const int64_t query = s.group * s.dim, step = s.kv_heads * query;
  auto held = [=](int64_t row) { return std::clamp<int64_t>(lp[row], 0, s.slots); };
  auto cache = [=](int64_t row, int64_t head) { return (row * s.kv_heads + head) * s.slots * s.dim; };
  // the slots a row reads from its chunk's first row's cache: whole tiles of W keys only (a tile's
  // keys are read from one row's cache: tile_scores)
  auto common_of = [=](int64_t row, int64_t first_row) {
    return std::min<int64_t>({sp[row], sp[first_row], held(row), held(first_row)}) / W * W;
  };
  auto ahead_of = [=](int64_t row, int64_t head, int64_t from_slot) {
    const int64_t at = cache(row, head) + from_slot * s.dim;
    return Ahead{kp + at, vp + at, held(row) - from_slot};
  };
  run_tasks(pool, count, [=, &chunks](int64_t t, int64_t next) {
    thread_local std::vector<float> scratch;
    const int64_t chunk = t / s.kv_heads, head = t % s.kv_heads;
    const int64_t from = chunks.starts[chunk], to = chunks.starts[chunk + 1], first_row = chunks.order[from];
    const int64_t shared_from = cache(first_row, head);
    for (int64_t i = from; i < to; ++i) {
      const int64_t row = chunks.order[i];
      const int64_t real = std::clamp<int64_t>(np_[row], 0, s.tokens);
      const int64_t common = common_of(row, first_row);
      const int64_t own = cache(row, head), fresh = (row * s.tokens * s.kv_heads + head) * s.dim;
      const Rows k{kp + own, knp + fresh, held(row), s.kv_heads * s.dim, s.dim, kp + shared_from, common};
      const Rows v{vp + own, vnp + fresh, held(row), s.kv_heads * s.dim, s.dim, vp + shared_from, common};
      const int64_t first = row * s.tokens * step + head * query;  // the row's first token's queries
      // what this thread reads next, asked of the memory while this row sums its values: the chunk's
      // next row's own slots (past the prompt its first row holds), or the next task's first row's
      const int64_t after = i + 1 < to ? chunks.order[i + 1] : -1;
      const Ahead ahead = after >= 0 ? ahead_of(after, head, common_of(after, first_row))
          : next < count ? ahead_of(chunks.order[chunks.starts[next / s.kv_heads]], next % s.kv_heads, 0)
          : Ahead{};
      if (real > 1 && s.dim % W == 0)
        attend_block(s.group, scale, qp + first, step, real, k, v, op + first, scratch, ahead);
      else
        for (int64_t token = 0; token < real; ++token)  // the last token's values pass asks for `ahead`
          attend_one(s.group, scale, qp + first + token * step, k, v, held(row) + token + 1,
                     op + first + token * step, scratch, token + 1 == real ? ahead : Ahead{});
      for (int64_t token = real; token < s.tokens; ++token) std::fill_n(op + first + token * step, query, 0.f);
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(starpo_cached_attention, CachedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<float>("scale")
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [..., tokens, kv_heads, group, dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // keys [..., kv_heads, slots, dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // values, as keys
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lengths [...]: slots held
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_new [...]: real new tokens
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_new [..., tokens, kv_heads, dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_new, as k_new
                                  .Arg<ffi::Buffer<ffi::S32>>()   // groups [...]: rows sharing a prefix
                                  .Arg<ffi::Buffer<ffi::S32>>()   // shared [...]: slots of that prefix
                                  .Ret<ffi::Buffer<ffi::F32>>());  // as q
