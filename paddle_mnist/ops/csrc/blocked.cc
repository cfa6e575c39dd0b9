// MiniGoogLeNet's and cifar_fast's training steps and evaluation in oneDNN's channel-blocked layout: Paddle custom operators with their gradient
// operators, built into one library with the convolutions of onednn_conv.cc (paddle_mnist/ops/onednn.py).
//
// oneDNN's convolution kernels run on maps blocked by channels: by 8 with AVX2 (aBcd8b: N, C/8, H, W, 8), by 16
// with AVX-512 (aBcd16b). Paddle's tensors are NCHW, so onednn_conv2d reorders its input, output and their
// gradients at every call, and batch norm and ReLU run in Paddle on one thread. Here the maps stay blocked from the
// first convolution to the global average pool, as 5-D Paddle tensors [N, C/B, H, W, B] whose plain layout is the
// blocked one, B being 8 or 16 (every width in MiniGoogLeNet is a multiple of 16). The first conv module's `block`
// attribute sets B; the other operators read it from their input. docs/performance.md has the measurements.
//
//   onednn_conv_bn_relu       conv module: convolution (with its bias), batch norm on the batch's statistics,
//                             ReLU, all by oneDNN on every thread; the input NCHW (the first module) or blocked,
//                             the output blocked, with the batch's mean and biased variance for the running averages
//   onednn_conv_relu_blocked  conv module in evaluation: the convolution with batch norm folded into its weights
//                             and bias (by the caller), ReLU as its post-op; no gradient, no plan kept
//   onednn_max_pool_blocked   max-pool of a blocked map, no padding, floor mode (the downsample modules' 3x3/2,
//                             cifar_fast's 2x2/2 and its global max-pool, a window of the whole map)
//   onednn_max_pool_relu_blocked
//                             the same, then ReLU (mnist_cnn's and cifar_cnn's blocks: relu(max) = max(relu), to
//                             the bit); 2x2 windows of stride 2 by loops of its own, branch-free
//   onednn_concat_blocked     two blocked maps joined on channels (each part holds whole blocks); its gradient is
//                             split in place from the output's
//   onednn_unblock            a blocked map as NCHW, by oneDNN's reorder, its gradient blocked again (Paddle's
//                             transpose gives a strided view, whose readers and copies go value by value)
//
// MiniGoogLeNet's global average pool is a mean over H and W (in Paddle). The primitives of a shape are kept by its first
// backward pass (PlanCache in onednn_common.h); the buffers a call needs are made for it.

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <unordered_map>
#include <vector>

#include "onednn_common.h"
#include "paddle/extension.h"

namespace {

using namespace paddle_mnist;  // NOLINT: the shared helpers of onednn_common.h

// A map of NCHW dims blocked by `block` channels: 8 or 16, or all of them (NHWC; check_map and check_conv refuse
// others).
memory::desc blocked(const Dims& dims, int64_t block) { return blocked_map(dims, block); }
memory::desc per_channel(int64_t c) { return memory::desc({c}, memory::data_type::f32, memory::format_tag::a); }

// The NCHW dims of a tensor: itself where it has 4 dimensions, [N, C/B * B, H, W] for a blocked one.
Dims logical(const std::vector<int64_t>& shape) {
  if (shape.size() == 5) return {shape[0], shape[1] * shape[4], shape[2], shape[3]};
  return {shape[0], shape[1], shape[2], shape[3]};
}

std::vector<int64_t> blocked_shape(const Dims& d, int64_t block) { return {d[0], d[1] / block, d[2], d[3], block}; }

void check_float(const paddle::Tensor& t, const char* op, const char* name) {
  PD_CHECK(t.is_cpu() && t.dtype() == paddle::DataType::FLOAT32, op, ": ", name, " must be float32 on the CPU");
}

void check_map(const paddle::Tensor& t, const char* op, const char* name) {
  check_float(t, op, name);
  const auto& s = t.shape();
  PD_CHECK(s.size() == 4 || (s.size() == 5 && valid_block(s[4], s[1] * s[4])), op, ": ", name,
           " must be NCHW or blocked by 8 or 16 channels or by all of them (N, C/B, H, W, B)");
}

paddle::Tensor empty(const std::vector<int64_t>& shape, paddle::DataType type = paddle::DataType::FLOAT32) {
  return paddle::empty(shape, type, paddle::CPUPlace());
}

memory wrap(const memory::desc& d, const paddle::Tensor& t) {
  return memory(d, cpu_engine(), const_cast<void*>(static_cast<const void*>(t.data<float>())));
}

// ---- convolution, batch norm, ReLU ----

struct ModuleShape {
  Dims src, weights, dst, strides, pad_left, pad_right;
  bool blocked_src;
  float epsilon;
  int64_t block;  // of the output, and of the input where it is blocked
  bool operator<(const ModuleShape& o) const {
    return std::tie(src, weights, dst, strides, pad_left, pad_right, blocked_src, epsilon, block) <
           std::tie(o.src, o.weights, o.dst, o.strides, o.pad_left, o.pad_right, o.blocked_src, o.epsilon, o.block);
  }
  int64_t channels() const { return weights[0]; }
};

ModuleShape module_shape(const std::vector<int64_t>& x, const std::vector<int64_t>& w, int stride, int padding,
                         float epsilon, int block) {
  const Dims src = logical(x);
  const ConvSide h = conv_side(src[2], w[2], stride, padding), v = conv_side(src[3], w[3], stride, padding);
  return {src,
          {w[0], w[1], w[2], w[3]},
          {src[0], w[0], h.out, v.out},
          {stride, stride},
          {padding, padding},
          {h.pad_right, v.pad_right},
          x.size() == 5,
          epsilon,
          block};
}

struct ModuleBackward;

// The forward primitives of one module shape, and the backward ones where it is made for training.
struct Module {
  Module(const ModuleShape& s, bool training)
      : shape(s),
        dst(blocked(s.dst, s.block)),
        src_user(s.blocked_src ? blocked(s.src, s.block) : paddle_mnist::nchw(s.src)),
        conv_pd(cpu_engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
                s.blocked_src ? src_user : any(s.src), any(s.weights), per_channel(s.channels()), dst, s.strides,
                s.pad_left, s.pad_right),
        conv(conv_pd),
        conv_src(src_user, conv_pd.src_desc()),
        conv_weights(s.weights, conv_pd.weights_desc()),
        bn_pd(cpu_engine(), dnnl::prop_kind::forward_training, dst, dst, s.epsilon,
              dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift),
        bn(bn_pd),
        relu_pd(cpu_engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::eltwise_relu, dst, dst, 0.f),
        relu(relu_pd) {
    note_kernel(conv_pd);
    if (training) make_backward();
  }

