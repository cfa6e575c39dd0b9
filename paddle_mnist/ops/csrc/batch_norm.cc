// What batch norm over the global batch (paddle_mnist/network/batchnorm.py) does per image, on float32 NCHW CPU
// tensors: Paddle custom operators without gradient operators (the PyLayer there is the gradient), built into
// cpu_ops with the others (paddle_mnist/ops/onednn.py).
//
//   bn_plane_sums(x)            [N, 2C] float64: each image's per-channel sum of x, then of x * x
//   bn_plane_sums2(g, x)        [N, 2C] float64: each image's per-channel sum of g, then of g * x
//   bn_affine(x, a, b)          x * a + b per channel (a, b float32 [C])
//   bn_affine2(g, x, a, b, c)   g * a + x * b + c per channel, added in that order
//
// and per-worker batch norm in training on maps held NHWC, channels last ([..., C]: mnist_cnn_bn's maps, which
// Paddle's CPU batch norm runs twice as slowly as NCHW), with its gradient operator:
//
//   bn_nhwc(x, gamma, beta)     (y, the batch's mean, its biased variance): y = (x - mean) * gamma / sqrt(variance
//                               + epsilon) + beta per channel, over every other axis
//
// A plane's sum runs through its values in one fixed order (eight running sums, values i, i + 8, ..., then added
// pairwise in a fixed tree), so an image's sums are the same bits in any batch; products of two float32 values are
// exact in float64. The elementwise ones round each product and each sum (no fused multiply-add: contraction is
// off for this file), as Paddle's elementwise kernels do, so batchnorm.py's fallback by Paddle's operators gives
// the same outputs from the same constants (its sums differ from these in the last bits of float64). They are here
// for speed: Paddle's CPU operators took 4 ms for a float64 copy of 1M values, 1.3 ms for their sums per plane.

#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <cmath>
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

// ---- batch norm on maps held NHWC ----

// x as rows of C values (its last axis), float32 on the CPU.
struct Rows {
  int64_t m, c;
};

Rows rows_of(const paddle::Tensor& x, const char* op) {
  PD_CHECK(x.is_cpu() && x.dtype() == paddle::DataType::FLOAT32, op, ": tensors must be float32 on the CPU");
  PD_CHECK(x.shape().size() >= 2 && x.shape().back() > 0, op, ": x must hold its channels on its last axis");
  return {x.numel() / x.shape().back(), x.shape().back()};
}

constexpr int64_t kChunk = 256;  // rows summed in float before their sums go into the double ones

// Per-channel sums over the rows, in double [2C]: of u = a - shift and of u * u (b null), or of a and of
// a * (b - shift). The shift (a value near the channel's mean: its first row's, or the mean) keeps the sum of
// squares from cancelling where the mean is large against the spread. Float within chunks of kChunk rows
// (vectorised across the channels), the chunks' sums added in double.
#if defined(__x86_64__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void channel_sums(const float* a, const float* b, const float* shift, Rows r, double* out) {
  std::vector<float> s(r.c), p(r.c);
  for (int64_t k = 0; k < 2 * r.c; ++k) out[k] = 0.0;
  for (int64_t start = 0; start < r.m; start += kChunk) {
    std::fill(s.begin(), s.end(), 0.f);
    std::fill(p.begin(), p.end(), 0.f);
    const int64_t end = std::min(r.m, start + kChunk);
    for (int64_t i = start; i < end; ++i) {
      const float* ai = a + i * r.c;
      if (b == nullptr) {
        for (int64_t k = 0; k < r.c; ++k) {
          const float u = ai[k] - shift[k];
          s[k] += u;
          p[k] += u * u;
        }
      } else {
        const float* bi = b + i * r.c;
        for (int64_t k = 0; k < r.c; ++k) {
          s[k] += ai[k];
          p[k] += ai[k] * (bi[k] - shift[k]);
        }
      }
    }
    for (int64_t k = 0; k < r.c; ++k) {
      out[k] += s[k];
      out[r.c + k] += p[k];
    }
  }
}

// y = (x - mean) * a + b per channel of rows, or with g, y = g * a + (x - mean) * b + c.
#if defined(__x86_64__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void channel_affine(const float* g, const float* x, const float* mean, const float* a, const float* b,
                    const float* c, Rows r, float* y) {
  for (int64_t i = 0; i < r.m; ++i) {
    const float* xi = x + i * r.c;
    float* yi = y + i * r.c;
    if (g == nullptr) {
      for (int64_t k = 0; k < r.c; ++k) yi[k] = (xi[k] - mean[k]) * a[k] + b[k];
    } else {
      const float* gi = g + i * r.c;
      for (int64_t k = 0; k < r.c; ++k) yi[k] = gi[k] * a[k] + (xi[k] - mean[k]) * b[k] + c[k];
    }
  }
}

}  // namespace

