// A few rows times weight matrices on CPU, as an XLA FFI kernel: a decode step's weight products
// (starpo_jax/models/cpu_kernels.py says why and when it is used).
//
// y_i [rows, out_i] = x [rows, in] @ w_i [in, out_i] for one to a few weights w_i of the same input
// (a block's q, k and v; its gate and up), float32, w_i row-major as the checkpoints' weights are
// stored (``decoder.weight_product``); leading dimensions (vmap's) are members, each with weights of
// its own. Each output is cut into column blocks of COLUMNS floats and each block into tiles of up
// to TILE rows, a tile's sums kept in registers: for every input feature, a tile reads one row of
// its block's weights once and multiplies it by each of its rows' input, broadcast. A task is one
// column block for all the rows: its weights [in, COLUMNS] come from memory once, for the first
// tile, and stay in the core's cache for the others. With a decode step's few rows the weights'
// reads are what waits, so while a task runs its tiles it asks the memory for the weights of the
// task its thread takes next, a few rows of them per tile. The tasks of all the outputs are spread
// over XLA's intra-op threads together. Each output sums its products over the input features in
// order, one fused multiply-add at a time.

#include <functional>
#include <numeric>
#include <vector>

#include "cpu_kernels.h"

namespace {

using namespace starpo;

constexpr int TILE = 6;                  // rows of a tile
constexpr int VECTORS = W == 16 ? 4 : 2;  // a tile's sums: 24 of AVX-512's 32 registers, 12 of AVX2's 16
constexpr int64_t COLUMNS = VECTORS * W;

// One output's weights w [K, N] (row-major) and its sums y [M, N].
struct Product {
  const float* w;
  float* y;
  int64_t N;
};

// y[r, n0 + c] for R rows and V vectors of columns c, summed over the K input features. `ahead`, when
// not null, is another block's weights [K, ...] (N floats a row): of its rows k with k % every ==
// phase, the first V vectors' lines are asked of the memory.
template <int R, int V>
void tile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, const float* ahead,
          int64_t ahead_N, int64_t phase, int64_t every) {
  vf acc[R][V] = {};
  for (int64_t k = 0, due = phase; k < K; ++k) {
    if (ahead && k == due) {
      ask_for<2>(ahead + k * ahead_N, V * W);
      due += every;
    }
    vf wv[V];
    for (int j = 0; j < V; ++j) wv[j] = load(w + k * N + n0 + j * W);
    for (int r = 0; r < R; ++r) {
      const vf xb = vf{} + x[r * K + k];
      for (int j = 0; j < V; ++j) acc[r][j] += xb * wv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) store(y + r * N + n0 + j * W, acc[r][j]);
}

// Columns [n0, N), fewer than a vector, one float at a time.
void tile_scalar(const float* x, const float* w, float* y, int64_t R, int64_t K, int64_t N, int64_t n0) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t n = n0; n < N; ++n) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[r * K + k] * w[k * N + n];
      y[r * N + n] = acc;
    }
}

// Column block n0 of one output for all M rows, the tiles in turn; tile i asks for rows k = i mod
// (tiles) of `ahead`'s weights, so that the next block's weights are all asked for by the last tile.
void column_block(const float* x, const Product& p, int64_t M, int64_t K, int64_t n0, const float* ahead,
                  int64_t ahead_N) {
  const int64_t vectors = std::min<int64_t>(VECTORS, (p.N - n0) / W), tiles = (M + TILE - 1) / TILE;
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t m0 = i * TILE, R = std::min<int64_t>(TILE, M - m0);
    if (vectors)
      with_constant<TILE>(R, [&](auto r) {
        with_constant<VECTORS>(vectors, [&](auto v) {
          tile<decltype(r)::value, decltype(v)::value>(x + m0 * K, p.w, p.y + m0 * p.N, K, p.N, n0, ahead, ahead_N, i,
                                                       tiles);
        });
      });
    if (n0 + vectors * W < p.N && vectors < VECTORS)
      tile_scalar(x + m0 * K, p.w, p.y + m0 * p.N, R, K, p.N, n0 + vectors * W);
  }
}

}  // namespace

static ffi::Error RowProducts(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights,
                              ffi::RemainingRets outputs) {
  const auto xd = x.dimensions();
  const size_t r = xd.size();
  if (r < 2 || weights.size() == 0 || weights.size() != outputs.size())
    return ffi::Error::InvalidArgument("row products: x [..., rows, in], then weights [..., in, out], one output each");
  const int64_t M = xd[r - 2], K = xd[r - 1];
  const int64_t members = std::accumulate(xd.begin(), xd.end() - 2, int64_t{1}, std::multiplies<int64_t>());
  std::vector<Product> products;
  std::vector<int64_t> first_task{0};  // a member's tasks of product i: [first_task[i], first_task[i + 1])
  for (size_t i = 0; i < weights.size(); ++i) {
    auto w = weights.get<ffi::Buffer<ffi::F32>>(i);
    auto y = outputs.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error() || y.has_error()) return ffi::Error::InvalidArgument("row products: float32 weights and outputs");
    const auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (wd.size() != r || yd.size() != r || wd[r - 2] != K || yd[r - 2] != M || yd[r - 1] != wd[r - 1] ||
        !std::equal(xd.begin(), xd.end() - 2, wd.begin()))
      return ffi::Error::InvalidArgument("row products: x [..., rows, in] @ w [..., in, out] -> y [..., rows, out]");
    products.push_back({w->typed_data(), (*y)->typed_data(), wd[r - 1]});
    first_task.push_back(first_task.back() + (wd[r - 1] + COLUMNS - 1) / COLUMNS);
  }
  const int64_t per_member = first_task.back(), count = members * per_member;
  struct Task {
    const float* x;
    Product p;
    int64_t n0;
  };
  auto located = [&](int64_t t) {  // leading dimensions (vmap's) are members, each with weights of its own
    const int64_t member = t / per_member, within = t % per_member;
    const size_t i = std::upper_bound(first_task.begin(), first_task.end(), within) - first_task.begin() - 1;
    const Product& p = products[i];
    return Task{x.typed_data() + member * M * K, {p.w + member * K * p.N, p.y + member * M * p.N, p.N},
                (within - first_task[i]) * COLUMNS};
  };
  run_tasks(pool, count, [&](int64_t t, int64_t next) {
    const Task task = located(t);
    const Task ahead = next < count ? located(next) : Task{};
    column_block(task.x, task.p, M, K, task.n0, ahead.p.w ? ahead.p.w + ahead.n0 : nullptr, ahead.p.N);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(starpo_row_products, RowProducts,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., rows, in]
                                  .RemainingArgs()               // weights [..., in, out_i]
                                  .RemainingRets());             // outputs [..., rows, out_i]
