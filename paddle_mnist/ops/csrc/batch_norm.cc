// What batch norm over the global batch (paddle_mnist/network/batchnorm.py) does per image, on float32 NCHW CPU
// tensors: Paddle custom operators without gradient operators (the PyLayer there is the gradient), built into
// cpu_ops with the others (paddle_mnist/ops/onednn.py).
//
//   bn_plane_sums(x)            [N, 2C] float64: each image's per-channel sum of x, then of x * x
//   bn_plane_sums2(g, x)        [N, 2C] float64: each image's per-channel sum of g, then of g * x
//   bn_affine(x, a, b)          x * a + b per channel (a, b float32 [C])
//   bn_affine2(g, x, a, b, c)   g * a + x * b + c per channel, added in that order
//
// A plane's sum runs through its values in one fixed order (eight running sums, values i, i + 8, ..., then added
// pairwise in a fixed tree), so an image's sums are the same bits in any batch; products of two float32 values are
// exact in float64. The elementwise ones round each product and each sum (no fused multiply-add: contraction is
// off for this file), as Paddle's elementwise kernels do, so batchnorm.py's fallback by Paddle's operators gives
// the same outputs from the same constants (its sums differ from these in the last bits of float64). They are here
// for speed: Paddle's CPU operators took 4 ms for a float64 copy of 1M values, 1.3 ms for their sums per plane.

#pragma GCC optimize("fp-contract=off")

#include <cstdint>
#include <vector>

#include "paddle/extension.h"

namespace {

constexpr int kLanes = 8;

struct Planes {
  int64_t n, c, size;  // images, channels, values per plane (H * W)
};

Planes planes_of(const paddle::Tensor& x, const char* op) {
  PD_CHECK(x.is_cpu() && x.dtype() == paddle::DataType::FLOAT32, op, ": tensors must be float32 on the CPU");
  PD_CHECK(x.shape().size() == 4, op, ": x must be NCHW");
  return {x.shape()[0], x.shape()[1], x.shape()[2] * x.shape()[3]};
}

double fold(const double (&lane)[kLanes]) {
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// sum of a, and of a * b (b == nullptr: a * a), over one plane of `size` values
void plane_sums(const float* a, const float* b, int64_t size, double* sum, double* products) {
  double s[kLanes] = {}, p[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= size; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const double x = a[i + j], y = b ? b[i + j] : a[i + j];
      s[j] += x;
      p[j] += x * y;
    }
  }
  for (int j = 0; i < size; ++i, ++j) {
    const double x = a[i], y = b ? b[i] : a[i];
    s[j] += x;
    p[j] += x * y;
  }
  *sum = fold(s);
  *products = fold(p);
}

std::vector<paddle::Tensor> sums(const paddle::Tensor& a, const float* b, const Planes& s) {
  auto out = paddle::empty({s.n, 2 * s.c}, paddle::DataType::FLOAT64, paddle::CPUPlace());
  double* o = out.data<double>();
  const float* in = a.data<float>();
  for (int64_t i = 0; i < s.n; ++i) {
    for (int64_t ch = 0; ch < s.c; ++ch) {
      const int64_t at = (i * s.c + ch) * s.size;
      plane_sums(in + at, b ? b + at : nullptr, s.size, o + i * 2 * s.c + ch, o + i * 2 * s.c + s.c + ch);
    }
  }
  return {out};
}

const float* channel_vector(const paddle::Tensor& v, const Planes& s, const char* op) {
  PD_CHECK(v.is_cpu() && v.dtype() == paddle::DataType::FLOAT32 && v.numel() == s.c, op,
           ": per-channel vectors must be float32 [C] on the CPU");
  return v.data<float>();
}

}  // namespace

std::vector<paddle::Tensor> PlaneSums(const paddle::Tensor& x) {
  return sums(x, nullptr, planes_of(x, "bn_plane_sums"));
}

std::vector<paddle::Tensor> PlaneSums2(const paddle::Tensor& g, const paddle::Tensor& x) {
  const Planes s = planes_of(x, "bn_plane_sums2");
  PD_CHECK(g.shape() == x.shape(), "bn_plane_sums2: g and x must have one shape");
  planes_of(g, "bn_plane_sums2");
  return sums(g, x.data<float>(), s);
}

std::vector<paddle::Tensor> Affine(const paddle::Tensor& x, const paddle::Tensor& a, const paddle::Tensor& b) {
  const Planes s = planes_of(x, "bn_affine");
  const float* av = channel_vector(a, s, "bn_affine");
  const float* bv = channel_vector(b, s, "bn_affine");
  auto out = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* in = x.data<float>();
  float* o = out.data<float>();
  for (int64_t plane = 0; plane < s.n * s.c; ++plane) {
    const float scale = av[plane % s.c], shift = bv[plane % s.c];
    const float* xi = in + plane * s.size;
    float* yi = o + plane * s.size;
    for (int64_t k = 0; k < s.size; ++k) {
      const float product = xi[k] * scale;
      yi[k] = product + shift;
    }
  }
  return {out};
}

std::vector<paddle::Tensor> Affine2(const paddle::Tensor& g, const paddle::Tensor& x, const paddle::Tensor& a,
                                    const paddle::Tensor& b, const paddle::Tensor& c) {
  const Planes s = planes_of(x, "bn_affine2");
  PD_CHECK(g.shape() == x.shape(), "bn_affine2: g and x must have one shape");
  planes_of(g, "bn_affine2");
  const float* av = channel_vector(a, s, "bn_affine2");
  const float* bv = channel_vector(b, s, "bn_affine2");
  const float* cv = channel_vector(c, s, "bn_affine2");
  auto out = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* gin = g.data<float>();
  const float* xin = x.data<float>();
  float* o = out.data<float>();
  for (int64_t plane = 0; plane < s.n * s.c; ++plane) {
    const float ga = av[plane % s.c], xb = bv[plane % s.c], shift = cv[plane % s.c];
    const int64_t at = plane * s.size;
    for (int64_t k = 0; k < s.size; ++k) {
      const float first = gin[at + k] * ga, second = xin[at + k] * xb;
      const float both = first + second;
      o[at + k] = both + shift;
    }
  }
  return {out};
}

std::vector<std::vector<int64_t>> SumsShape(const std::vector<int64_t>& x) { return {{x[0], 2 * x[1]}}; }
std::vector<std::vector<int64_t>> SumsShape2(const std::vector<int64_t>& g, const std::vector<int64_t>& x) {
  return {{x[0], 2 * x[1]}};
}
std::vector<paddle::DataType> SumsDtype(const paddle::DataType& x) { return {paddle::DataType::FLOAT64}; }
std::vector<paddle::DataType> SumsDtype2(const paddle::DataType& g, const paddle::DataType& x) {
  return {paddle::DataType::FLOAT64};
}

PD_BUILD_OP(bn_plane_sums)
    .Inputs({"X"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(PlaneSums))
    .SetInferShapeFn(PD_INFER_SHAPE(SumsShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SumsDtype));

PD_BUILD_OP(bn_plane_sums2)
    .Inputs({"G", "X"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(PlaneSums2))
    .SetInferShapeFn(PD_INFER_SHAPE(SumsShape2))
    .SetInferDtypeFn(PD_INFER_DTYPE(SumsDtype2));

PD_BUILD_OP(bn_affine).Inputs({"X", "A", "B"}).Outputs({"Out"}).SetKernelFn(PD_KERNEL(Affine));

PD_BUILD_OP(bn_affine2).Inputs({"G", "X", "A", "B", "C"}).Outputs({"Out"}).SetKernelFn(PD_KERNEL(Affine2));
