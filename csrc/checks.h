// Generic input-check helpers for the C++ glue. Each op's rules live in one header beside
// its glue (csrc/<op group>_checks.h), included by both its CPU (csrc/*.cpp) and CUDA
// (csrc/cuda/*.cu) bindings; backends add only their kernel's limits. Python validates and
// normalises inputs first, so these only catch misuse of torch.ops.specdec.* directly:
// metadata only (dims, dtypes, devices, sizes), never a scan of the data. Messages name the
// op and argument.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>

namespace specdec {

inline void check_tensor(const char* op, const char* name, const at::Tensor& t, int64_t dims, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == dims, op, ": ", name, " must be a ", dims, "-D tensor, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must have dtype ", dtype, ", got ", t.scalar_type());
}

inline void check_device(const char* op, const char* name, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be on ", device, " like the other inputs, got ",
              t.device());
}

inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim, int64_t expected,
                       const char* what) {
  TORCH_CHECK(t.size(dim) == expected, op, ": ", name, ".size(", dim, ") must be ", what, " = ", expected,
              ", got shape ", t.sizes());
}

// float32, bfloat16 or float16: the dtypes every floating-point input of the ops may have.
inline void check_float_dtype(const char* op, const char* name, const at::Tensor& t) {
  const at::ScalarType dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op, ": ", name,
              " must have dtype float32, bfloat16 or float16, got ", dtype);
}

// The kernels read a row of the last dim with unit stride (a dim of size <= 1 has any stride).
inline void check_last_dim_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, op, ": ", name,
              " needs a contiguous last dim (stride 1), got strides ", t.strides());
}

inline void check_fits_int32(const char* op, const char* name, int64_t value) {
  TORCH_CHECK(value <= std::numeric_limits<int32_t>::max(), op, ": ", name, " = ", value, " does not fit in int32");
}

}  // namespace specdec