  void make_backward();  // once ModuleBackward is defined, below

  ModuleShape shape;
  memory::desc dst, src_user;
  dnnl::convolution_forward::primitive_desc conv_pd;
  dnnl::convolution_forward conv;
  Operand conv_src, conv_weights;
  dnnl::batch_normalization_forward::primitive_desc bn_pd;
  dnnl::batch_normalization_forward bn;
  dnnl::eltwise_forward::primitive_desc relu_pd;
  dnnl::eltwise_forward relu;
  std::unique_ptr<ModuleBackward> bwd;
};

dnnl::convolution_backward_weights::primitive_desc weights_primitive_with(const Module& m, const memory::desc& src) {
  const ModuleShape& s = m.shape;
  return dnnl::convolution_backward_weights::primitive_desc(
      cpu_engine(), dnnl::algorithm::convolution_direct, src, any(s.weights), per_channel(s.channels()),
      m.dst, s.strides, s.pad_left, s.pad_right, m.conv_pd);
}

// The weights' backward primitive, reading the input in the layout the forward pass read it in where a direct
// kernel does (the blocked maps; the first module's NCHW image on oneDNN 3.6), else in the one oneDNN chooses:
// for a 1-channel image in NCHW, oneDNN 3.2 has only its reference loops, 100 times slower.
dnnl::convolution_backward_weights::primitive_desc weights_primitive(const Module& m) {
  try {
    auto pd = weights_primitive_with(m, m.conv_pd.src_desc());
    if (paddle_mnist::direct(pd)) return pd;
  } catch (const dnnl::error&) {
  }
  return weights_primitive_with(m, any(m.shape.src));
}

// The backward primitives of one module shape: ReLU's from its output, batch norm's, then the convolution's
// weights (and bias) and, where the input takes a gradient, its data.
struct ModuleBackward {
  explicit ModuleBackward(const Module& m)
      : relu_pd(cpu_engine(), dnnl::algorithm::eltwise_relu_use_dst_for_bwd, m.dst, m.dst, m.dst, 0.f, m.relu_pd),
        relu(relu_pd),
        bn_pd(cpu_engine(), dnnl::prop_kind::backward, m.dst, m.dst, m.dst, m.shape.epsilon,
              dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift, m.bn_pd),
        bn(bn_pd),
        weights_pd(weights_primitive(m)),
        weights(weights_pd),
        weights_src(m.src_user, weights_pd.src_desc()),
        weights_diff(m.shape.weights, weights_pd.diff_weights_desc()),
        data_pd(cpu_engine(), dnnl::algorithm::convolution_direct,
                m.shape.blocked_src ? m.src_user : any(m.shape.src), any(m.shape.weights), m.dst,
                m.shape.strides, m.shape.pad_left, m.shape.pad_right, m.conv_pd),
        data(data_pd),
        data_weights(m.shape.weights, data_pd.weights_desc()),
        data_src(m.src_user, data_pd.diff_src_desc()) {
    note_kernel(weights_pd);
    note_kernel(data_pd);
  }

