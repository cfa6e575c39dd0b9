// A 2-D convolution (no dilation, one group) on float32 NCHW CPU tensors, run by oneDNN: Paddle custom operators
// with their gradient operators, so dygraph autograd and DataParallel treat them as any other operator.
// onednn_conv2d has no bias; onednn_conv2d_bias adds one per output channel inside oneDNN's kernel, and its
// gradient comes out of the same pass as the weights' (oneDNN's backward-weights primitive sums it there).
//
// paddle_mnist/ops/onednn.py builds this file, with blocked.cc and max_pool.cc, into one library (cpu_ops) once
// per machine and Paddle version against the libdnnl.so.3 that Paddle's CPU wheel ships, and ops/fastpath.py uses
// it in place of F.conv2d for training on the CPU. oneDNN picks the memory layouts its kernels run fastest in
// (blocked by 8 or 16 channels); Paddle's NCHW buffers are reordered into them and back around each call, through
// buffers made for the call. The primitives and the reorders of a shape are kept by its first backward pass
// (PlanCache), so a training step only executes them; a forward pass without one (evaluation) makes them for its
// call.

#include <algorithm>
#include <cstdlib>

#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <unordered_map>
#include <vector>

#include "onednn_common.h"
#include "paddle/extension.h"

namespace {

using namespace paddle_mnist;  // NOLINT: the shared helpers of onednn_common.h

struct Geometry {
  Dims src, weights, dst, strides, pad_left, pad_right;
  bool bias;
  bool serial = false;  // the weights' gradient of each image on one thread (WeightsByImage)
  // how Paddle holds the input and the output (and their gradients): NCHW (0), or blocked by 8 or 16 channels or
  // by all of them (NHWC), a 5-D tensor [N, C/B, H, W, B] (user_map): a network that keeps its maps so between
  // convolutions
  int64_t src_block = 0, dst_block = 0;
  // the layout of the maps (input, output and their gradients): any (oneDNN's choice) or nhwc (maps_layout); not
  // part of the key, since it follows from the rest
  memory::format_tag maps = memory::format_tag::any;
  bool operator<(const Geometry& other) const {
    return std::tie(src, weights, dst, strides, pad_left, pad_right, bias, serial, src_block, dst_block) <
           std::tie(other.src, other.weights, other.dst, other.strides, other.pad_left, other.pad_right, other.bias,
                    other.serial, other.src_block, other.dst_block);
  }
  Dims bias_dims() const { return {weights[0]}; }
};

// A map of g (dims: its input's or its output's) in g's layout.
memory::desc maps(const Geometry& g, const Dims& dims) {
  return memory::desc(dims, memory::data_type::f32, g.maps);
}

// A map of g as Paddle holds it: NCHW (block 0) or blocked by `block` channels (blocked_map). An NCHW map of one
// channel is NHWC too: so described where g's maps are NHWC, it needs no reorder.
memory::desc user_map(const Geometry& g, const Dims& dims, int64_t block) {
  if (block != 0) return blocked_map(dims, block);
  return dims[1] == 1 && g.maps == memory::format_tag::nhwc ? maps(g, dims) : nchw(dims);
}

// Whether a map of `channels` is held NHWC ([N, 1, H, W, C]), blocked by all its channels, not by oneDNN's 8 or 16.
bool held_nhwc(int64_t block, int64_t channels) { return block == channels && block != 8 && block != 16; }

memory::desc bias_desc(const Geometry& g) {
  return memory::desc(g.bias_dims(), memory::data_type::f32, memory::format_tag::a);
}

// What oneDNN would otherwise refuse by aborting the process (a dnnl::error) or a division by a zero stride: the
// input's channels against the weight's, the stride, the padding, and an output of at least one pixel a side.
// Checked here, where the kernels and the shape inference both start.
void check_geometry(const std::vector<int64_t>& x, const std::vector<int64_t>& w, int stride, int padding) {
  PD_CHECK(x[1] == w[1], "onednn_conv2d: x has ", x[1], " channels, the weight takes ", w[1]);
  PD_CHECK(stride >= 1, "onednn_conv2d: the stride must be 1 or more, not ", stride);
  PD_CHECK(padding >= 0, "onednn_conv2d: the padding must be 0 or more, not ", padding);
  PD_CHECK(x[2] + 2 * padding >= w[2] && x[3] + 2 * padding >= w[3], "onednn_conv2d: no output: the ", w[2], "x",
           w[3], " kernel is larger than the input with its padding, ", x[2] + 2 * padding, "x", x[3] + 2 * padding);
}

// The geometry of a convolution of x (NCHW, or blocked [N, C/B, H, W, B]) whose output is blocked by dst_block
// channels (0: NCHW).
Geometry geometry(const std::vector<int64_t>& shape, const std::vector<int64_t>& w, int stride, int padding,
                  bool bias, int64_t dst_block = 0) {
  PD_CHECK(shape.size() == 4 || shape.size() == 5, "onednn_conv2d: x must have 4 dimensions (or 5, blocked)");
  PD_CHECK(w.size() == 4, "onednn_conv2d: the weight must have 4 dimensions");
  const int64_t src_block = shape.size() == 5 ? shape[4] : 0;
  const std::vector<int64_t> x = {shape[0], shape[1] * (src_block ? src_block : 1), shape[2], shape[3]};
  check_geometry(x, w, stride, padding);
  for (const auto& [b, c] : {std::pair<int64_t, int64_t>{src_block, x[1]}, {dst_block, w[0]}}) {
    PD_CHECK(b == 0 || valid_block(b, c), "onednn_conv2d: maps are blocked by 8 or 16 channels or by all of them, ",
             "not by ", b, " of ", c);
  }
  PD_CHECK(dst_block == 0 || w[0] % dst_block == 0, "onednn_conv2d: ", w[0], " output channels do not fill blocks of ",
           dst_block);
  const ConvSide h = conv_side(x[2], w[2], stride, padding), v = conv_side(x[3], w[3], stride, padding);
  Geometry g{{x[0], x[1], x[2], x[3]}, {w[0], w[1], w[2], w[3]}, {x[0], w[0], h.out, v.out},
             {stride, stride},        {padding, padding},        {h.pad_right, v.pad_right},
             bias};
  g.src_block = src_block;
  g.dst_block = dst_block;
  return g;
}

// The shape of the output as Paddle holds it.
std::vector<int64_t> output_shape(const Geometry& g) {
  const Dims& d = g.dst;
  if (g.dst_block == 0) return {d[0], d[1], d[2], d[3]};
  return {d[0], d[1] / g.dst_block, d[2], d[3], g.dst_block};
}

dnnl::convolution_backward_weights::primitive_desc weights_primitive_with(
    const Geometry& g, const memory::desc& src, const dnnl::convolution_forward::primitive_desc& hint) {
  using dnnl::convolution_backward_weights;
  const auto direct = dnnl::algorithm::convolution_direct;
  if (g.bias) {
    return convolution_backward_weights::primitive_desc(cpu_engine(), direct, src, any(g.weights), bias_desc(g),
                                                        maps(g, g.dst), g.strides, g.pad_left, g.pad_right, hint);
  }
  return convolution_backward_weights::primitive_desc(cpu_engine(), direct, src, any(g.weights), maps(g, g.dst),
                                                      g.strides, g.pad_left, g.pad_right, hint);
}

// The weights' backward primitive. Offered the input in the layout the forward pass chose, oneDNN has a kernel for
// a network's first convolution (few input channels) that reads it as Paddle holds it (NCHW); left to choose, it
// picks the layout blocked by 8 channels, pads 1 channel to 8 and does 8 times the work (docs/performance.md,
// "The first layer's weight gradient"). Where that layout has no direct kernel, only im2col and a GEMM (the oneDNN 3.2
// of Paddle 2.6) or the reference one, which loops element by element, oneDNN chooses.
dnnl::convolution_backward_weights::primitive_desc weights_primitive(
    const Geometry& g, const dnnl::convolution_forward::primitive_desc& hint) {
  try {
    auto pd = weights_primitive_with(g, hint.src_desc(), hint);
    if (paddle_mnist::direct(pd)) return pd;
  } catch (const dnnl::error&) {
  }
  return weights_primitive_with(g, maps(g, g.src), hint);
}

// The geometry of one image of g's batch.
Geometry one_image(Geometry g) {
  g.src[0] = g.dst[0] = 1;
  return g;
}

// The layouts a map of one image may take in the weights' backward pass: each keeps an image's values together, so
// image i of a batch in it starts i images' size in, and a batch in it is a run of images, one after another.
const memory::format_tag kImageLayouts[] = {memory::format_tag::nchw, memory::format_tag::nChw16c,
                                             memory::format_tag::nChw8c, memory::format_tag::nhwc};

// The layout of kImageLayouts that d (dims of one image) is in; nchw where it is in none of them.
memory::format_tag image_layout(const memory::desc& d) {
  for (auto tag : kImageLayouts) {
    if (memory::desc(d.get_dims(), memory::data_type::f32, tag) == d) return tag;
  }
  return memory::format_tag::nchw;
}

memory::desc with_batch(const Dims& dims, memory::format_tag tag) {
  return memory::desc(dims, memory::data_type::f32, tag);
}

// The weights' gradient is summed image by image: a primitive made for a batch of one runs on each image in turn,
// and each image's gradient is added to a sum in double (sum_by_image). oneDNN's kernels for a whole batch sum over
// it in an order of their own, which changes with the batch's size and with how its images are split among
// threads, in long running sums that round more than Paddle's convolution, which also adds one image at a time
// (docs/training.md, "N workers equal one process"). So an image's gradient is the same bits in any batch (and,
// for exact.py's sums, on any number of threads: WeightsByImage), as its output and its input's gradient are, and
// a batch split among workers or micro-batches adds up the same numbers as one process (tests/test_onednn.py).

struct WeightsByImage {
  explicit WeightsByImage(const Geometry& g) : WeightsByImage(g, OpenMPThreads(g.serial ? 1 : 0)) {}

