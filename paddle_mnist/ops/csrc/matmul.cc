// onednn_rows_matmul(x, w, transpose_y, rows): x @ w (w transposed where asked) on float32 CPU tensors, one
// product of `rows` rows at a time, each row's result the same bits in any batch, at any place in it, on any number
// of threads: what network/exact.py's dense layers (by_rows) need. A product of all the rows at once is not so: a
// GEMM adds its terms in an order that changes with its number of rows, and splits a product among its threads by
// shapes that change with it too.
//
// One oneDNN matmul primitive per shape, made for a block of `rows` rows on one thread (OpenMPThreads), runs each
// block; the last block, short, runs padded with zero rows. The blocks are shared among the process's OpenMP threads
// (Team), each with its own stream and scratchpad: a block's result does not depend on the thread that runs it.

#include <algorithm>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "onednn_common.h"
#include "paddle/extension.h"

namespace {

using namespace paddle_mnist;  // NOLINT: the shared helpers of onednn_common.h

struct Shape {
  int64_t rows, k, n;
  bool transpose;  // w is [n, k], not [k, n]
  bool operator<(const Shape& other) const {
    return std::tie(rows, k, n, transpose) < std::tie(other.rows, other.k, other.n, other.transpose);
  }
};

dnnl::matmul::primitive_desc make_pd(const Shape& s) {
  const OpenMPThreads one(1);  // the primitive's split of a block among threads: none
  dnnl::primitive_attr attr;    // each thread that runs it brings its own scratchpad
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const auto f32 = memory::data_type::f32;
  const memory::desc src({s.rows, s.k}, f32, memory::format_tag::ab);
  const memory::desc weights({s.k, s.n}, f32, s.transpose ? memory::format_tag::ba : memory::format_tag::ab);
  const memory::desc dst({s.rows, s.n}, f32, memory::format_tag::ab);
  return dnnl::matmul::primitive_desc(cpu_engine(), src, weights, dst, attr);
}

struct Plan {
  explicit Plan(const Shape& s) : shape(s), pd(make_pd(s)), primitive(pd) { note_kernel(pd); }
  Shape shape;
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul primitive;
};

// One thread's blocks: block b of x's rows into out's, through a stream, a scratchpad and memory objects of its own.
class BlockRunner {
 public:
  BlockRunner(const Plan& p, const float* x, const float* w, float* out, int64_t m)
      : p_(p),
        x_(x),
        out_(out),
        m_(m),
        stream_(cpu_engine()),
        src_(p.pd.src_desc(), cpu_engine(), DNNL_MEMORY_NONE),
        weights_(p.pd.weights_desc(), cpu_engine(), const_cast<float*>(w)),
        dst_(p.pd.dst_desc(), cpu_engine(), DNNL_MEMORY_NONE),
        scratchpad_(p.pd.scratchpad_desc(), cpu_engine()) {
    args_ = {{DNNL_ARG_SRC, src_}, {DNNL_ARG_WEIGHTS, weights_}, {DNNL_ARG_DST, dst_},
             {DNNL_ARG_SCRATCHPAD, scratchpad_}};
  }

  void run(int64_t b) {
    const Shape& s = p_.shape;
    const int64_t first = b * s.rows, count = std::min(s.rows, m_ - first);
    if (count == s.rows) {
      src_.set_data_handle(const_cast<float*>(x_ + first * s.k));
      dst_.set_data_handle(out_ + first * s.n);
      execute();
      return;
    }
    std::vector<float> padded_x(s.rows * s.k, 0.0f), padded_out(s.rows * s.n);  // the short last block
    std::copy(x_ + first * s.k, x_ + (first + count) * s.k, padded_x.begin());
    src_.set_data_handle(padded_x.data());
    dst_.set_data_handle(padded_out.data());
    execute();
    std::copy(padded_out.begin(), padded_out.begin() + count * s.n, out_ + first * s.n);
  }