  dnnl::eltwise_backward::primitive_desc relu_pd;
  dnnl::eltwise_backward relu;
  dnnl::batch_normalization_backward::primitive_desc bn_pd;
  dnnl::batch_normalization_backward bn;
  dnnl::convolution_backward_weights::primitive_desc weights_pd;
  dnnl::convolution_backward_weights weights;
  Operand weights_src, weights_diff;
  dnnl::convolution_backward_data::primitive_desc data_pd;
  dnnl::convolution_backward_data data;
  Operand data_weights, data_src;
};

void Module::make_backward() { bwd = std::make_unique<ModuleBackward>(*this); }

// A module shape's plan: the one kept, else a new one, kept where it is made for a backward pass.
std::shared_ptr<const Module> module_for(const paddle::Tensor& x, const paddle::Tensor& w, int stride, int padding,
                                         float epsilon, int block, bool training) {
  static PlanCache<ModuleShape, Module> modules;
  const ModuleShape s = module_shape(x.shape(), w.shape(), stride, padding, epsilon, block);
  return modules.find_or_make(s, training, [&] { return std::make_shared<const Module>(s, training); });
}

constexpr const char* kModule = "onednn_conv_bn_relu";

// A blocked convolution's input, block and weight, and per-channel vectors (its bias, batch norm's scale and
// shift), as the conv module and its evaluation form take them.
void check_conv(const char* op, const paddle::Tensor& x, const paddle::Tensor& w, int block,
                std::initializer_list<const paddle::Tensor*> per_channel_vectors) {
  check_map(x, op, "x");
  PD_CHECK(block == 8 || block == 16, op, ": block must be 8 or 16, not ", block);
  PD_CHECK(x.shape().size() == 4 || x.shape()[4] == block, op, ": x is blocked by ", x.shape().back(),
           " channels, the output would be by ", block);
  check_float(w, op, "the weight");
  PD_CHECK(w.shape().size() == 4 && logical(x.shape())[1] == w.shape()[1], op,
           ": the weight must be OIHW with I the input's channels");
  const int64_t c = w.shape()[0];
  PD_CHECK(c % block == 0, op, ": the output channels (", c, ") must be a multiple of the block, ", block);
  for (const paddle::Tensor* t : per_channel_vectors) {
    check_float(*t, op, "the bias and batch norm's scale and shift");
    PD_CHECK(t->shape().size() == 1 && t->shape()[0] == c, op, ": the bias and batch norm's scale and shift ",
             "must have one value per output channel");
  }
}

void check_module(const paddle::Tensor& x, const paddle::Tensor& w, const paddle::Tensor& b,
                  const paddle::Tensor& gamma, const paddle::Tensor& beta, int block) {
  check_conv(kModule, x, w, block, {&b, &gamma, &beta});
}

std::vector<paddle::Tensor> ModuleForward(const paddle::Tensor& x, const paddle::Tensor& w, const paddle::Tensor& b,
                                          const paddle::Tensor& gamma, const paddle::Tensor& beta, int stride,
                                          int padding, float epsilon, bool input_grad, int block) {
  check_module(x, w, b, gamma, beta, block);
  const auto plan = module_for(x, w, stride, padding, epsilon, block, false);
  const Module& m = *plan;
  const int64_t c = m.shape.channels();
  auto conv_out = empty(blocked_shape(m.shape.dst, block));
  auto out = empty(blocked_shape(m.shape.dst, block));
  auto mean = empty({c});
  auto variance = empty({c});
  const memory::desc dst = m.dst;
  m.conv.execute(cpu_stream(), {{DNNL_ARG_SRC, m.conv_src.input(x.data<float>())},
                                {DNNL_ARG_WEIGHTS, m.conv_weights.input(w.data<float>())},
                                {DNNL_ARG_BIAS, wrap(per_channel(c), b)},
                                {DNNL_ARG_DST, wrap(dst, conv_out)}});
  m.bn.execute(cpu_stream(), {{DNNL_ARG_SRC, wrap(dst, conv_out)},
                              {DNNL_ARG_DST, wrap(dst, out)},
                              {DNNL_ARG_SCALE, wrap(per_channel(c), gamma)},
                              {DNNL_ARG_SHIFT, wrap(per_channel(c), beta)},
                              {DNNL_ARG_MEAN, wrap(per_channel(c), mean)},
                              {DNNL_ARG_VARIANCE, wrap(per_channel(c), variance)}});
  m.relu.execute(cpu_stream(), {{DNNL_ARG_SRC, wrap(dst, out)}, {DNNL_ARG_DST, wrap(dst, out)}});
  cpu_stream().wait();
  return {out, conv_out, mean, variance};
}

std::vector<paddle::Tensor> ModuleBackwardFn(const paddle::Tensor& x, const paddle::Tensor& w,
                                             const paddle::Tensor& b, const paddle::Tensor& gamma,
                                             const paddle::Tensor& beta, const paddle::Tensor& conv_out,
                                             const paddle::Tensor& out, const paddle::Tensor& mean,
                                             const paddle::Tensor& variance, const paddle::Tensor& grad_out,
                                             int stride, int padding, float epsilon, bool input_grad, int block) {
  check_float(grad_out, kModule, "the output's gradient");
  const auto plan = module_for(x, w, stride, padding, epsilon, block, true);
  const Module& m = *plan;
  const ModuleBackward& p = *m.bwd;
  const int64_t c = m.shape.channels();
  const memory::desc dst = m.dst;
  auto grad_w = empty(w.shape());
  auto grad_b = empty({c}), grad_gamma = empty({c}), grad_beta = empty({c});
  // the gradients of batch norm's output and of the convolution's, for this call
  memory diff_norm(dst, cpu_engine()), diff_conv(dst, cpu_engine());
  p.relu.execute(cpu_stream(),
                 {{DNNL_ARG_DST, wrap(dst, out)}, {DNNL_ARG_DIFF_DST, wrap(dst, grad_out)}, {DNNL_ARG_DIFF_SRC, diff_norm}});
  p.bn.execute(cpu_stream(), {{DNNL_ARG_SRC, wrap(dst, conv_out)},
                              {DNNL_ARG_MEAN, wrap(per_channel(c), mean)},
                              {DNNL_ARG_VARIANCE, wrap(per_channel(c), variance)},
                              {DNNL_ARG_DIFF_DST, diff_norm},
                              {DNNL_ARG_SCALE, wrap(per_channel(c), gamma)},
                              {DNNL_ARG_DIFF_SRC, diff_conv},
                              {DNNL_ARG_DIFF_SCALE, wrap(per_channel(c), grad_gamma)},
                              {DNNL_ARG_DIFF_SHIFT, wrap(per_channel(c), grad_beta)}});
  float* grad_w_data = grad_w.data<float>();
  memory diff_weights = p.weights_diff.output(grad_w_data);
  p.weights.execute(cpu_stream(), {{DNNL_ARG_SRC, p.weights_src.input(x.data<float>())},
                                   {DNNL_ARG_DIFF_DST, diff_conv},
                                   {DNNL_ARG_DIFF_WEIGHTS, diff_weights},
                                   {DNNL_ARG_DIFF_BIAS, wrap(per_channel(c), grad_b)}});
  p.weights_diff.finish(diff_weights, grad_w_data);
  paddle::Tensor grad_x;
  if (input_grad) {
    grad_x = empty(x.shape());
    float* grad_x_data = grad_x.data<float>();
    memory diff_src = p.data_src.output(grad_x_data);
    p.data.execute(cpu_stream(), {{DNNL_ARG_DIFF_DST, diff_conv},
                                  {DNNL_ARG_WEIGHTS, p.data_weights.input(w.data<float>())},
                                  {DNNL_ARG_DIFF_SRC, diff_src}});
    p.data_src.finish(diff_src, grad_x_data);
  } else {  // the network's input, which takes no gradient: nothing reads this
    grad_x = paddle::full(x.shape(), 0.0, paddle::DataType::FLOAT32, paddle::CPUPlace());
  }
  cpu_stream().wait();
  return {grad_x, grad_w, grad_b, grad_gamma, grad_beta};
}

// ---- a conv module in evaluation: batch norm folded into the convolution, ReLU as its post-op ----

// One forward-inference primitive per call (oneDNN's own primitive cache makes a repeated shape cheap): evaluation
// runs at any batch size and keeps no plan of its own.
std::vector<paddle::Tensor> InferenceForward(const paddle::Tensor& x, const paddle::Tensor& w,
                                             const paddle::Tensor& b, int stride, int padding, int block) {
  check_conv("onednn_conv_relu_blocked", x, w, block, {&b});
  const int64_t c = w.shape()[0];
  const ModuleShape s = module_shape(x.shape(), w.shape(), stride, padding, 0.f, block);
  const memory::desc dst = blocked(s.dst, block);
  const memory::desc src_user = s.blocked_src ? blocked(s.src, block) : paddle_mnist::nchw(s.src);
  dnnl::post_ops relu;
  relu.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
  dnnl::primitive_attr attr;
  attr.set_post_ops(relu);
  const dnnl::convolution_forward::primitive_desc pd(
      cpu_engine(), dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct,
      s.blocked_src ? src_user : any(s.src), any(s.weights), per_channel(c), dst, s.strides, s.pad_left,
      s.pad_right, attr);
  note_kernel(pd);
  const Operand src(src_user, pd.src_desc()), weights(s.weights, pd.weights_desc());
  auto out = empty(blocked_shape(s.dst, block));
  dnnl::convolution_forward(pd).execute(cpu_stream(), {{DNNL_ARG_SRC, src.input(x.data<float>())},
                                                       {DNNL_ARG_WEIGHTS, weights.input(w.data<float>())},
                                                       {DNNL_ARG_BIAS, wrap(per_channel(c), b)},
                                                       {DNNL_ARG_DST, wrap(dst, out)}});
  cpu_stream().wait();
  return {out};
}

std::vector<std::vector<int64_t>> InferenceInferShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                                      const std::vector<int64_t>& b, int stride, int padding,
                                                      int block) {
  const ModuleShape s = module_shape(x, w, stride, padding, 0.f, block);
  return {blocked_shape(s.dst, block)};
}

