// Max-pooling over 2x2 windows of stride 2 (no padding, floor mode: the pools of mnist_cnn and the default model)
// on float32 NCHW CPU tensors, for training: a Paddle custom operator with its gradient operator, built into one
// library with the oneDNN operators, cpu_ops (paddle_mnist/ops/onednn.py).
//
// Paddle's CPU max-pool kernels compare one window at a time with branches the processor cannot predict on real
// data. This one runs four windows at a time in SSE2 registers and gives the same numbers as F.max_pool2d, to the
// bit, NaN and infinities included: maxps computes (y > v ? y : v), Paddle's own comparison, from -FLT_MAX
// through the window row by row, and the mask notes which input the gradient goes to: the first equal to the
// output, where Paddle's backward pass puts it, or none (255) where none is (a window whose maximum is NaN). The
// backward pass writes each input once: its output's gradient (as 0 + g, Paddle's sum, so -0 comes out +0) or 0.
// It runs on one thread: spread over OpenMP's threads, between oneDNN's and MKL's, it slowed the whole step
// (docs/performance.md has the measurement).

#include <cfloat>
#include <cstdint>
#include <cstring>
#include <vector>

#include <emmintrin.h>  // SSE2, which every x86-64 processor has

#include "paddle/extension.h"

namespace {

constexpr uint8_t kNone = 255;  // the mask of a window no input of which takes the gradient

struct Shape {
  int64_t planes, h, w, out_h, out_w;
};

Shape shape_of(const std::vector<int64_t>& x) { return {x[0] * x[1], x[2], x[3], x[2] / 2, x[3] / 2}; }

// The first output of each group of four: 0, 4, ..., and out_w - 4 for the last, which may overlap the one before
// it. Computing an output twice writes the same values, so no row needs a scalar tail (out_w >= 4).
int64_t group_start(int64_t ow, int64_t out_w) { return ow + 4 <= out_w ? ow : out_w - 4; }

// Four windows' outputs and mask from the two input rows r0 and r1, starting at input column 2 * ow.
void pool4(const float* r0, const float* r1, float* out, uint8_t* mask) {
  const __m128 top_lo = _mm_loadu_ps(r0), top_hi = _mm_loadu_ps(r0 + 4);
  const __m128 bottom_lo = _mm_loadu_ps(r1), bottom_hi = _mm_loadu_ps(r1 + 4);
  const __m128 v[4] = {_mm_shuffle_ps(top_lo, top_hi, _MM_SHUFFLE(2, 0, 2, 0)),  // the windows' top left inputs
                       _mm_shuffle_ps(top_lo, top_hi, _MM_SHUFFLE(3, 1, 3, 1)),
                       _mm_shuffle_ps(bottom_lo, bottom_hi, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm_shuffle_ps(bottom_lo, bottom_hi, _MM_SHUFFLE(3, 1, 3, 1))};
  __m128 y = _mm_set1_ps(-FLT_MAX);
  for (const __m128& x : v) y = _mm_max_ps(y, x);
  __m128i at = _mm_set1_epi32(kNone);
  for (int i = 3; i >= 0; --i) {  // from the last input back, so that the first equal to the maximum wins
    const __m128i equal = _mm_castps_si128(_mm_cmpeq_ps(v[i], y));
    at = _mm_or_si128(_mm_and_si128(equal, _mm_set1_epi32(i)), _mm_andnot_si128(equal, at));
  }
  _mm_storeu_ps(out, y);
  const int32_t four = _mm_cvtsi128_si32(_mm_packus_epi16(_mm_packs_epi32(at, at), _mm_setzero_si128()));
  std::memcpy(mask, &four, 4);
}

// The gradients of the four windows' inputs in rows r0 and r1 from their outputs' gradients and mask.
void unpool4(const float* grad_out, const uint8_t* mask, float* r0, float* r1) {
  const __m128 g = _mm_add_ps(_mm_setzero_ps(), _mm_loadu_ps(grad_out));
  int32_t four;
  std::memcpy(&four, mask, 4);
  const __m128i bytes = _mm_cvtsi32_si128(four);
  const __m128i at = _mm_unpacklo_epi16(_mm_unpacklo_epi8(bytes, _mm_setzero_si128()), _mm_setzero_si128());
  __m128 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(at, _mm_set1_epi32(i))), g);
  _mm_storeu_ps(r0, _mm_unpacklo_ps(v[0], v[1]));
  _mm_storeu_ps(r0 + 4, _mm_unpackhi_ps(v[0], v[1]));
  _mm_storeu_ps(r1, _mm_unpacklo_ps(v[2], v[3]));
  _mm_storeu_ps(r1 + 4, _mm_unpackhi_ps(v[2], v[3]));
}

// One window at a time, for rows of fewer than four outputs: the same comparisons in scalar form.
void pool1(const float* r0, const float* r1, float* out, uint8_t* mask) {
  const float v[4] = {r0[0], r0[1], r1[0], r1[1]};
  float y = -FLT_MAX;
  for (float x : v) y = y > x ? y : x;
  uint8_t at = kNone;
  for (int i = 3; i >= 0; --i) at = v[i] == y ? static_cast<uint8_t>(i) : at;
  *out = y;
  *mask = at;
}