  // oneDNN's kernels for one image's weight gradient may split its sum over the map among the threads a primitive
  // is made and run for (the 3-channel first layer's does on 2 threads), which rounds it by the number of threads.
  // A serial geometry's primitive is made, and run (sum_by_image), on one thread: each image's gradient is then the
  // same bits in a process of any number of threads, as exact.py's sums need; elsewhere it uses the process's.
  WeightsByImage(const Geometry& g, const OpenMPThreads&)
      : image(one_image(g)),
        hint(hint_for(image)),
        pd(make_pd(image, hint)),
        primitive(pd),
        src_layout(image_layout(pd.src_desc())),
        diff_dst_layout(image_layout(pd.diff_dst_desc())),
        src_floats(pd.src_desc().get_size() / sizeof(float)),
        diff_dst_floats(pd.diff_dst_desc().get_size() / sizeof(float)),
        weights_floats(pd.diff_weights_desc().get_size() / sizeof(float)),
        weights_runs(value_runs(image.weights, pd.diff_weights_desc())) {
    note_kernel(pd);
  }

  // Where the weights' values lie in the chosen layout, as runs (first float, count) in order: a layout blocked by
  // 16 channels holds 20 of them padded to 32 (mnist_cnn's second convolution: 25,600 floats for 10,000 values), and
  // the padding, zeros, need no adding up. Found by reordering ones from the plain layout into a zeroed buffer.
  static std::vector<std::pair<size_t, size_t>> value_runs(const Dims& weights, const memory::desc& chosen) {
    const memory::desc plain(weights, memory::data_type::f32, memory::format_tag::oihw);
    std::vector<float> ones(plain.get_size() / sizeof(float), 1.0f);
    std::vector<float> marked(chosen.get_size() / sizeof(float), 0.0f);
    memory from(plain, cpu_engine(), ones.data()), to(chosen, cpu_engine(), marked.data());
    dnnl::reorder(from, to).execute(cpu_stream(), from, to);
    cpu_stream().wait();
    std::vector<std::pair<size_t, size_t>> runs;
    for (size_t k = 0; k < marked.size(); ++k) {
      if (marked[k] == 0.0f) continue;
      if (!runs.empty() && runs.back().first + runs.back().second == k) {
        ++runs.back().second;
      } else {
        runs.emplace_back(k, 1);
      }
    }
    return runs;
  }