std::vector<paddle::DataType> InferenceInferDtype(const paddle::DataType& x, const paddle::DataType& w,
                                                  const paddle::DataType& b) {
  return {x};
}

// ---- max-pool of a blocked map ----

struct PoolShape {
  Dims src, dst;
  int64_t kernel, stride, block;
  bool operator<(const PoolShape& o) const {
    return std::tie(src, dst, kernel, stride, block) < std::tie(o.src, o.dst, o.kernel, o.stride, o.block);
  }
};

PoolShape pool_shape(const std::vector<int64_t>& x, int kernel, int stride) {
  const Dims src = logical(x);
  return {src, {src[0], src[1], (src[2] - kernel) / stride + 1, (src[3] - kernel) / stride + 1}, kernel, stride,
          x.back()};
}

struct Pool {
  Pool(const PoolShape& s, bool training)
      : shape(s),
        src(blocked(s.src, s.block)),
        dst(blocked(s.dst, s.block)),
        fwd_pd(cpu_engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::pooling_max, src, dst,
               {s.stride, s.stride}, {s.kernel, s.kernel}, {0, 0}, {0, 0}, {0, 0}),
        fwd(fwd_pd) {
    // the workspace (where each window's maximum was) is one byte per output, held in a uint8 tensor of the
    // output's shape
    PD_CHECK(fwd_pd.workspace_desc().get_size() == static_cast<size_t>(s.dst[0] * s.dst[1] * s.dst[2] * s.dst[3]),
             "onednn_max_pool_blocked: oneDNN's workspace is not one byte per output");
    if (!training) return;
    bwd_pd = dnnl::pooling_backward::primitive_desc(cpu_engine(), dnnl::algorithm::pooling_max, src, dst,
                                                    {s.stride, s.stride}, {s.kernel, s.kernel}, {0, 0}, {0, 0},
                                                    {0, 0}, fwd_pd);
    bwd = std::make_unique<dnnl::pooling_backward>(bwd_pd);
  }

  PoolShape shape;
  memory::desc src, dst;
  dnnl::pooling_forward::primitive_desc fwd_pd;
  dnnl::pooling_forward fwd;
  dnnl::pooling_backward::primitive_desc bwd_pd;
  std::unique_ptr<dnnl::pooling_backward> bwd;
};

