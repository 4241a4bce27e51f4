// Philox4x32-10 random numbers of verification, host and device: the one C++ copy, used by
// the CPU verify (verify.h) and the CUDA verify (verify.cuh). The numbers are those of
// specdec_kernels/philox.py (the Python copy, which the reference and the Triton kernel use;
// python_tests/test_verify_cpu.py checks the C++ copy bit for bit against it): key = seed
// (low word k0, high word k1), counter = (index, node, purpose, 0), 10 rounds, word 0 of the
// output; the uniform is ((word >> 9) + 0.5) * 2^-23, strictly inside (0, 1) and exact in fp32.
//
// Compiled by a host compiler, every function is plain C++ (always inlined, so the CPU
// race's vectorised loop sees it); by nvcc, __host__ __device__, and device code uses the
// same instructions as before this header existed (__umulhi for the high words, the
// round-to-nearest intrinsics for the uniform), so the kernels' PTX is unchanged.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SPECDEC_PHILOX_INLINE __host__ __device__ __forceinline__
#else
#define SPECDEC_PHILOX_INLINE inline __attribute__((always_inline))
#endif

namespace specdec {
namespace philox {

constexpr uint32_t kM0 = 0xD2511F53u;  // round multipliers
constexpr uint32_t kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u;  // key schedule (Weyl) increments
constexpr uint32_t kW1 = 0xBB67AE85u;

// `purpose` values of the counter (specdec_kernels/philox.py).
constexpr uint32_t kPurposeAccept = 0;  // the uniform of the acceptance test of a drafted node
constexpr uint32_t kPurposeSample = 1;  // the exponentials of the race that samples a token

// Word 0 of Philox4x32-10 for counter (c0, c1, c2, c3) and key (k0, k1).
SPECDEC_PHILOX_INLINE uint32_t word0(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    // The high and low words of the 64-bit products kM0 * c0 and kM1 * c2.
#if defined(__CUDA_ARCH__)
    const uint32_t lo0 = kM0 * c0;
    const uint32_t hi0 = __umulhi(kM0, c0);
    const uint32_t lo1 = kM1 * c2;
    const uint32_t hi1 = __umulhi(kM1, c2);
#else
    const uint64_t product0 = static_cast<uint64_t>(kM0) * c0;
    const uint64_t product1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t lo0 = static_cast<uint32_t>(product0);
    const uint32_t hi0 = static_cast<uint32_t>(product0 >> 32);
    const uint32_t lo1 = static_cast<uint32_t>(product1);
    const uint32_t hi1 = static_cast<uint32_t>(product1 >> 32);
#endif
    const uint32_t next0 = hi1 ^ c1 ^ k0;
    const uint32_t next2 = hi0 ^ c3 ^ k1;
    c0 = next0;
    c1 = lo1;
    c2 = next2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return c0;
}

// The uniform in (0, 1) of a Philox word: ((word >> 9) + 0.5) * 2^-23, exact (23 bits + 0.5,
// times a power of two), so rounding modes and contraction cannot change it.
SPECDEC_PHILOX_INLINE float word_to_uniform(uint32_t word) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(__fadd_rn(static_cast<float>(word >> 9), 0.5f), 0x1p-23f);
#else
  return (static_cast<float>(word >> 9) + 0.5f) * 0x1p-23f;
#endif
}

// The uniform of (seed, node, purpose, index): specdec_kernels/philox.py `uniform`. Node and
// index are taken modulo 2^32, as the counter words hold them.
SPECDEC_PHILOX_INLINE float uniform(uint64_t seed, uint32_t node, uint32_t purpose, uint32_t index) {
  return word_to_uniform(
      word0(index, node, purpose, 0u, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)));
}

}  // namespace philox
}  // namespace specdec

#undef SPECDEC_PHILOX_INLINE