  static dnnl::convolution_forward::primitive_desc hint_for(const Geometry& g) {
    return dnnl::convolution_forward::primitive_desc(cpu_engine(), dnnl::prop_kind::forward_training,
                                                     dnnl::algorithm::convolution_direct, maps(g, g.src),
                                                     any(g.weights), maps(g, g.dst), g.strides, g.pad_left,
                                                     g.pad_right);
  }

  // The image primitive with its input and the output's gradient in layouts that hold a batch image after image:
  // the layouts it chooses where they do, else Paddle's (NCHW), which every kernel takes.
  static dnnl::convolution_backward_weights::primitive_desc make_pd(
      const Geometry& image, const dnnl::convolution_forward::primitive_desc& hint) {
    auto chosen = weights_primitive(image, hint);
    const memory::format_tag s = image_layout(chosen.src_desc()), d = image_layout(chosen.diff_dst_desc());
    return weights_primitive_with_dst(image, hint, with_batch(image.src, s), with_batch(image.dst, d));
  }

  static dnnl::convolution_backward_weights::primitive_desc weights_primitive_with_dst(
      const Geometry& image, const dnnl::convolution_forward::primitive_desc& hint, const memory::desc& src,
      const memory::desc& diff_dst) {
    using dnnl::convolution_backward_weights;
    const auto direct = dnnl::algorithm::convolution_direct;
    dnnl::primitive_attr attr;  // each thread that runs it brings its own scratchpad: see sum_by_image
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (image.bias) {
      return convolution_backward_weights::primitive_desc(cpu_engine(), direct, src, any(image.weights),
                                                          bias_desc(image), diff_dst, image.strides, image.pad_left,
                                                          image.pad_right, hint, attr);
    }
    return convolution_backward_weights::primitive_desc(cpu_engine(), direct, src, any(image.weights), diff_dst,
                                                        image.strides, image.pad_left, image.pad_right, hint, attr);
  }

  Geometry image;
  dnnl::convolution_forward::primitive_desc hint;
  dnnl::convolution_backward_weights::primitive_desc pd;
  dnnl::convolution_backward_weights primitive;
  memory::format_tag src_layout, diff_dst_layout;  // of the batch: pd's layouts, image after image
  size_t src_floats, diff_dst_floats, weights_floats;  // one image's input and output gradient, the weights' gradient
  std::vector<std::pair<size_t, size_t>> weights_runs;  // where in weights_floats the values lie (value_runs)
};

// The backward-data primitive of one geometry, the weights' (by image) and their operands.
struct Backward {
  Backward(const Geometry& g, const dnnl::convolution_forward::primitive_desc& hint)
      : data_pd(cpu_engine(), dnnl::algorithm::convolution_direct, maps(g, g.src), any(g.weights), maps(g, g.dst),
                g.strides, g.pad_left, g.pad_right, hint),
        weights(g),
        data(data_pd),
        data_diff_dst(user_map(g, g.dst, g.dst_block), data_pd.diff_dst_desc()),
        data_weights(g.weights, data_pd.weights_desc()),
        data_diff_src(user_map(g, g.src, g.src_block), data_pd.diff_src_desc()),
        weights_src(user_map(g, g.src, g.src_block), with_batch(g.src, weights.src_layout)),
        weights_diff_dst(user_map(g, g.dst, g.dst_block), with_batch(g.dst, weights.diff_dst_layout)),
        weights_diff_weights(g.weights, weights.pd.diff_weights_desc()),
        share_diff_dst(data_pd.diff_dst_desc() == with_batch(g.dst, weights.diff_dst_layout)) {
    note_kernel(data_pd);
  }

  dnnl::convolution_backward_data::primitive_desc data_pd;
  WeightsByImage weights;
  dnnl::convolution_backward_data data;
  Operand data_diff_dst, data_weights, data_diff_src;
  Operand weights_src, weights_diff_dst, weights_diff_weights;
  bool share_diff_dst;  // both want the output's gradient in the same layout: reorder it once
};

// The forward primitive of one geometry and its operands, and the backward ones where it is made for training.
struct Plan {
  Plan(const Geometry& g, bool training)
      : geometry(g),
        fwd_pd(g.bias ? dnnl::convolution_forward::primitive_desc(
                            cpu_engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
                            maps(g, g.src), any(g.weights), bias_desc(g), maps(g, g.dst), g.strides, g.pad_left,
                            g.pad_right)
                      : dnnl::convolution_forward::primitive_desc(
                            cpu_engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
                            maps(g, g.src), any(g.weights), maps(g, g.dst), g.strides, g.pad_left, g.pad_right)),
        fwd(fwd_pd),
        fwd_src(user_map(g, g.src, g.src_block), fwd_pd.src_desc()),
        fwd_weights(g.weights, fwd_pd.weights_desc()),
        fwd_dst(user_map(g, g.dst, g.dst_block), fwd_pd.dst_desc()) {
    note_kernel(fwd_pd);
    if (training) bwd = std::make_unique<Backward>(g, fwd_pd);
  }

