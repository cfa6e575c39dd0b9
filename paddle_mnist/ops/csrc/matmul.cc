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

constexpr int64_t kSharedFrom = 65536;  // weights of at least this many values share their blocks

std::vector<paddle::Tensor> RowsMatmul(const paddle::Tensor& x, const paddle::Tensor& w, bool transpose_y,
                                       int rows) {
  PD_CHECK(x.is_cpu() && w.is_cpu(), "onednn_rows_matmul: x and w must be on the CPU");
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && w.dtype() == paddle::DataType::FLOAT32,
           "onednn_rows_matmul: x and w must be float32");
  PD_CHECK(x.shape().size() == 2 && w.shape().size() == 2, "onednn_rows_matmul: x and w must have 2 dimensions");
  PD_CHECK(rows >= 1, "onednn_rows_matmul: rows must be 1 or more, not ", rows);
  const int64_t m = x.shape()[0], k = x.shape()[1];
  const int64_t n = transpose_y ? w.shape()[0] : w.shape()[1];
  PD_CHECK((transpose_y ? w.shape()[1] : w.shape()[0]) == k, "onednn_rows_matmul: x has ", k,
           " columns, w does not take them");
  auto out = paddle::empty({m, n}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  if (m == 0) return {out};
  static PlanCache<Shape, Plan> plans;
  const Shape shape{rows, k, n, transpose_y};
  const auto plan = plans.find_or_make(shape, true, [&] { return std::make_shared<const Plan>(shape); });
  const float* x_data = x.data<float>();
  const float* w_data = w.data<float>();
  float* out_data = out.data<float>();
  const int64_t blocks = (m + rows - 1) / rows;
  const Team& team = Team::get();
  // a small product on the calling thread: waking the team costs more than it saves (mnist_cnn's 980 by 10 layer,
  // 64 rows: 0.021 ms on one thread, 0.043 shared by 2; scripts/rows_product.py)
  const bool small = k * n < kSharedFrom;
  const int64_t threads = team.usable() && !small ? std::min<int64_t>(team.max_threads(), blocks) : 1;
  if (threads <= 1) {
    const OpenMPThreads one(1);
    BlockRunner runner(*plan, x_data, w_data, out_data, m);
    for (int64_t b = 0; b < blocks; ++b) runner.run(b);
    return {out};
  }
  const std::string failure = team.run(static_cast<int>(threads), [&](int64_t t, int64_t team_size) {
    const OpenMPThreads one(1);  // a kernel that asks for threads inside gets this one
    BlockRunner runner(*plan, x_data, w_data, out_data, m);
    for (int64_t b = blocks * t / team_size; b < blocks * (t + 1) / team_size; ++b) runner.run(b);
  });
  PD_CHECK(failure.empty(), "onednn_rows_matmul: ", failure);
  return {out};
}

std::vector<std::vector<int64_t>> RowsMatmulShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                                   bool transpose_y, int) {
  PD_CHECK(x.size() == 2 && w.size() == 2, "onednn_rows_matmul: x and w must have 2 dimensions");
  return {{x[0], transpose_y ? w[0] : w[1]}};
}

// Eight doubles, as GCC's vector extension lowers them for the processor the clone is for (one AVX-512 register,
// two AVX2 ones, four SSE2 ones); loaded from and stored to any double's address.
typedef double Lanes __attribute__((vector_size(64), aligned(8)));

}  // namespace

PD_BUILD_OP(onednn_rows_matmul)
    .Inputs({"X", "W"})
    .Outputs({"Out"})
    .Attrs({"transpose_y: bool", "rows: int"})
    .SetKernelFn(PD_KERNEL(RowsMatmul))
    .SetInferShapeFn(PD_INFER_SHAPE(RowsMatmulShape));

