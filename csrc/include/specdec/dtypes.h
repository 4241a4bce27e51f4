// 16-bit floating-point storage on the CPU without torch: bfloat16 and float16 as bit
// patterns (the glue reinterprets at::BFloat16 / at::Half, which have the same layout) and
// their exact conversions to and from fp32. Used by the CPU kernels (tree_attention.h,
// verify.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace specdec {
namespace cpu {

struct BFloat16Bits {
  uint16_t bits;
};
struct HalfBits {
  uint16_t bits;
};

inline __attribute__((always_inline)) float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline __attribute__((always_inline)) uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

inline float to_float(float x) { return x; }
inline float to_float(BFloat16Bits x) { return bits_to_float(static_cast<uint32_t>(x.bits) << 16); }
// Branch-free (so the row loops vectorise): moving the 15 exponent+mantissa bits into
// place and scaling by 2^(127-15) is exact for normal and subnormal halves alike;
// inf/NaN keep an all-ones exponent.
inline float to_float(HalfBits x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t magnitude = static_cast<uint32_t>(x.bits & 0x7fffu) << 13;
  const uint32_t finite = float_to_bits(bits_to_float(magnitude) * 0x1p112f);
  const uint32_t special = magnitude | 0x7f800000u;
  return bits_to_float(sign | (magnitude >= (0x7c00u << 13) ? special : finite));
}

inline void from_float(float x, float* out) { *out = x; }
// Round to nearest even; NaN stays a (quiet) NaN.
inline void from_float(float x, BFloat16Bits* out) {
  const uint32_t bits = float_to_bits(x);
  if (std::isnan(x)) {
    out->bits = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  out->bits = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
inline void from_float(float x, HalfBits* out) {
  const uint32_t bits = float_to_bits(x);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) {
    out->bits = sign | 0x7e00u;  // NaN
  } else if (magnitude >= 0x477ff000u) {
    out->bits = sign | 0x7c00u;  // >= 65520 rounds to inf
  } else if (magnitude < 0x38800000u) {
    // Below 2^-14: a subnormal half, |x| / 2^-24 rounded to an integer (1024 = the
    // smallest normal, whose encoding is also 1024).
    out->bits = sign | static_cast<uint16_t>(std::nearbyint(std::fabs(x) * 16777216.0f));
  } else {
    // Rebias the exponent (127 -> 15) and round the mantissa from 23 to 10 bits, to even;
    // a carry out of the mantissa correctly bumps the exponent.
    const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
    out->bits = sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
  }
}

}  // namespace cpu
}  // namespace specdec