  Geometry geometry;
  dnnl::convolution_forward::primitive_desc fwd_pd;
  dnnl::convolution_forward fwd;
  Operand fwd_src, fwd_weights, fwd_dst;
  std::unique_ptr<Backward> bwd;
};

// The channel block of a layout oneDNN chose for a map of dims: 16 or 8, or 0 where it is not blocked so.
int64_t channel_block(const memory::desc& chosen, const Dims& dims) {
  if (chosen == memory::desc(dims, memory::data_type::f32, memory::format_tag::nChw16c)) return 16;
  if (chosen == memory::desc(dims, memory::data_type::f32, memory::format_tag::nChw8c)) return 8;
  return 0;
}

// The layout of g's maps. oneDNN's own choice blocks the channels by 16 (AVX-512) or 8 (AVX2), padding a count that
// is not a multiple of it, and its kernels then do the padded work: mnist_cnn's second convolution, 20 channels to
// 20, does 2.56 times its multiply-adds at 16. Where the padding at least doubles the work, the maps go NHWC, whose
// kernels take any count (at 16, 20 to 20 channels: forward, backward-data and image-by-image backward-weights
// 15.0 ms a batch of 64 against 22.4 blocked; at 8 it pads 1.44 times and stays blocked, which ran as fast:
// docs/performance.md). A first layer (under 8 input channels) keeps oneDNN's choice, its kernels made for few
// channels. PADDLE_MNIST_CONV_MAPS=blocked keeps oneDNN's choice everywhere (for measuring the two side by side).
// Maps Paddle holds NHWC (a network that keeps them so between layers: mnist_cnn) go NHWC whatever their counts.
memory::format_tag maps_layout(const Geometry& g) {
  static const bool blocked_only = [] {
    const char* v = std::getenv("PADDLE_MNIST_CONV_MAPS");
    return v != nullptr && std::string(v) == "blocked";
  }();
  const int64_t in = g.src[1], out = g.dst[1];
  const bool nhwc_held = held_nhwc(g.src_block, in) || held_nhwc(g.dst_block, out);
  if (!nhwc_held) {
    // maps Paddle holds blocked take oneDNN's choice, which is their layout
    if (blocked_only || in < 8 || g.src_block != 0 || g.dst_block != 0) return memory::format_tag::any;
    const dnnl::convolution_forward::primitive_desc chosen(
        cpu_engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, any(g.src),
        any(g.weights), any(g.dst), g.strides, g.pad_left, g.pad_right);
    const int64_t b = channel_block(chosen.dst_desc(), g.dst);
    if (b == 0) return memory::format_tag::any;
    const int64_t padded = (in + b - 1) / b * b * ((out + b - 1) / b * b);
    if (padded < 2 * in * out) return memory::format_tag::any;
  }
  // NHWC only where its forward, backward-data and image-by-image backward-weights kernels are direct ones (an older
  // oneDNN may offer only im2col and a GEMM, or its reference loops, there: the oneDNN 3.2 of Paddle 2.6 has only
  // those for a first layer's weights with NHWC maps)
  const auto nhwc = [](const Dims& dims) {
    return memory::desc(dims, memory::data_type::f32, memory::format_tag::nhwc);
  };
  try {
    const dnnl::convolution_forward::primitive_desc fwd(
        cpu_engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, nhwc(g.src),
        any(g.weights), nhwc(g.dst), g.strides, g.pad_left, g.pad_right);
    const dnnl::convolution_backward_data::primitive_desc data(cpu_engine(), dnnl::algorithm::convolution_direct,
                                                               nhwc(g.src), any(g.weights), nhwc(g.dst), g.strides,
                                                               g.pad_left, g.pad_right, fwd);
    Geometry image = one_image(g);
    image.maps = memory::format_tag::nhwc;
    const auto weights = WeightsByImage::make_pd(image, WeightsByImage::hint_for(image));
    if (paddle_mnist::direct(fwd) && paddle_mnist::direct(data) && paddle_mnist::direct(weights)) {
      return memory::format_tag::nhwc;
    }
  } catch (const dnnl::error&) {
  }
  return memory::format_tag::any;
}

// The plan of a geometry: the one kept, else a new one, kept where it is made for a backward pass. A forward pass
// (training false) takes the plan a backward pass of either kind keeps (serial or not: the same forward primitive).
std::shared_ptr<const Plan> plan_for(const paddle::Tensor& x, const paddle::Tensor& w, int stride, int padding,
                                     bool bias, int64_t dst_block, bool training, bool serial = false) {
  static PlanCache<Geometry, Plan> plans;
  Geometry g = geometry(x.shape(), w.shape(), stride, padding, bias, dst_block);
  g.serial = serial;
  if (!training) {
    Geometry other = g;
    other.serial = !serial;
    if (auto kept = plans.find(other)) return kept;
  }
  return plans.find_or_make(g, training, [&] {
    Geometry chosen = g;
    chosen.maps = maps_layout(g);
    return std::make_shared<const Plan>(chosen, training);
  });
}

void check(const paddle::Tensor& t, const char* name) {
  PD_CHECK(t.is_cpu(), "onednn_conv2d: ", name, " must be on the CPU");
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT32, "onednn_conv2d: ", name, " must be float32");
  PD_CHECK(t.shape().size() == 4 || t.shape().size() == 5, "onednn_conv2d: ", name,
           " must have 4 dimensions (or 5, blocked)");
}

