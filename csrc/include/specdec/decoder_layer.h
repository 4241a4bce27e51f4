// The element-wise parts of a Llama-family decoder layer on the CPU, fp32 or bf16 storage
// (csrc/decoder_layer.cpp runs the layer): RMSNorm, the rotary embedding, residual adds and the
// gated product of the MLP. Each rounds to the storage type where transformers' modules do
// (RMSNorm: the normalised row to the input's dtype, then the product with the weight; the
// rotation: x * cos, rotate_half(x) * sin and their sum; every add and product), and computes
// in fp32 in between, so results differ from torch's only by the order of RMSNorm's sum of
// squares (a last-bit difference, as between any two reduction kernels).
//
// Header-only, no torch dependency.
#pragma once

#include <cmath>
#include <cstdint>

#include "specdec/dtypes.h"  // BFloat16Bits, to_float, from_float

namespace specdec {
namespace cpu {

// x rounded to Storage's precision, as a float (fp32: x itself).
inline float round_to(float x, const float*) { return x; }
inline float round_to(float x, const BFloat16Bits*) {
  BFloat16Bits b;
  from_float(x, &b);
  return to_float(b);
}

// y[r, :] = weight * round(x[r, :] * rsqrt(mean(x[r, :]^2) + eps)) for `rows` rows of `dim`
// (row strides x_stride / y_stride elements). y may alias x.
template <typename Storage>
void rms_norm_rows(const Storage* x, int64_t x_stride, const Storage* weight, Storage* y, int64_t y_stride,
                   int64_t rows, int64_t dim, float eps) {
  constexpr int kLanes = 16;  // partial sums: a vectorisable sum of squares
  for (int64_t r = 0; r < rows; ++r) {
    const Storage* xr = x + r * x_stride;
    Storage* yr = y + r * y_stride;
    float lanes[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= dim; i += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float v = to_float(xr[i + l]);
        lanes[l] += v * v;
      }
    }
    float sum = 0.f;
    for (int l = 0; l < kLanes; ++l) sum += lanes[l];
    for (; i < dim; ++i) sum += to_float(xr[i]) * to_float(xr[i]);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
    for (int64_t j = 0; j < dim; ++j) {
      const float normed = round_to(to_float(xr[j]) * inv, y);
      from_float(to_float(weight[j]) * normed, yr + j);
    }
  }
}

// apply_rotary_pos_emb in place on x [rows, heads, head_dim] (row stride x_stride elements,
// heads contiguous) with cos/sin [rows, head_dim]: x * cos + rotate_half(x) * sin, where
// rotate_half(x) = cat(-x[half:], x[:half]).
template <typename Storage>
void rotate_rows(Storage* x, int64_t x_stride, const Storage* cos, const Storage* sin, int64_t rows, int64_t heads,
                 int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const Storage* c = cos + r * head_dim;
    const Storage* s = sin + r * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      Storage* xh = x + r * x_stride + h * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = to_float(xh[i]), b = to_float(xh[i + half]);
        const float first = round_to(a * to_float(c[i]), x) + round_to(-b * to_float(s[i]), x);
        const float second = round_to(b * to_float(c[i + half]), x) + round_to(a * to_float(s[i + half]), x);
        from_float(first, xh + i);
        from_float(second, xh + i + half);
      }
    }
  }
}

// out[i] = a[i] + b[i] (rounded to Storage), n elements; out may alias a or b.
template <typename Storage>
void add_elements(const Storage* a, const Storage* b, Storage* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) from_float(to_float(a[i]) + to_float(b[i]), out + i);
}

// out[i] = a[i] * b[i] (rounded to Storage), n elements; out may alias a or b.
template <typename Storage>
void mul_elements(const Storage* a, const Storage* b, Storage* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) from_float(to_float(a[i]) * to_float(b[i]), out + i);
}

}  // namespace cpu
}  // namespace specdec
