// RMSNorm on the CPU in one op (specdec_kernels/ops/rms_norm.py): the learned heads' norms on
// their few drafting rows. transformers' RMSNorm is ~8 torch ops (upcast, square, mean, add,
// rsqrt, product, downcast, weight), ~60 us a call inside the decode loop on the 2-core machine
// for a row of 576; this is one. Rounds where transformers' module rounds (the decoder layer's
// `rms_norm_rows`, include/specdec/decoder_layer.h): equal to it up to the order of the sum of
// squares.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "specdec/decoder_layer.h"

namespace {

template <typename Storage, typename TorchScalar>
void norm_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& y, double eps) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim, groups = weight.numel() / dim;
  const auto* xs = reinterpret_cast<const Storage*>(x.const_data_ptr<TorchScalar>());
  const auto* ws = reinterpret_cast<const Storage*>(weight.const_data_ptr<TorchScalar>());
  auto* ys = reinterpret_cast<Storage*>(y.mutable_data_ptr<TorchScalar>());
  // Row r is normalised with weight row r mod groups (the weight covers x's trailing dims).
  for (int64_t r = 0; r < rows; ++r) {
    specdec::cpu::rms_norm_rows(xs + r * dim, dim, ws + (r % groups) * dim, ys + r * dim, dim, 1, dim,
                                static_cast<float>(eps));
  }
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: x and weight must be CPU tensors");
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype,
              "rms_norm: x and weight must both be float32 or both bfloat16, got ", dtype, " and ",
              weight.scalar_type());
  TORCH_CHECK(weight.dim() >= 1 && weight.dim() <= x.dim(), "rms_norm: weight must have 1 to x.dim() = ", x.dim(),
              " dims, got ", weight.dim());
  TORCH_CHECK(x.sizes().slice(x.dim() - weight.dim()).equals(weight.sizes()),
              "rms_norm: weight's shape ", weight.sizes(), " must equal x's trailing dims ", x.sizes());
  TORCH_CHECK(x.size(-1) > 0, "rms_norm: the normalised dim is empty");
  TORCH_CHECK(eps >= 0, "rms_norm: eps must be >= 0, got ", eps);
  const at::Tensor x_c = x.contiguous(), w_c = weight.contiguous();
  at::Tensor y = at::empty_like(x_c);
  if (x_c.numel() == 0) return y;
  if (dtype == at::kFloat) {
    norm_rows<float, float>(x_c, w_c, y, eps);
  } else {
    norm_rows<specdec::cpu::BFloat16Bits, at::BFloat16>(x_c, w_c, y, eps);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("rms_norm", &rms_norm_cpu); }