 private:
  void execute() {
    p_.primitive.execute(stream_, args_);
    stream_.wait();
  }
  const Plan& p_;
  const float* x_;
  float* out_;
  int64_t m_;
  dnnl::stream stream_;
  memory src_, weights_, dst_, scratchpad_;
  std::unordered_map<int, memory> args_;
};

constexpr int64_t kSharedFrom = 65536;  // weights of at least this many values share their work

// The number of the process's OpenMP threads a product of k by n weights shares its `parts` parts among: 1 for a
// small one, which runs on the calling thread, where waking the team costs more than it saves (mnist_cnn's 980 by
// 10 layer, 64 rows: 0.021 ms on one thread, 0.043 shared by 2; scripts/rows_product.py).
int64_t sharing_threads(const Team& team, int64_t k, int64_t n, int64_t parts) {
  return team.usable() && k * n >= kSharedFrom ? std::min<int64_t>(team.max_threads(), parts) : 1;
}

// out = x @ w (w [n, k] where transpose, else [k, n]), m rows, one block of `rows` at a time (see the top).
void rows_product(const float* x, const float* w, float* out, int64_t m, int64_t k, int64_t n, bool transpose,
                  int64_t rows, const char* op) {
  if (m == 0) return;
  static PlanCache<Shape, Plan> plans;
  const Shape shape{rows, k, n, transpose};
  const auto plan = plans.find_or_make(shape, true, [&] { return std::make_shared<const Plan>(shape); });
  const int64_t blocks = (m + rows - 1) / rows;
  const Team& team = Team::get();
  team.share(sharing_threads(team, k, n, blocks), blocks, op, [&](int64_t first, int64_t last) {
    const OpenMPThreads one(1);  // a kernel that asks for threads inside gets this one
    BlockRunner runner(*plan, x, w, out, m);
    for (int64_t b = first; b < last; ++b) runner.run(b);
  });
}

void check_2d_float(const paddle::Tensor& t, const char* op, const char* what) {
  PD_CHECK(t.is_cpu() && t.dtype() == paddle::DataType::FLOAT32 && t.shape().size() == 2, op, ": ", what,
           " must be a 2-D float32 CPU tensor");
}

std::vector<paddle::Tensor> RowsMatmul(const paddle::Tensor& x, const paddle::Tensor& w, bool transpose_y,
                                       int rows) {
  check_2d_float(x, "onednn_rows_matmul", "x");
  check_2d_float(w, "onednn_rows_matmul", "w");
  PD_CHECK(rows >= 1, "onednn_rows_matmul: rows must be 1 or more, not ", rows);
  const int64_t m = x.shape()[0], k = x.shape()[1];
  const int64_t n = transpose_y ? w.shape()[0] : w.shape()[1];
  PD_CHECK((transpose_y ? w.shape()[1] : w.shape()[0]) == k, "onednn_rows_matmul: x has ", k,
           " columns, w does not take them");
  auto out = paddle::empty({m, n}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  rows_product(x.data<float>(), w.data<float>(), out.data<float>(), m, k, n, transpose_y, rows,
               "onednn_rows_matmul");
  return {out};
}

// Eight doubles, as GCC's vector extension lowers them for the processor the clone is for (one AVX-512 register,
// two AVX2 ones, four SSE2 ones); loaded from and stored to any double's address.
typedef double Lanes __attribute__((vector_size(64), aligned(8)));
constexpr int64_t kLanes = 8;
constexpr int64_t kTileOutputs = 4;          // a tile's outputs (columns of the weights' gradient) ...
constexpr int64_t kTileVectors = 4;          // ... by its inputs, in vectors of kLanes: 16 sums, held in registers
constexpr int64_t kTileInputs = kTileVectors * kLanes;

// The weights' gradient x^T @ grad_out as a product a^T @ b of two operands in double, each [m, ...], padded
// with zeros to whole tiles: a's columns are broadcast, b's run in vectors. With n of at least kTileInputs outputs, a
// is x and b grad_out, and the product is the gradient itself, [k, n]; with fewer, a is grad_out and b x, and the
// product is its transpose, [n, k] (a tile then runs whole vectors, not mostly zeros). A float32 times a float32 is
// exact in double, so a fused multiply-add rounds as a multiply then an add would: each clone below gives the same
// bits, and each sum adds the rows in their order whatever the tiles and threads.
//
// Both are packed as the tiles read them: a in panels of kTileOutputs columns, b in panels of kTileInputs, each
// panel its m rows one after another, so a tile's loop over the rows reads two contiguous runs. Read in place, the
// rows of b lie n doubles apart (4 KB for cifar_cnn's 512 outputs), all on the same few sets of the L1 cache:
// the 1,600 by 512 layer's weights' and bias's gradients, 64 rows, took 1.48 ms so on one thread, 0.91 packed
// (0.83 and 0.53 on two; AMD EPYC with AVX-512, 2026-11-30).
struct Operands {
  Operands(const float* x, const float* g, int64_t m, int64_t k, int64_t n)
      : m(m), transposed(n < kTileInputs) {
    const float *a_data = transposed ? g : x, *b_data = transposed ? x : g;
    a_cols = transposed ? n : k;
    b_cols = transposed ? k : n;
    a_padded = (a_cols + kTileOutputs - 1) / kTileOutputs * kTileOutputs;
    b_padded = (b_cols + kTileInputs - 1) / kTileInputs * kTileInputs;
    a = pack(a_data, m, a_cols, a_padded, kTileOutputs);
    b = pack(b_data, m, b_cols, b_padded, kTileInputs);
  }
  // data [m, cols] in panels of `width` columns, panel after panel, each [m, width], zeros past cols.
  static std::vector<double> pack(const float* data, int64_t m, int64_t cols, int64_t padded, int64_t width) {
    std::vector<double> packed(m * padded, 0.0);
    double* out = packed.data();
    for (int64_t c0 = 0; c0 < padded; c0 += width) {
      const int64_t count = std::min(width, cols - c0);  // the panel's columns that hold values
      for (int64_t r = 0; r < m; ++r, out += width) {
        const float* row = data + r * cols + c0;
        for (int64_t c = 0; c < count; ++c) out[c] = row[c];
      }
    }
    return packed;
  }
  const double* a_panel(int64_t tile) const { return a.data() + tile * m * kTileOutputs; }
  const double* b_panel(int64_t j0) const { return b.data() + j0 * m; }  // j0: the panel's first column
  int64_t m;
  bool transposed;
  int64_t a_cols, b_cols, a_padded, b_padded;
  std::vector<double> a, b;
};

// The rows of tiles first_tile to last_tile - 1 of a^T @ b ([a_padded, b_padded]) into out, from its start: row i,
// column j, the sum over the rows r, in their order, of a[r, i] * b[r, j]. Each panel of b is read by every tile of
// a in turn, from the L1 cache (m by kTileInputs doubles: 16 KB for 64 rows).
__attribute__((target_clones("avx512f", "avx2", "default"))) void product_rows(const Operands& p, int64_t first_tile,
                                                                                 int64_t last_tile, double* out) {
  for (int64_t j0 = 0; j0 < p.b_padded; j0 += kTileInputs) {
    const Lanes* b_panel = reinterpret_cast<const Lanes*>(p.b_panel(j0));
    for (int64_t tile = first_tile; tile < last_tile; ++tile) {
      const double* a_panel = p.a_panel(tile);
      Lanes acc[kTileOutputs][kTileVectors] = {};
      for (int64_t r = 0; r < p.m; ++r) {
        const double* ar = a_panel + r * kTileOutputs;
        const Lanes* br = b_panel + r * kTileVectors;
#pragma GCC unroll 4
        for (int64_t o = 0; o < kTileOutputs; ++o) {
#pragma GCC unroll 4
          for (int64_t v = 0; v < kTileVectors; ++v) acc[o][v] += br[v] * ar[o];
        }
      }
      const int64_t i0 = (tile - first_tile) * kTileOutputs;
#pragma GCC unroll 4
      for (int64_t o = 0; o < kTileOutputs; ++o) {
        Lanes* row = reinterpret_cast<Lanes*>(out + (i0 + o) * p.b_padded + j0);
#pragma GCC unroll 4
        for (int64_t v = 0; v < kTileVectors; ++v) row[v] = acc[o][v];
      }
    }
  }
}

// to[i] = from[i] rounded to float32, for i below count.
__attribute__((target_clones("avx512f", "avx2", "default"))) void round_into(const double* from, int64_t count,
                                                                               float* to) {
  for (int64_t i = 0; i < count; ++i) to[i] = static_cast<float>(from[i]);
}

// A dense layer's backward pass for network/exact.py: x [m, k] its input, w [k, n] its weights, grad_out [m, n].
// The input's gradient grad_out @ w^T in float32, `rows` rows at a time as onednn_rows_matmul gives it (zeros
// where input_grad is false); the weights' gradient x^T @ grad_out [k, n] and the bias's, grad_out's column sums,
// each summed over the rows in their order in double, and each rounded to float32 once: one operator for what took
// seven of Paddle's (two casts to float64, a float64 product, a sum, two casts back and the rows product).
std::vector<paddle::Tensor> DenseBackward(const paddle::Tensor& x, const paddle::Tensor& w,
                                        const paddle::Tensor& grad_out, bool input_grad, int rows) {
  const char* op = "onednn_dense_backward";
  check_2d_float(x, op, "x");
  check_2d_float(w, op, "w");
  check_2d_float(grad_out, op, "the output's gradient");
  PD_CHECK(rows >= 1, op, ": rows must be 1 or more, not ", rows);
  const int64_t m = x.shape()[0], k = x.shape()[1], n = w.shape()[1];
  PD_CHECK(w.shape()[0] == k && grad_out.shape()[0] == m && grad_out.shape()[1] == n, op, ": x [", m, ", ", k,
           "], w [", w.shape()[0], ", ", n, "] and the output's gradient [", grad_out.shape()[0], ", ",
           grad_out.shape()[1], "] do not fit");
  const auto f32 = paddle::DataType::FLOAT32, f64 = paddle::DataType::FLOAT64;
  auto grad_x = input_grad ? paddle::empty({m, k}, f32, paddle::CPUPlace())
                           : paddle::full({m, k}, 0.0, f32, paddle::CPUPlace());
  if (input_grad) rows_product(grad_out.data<float>(), w.data<float>(), grad_x.data<float>(), m, n, k, true, rows, op);
  auto grad_w = paddle::empty({k, n}, f64, paddle::CPUPlace());
  auto grad_w32 = paddle::empty({k, n}, f32, paddle::CPUPlace());
  auto grad_b = paddle::empty({n}, f64, paddle::CPUPlace());
  auto grad_b32 = paddle::empty({n}, f32, paddle::CPUPlace());
  const float* g = grad_out.data<float>();
  const Operands operands(x.data<float>(), g, m, k, n);
  double* w64 = grad_w.data<double>();
  const bool in_place = !operands.transposed && operands.b_padded == n;  // the product is the gradient: no copy
  std::vector<double> product(in_place ? 0 : operands.a_padded * operands.b_padded);
  double* out = in_place ? w64 : product.data();
  // the padded rows of a (x's last columns) past k: written to a scratch tile, not past the gradient's end
  const int64_t whole = in_place ? k / kTileOutputs : operands.a_padded / kTileOutputs;
  const Team& team = Team::get();
  team.share(sharing_threads(team, k, n, whole), whole, op, [&](int64_t first, int64_t last) {
    product_rows(operands, first, last, out + first * kTileOutputs * operands.b_padded);
  });
  if (in_place && whole * kTileOutputs < k) {
    std::vector<double> last(kTileOutputs * operands.b_padded);
    product_rows(operands, whole, whole + 1, last.data());
    std::copy(last.begin(), last.begin() + (k - whole * kTileOutputs) * n, w64 + whole * kTileOutputs * n);
  }
  if (!in_place) {
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        w64[i * n + j] = operands.transposed ? product[j * operands.b_padded + i] : product[i * operands.b_padded + j];
      }
    }
  }
  round_into(w64, k * n, grad_w32.data<float>());
  double* b64 = grad_b.data<double>();
  float* b32 = grad_b32.data<float>();
  for (int64_t j = 0; j < n; ++j) b64[j] = 0.0;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < n; ++j) b64[j] += g[r * n + j];
  }
  for (int64_t j = 0; j < n; ++j) b32[j] = static_cast<float>(b64[j]);
  return {grad_x, grad_w, grad_b, grad_w32, grad_b32};
}