void check_bias(const paddle::Tensor& b, const paddle::Tensor& w) {
  PD_CHECK(b.is_cpu() && b.dtype() == paddle::DataType::FLOAT32, "onednn_conv2d: the bias must be float32 on the CPU");
  PD_CHECK(b.shape().size() == 1 && b.shape()[0] == w.shape()[0], "onednn_conv2d: the bias must have one value per ",
           "output channel");
}

// The forward pass; b is null for the operator without a bias.
paddle::Tensor forward(const paddle::Tensor& x, const paddle::Tensor& w, const paddle::Tensor* b, int stride,
                       int padding, int block) {
  check(x, "x");
  check(w, "weight");
  const auto plan = plan_for(x, w, stride, padding, b != nullptr, block, false);
  const Plan& p = *plan;
  auto out = paddle::empty(output_shape(p.geometry), paddle::DataType::FLOAT32, paddle::CPUPlace());
  float* out_data = out.data<float>();
  memory written = p.fwd_dst.output(out_data);
  std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, p.fwd_src.input(x.data<float>())},
                                          {DNNL_ARG_WEIGHTS, p.fwd_weights.input(w.data<float>())},
                                          {DNNL_ARG_DST, written}};
  if (b != nullptr) {
    check_bias(*b, w);
    args[DNNL_ARG_BIAS] = memory(bias_desc(p.geometry), cpu_engine(), const_cast<float*>(b->data<float>()));
  }
  p.fwd.execute(cpu_stream(), args);
  p.fwd_dst.finish(written, out_data);
  cpu_stream().wait();
  return out;
}

// One thread's images of a batch (WeightsByImage): each image's weights' gradient (and bias's) into its place of
// a round's buffers, on the calling thread, through a stream and a scratchpad of its own, so that the threads of a
// team can run the one primitive at once.
class ImageRunner {
 public:
  ImageRunner(const WeightsByImage& w, const float* src, const float* diff_dst, float* weights, float* bias)
      : w_(w),
        src_(src),
        diff_dst_(diff_dst),
        weights_(weights),
        bias_(bias),
        stream_(cpu_engine()),
        image_src_(w.pd.src_desc(), cpu_engine(), DNNL_MEMORY_NONE),
        image_diff_dst_(w.pd.diff_dst_desc(), cpu_engine(), DNNL_MEMORY_NONE),
        image_weights_(w.pd.diff_weights_desc(), cpu_engine(), DNNL_MEMORY_NONE),
        image_bias_(bias_desc(w.image), cpu_engine(), DNNL_MEMORY_NONE),
        scratchpad_(w.pd.scratchpad_desc(), cpu_engine()) {
    // one argument map for all the images: its memory objects are handles, which move to each image in turn
    args_ = {{DNNL_ARG_SRC, image_src_},
             {DNNL_ARG_DIFF_DST, image_diff_dst_},
             {DNNL_ARG_DIFF_WEIGHTS, image_weights_},
             {DNNL_ARG_SCRATCHPAD, scratchpad_}};
    if (bias_ != nullptr) args_[DNNL_ARG_DIFF_BIAS] = image_bias_;
  }

  // Image `image` of the batch into slot `slot` of the buffers.
  void run(int64_t image, int64_t slot) {
    image_src_.set_data_handle(const_cast<float*>(src_ + image * w_.src_floats));
    image_diff_dst_.set_data_handle(const_cast<float*>(diff_dst_ + image * w_.diff_dst_floats));
    image_weights_.set_data_handle(weights_ + slot * w_.weights_floats);
    if (bias_ != nullptr) image_bias_.set_data_handle(bias_ + slot * w_.image.weights[0]);
    w_.primitive.execute(stream_, args_);
    stream_.wait();
  }

 private:
  const WeightsByImage& w_;
  const float* src_;
  const float* diff_dst_;
  float* weights_;
  float* bias_;
  dnnl::stream stream_;
  memory image_src_, image_diff_dst_, image_weights_, image_bias_, scratchpad_;
  std::unordered_map<int, memory> args_;
};

// How many images each thread of a team computes in a round before the round's gradients are added up.
constexpr int64_t kImagesPerThread = 4;

// Adds slots first to last - 1 of a round's gradients (each `floats` long) to total, in the slots' order, over the
// elements of runs begin to end - 1 (WeightsByImage::value_runs). Each element's sum adds the same numbers in the
// same order in every clone.
using Run = std::pair<size_t, size_t>;
__attribute__((target_clones("avx512f", "avx2", "default"))) void add_slots(const float* slots, int64_t first,
                                                                              int64_t last, size_t floats,
                                                                              const Run* runs, size_t begin,
                                                                              size_t end, double* total) {
  for (int64_t j = first; j < last; ++j) {
    const float* image = slots + j * floats;
    for (size_t r = begin; r < end; ++r) {
      const size_t from = runs[r].first, to = runs[r].first + runs[r].second;
      for (size_t k = from; k < to; ++k) total[k] += image[k];
    }
  }
}