std::vector<paddle::Tensor> NhwcForward(const paddle::Tensor& x, const paddle::Tensor& gamma,
                                        const paddle::Tensor& beta, float epsilon) {
  const Rows r = rows_of(x, "bn_nhwc");
  const Planes s{1, r.c, 1};
  const float* g = channel_vector(gamma, s, "bn_nhwc");
  const float* be = channel_vector(beta, s, "bn_nhwc");
  std::vector<double> sums(2 * r.c);
  const float* first = x.data<float>();  // the first row: the shift
  channel_sums(x.data<float>(), nullptr, first, r, sums.data());
  auto mean = paddle::empty({r.c}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto variance = paddle::empty({r.c}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  std::vector<float> a(r.c), b(r.c);
  for (int64_t k = 0; k < r.c; ++k) {
    const double offset = sums[k] / r.m, mu = first[k] + offset;
    const double var = std::max(sums[r.c + k] / r.m - offset * offset, 0.0);
    const double scale = g[k] / std::sqrt(var + epsilon);
    mean.data<float>()[k] = static_cast<float>(mu);
    variance.data<float>()[k] = static_cast<float>(var);
    a[k] = static_cast<float>(scale);
    b[k] = be[k];
  }
  auto y = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  channel_affine(nullptr, x.data<float>(), mean.data<float>(), a.data(), b.data(), nullptr, r, y.data<float>());
  return {y, mean, variance};
}

// dx = dy * a + (x - mean) * b + c per channel, with a = gamma * inv_std, and b and c from the sums of dy and of
// dy * (x - mean): the gradient of y through the batch's mean and variance (as batchnorm.py's _GlobalNorm's, over
// one worker's batch).
std::vector<paddle::Tensor> NhwcBackward(const paddle::Tensor& x, const paddle::Tensor& gamma,
                                         const paddle::Tensor& mean, const paddle::Tensor& variance,
                                         const paddle::Tensor& grad_y, float epsilon) {
  const Rows r = rows_of(x, "bn_nhwc");
  PD_CHECK(grad_y.shape() == x.shape(), "bn_nhwc: the output's gradient must have x's shape");
  std::vector<double> sums(2 * r.c);
  channel_sums(grad_y.data<float>(), x.data<float>(), mean.data<float>(), r, sums.data());  // of dy * (x - mean)
  auto grad_gamma = paddle::empty({r.c}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto grad_beta = paddle::empty({r.c}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  std::vector<float> a(r.c), b(r.c), c(r.c);
  for (int64_t k = 0; k < r.c; ++k) {
    const double inv_std = 1.0 / std::sqrt(variance.data<float>()[k] + epsilon);
    const double scale = gamma.data<float>()[k] * inv_std;
    const double sum_dy = sums[k], sum_dy_xhat = inv_std * sums[r.c + k];
    grad_beta.data<float>()[k] = static_cast<float>(sum_dy);
    grad_gamma.data<float>()[k] = static_cast<float>(sum_dy_xhat);
    const double bk = -scale * inv_std * sum_dy_xhat / r.m;
    a[k] = static_cast<float>(scale);
    b[k] = static_cast<float>(bk);
    c[k] = static_cast<float>(-scale * sum_dy / r.m);
  }
  auto grad_x = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  channel_affine(grad_y.data<float>(), x.data<float>(), mean.data<float>(), a.data(), b.data(), c.data(), r,
                 grad_x.data<float>());
  return {grad_x, grad_gamma, grad_beta};
}

std::vector<std::vector<int64_t>> NhwcShape(const std::vector<int64_t>& x, const std::vector<int64_t>& gamma,
                                            const std::vector<int64_t>& beta) {
  return {x, {x.back()}, {x.back()}};
}
std::vector<paddle::DataType> NhwcDtype(const paddle::DataType& x, const paddle::DataType& gamma,
                                        const paddle::DataType& beta) {
  return {x, x, x};
}

PD_BUILD_OP(bn_nhwc)
    .Inputs({"X", "Gamma", "Beta"})
    .Outputs({"Y", "Mean", "Variance"})
    .Attrs({"epsilon: float"})
    .SetKernelFn(PD_KERNEL(NhwcForward))
    .SetInferShapeFn(PD_INFER_SHAPE(NhwcShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(NhwcDtype));

PD_BUILD_GRAD_OP(bn_nhwc)
    .Inputs({"X", "Gamma", "Mean", "Variance", paddle::Grad("Y")})
    .Outputs({paddle::Grad("X"), paddle::Grad("Gamma"), paddle::Grad("Beta")})
    .Attrs({"epsilon: float"})
    .SetKernelFn(PD_KERNEL(NhwcBackward));

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