std::shared_ptr<const Pool> pool_for(const paddle::Tensor& x, int kernel, int stride, bool training) {
  static PlanCache<PoolShape, Pool> pools;
  const PoolShape s = pool_shape(x.shape(), kernel, stride);
  return pools.find_or_make(s, training, [&] { return std::make_shared<const Pool>(s, training); });
}

memory workspace(const Pool& p, const paddle::Tensor& t) {
  return memory(p.fwd_pd.workspace_desc(), cpu_engine(), const_cast<uint8_t*>(t.data<uint8_t>()));
}

std::vector<paddle::Tensor> PoolForward(const paddle::Tensor& x, int kernel, int stride) {
  check_map(x, "onednn_max_pool_blocked", "x");
  PD_CHECK(x.shape().size() == 5, "onednn_max_pool_blocked: x must be blocked (N, C/B, H, W, B)");
  const auto plan = pool_for(x, kernel, stride, false);
  const Pool& p = *plan;
  auto out = empty(blocked_shape(p.shape.dst, p.shape.block));
  auto ws = empty(blocked_shape(p.shape.dst, p.shape.block), paddle::DataType::UINT8);
  p.fwd.execute(cpu_stream(), {{DNNL_ARG_SRC, wrap(p.src, x)},
                               {DNNL_ARG_DST, wrap(p.dst, out)},
                               {DNNL_ARG_WORKSPACE, workspace(p, ws)}});
  cpu_stream().wait();
  return {out, ws};
}

std::vector<paddle::Tensor> PoolBackward(const paddle::Tensor& x, const paddle::Tensor& ws,
                                         const paddle::Tensor& grad_out, int kernel, int stride) {
  check_float(grad_out, "onednn_max_pool_blocked", "the output's gradient");
  const auto plan = pool_for(x, kernel, stride, true);
  const Pool& p = *plan;
  auto grad_x = empty(x.shape());
  p.bwd->execute(cpu_stream(), {{DNNL_ARG_DIFF_DST, wrap(p.dst, grad_out)},
                                      {DNNL_ARG_DIFF_SRC, wrap(p.src, grad_x)},
                                      {DNNL_ARG_WORKSPACE, workspace(p, ws)}});
  cpu_stream().wait();
  return {grad_x};
}

// relu(max-pool): mnist_cnn's blocks and cifar_cnn's run ReLU after the pool (relu(max) = max(relu), to the bit):
// one operator for the two, forward and backward. Their pools, 2x2 of stride 2, run by the loops below
// (pool_relu_2x2), which write the gradient of each input once; other windows run by oneDNN's pooling, then ReLU.

// p[i] = y[i] > 0 ? g[i] : 0 for n values (p may be y and g: ReLU in place); both read unconditionally, so that
// each clone runs it in vectors.
__attribute__((target_clones("avx512f", "avx2", "default"))) void where_positive(const float* y, const float* g,
                                                                                   float* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float yi = y[i], gi = g[i];
    p[i] = yi > 0.0f ? gi : 0.0f;
  }
}

constexpr uint8_t kNoInput = 255;  // the mask of a window none of whose inputs takes the gradient (its maximum NaN)