// The weights' gradient (and the bias's, where bias_sum is given) of a batch, summed image by image in order
// (WeightsByImage) in double: src and diff_dst hold the batch in the primitive's layouts, image after image, and
// sum holds the weights' gradient in the layout the primitive chose. Each image's gradient is float32, as oneDNN
// computes it; their sum in double is exact but for rounding 2^-29 of float32's, so it is the same number in
// whatever order and grouping the images are added: the gradient of a batch split among workers or micro-batches,
// added up in double too (exact.py), rounds to the float32 of one process.
//
// A serial geometry's images (exact.py's sums), each on one thread, are shared among the process's OpenMP threads,
// a team of them: in rounds of kImagesPerThread images a thread, each thread its share of the round's images, then
// each its share of the weights' elements, added up over the round's images in their order. Each element's sum thus
// adds the same numbers in the same order as on one thread: the same bits on any number of threads (mnist_cnn's
// exact path on 2 threads read 0.80 of its float32 path with one thread for all the images, 0.92 so). The team is
// (Team) the one oneDNN's kernels run on, its threads already waiting; the primitive, made for one thread, runs on
// the thread that calls it. Elsewhere one image at a time runs on the process's threads.
void sum_by_image(const WeightsByImage& w, const memory& src, const memory& diff_dst, std::vector<double>& sum,
                  std::vector<double>* bias_sum, int64_t batch) {
  const float* src_data = static_cast<const float*>(src.get_data_handle());
  const float* diff_dst_data = static_cast<const float*>(diff_dst.get_data_handle());
  const int64_t channels = w.image.weights[0];
  const size_t floats = w.weights_floats;
  const std::vector<Run>& runs = w.weights_runs;
  const Run bias_run(0, channels);
  const Team& team = Team::get();
  const int64_t threads = w.image.serial && team.usable() ? std::min<int64_t>(team.max_threads(), batch) : 1;
  const int64_t round = threads > 1 ? threads * kImagesPerThread : 1;
  std::vector<float> weights(round * floats), bias(bias_sum != nullptr ? round * channels : 0);
  float* bias_data = bias_sum != nullptr ? bias.data() : nullptr;
  sum.assign(floats, 0.0);
  if (bias_sum != nullptr) bias_sum->assign(channels, 0.0);
  double* total = sum.data();
  double* bias_total = bias_sum != nullptr ? bias_sum->data() : nullptr;
  if (threads <= 1) {
    const OpenMPThreads one(w.image.serial ? 1 : 0);  // see WeightsByImage
    ImageRunner runner(w, src_data, diff_dst_data, weights.data(), bias_data);
    for (int64_t i = 0; i < batch; ++i) {
      runner.run(i, 0);
      add_slots(weights.data(), 0, 1, floats, runs.data(), 0, runs.size(), total);
      if (bias_total != nullptr) add_slots(bias_data, 0, 1, channels, &bias_run, 0, 1, bias_total);
    }
    return;
  }
  const std::string failure = team.run(static_cast<int>(threads), [&](int64_t t, int64_t team_size) {
    const OpenMPThreads one(1);  // a kernel that asks for threads inside gets this one (see WeightsByImage)
    // a thread that fails runs no further images but meets the others at every barrier, and throws after the last
    std::string failed;
    std::unique_ptr<ImageRunner> runner;
    try {
      runner = std::make_unique<ImageRunner>(w, src_data, diff_dst_data, weights.data(), bias_data);
    } catch (const std::exception& e) {
      failed = e.what();
    }
    for (int64_t first = 0; first < batch; first += round) {
      const int64_t n = std::min(round, batch - first);
      for (int64_t j = n * t / team_size; runner != nullptr && j < n * (t + 1) / team_size; ++j) {
        try {
          runner->run(first + j, j);
        } catch (const std::exception& e) {
          failed = e.what();
          runner.reset();
        }
      }
      team.barrier();
      add_slots(weights.data(), 0, n, floats, runs.data(), runs.size() * t / team_size,
                runs.size() * (t + 1) / team_size, total);
      if (bias_total != nullptr && t == 0) add_slots(bias_data, 0, n, channels, &bias_run, 0, 1, bias_total);
      team.barrier();
    }
    if (!failed.empty()) throw std::runtime_error(failed);
  });
  PD_CHECK(failure.empty(), "onednn_conv2d: the weights' gradient image by image: ", failure);
}

// Writes sum (in the layout the weights' primitive chose) into Paddle's buffer dst, rounded to float32 (low false),
// or what that rounding left over, rounded again (low true): the two add up to sum within 2^-48 of it.
void write_weights(const Operand& operand, const std::vector<double>& sum, float* dst, bool low) {
  memory written = operand.output(dst);
  float* chosen = static_cast<float*>(written.get_data_handle());
  for (size_t k = 0; k < sum.size(); ++k) {
    const float high = static_cast<float>(sum[k]);
    chosen[k] = low ? static_cast<float>(sum[k] - high) : high;
  }
  operand.finish(written, dst);
}

