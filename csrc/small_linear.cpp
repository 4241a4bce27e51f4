// torch glue of the few-row linear product (csrc/include/specdec/small_linear.h), CPU only:
// fp32 or bf16 (x, weight and bias of one dtype; sums in fp32), y = x @ weight^T (+ bias),
// output features split over torch's threads in blocks of 4 weight rows (each thread streams
// its own share of the weights once).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "specdec/small_linear.h"

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
  const int64_t rows = x.size(0), k_dim = x.size(1), n_dim = weight.size(0);
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == n_dim,
                "small_linear: bias must be a ", dtype, " CPU tensor [N] = [", n_dim, "] (x's dtype)");
    bias_c = bias->contiguous();
  }
  const at::Tensor x_c = x.contiguous(), w_c = weight.contiguous();
  at::Tensor y = at::empty({rows, n_dim}, x.options());
  if (rows == 0 || n_dim == 0) return y;
  const int64_t blocks = (n_dim + 3) / 4;
  // Tasks of at least 8K (fp32) or 16K (bf16) blocks * K, i.e. ~128 KB of weights: enough
  // work to hide the split, and N / 4 blocks to share.
  const int64_t grain = std::max<int64_t>(1, (32768 / x.element_size()) / std::max<int64_t>(k_dim, 1));
  if (dtype == at::kFloat) {
    const float* xp = x_c.const_data_ptr<float>();
    const float* wp = w_c.const_data_ptr<float>();
    const float* bp = bias_c.defined() ? bias_c.const_data_ptr<float>() : nullptr;
    float* yp = y.mutable_data_ptr<float>();
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      specdec::small_linear_rows(xp, rows, k_dim, wp, bp, yp, n_dim, b0 * 4, std::min(n_dim, b1 * 4));
    });
    return y;
  }
  using Bits = specdec::cpu::BFloat16Bits;
  static_assert(sizeof(Bits) == sizeof(at::BFloat16), "bf16 storage must match at::BFloat16 bit for bit");
  const Bits* xp = reinterpret_cast<const Bits*>(x_c.const_data_ptr<at::BFloat16>());
  const Bits* wp = reinterpret_cast<const Bits*>(w_c.const_data_ptr<at::BFloat16>());
  const Bits* bp = bias_c.defined() ? reinterpret_cast<const Bits*>(bias_c.const_data_ptr<at::BFloat16>()) : nullptr;
  Bits* yp = reinterpret_cast<Bits*>(y.mutable_data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    specdec::small_linear_rows_bf16(xp, rows, k_dim, wp, bp, yp, n_dim, b0 * 4, std::min(n_dim, b1 * 4));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("small_linear", &small_linear_cpu); }