// Four floats and four ints (GCC's vector extension: a comparison gives a lane mask, ?: chooses lane by lane).
typedef float F4 __attribute__((vector_size(16)));
typedef int32_t I4 __attribute__((vector_size(16)));
inline F4 load4(const float* p) {
  F4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store4(float* p, F4 v) { std::memcpy(p, &v, sizeof(v)); }

// A blocked map as planes of h x w pixels of b floats each ([N, C/B, H, W, B]: N * C/B planes; b a multiple of
// 4), its planes first to last - 1 pooled 2x2 with stride 2 (floor mode), then ReLU: y = relu(max), and mask =
// which of the window's inputs (0 to 3, row by row) the gradient goes to, the first equal to the maximum, as
// Paddle's max-pool and csrc/max_pool.cc compare: from -FLT_MAX, max = (max > v ? max : v). No branch: each lane
// chooses, four channels at a time.
__attribute__((target_clones("avx512f", "avx2", "default"))) void pool_relu_2x2(const float* x, float* y,
                                                                                  uint8_t* mask, int64_t first,
                                                                                  int64_t last, int64_t h,
                                                                                  int64_t w, int64_t b) {
  const int64_t out_h = h / 2, out_w = w / 2;
  const F4 lowest = {-FLT_MAX, -FLT_MAX, -FLT_MAX, -FLT_MAX}, zero = {0, 0, 0, 0};
  const I4 none = {kNoInput, kNoInput, kNoInput, kNoInput};
  const I4 index[4] = {{0, 0, 0, 0}, {1, 1, 1, 1}, {2, 2, 2, 2}, {3, 3, 3, 3}};
  for (int64_t p = first; p < last; ++p) {
    for (int64_t i = 0; i < out_h; ++i) {
      for (int64_t j = 0; j < out_w; ++j) {
        const float* v0 = x + ((p * h + 2 * i) * w + 2 * j) * b;
        const float* rows[4] = {v0, v0 + b, v0 + w * b, v0 + w * b + b};
        const int64_t at = ((p * out_h + i) * out_w + j) * b;
        for (int64_t k = 0; k < b; k += 4) {
          const F4 a[4] = {load4(rows[0] + k), load4(rows[1] + k), load4(rows[2] + k), load4(rows[3] + k)};
          F4 m = lowest;
          for (int q = 0; q < 4; ++q) m = m > a[q] ? m : a[q];
          I4 first = none;
          for (int q = 3; q >= 0; --q) first = a[q] == m ? index[q] : first;
          store4(y + at + k, m > zero ? m : zero);
          for (int q = 0; q < 4; ++q) mask[at + k + q] = static_cast<uint8_t>(first[q]);
        }
      }
    }
  }
}

// Its gradient: each window's output gradient (as 0 + g, Paddle's sum) to the input the mask names where the
// output is positive, 0 to every other input, the rows and columns no window covers included.
__attribute__((target_clones("avx512f", "avx2", "default"))) void unpool_relu_2x2(const float* g, const float* y,
                                                                                    const uint8_t* mask, float* gx,
                                                                                    int64_t first, int64_t last,
                                                                                    int64_t h, int64_t w, int64_t b) {
  const int64_t out_h = h / 2, out_w = w / 2;
  const F4 zero = {0, 0, 0, 0};
  for (int64_t p = first; p < last; ++p) {
    for (int64_t i = 0; i < out_h; ++i) {
      for (int64_t j = 0; j < out_w; ++j) {
        float* v0 = gx + ((p * h + 2 * i) * w + 2 * j) * b;
        float* rows[4] = {v0, v0 + b, v0 + w * b, v0 + w * b + b};
        const int64_t at = ((p * out_h + i) * out_w + j) * b;
        for (int64_t k = 0; k < b; k += 4) {
          const F4 passed = load4(y + at + k) > zero ? zero + load4(g + at + k) : zero;
          const uint8_t* m = mask + at + k;
          const I4 first = {m[0], m[1], m[2], m[3]};
          for (int q = 0; q < 4; ++q) {
            const I4 here = {q, q, q, q};
            store4(rows[q] + k, first == here ? passed : zero);
          }
        }
      }
      if (w % 2 != 0) std::fill_n(gx + ((p * h + 2 * i) * w + w - 1) * b, b, 0.0f);
      if (w % 2 != 0) std::fill_n(gx + ((p * h + 2 * i + 1) * w + w - 1) * b, b, 0.0f);
    }
    if (h % 2 != 0) std::fill_n(gx + (p * h + h - 1) * w * b, w * b, 0.0f);
  }
}

// body(first, last) over the planes 0 to planes - 1: shared among the process's OpenMP team (the threads oneDNN's
// kernels run on, already waiting) where it has more than one thread; each plane's values are the same either way.
void over_planes(int64_t planes, const char* op, const std::function<void(int64_t, int64_t)>& body) {
  const Team& team = Team::get();
  team.share(team.usable() ? std::min<int64_t>(team.max_threads(), planes) : 1, planes, op, body);
}

bool pools_2x2(const paddle::Tensor& x, int kernel, int stride) {
  return kernel == 2 && stride == 2 && x.shape().size() == 5 && x.shape()[4] % 4 == 0;
}

std::vector<paddle::Tensor> PoolReluForward(const paddle::Tensor& x, int kernel, int stride) {
  if (!pools_2x2(x, kernel, stride)) {
    std::vector<paddle::Tensor> out = PoolForward(x, kernel, stride);
    float* y = out[0].data<float>();
    where_positive(y, y, y, out[0].numel());
    return out;
  }
  check_map(x, "onednn_max_pool_relu_blocked", "x");
  const auto& s = x.shape();
  const PoolShape shape = pool_shape(s, kernel, stride);
  auto out = empty(blocked_shape(shape.dst, shape.block));
  auto mask = empty(blocked_shape(shape.dst, shape.block), paddle::DataType::UINT8);
  const float* x_data = x.data<float>();
  float* y = out.data<float>();
  uint8_t* m = mask.data<uint8_t>();
  over_planes(s[0] * s[1], "onednn_max_pool_relu_blocked", [&](int64_t first, int64_t last) {
    pool_relu_2x2(x_data, y, m, first, last, s[2], s[3], s[4]);
  });
  return {out, mask};
}

// The gradient passes where the output is positive (elsewhere 0), then back through the pool.
std::vector<paddle::Tensor> PoolReluBackward(const paddle::Tensor& x, const paddle::Tensor& ws,
                                             const paddle::Tensor& out, const paddle::Tensor& grad_out, int kernel,
                                             int stride) {
  check_float(grad_out, "onednn_max_pool_relu_blocked", "the output's gradient");
  PD_CHECK(out.numel() == grad_out.numel(), "onednn_max_pool_relu_blocked: the output's gradient has ",
           grad_out.numel(), " values for an output of ", out.numel());
  if (pools_2x2(x, kernel, stride)) {
    const auto& s = x.shape();
    auto grad_x = empty(s);
    const float* g = grad_out.data<float>();
    const float* y = out.data<float>();
    const uint8_t* m = ws.data<uint8_t>();
    float* gx = grad_x.data<float>();
    over_planes(s[0] * s[1], "onednn_max_pool_relu_blocked", [&](int64_t first, int64_t last) {
      unpool_relu_2x2(g, y, m, gx, first, last, s[2], s[3], s[4]);
    });
    return {grad_x};
  }
  auto passed = empty(grad_out.shape());
  where_positive(out.data<float>(), grad_out.data<float>(), passed.data<float>(), out.numel());
  return PoolBackward(x, ws, passed, kernel, stride);
}

// ---- two blocked maps joined on channels ----

struct Concat {
  Concat(const Dims& a, const Dims& b, int64_t block)
      : a(a),
        b(b),
        out{a[0], a[1] + b[1], a[2], a[3]},
        block(block),
        pd(cpu_engine(), blocked(out, block), 1, {blocked(a, block), blocked(b, block)}),
        join(pd),
        // the gradient's parts, read in place from the output's gradient: oneDNN's views of its first a[1]
        // channels and of the rest
        a_part(blocked(out, block).submemory_desc(a, {0, 0, 0, 0})),
        b_part(blocked(out, block).submemory_desc(b, {0, a[1], 0, 0})),
        split_a(dnnl::reorder::primitive_desc(cpu_engine(), a_part, cpu_engine(), blocked(a, block))),
        split_b(dnnl::reorder::primitive_desc(cpu_engine(), b_part, cpu_engine(), blocked(b, block))) {}

  Dims a, b, out;
  int64_t block;
  dnnl::concat::primitive_desc pd;
  dnnl::concat join;
  memory::desc a_part, b_part;
  dnnl::reorder split_a, split_b;
};

std::shared_ptr<const Concat> concat_for(const paddle::Tensor& a, const paddle::Tensor& b, bool training) {
  static PlanCache<std::tuple<Dims, Dims, int64_t>, Concat> concats;
  const auto key = std::make_tuple(logical(a.shape()), logical(b.shape()), a.shape().back());
  return concats.find_or_make(key, training, [&] {
    return std::make_shared<const Concat>(std::get<0>(key), std::get<1>(key), std::get<2>(key));
  });
}

constexpr const char* kConcat = "onednn_concat_blocked";

std::vector<paddle::Tensor> ConcatForward(const paddle::Tensor& a, const paddle::Tensor& b) {
  check_map(a, kConcat, "a");
  check_map(b, kConcat, "b");
  const auto &sa = a.shape(), &sb = b.shape();
  PD_CHECK(sa.size() == 5 && sb.size() == 5 && sa[0] == sb[0] && sa[2] == sb[2] && sa[3] == sb[3] && sa[4] == sb[4],
           kConcat, ": a and b must be blocked maps of the same batch, height, width and block");
  const auto plan = concat_for(a, b, false);
  const Concat& c = *plan;
  auto out = empty(blocked_shape(c.out, c.block));
  c.join.execute(cpu_stream(), {{DNNL_ARG_MULTIPLE_SRC, wrap(blocked(c.a, c.block), a)},
                                {DNNL_ARG_MULTIPLE_SRC + 1, wrap(blocked(c.b, c.block), b)},
                                {DNNL_ARG_DST, wrap(blocked(c.out, c.block), out)}});
  cpu_stream().wait();
  return {out};
}

std::vector<paddle::Tensor> ConcatBackward(const paddle::Tensor& a, const paddle::Tensor& b,
                                           const paddle::Tensor& grad_out) {
  check_float(grad_out, kConcat, "the output's gradient");
  const auto plan = concat_for(a, b, true);
  const Concat& c = *plan;
  auto grad_a = empty(a.shape()), grad_b = empty(b.shape());
  memory from_a = wrap(c.a_part, grad_out), to_a = wrap(blocked(c.a, c.block), grad_a);
  memory from_b = wrap(c.b_part, grad_out), to_b = wrap(blocked(c.b, c.block), grad_b);
  c.split_a.execute(cpu_stream(), from_a, to_a);
  c.split_b.execute(cpu_stream(), from_b, to_b);
  cpu_stream().wait();
  return {grad_a, grad_b};
}

// ---- shapes and types, for Paddle ----

// ---- a blocked map as NCHW ----

struct Unblock {
  Unblock(const Dims& d, int64_t block)
      : to_nchw(dnnl::reorder::primitive_desc(cpu_engine(), blocked(d, block), cpu_engine(), paddle_mnist::nchw(d))),
        to_blocked(
            dnnl::reorder::primitive_desc(cpu_engine(), paddle_mnist::nchw(d), cpu_engine(), blocked(d, block))) {}
  dnnl::reorder to_nchw, to_blocked;
};

std::shared_ptr<const Unblock> unblock_for(const paddle::Tensor& x, bool training) {
  static PlanCache<std::pair<Dims, int64_t>, Unblock> plans;
  const auto key = std::make_pair(logical(x.shape()), x.shape().back());
  return plans.find_or_make(key, training, [&] { return std::make_shared<const Unblock>(key.first, key.second); });
}

constexpr const char* kUnblock = "onednn_unblock";

std::vector<paddle::Tensor> UnblockForward(const paddle::Tensor& x) {
  check_map(x, kUnblock, "x");
  PD_CHECK(x.shape().size() == 5, kUnblock, ": x must be blocked (N, C/B, H, W, B)");
  const auto plan = unblock_for(x, false);
  const Dims d = logical(x.shape());
  auto out = empty({d[0], d[1], d[2], d[3]});
  memory from = wrap(blocked(d, x.shape().back()), x), to = wrap(paddle_mnist::nchw(d), out);
  plan->to_nchw.execute(cpu_stream(), from, to);
  cpu_stream().wait();
  return {out};
}

std::vector<paddle::Tensor> UnblockBackward(const paddle::Tensor& x, const paddle::Tensor& grad_out) {
  check_float(grad_out, kUnblock, "the output's gradient");
  const auto plan = unblock_for(x, true);
  const Dims d = logical(x.shape());
  auto grad_x = empty(x.shape());
  memory from = wrap(paddle_mnist::nchw(d), grad_out), to = wrap(blocked(d, x.shape().back()), grad_x);
  plan->to_blocked.execute(cpu_stream(), from, to);
  cpu_stream().wait();
  return {grad_x};
}

std::vector<std::vector<int64_t>> UnblockInferShape(const std::vector<int64_t>& x) {
  const Dims d = logical(x);
  return {{d[0], d[1], d[2], d[3]}};
}

std::vector<paddle::DataType> UnblockInferDtype(const paddle::DataType& x) { return {x}; }

std::vector<std::vector<int64_t>> ModuleInferShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                                   const std::vector<int64_t>& b, const std::vector<int64_t>& gamma,
                                                   const std::vector<int64_t>& beta, int stride, int padding,
                                                   float epsilon, bool input_grad, int block) {
  const ModuleShape s = module_shape(x, w, stride, padding, epsilon, block);
  const auto out = blocked_shape(s.dst, block);
  return {out, out, {s.channels()}, {s.channels()}};
}