// The input's gradient (or zeros where the input takes none: the network's first layer, where nothing reads it).
paddle::Tensor input_gradient(const Backward& p, const paddle::Tensor& x, const paddle::Tensor& w,
                              const paddle::Tensor& grad_out, memory diff_dst, bool input_grad) {
  if (!input_grad) return paddle::full(x.shape(), 0.0, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto grad_x = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  float* grad_x_data = grad_x.data<float>();
  if (!p.share_diff_dst) diff_dst = p.data_diff_dst.input(grad_out.data<float>());
  memory diff_src = p.data_diff_src.output(grad_x_data);
  p.data.execute(cpu_stream(), {{DNNL_ARG_DIFF_DST, diff_dst},
                                {DNNL_ARG_WEIGHTS, p.data_weights.input(w.data<float>())},
                                {DNNL_ARG_DIFF_SRC, diff_src}});
  p.data_diff_src.finish(diff_src, grad_x_data);
  cpu_stream().wait();
  return grad_x;
}

// The backward pass: the input's and the weights' gradients, and the bias's where the operator has one; the
// weights' and the bias's in float32 (wide false: the gradient operators) or in float64 (wide true: the sums
// exact.py adds up across micro-batches and workers before it rounds them once).
std::vector<paddle::Tensor> backward(const paddle::Tensor& x, const paddle::Tensor& w, const paddle::Tensor& grad_out,
                                     int stride, int padding, bool input_grad, bool bias, bool wide) {
  check(grad_out, "the output's gradient");
  const int64_t dst_block = grad_out.shape().size() == 5 ? grad_out.shape()[4] : 0;  // held as the output is
  const auto plan = plan_for(x, w, stride, padding, bias, dst_block, true, wide);  // exact.py's sums: serial
  const Backward& p = *plan->bwd;
  memory diff_dst = p.weights_diff_dst.input(grad_out.data<float>());
  std::vector<double> sum, bias_sum;
  sum_by_image(p.weights, p.weights_src.input(x.data<float>()), diff_dst, sum, bias ? &bias_sum : nullptr,
               x.shape()[0]);
  const auto type = wide ? paddle::DataType::FLOAT64 : paddle::DataType::FLOAT32;
  auto grad_w = paddle::empty(w.shape(), type, paddle::CPUPlace());
  paddle::Tensor rounded_w;  // wide: grad_w rounded to float32, what autograd gets (exact.py's hand_over)
  if (wide) {
    auto high = paddle::empty(w.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
    auto low = paddle::empty(w.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
    write_weights(p.weights_diff_weights, sum, high.data<float>(), false);
    write_weights(p.weights_diff_weights, sum, low.data<float>(), true);
    cpu_stream().wait();
    rounded_w = paddle::empty(w.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
    double* out = grad_w.data<double>();  // the pointers fetched once: data<T>() checks the tensor at each call
    float* rounded = rounded_w.data<float>();
    const float* high_data = high.data<float>();
    const float* low_data = low.data<float>();
    for (int64_t k = 0, n = grad_w.numel(); k < n; ++k) {
      out[k] = static_cast<double>(high_data[k]) + static_cast<double>(low_data[k]);
      rounded[k] = static_cast<float>(out[k]);
    }
  } else {
    write_weights(p.weights_diff_weights, sum, grad_w.data<float>(), false);
  }
  paddle::Tensor grad_x = input_gradient(p, x, w, grad_out, diff_dst, input_grad);
  if (!bias && wide) return {grad_x, grad_w, rounded_w};
  if (!bias) return {grad_x, grad_w};
  auto grad_b = paddle::empty({w.shape()[0]}, type, paddle::CPUPlace());
  auto rounded_b = paddle::empty({w.shape()[0]}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  float* out = (wide ? rounded_b : grad_b).data<float>();
  for (size_t k = 0; k < bias_sum.size(); ++k) out[k] = static_cast<float>(bias_sum[k]);
  if (!wide) return {grad_x, grad_w, grad_b};
  std::copy(bias_sum.begin(), bias_sum.end(), grad_b.data<double>());
  return {grad_x, grad_w, grad_b, rounded_w, rounded_b};
}

}  // namespace

std::vector<paddle::Tensor> ConvForward(const paddle::Tensor& x, const paddle::Tensor& w, int stride, int padding,
                                        bool input_grad, int block) {
  return {forward(x, w, nullptr, stride, padding, block)};
}

std::vector<paddle::Tensor> ConvBackward(const paddle::Tensor& x, const paddle::Tensor& w,
                                         const paddle::Tensor& grad_out, int stride, int padding, bool input_grad,
                                         int block) {
  return backward(x, w, grad_out, stride, padding, input_grad, false, false);
}

std::vector<paddle::Tensor> ConvBiasForward(const paddle::Tensor& x, const paddle::Tensor& w, const paddle::Tensor& b,
                                            int stride, int padding, bool input_grad, int block) {
  return {forward(x, w, &b, stride, padding, block)};
}

std::vector<paddle::Tensor> ConvBiasBackward(const paddle::Tensor& x, const paddle::Tensor& w, const paddle::Tensor& b,
                                             const paddle::Tensor& grad_out, int stride, int padding,
                                             bool input_grad, int block) {
  return backward(x, w, grad_out, stride, padding, input_grad, true, false);
}

std::vector<std::vector<int64_t>> ConvInferShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                                 int stride, int padding, bool input_grad, int block) {
  return {output_shape(geometry(x, w, stride, padding, false, block))};
}

std::vector<std::vector<int64_t>> ConvBiasInferShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                                     const std::vector<int64_t>& b, int stride, int padding,
                                                     bool input_grad, int block) {
  return ConvInferShape(x, w, stride, padding, input_grad, block);
}

std::vector<paddle::DataType> ConvInferDtype(const paddle::DataType& x, const paddle::DataType& w) { return {x}; }

std::vector<paddle::DataType> ConvBiasInferDtype(const paddle::DataType& x, const paddle::DataType& w,
                                                 const paddle::DataType& b) {
  return {x};
}

PD_BUILD_OP(onednn_conv2d)
    .Inputs({"X", "W"})
    .Outputs({"Out"})
    .Attrs({"stride: int", "padding: int", "input_grad: bool", "block: int"})
    .SetKernelFn(PD_KERNEL(ConvForward))
    .SetInferShapeFn(PD_INFER_SHAPE(ConvInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ConvInferDtype));

PD_BUILD_GRAD_OP(onednn_conv2d)
    .Inputs({"X", "W", paddle::Grad("Out")})
    .Outputs({paddle::Grad("X"), paddle::Grad("W")})
    .Attrs({"stride: int", "padding: int", "input_grad: bool", "block: int"})
    .SetKernelFn(PD_KERNEL(ConvBackward));

PD_BUILD_OP(onednn_conv2d_bias)
    .Inputs({"X", "W", "B"})
    .Outputs({"Out"})
    .Attrs({"stride: int", "padding: int", "input_grad: bool", "block: int"})
    .SetKernelFn(PD_KERNEL(ConvBiasForward))
    .SetInferShapeFn(PD_INFER_SHAPE(ConvBiasInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ConvBiasInferDtype));

PD_BUILD_GRAD_OP(onednn_conv2d_bias)
    .Inputs({"X", "W", "B", paddle::Grad("Out")})
    .Outputs({paddle::Grad("X"), paddle::Grad("W"), paddle::Grad("B")})
    .Attrs({"stride: int", "padding: int", "input_grad: bool", "block: int"})
    .SetKernelFn(PD_KERNEL(ConvBiasBackward));

// The backward passes as operators of their own, with the weights' and the bias's gradients in float64: what
// exact.py's layers call from their own backward pass, so that a step's sums over images, micro-batches and
// workers are added in double and rounded to float32 once.
std::vector<paddle::Tensor> ConvGrad64(const paddle::Tensor& x, const paddle::Tensor& w, const paddle::Tensor& grad_out,
                                       int stride, int padding, bool input_grad) {
  return backward(x, w, grad_out, stride, padding, input_grad, false, true);
}

std::vector<paddle::Tensor> ConvBiasGrad64(const paddle::Tensor& x, const paddle::Tensor& w,
                                           const paddle::Tensor& grad_out, int stride, int padding, bool input_grad) {
  return backward(x, w, grad_out, stride, padding, input_grad, true, true);
}

std::vector<std::vector<int64_t>> Grad64InferShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                                   const std::vector<int64_t>& grad_out) {
  return {x, w, w};
}

std::vector<std::vector<int64_t>> BiasGrad64InferShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                                       const std::vector<int64_t>& grad_out) {
  return {x, w, {w[0]}, w, {w[0]}};
}

