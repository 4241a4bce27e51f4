// torch glue of the few-row linear product (csrc/include/specdec/small_linear.h), CPU only:
// fp32 or bf16 (x, weight and bias of one dtype; sums in fp32), y = x @ weight^T (+ bias),
// output features split over torch's threads in blocks of 4 weight rows (each thread streams
// its own share of the weights once; csrc/small_linear_cpu.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "small_linear_cpu.h"

namespace {

at::Tensor small_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  specdec::check_small_linear("small_linear", x, weight, bias);
  const at::Tensor x_c = x.contiguous(), w_c = weight.contiguous();
  const at::Tensor bias_c = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  const specdec::LinearProduct product{&w_c, bias_c.defined() ? &bias_c : nullptr, &y};
  specdec::small_linear_many(x_c, product);
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("small_linear", &small_linear_cpu); }