std::vector<paddle::DataType> ModuleInferDtype(const paddle::DataType& x, const paddle::DataType& w,
                                               const paddle::DataType& b, const paddle::DataType& gamma,
                                               const paddle::DataType& beta) {
  return {x, x, x, x};
}

std::vector<std::vector<int64_t>> PoolInferShape(const std::vector<int64_t>& x, int kernel, int stride) {
  const PoolShape s = pool_shape(x, kernel, stride);
  const auto out = blocked_shape(s.dst, s.block);
  return {out, out};
}

std::vector<paddle::DataType> PoolInferDtype(const paddle::DataType& x) { return {x, paddle::DataType::UINT8}; }

std::vector<std::vector<int64_t>> ConcatInferShape(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  return {{a[0], a[1] + b[1], a[2], a[3], a[4]}};
}

std::vector<paddle::DataType> ConcatInferDtype(const paddle::DataType& a, const paddle::DataType& b) { return {a}; }

}  // namespace

PD_BUILD_OP(onednn_conv_bn_relu)
    .Inputs({"X", "W", "B", "Gamma", "Beta"})
    .Outputs({"Out", "Conv", "Mean", "Variance"})
    .Attrs({"stride: int", "padding: int", "epsilon: float", "input_grad: bool", "block: int"})
    .SetKernelFn(PD_KERNEL(ModuleForward))
    .SetInferShapeFn(PD_INFER_SHAPE(ModuleInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ModuleInferDtype));

