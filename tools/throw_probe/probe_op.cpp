// A minimal op whose CPU kernel (g++) and CUDA kernel (nvcc) each fail a TORCH_CHECK: does a
// C++ exception thrown inside an extension reach Python on this machine's toolchain?
#include <torch/library.h>
#include <ATen/core/Tensor.h>

TORCH_LIBRARY(throw_probe, m) { m.def("fail(Tensor x) -> Tensor"); }

at::Tensor fail_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 99, "throw_probe: cpu check failed as intended, dim ", x.dim());
  return x;
}
TORCH_LIBRARY_IMPL(throw_probe, CPU, m) { m.impl("fail", &fail_cpu); }