std::vector<std::vector<int64_t>> DenseBackwardShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                                    const std::vector<int64_t>& grad_out) {
  return {x, w, {w.back()}, w, {w.back()}};
}

std::vector<paddle::DataType> DenseBackwardDtype(const paddle::DataType& x, const paddle::DataType& w,
                                               const paddle::DataType& grad_out) {
  const auto f32 = paddle::DataType::FLOAT32, f64 = paddle::DataType::FLOAT64;
  return {f32, f64, f64, f32, f32};
}

std::vector<std::vector<int64_t>> RowsMatmulShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                                   bool transpose_y, int) {
  PD_CHECK(x.size() == 2 && w.size() == 2, "onednn_rows_matmul: x and w must have 2 dimensions");
  return {{x[0], transpose_y ? w[0] : w[1]}};
}

}  // namespace

PD_BUILD_OP(onednn_rows_matmul)
    .Inputs({"X", "W"})
    .Outputs({"Out"})
    .Attrs({"transpose_y: bool", "rows: int"})
    .SetKernelFn(PD_KERNEL(RowsMatmul))
    .SetInferShapeFn(PD_INFER_SHAPE(RowsMatmulShape));


PD_BUILD_OP(onednn_dense_backward)
    .Inputs({"X", "W", "GradOut"})
    .Outputs({"GradX", "GradW", "GradB", "GradW32", "GradB32"})
    .Attrs({"input_grad: bool", "rows: int"})
    .SetKernelFn(PD_KERNEL(DenseBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(DenseBackwardShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(DenseBackwardDtype));