PD_BUILD_GRAD_OP(onednn_conv_bn_relu)
    .Inputs({"X", "W", "B", "Gamma", "Beta", "Conv", "Out", "Mean", "Variance", paddle::Grad("Out")})
    .Outputs({paddle::Grad("X"), paddle::Grad("W"), paddle::Grad("B"), paddle::Grad("Gamma"), paddle::Grad("Beta")})
    .Attrs({"stride: int", "padding: int", "epsilon: float", "input_grad: bool", "block: int"})
    .SetKernelFn(PD_KERNEL(ModuleBackwardFn));

PD_BUILD_OP(onednn_conv_relu_blocked)
    .Inputs({"X", "W", "B"})
    .Outputs({"Out"})
    .Attrs({"stride: int", "padding: int", "block: int"})
    .SetKernelFn(PD_KERNEL(InferenceForward))
    .SetInferShapeFn(PD_INFER_SHAPE(InferenceInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(InferenceInferDtype));

PD_BUILD_OP(onednn_max_pool_blocked)
    .Inputs({"X"})
    .Outputs({"Out", "Workspace"})
    .Attrs({"kernel: int", "stride: int"})
    .SetKernelFn(PD_KERNEL(PoolForward))
    .SetInferShapeFn(PD_INFER_SHAPE(PoolInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PoolInferDtype));

PD_BUILD_GRAD_OP(onednn_max_pool_blocked)
    .Inputs({"X", "Workspace", paddle::Grad("Out")})
    .Outputs({paddle::Grad("X")})
    .Attrs({"kernel: int", "stride: int"})
    .SetKernelFn(PD_KERNEL(PoolBackward));

PD_BUILD_OP(onednn_max_pool_relu_blocked)
    .Inputs({"X"})
    .Outputs({"Out", "Workspace"})
    .Attrs({"kernel: int", "stride: int"})
    .SetKernelFn(PD_KERNEL(PoolReluForward))
    .SetInferShapeFn(PD_INFER_SHAPE(PoolInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PoolInferDtype));

PD_BUILD_GRAD_OP(onednn_max_pool_relu_blocked)
    .Inputs({"X", "Workspace", "Out", paddle::Grad("Out")})
    .Outputs({paddle::Grad("X")})
    .Attrs({"kernel: int", "stride: int"})
    .SetKernelFn(PD_KERNEL(PoolReluBackward));

PD_BUILD_OP(onednn_concat_blocked)
    .Inputs({"A", "B"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(ConcatForward))
    .SetInferShapeFn(PD_INFER_SHAPE(ConcatInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ConcatInferDtype));

PD_BUILD_GRAD_OP(onednn_concat_blocked)
    .Inputs({"A", "B", paddle::Grad("Out")})
    .Outputs({paddle::Grad("A"), paddle::Grad("B")})
    .SetKernelFn(PD_KERNEL(ConcatBackward));

PD_BUILD_OP(onednn_unblock)
    .Inputs({"X"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(UnblockForward))
    .SetInferShapeFn(PD_INFER_SHAPE(UnblockInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(UnblockInferDtype));

PD_BUILD_GRAD_OP(onednn_unblock)
    .Inputs({"X", paddle::Grad("Out")})
    .Outputs({paddle::Grad("X")})
    .SetKernelFn(PD_KERNEL(UnblockBackward));
