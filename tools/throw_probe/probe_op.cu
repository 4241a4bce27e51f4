#include <torch/library.h>
#include <ATen/core/Tensor.h>

__global__ void noop_kernel() {}

at::Tensor fail_cuda(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 99, "throw_probe: cuda check failed as intended, dim ", x.dim());
  noop_kernel<<<1, 1>>>();
  return x;
}
TORCH_LIBRARY_IMPL(throw_probe, CUDA, m) { m.impl("fail", &fail_cuda); }