std::vector<paddle::DataType> Grad64InferDtype(const paddle::DataType& x, const paddle::DataType& w,
                                               const paddle::DataType& grad_out) {
  return {x, paddle::DataType::FLOAT64, x};
}

std::vector<paddle::DataType> BiasGrad64InferDtype(const paddle::DataType& x, const paddle::DataType& w,
                                                   const paddle::DataType& grad_out) {
  return {x, paddle::DataType::FLOAT64, paddle::DataType::FLOAT64, x, x};
}

// Outputs: the input's gradient, the weights' (and the bias's) in float64, then those rounded to float32.
PD_BUILD_OP(onednn_conv2d_grad64)
    .Inputs({"X", "W", "GradOut"})
    .Outputs({"GradX", "GradW", "GradW32"})
    .Attrs({"stride: int", "padding: int", "input_grad: bool"})
    .SetKernelFn(PD_KERNEL(ConvGrad64))
    .SetInferShapeFn(PD_INFER_SHAPE(Grad64InferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Grad64InferDtype));

PD_BUILD_OP(onednn_conv2d_bias_grad64)
    .Inputs({"X", "W", "GradOut"})
    .Outputs({"GradX", "GradW", "GradB", "GradW32", "GradB32"})
    .Attrs({"stride: int", "padding: int", "input_grad: bool"})
    .SetKernelFn(PD_KERNEL(ConvBiasGrad64))
    .SetInferShapeFn(PD_INFER_SHAPE(BiasGrad64InferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(BiasGrad64InferDtype));

// A counter as a one-element int64 tensor: the counting operators below take an input only because a custom
// operator must; it is not read.
std::vector<paddle::Tensor> as_tensor(int64_t value) {
  auto count = paddle::empty({1}, paddle::DataType::INT64, paddle::CPUPlace());
  count.data<int64_t>()[0] = value;
  return {count};
}

std::vector<std::vector<int64_t>> CountInferShape(const std::vector<int64_t>& unused) { return {{1}}; }

std::vector<paddle::DataType> CountInferDtype(const paddle::DataType& unused) { return {paddle::DataType::INT64}; }

// How many plans the operators' caches keep, all together (PlanCache): for the tests that hold them bounded.
std::vector<paddle::Tensor> KeptPlans(const paddle::Tensor& unused) { return as_tensor(paddle_mnist::kept_plans()); }

// How many convolution primitives were made on oneDNN's reference loops (note_kernel in onednn_common.h).
std::vector<paddle::Tensor> ReferenceKernels(const paddle::Tensor& unused) {
  return as_tensor(paddle_mnist::reference_kernels());
}

PD_BUILD_OP(onednn_kept_plans)
    .Inputs({"X"})
    .Outputs({"Count"})
    .SetKernelFn(PD_KERNEL(KeptPlans))
    .SetInferShapeFn(PD_INFER_SHAPE(CountInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(CountInferDtype));

PD_BUILD_OP(onednn_reference_kernels)
    .Inputs({"X"})
    .Outputs({"Count"})
    .SetKernelFn(PD_KERNEL(ReferenceKernels))
    .SetInferShapeFn(PD_INFER_SHAPE(CountInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(CountInferDtype));
