// torch glue of the few-row linear product (csrc/include/specdec/small_linear.h), CPU only:
// fp32, y = x @ weight^T (+ bias), output features split over torch's threads in blocks of
// 4 weight rows (each thread streams its own share of the weights once).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "specdec/small_linear.h"

namespace {

at::Tensor small_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_linear: x and weight must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "small_linear: x and weight must be float32, got ", x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(x.dim() == 2, "small_linear: x must be [rows, K], got ", x.dim(), " dims");
  TORCH_CHECK(weight.dim() == 2, "small_linear: weight must be [N, K], got ", weight.dim(), " dims");
  TORCH_CHECK(x.size(1) == weight.size(1), "small_linear: x has K = ", x.size(1), " but weight has K = ",
              weight.size(1));
  const int64_t rows = x.size(0), k_dim = x.size(1), n_dim = weight.size(0);
  const float* bias_ptr = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                    bias->size(0) == n_dim,
                "small_linear: bias must be a float32 CPU tensor [N] = [", n_dim, "]");
    bias_c = bias->contiguous();
    bias_ptr = bias_c.data_ptr<float>();
  }
  const at::Tensor x_c = x.contiguous(), w_c = weight.contiguous();
  at::Tensor y = at::empty({rows, n_dim}, x.options());
  if (rows == 0 || n_dim == 0) return y;
  const float* xp = x_c.data_ptr<float>();
  const float* wp = w_c.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (n_dim + 3) / 4;
  // At least ~8K weights (32 KB) per task: enough work to hide the split, and N / 4 blocks to share.
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(k_dim, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    specdec::small_linear_rows(xp, rows, k_dim, wp, bias_ptr, yp, n_dim, b0 * 4, std::min(n_dim, b1 * 4));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("small_linear", &small_linear_cpu); }