void unpool1(float grad_out, uint8_t mask, float* r0, float* r1) {
  const float g = 0.0f + grad_out;
  r0[0] = mask == 0 ? g : 0.0f;
  r0[1] = mask == 1 ? g : 0.0f;
  r1[0] = mask == 2 ? g : 0.0f;
  r1[1] = mask == 3 ? g : 0.0f;
}

}  // namespace

std::vector<paddle::Tensor> MaxPoolForward(const paddle::Tensor& x) {
  PD_CHECK(x.is_cpu() && x.dtype() == paddle::DataType::FLOAT32, "max_pool2x2: x must be float32 on the CPU");
  PD_CHECK(x.shape().size() == 4 && x.shape()[2] >= 2 && x.shape()[3] >= 2,
           "max_pool2x2: x must be NCHW, at least 2x2");
  const Shape s = shape_of(x.shape());
  const std::vector<int64_t> dims = {x.shape()[0], x.shape()[1], s.out_h, s.out_w};
  auto out = paddle::empty(dims, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto mask = paddle::empty(dims, paddle::DataType::UINT8, paddle::CPUPlace());
  const float* in = x.data<float>();
  float* o = out.data<float>();
  uint8_t* m = mask.data<uint8_t>();
  for (int64_t row = 0; row < s.planes * s.out_h; ++row) {  // an output row of any plane
    const float* r0 = in + (row / s.out_h) * s.h * s.w + (row % s.out_h) * 2 * s.w;
    float* out_row = o + row * s.out_w;
    uint8_t* mask_row = m + row * s.out_w;
    if (s.out_w < 4) {
      for (int64_t ow = 0; ow < s.out_w; ++ow) pool1(r0 + 2 * ow, r0 + s.w + 2 * ow, out_row + ow, mask_row + ow);
      continue;
    }
    for (int64_t ow = 0; ow < s.out_w; ow += 4) {
      const int64_t start = group_start(ow, s.out_w);
      pool4(r0 + 2 * start, r0 + s.w + 2 * start, out_row + start, mask_row + start);
    }
  }
  return {out, mask};
}

std::vector<paddle::Tensor> MaxPoolBackward(const paddle::Tensor& x, const paddle::Tensor& mask,
                                            const paddle::Tensor& grad_out) {
  PD_CHECK(grad_out.is_cpu() && grad_out.dtype() == paddle::DataType::FLOAT32,
           "max_pool2x2: the output's gradient must be float32 on the CPU");
  const Shape s = shape_of(x.shape());
  auto grad_x = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  float* gx = grad_x.data<float>();
  const float* go = grad_out.data<float>();
  const uint8_t* m = mask.data<uint8_t>();
  for (int64_t row = 0; row < s.planes * s.out_h; ++row) {
    float* r0 = gx + (row / s.out_h) * s.h * s.w + (row % s.out_h) * 2 * s.w;
    float* r1 = r0 + s.w;
    const float* d = go + row * s.out_w;
    const uint8_t* at = m + row * s.out_w;
    if (s.out_w < 4) {
      for (int64_t ow = 0; ow < s.out_w; ++ow) unpool1(d[ow], at[ow], r0 + 2 * ow, r1 + 2 * ow);
    } else {
      for (int64_t ow = 0; ow < s.out_w; ow += 4) {
        const int64_t start = group_start(ow, s.out_w);
        unpool4(d + start, at + start, r0 + 2 * start, r1 + 2 * start);
      }
    }
    if (s.w % 2) r0[s.w - 1] = r1[s.w - 1] = 0.0f;  // an odd width's last column is in no window
  }
  if (s.h % 2) {  // nor an odd height's last row
    for (int64_t p = 0; p < s.planes; ++p) std::memset(gx + p * s.h * s.w + (s.h - 1) * s.w, 0, s.w * sizeof(float));
  }
  return {grad_x};
}

std::vector<std::vector<int64_t>> MaxPoolInferShape(const std::vector<int64_t>& x) {
  const Shape s = shape_of(x);
  return {{x[0], x[1], s.out_h, s.out_w}, {x[0], x[1], s.out_h, s.out_w}};
}

std::vector<paddle::DataType> MaxPoolInferDtype(const paddle::DataType& x) { return {x, paddle::DataType::UINT8}; }

PD_BUILD_OP(max_pool2x2)
    .Inputs({"X"})
    .Outputs({"Out", "Mask"})
    .SetKernelFn(PD_KERNEL(MaxPoolForward))
    .SetInferShapeFn(PD_INFER_SHAPE(MaxPoolInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(MaxPoolInferDtype));

PD_BUILD_GRAD_OP(max_pool2x2)
    .Inputs({"X", "Mask", paddle::Grad("Out")})
    .Outputs({paddle::Grad("X")})
    .SetKernelFn(PD_KERNEL(MaxPoolBackward));
