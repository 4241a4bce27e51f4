// torch glue of the few-row linear product (csrc/include/specdec/small_linear.h), CPU only:
// fp32 or bf16 (x, weight and bias of one dtype; sums in fp32), y = x @ weight^T (+ bias),
// output features split over torch's threads in blocks of 4 weight rows (each thread streams
// its own share of the weights once; csrc/small_linear_cpu.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "small_linear_cpu.h"

namespace {

at::Tensor small_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_linear: x and weight must be CPU tensors");
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype,
              "small_linear: x and weight must both be float32 or both bfloat16, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(x.dim() == 2, "small_linear: x must be [rows, K], got ", x.dim(), " dims");
  TORCH_CHECK(weight.dim() == 2, "small_linear: weight must be [N, K], got ", weight.dim(), " dims");
  TORCH_CHECK(x.size(1) == weight.size(1), "small_linear: x has K = ", x.size(1), " but weight has K = ",
              weight.size(1));
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == dtype && bias->dim() == 1 &&
                    bias->size(0) == weight.size(0),
                "small_linear: bias must be a ", dtype, " CPU tensor [N] = [", weight.size(0), "] (x's dtype)");
    bias_c = bias->contiguous();
  }
  const at::Tensor x_c = x.contiguous(), w_c = weight.contiguous();
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  const specdec::LinearProduct product{&w_c, bias_c.defined() ? &bias_c : nullptr, &y};
  specdec::small_linear_many(x_c, product);
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("small_linear", &small_linear_cpu); }
